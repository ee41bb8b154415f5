package dra

import (
	"context"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// A SharingConfig's parameters are checked field by field, each refusal naming what
// is wrong.
func TestParseSharingConfig(t *testing.T) {
	for _, tc := range []struct{ raw, want string }{
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS"}`, ""},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"TimeSlicing","timeSlicing":{"interval":"Default"}}`, ""},
		{`{"apiVersion":"devicehost.io/v1","kind":"SharingConfig","strategy":"MPS"}`, `apiVersion "devicehost.io/v1", kind "SharingConfig": want "devicehost.io/v1alpha1"`},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"GpuConfig","strategy":"MPS"}`, `kind "GpuConfig"`},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"Spatial"}`, `strategy "Spatial": want Exclusive, TimeSlicing or MPS`},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{}}`, `unknown field "mps"`},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","timeSlicing":{}}`, "timeSlicing is for strategy TimeSlicing, not MPS"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"TimeSlicing","timeSlicing":{"interval":"Long"}}`, `timeSlicing.interval "Long": only Default`},
		{`[1]`, "not a devicehost.io/v1alpha1 SharingConfig"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","x":"` + strings.Repeat("a", maxSharingConfig) + `"}`, "bytes, at most 10240"},
	} {
		_, err := parseSharingConfig([]byte(tc.raw))
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%.80s: %v", tc.raw, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%.80s: %v, want %q", tc.raw, err, tc.want)
		}
	}
}

// At Prepare, a claim's SharingConfig must name the strategy its devices are held in:
// a time-sliced replica prepares under TimeSlicing; under MPS it is refused before
// anything is reserved, the error naming the request, the device, its mode and the
// DeviceClass to ask for; the claim's config overrides its class's; a config that
// does not parse fails the claim naming it.
func TestSharingConfigCheckedAtPrepare(t *testing.T) {
	t.Setenv("GORACE", "atexit_sleep_ms=0") // the simulated MPS daemon's control clients
	r := newRigArgs(t, "-config", sharingAgentConfig(t, `["time-slicing", "mps"]`, ""))
	r.startDriver(nil)
	k := r.kubelet()
	devs := r.waitSlices("8 GPUs, 32 replicas and 8 pooled MPS devices", func(d []resourceapi.Device) bool { return len(d) == 48 })
	var replicas []string
	for _, dv := range devs {
		if id := *dv.Attributes["id"].StringValue; strings.Contains(id, "::") && !strings.HasSuffix(id, "::mps") {
			replicas = append(replicas, dv.Name)
		}
	}
	params := func(strategy, extra string) runtime.RawExtension {
		return runtime.RawExtension{Raw: []byte(`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"` + strategy + `"` + extra + `}`)}
	}
	claimWith := func(name, device string, configs ...resourceapi.DeviceAllocationConfiguration) *resourceapi.ResourceClaim {
		c := r.claim(name, device)
		c.Status.Allocation.Devices.Config = configs
		if err := r.kube.Tracker().Update(resourceapi.SchemeGroupVersion.WithResource("resourceclaims"), c, c.Namespace); err != nil {
			t.Fatal(err)
		}
		return c
	}
	config := func(source resourceapi.AllocationConfigSource, p runtime.RawExtension, requests ...string) resourceapi.DeviceAllocationConfiguration {
		return resourceapi.DeviceAllocationConfiguration{Source: source, Requests: requests,
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: testDriver, Parameters: p}}}
	}
	held := func(c *resourceapi.ResourceClaim) int {
		rs, err := r.c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: claimRef{c.Namespace, c.Name, string(c.UID)}.owner(), State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
		if err != nil {
			t.Fatal(err)
		}
		return len(rs)
	}

	ok := claimWith("ts", replicas[0], config(resourceapi.AllocationConfigSourceClaim, params("TimeSlicing", `,"timeSlicing":{"interval":"Default"}`), "gpus"))
	if p := k.prepare(t, ok); p.GetError() != "" || held(ok) != 1 {
		t.Fatalf("a replica under TimeSlicing: %q, %d reservations", p.GetError(), held(ok))
	}
	wrong := claimWith("wrong", replicas[1], config(resourceapi.AllocationConfigSourceClaim, params("MPS", "")))
	p := k.prepare(t, wrong)
	if want := `request "gpus": SharingConfig strategy MPS, but device ` + replicas[1] + ` (type gpu.shared) is held TimeSlicing: for MPS ask DeviceClass gpu-mps.devicehost.io`; !strings.Contains(p.GetError(), want) || held(wrong) != 0 {
		t.Errorf("a replica under MPS: %q (%d reservations), want %q and nothing reserved", p.GetError(), held(wrong), want)
	}
	over := claimWith("override", replicas[2],
		config(resourceapi.AllocationConfigSourceClass, params("Exclusive", "")),
		config(resourceapi.AllocationConfigSourceClaim, params("TimeSlicing", "")))
	if p := k.prepare(t, over); p.GetError() != "" {
		t.Errorf("the claim's TimeSlicing over its class's Exclusive: %q", p.GetError())
	}
	other := claimWith("other-request", replicas[3], config(resourceapi.AllocationConfigSourceClaim, params("MPS", ""), "another"))
	if p := k.prepare(t, other); p.GetError() != "" {
		t.Errorf("a config for another request: %q", p.GetError())
	}
	bad := claimWith("bad", replicas[4], config(resourceapi.AllocationConfigSourceClaim, params("TimeSlicing", `,"timeSlicing":{"interval":"Long"}`)))
	if p := k.prepare(t, bad); !strings.Contains(p.GetError(), `device config 0 (FromClaim) for `+testDriver+`: timeSlicing.interval "Long"`) || held(bad) != 0 {
		t.Errorf("an interval the plugin cannot set: %q, %d reservations", p.GetError(), held(bad))
	}
	for _, c := range []*resourceapi.ResourceClaim{ok, over, other} {
		if e := k.unprepare(t, c); e != "" {
			t.Fatal(e)
		}
	}
}
