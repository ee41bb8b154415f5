package dra

import (
	"context"
	"maps"
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
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{}}`, ""},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"isolation":"PerHolder"}}`, ""},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"isolation":"Shared"}}`, ""},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"isolation":"per-holder"}}`, `mps.isolation "per-holder": want Shared or PerHolder`},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"isolaton":"Shared"}}`, `unknown field "isolaton"`},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"TimeSlicing","mps":{"isolation":"PerHolder"}}`, "mps is for strategy MPS, not TimeSlicing"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"Exclusive","mps":{}}`, "mps is for strategy MPS, not Exclusive"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","timeSlicing":{}}`, "timeSlicing is for strategy TimeSlicing, not MPS"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"TimeSlicing","timeSlicing":{"interval":"Long"}}`, `timeSlicing.interval "Long": only Default`},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"activeThreadPercentage":30,"pinnedDeviceMemoryLimit":"10Gi"}}`, ""},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"activeThreadPercentage":0}}`, "mps.activeThreadPercentage 0: want 1 to 100"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"activeThreadPercentage":101}}`, "mps.activeThreadPercentage 101: want 1 to 100"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"activeThreadPercentage":"30"}}`, "mps.activeThreadPercentage of type int"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"pinnedDeviceMemoryLimit":"ten gigs"}}`, `mps.pinnedDeviceMemoryLimit "ten gigs": not a quantity (e.g. 10Gi)`},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"pinnedDeviceMemoryLimit":"512Ki"}}`, `mps.pinnedDeviceMemoryLimit "512Ki": want at least 1Mi`},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS","mps":{"activeThreadPercentage":-1,"pinnedDeviceMemoryLimit":"-1Gi"}}`,
			"mps.activeThreadPercentage -1: want 1 to 100\nmps.pinnedDeviceMemoryLimit \"-1Gi\": want at least 1Mi"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"TimeSlicing","mps":{"activeThreadPercentage":30}}`, "mps is for strategy MPS, not TimeSlicing"},
		{`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"Exclusive","mps":{"pinnedDeviceMemoryLimit":"10Gi"}}`, "mps is for strategy MPS, not Exclusive"},
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

// withClaimConfig gives allocated claim c one opaque config of the claim for the test
// driver, parameters p, in the fake API server; it returns c.
func (r *rig) withClaimConfig(c *resourceapi.ResourceClaim, p runtime.RawExtension) *resourceapi.ResourceClaim {
	r.t.Helper()
	c.Status.Allocation.Devices.Config = []resourceapi.DeviceAllocationConfiguration{{Source: resourceapi.AllocationConfigSourceClaim,
		DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: testDriver, Parameters: p}}}}
	if err := r.kube.Tracker().Update(resourceapi.SchemeGroupVersion.WithResource("resourceclaims"), c, c.Namespace); err != nil {
		r.t.Fatal(err)
	}
	return c
}

// activeReservations are the agent's active reservations of claim c.
func (r *rig) activeReservations(c *resourceapi.ResourceClaim) []*pb.Reservation {
	r.t.Helper()
	rs, err := r.c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: claimRef{c.Namespace, c.Name, string(c.UID)}.owner(), State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil {
		r.t.Fatal(err)
	}
	return rs
}

// pooledMPSDevices waits for an MPS agent's pool (its 8 GPUs and their 8 pooled MPS
// devices) and returns the pooled ones (those that allow multiple allocations).
func (r *rig) pooledMPSDevices() []resourceapi.Device {
	r.t.Helper()
	devs := r.waitSlices("8 GPUs and 8 pooled MPS devices", func(d []resourceapi.Device) bool { return len(d) == 16 })
	var pooled []resourceapi.Device
	for _, dv := range devs {
		if dv.AllowMultipleAllocations != nil && *dv.AllowMultipleAllocations {
			pooled = append(pooled, dv)
		}
	}
	return pooled
}

// A claim's SharingConfig mps.isolation reaches the agent as the Reserve's plugin option
// mps_isolation: PerHolder gets the claim a daemon of its own, Shared the GPU's shared
// one, and the reservations carry the option; a value other than the two, or mps with
// another strategy, fails the claim at Prepare naming the field, before anything is
// reserved; so do two requests of one claim asking shares of one device with two
// isolations.
func TestSharingConfigMPSIsolation(t *testing.T) {
	t.Setenv("GORACE", "atexit_sleep_ms=0") // the simulated MPS daemon's control clients
	r := newRigArgs(t, "-config", mpsAgentConfig(t))
	r.startDriver(nil)
	k := r.kubelet()
	pooled := r.pooledMPSDevices()
	share := pooled[0].Capacity["memory"].RequestPolicy.ValidRange.Step.String()
	params := func(strategy, extra string) runtime.RawExtension {
		return runtime.RawExtension{Raw: []byte(`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"` + strategy + `"` + extra + `}`)}
	}

	own := r.withClaimConfig(r.consumingClaim("own", pooled[0].Name, share), params("MPS", `,"mps":{"isolation":"PerHolder"}`))
	shared := r.withClaimConfig(r.consumingClaim("shared", pooled[0].Name, share), params("MPS", `,"mps":{"isolation":"Shared"}`))
	for _, c := range []*resourceapi.ResourceClaim{own, shared} {
		if p := k.prepare(t, c); p.GetError() != "" {
			t.Fatalf("prepare of claim %s: %s", c.Name, p.GetError())
		}
	}
	ro, rsh := r.activeReservations(own), r.activeReservations(shared)
	if len(ro) != 1 || len(rsh) != 1 {
		t.Fatalf("reservations %v and %v; want one each", ro, rsh)
	}
	if got := ro[0].GetPluginOptions(); len(got) != 1 || got["mps_isolation"] != "per-holder" {
		t.Errorf("the PerHolder claim's reservation has plugin options %v; want mps_isolation=per-holder", got)
	}
	if got := rsh[0].GetPluginOptions(); len(got) != 1 || got["mps_isolation"] != "shared" {
		t.Errorf("the Shared claim's reservation has plugin options %v; want mps_isolation=shared", got)
	}
	pipeO, pipeS := ro[0].GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"], rsh[0].GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"]
	if !strings.Contains(pipeO, "/holder-") || strings.Contains(pipeS, "/holder-") || pipeS == "" {
		t.Errorf("pipe dirs: PerHolder %q, Shared %q; want the holder's own and the GPU's shared daemon's", pipeO, pipeS)
	}
	if again := k.prepare(t, own); again.GetError() != "" || r.activeReservations(own)[0].GetReservationId() != ro[0].GetReservationId() {
		t.Errorf("prepare asked again: %q; want the same reservation", again.GetError())
	}

	for _, tc := range []struct{ name, strategy, extra, want string }{
		{"bad", "MPS", `,"mps":{"isolation":"Strict"}`, `device config 0 (FromClaim) for ` + testDriver + `: mps.isolation "Strict": want Shared or PerHolder`},
		{"not-mps", "TimeSlicing", `,"mps":{"isolation":"PerHolder"}`, `device config 0 (FromClaim) for ` + testDriver + `: mps is for strategy MPS, not TimeSlicing`},
	} {
		c := r.withClaimConfig(r.consumingClaim(tc.name, pooled[1].Name, share), params(tc.strategy, tc.extra))
		p := k.prepare(t, c)
		if !strings.Contains(p.GetError(), tc.want) || len(r.activeReservations(c)) != 0 {
			t.Errorf("claim %s: %q (%d reservations); want %q and nothing reserved", tc.name, p.GetError(), len(r.activeReservations(c)), tc.want)
		}
	}

	// Two requests of one claim on one device with two isolations.
	two := r.consumingClaim("two", pooled[2].Name, share)
	second := two.Status.Allocation.Devices.Results[0]
	second.Request = "other"
	two.Status.Allocation.Devices.Results = append(two.Status.Allocation.Devices.Results, second)
	two.Status.Allocation.Devices.Config = []resourceapi.DeviceAllocationConfiguration{
		{Source: resourceapi.AllocationConfigSourceClaim, Requests: []string{"share"},
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: testDriver, Parameters: params("MPS", `,"mps":{"isolation":"PerHolder"}`)}}},
		{Source: resourceapi.AllocationConfigSourceClaim, Requests: []string{"other"},
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: testDriver, Parameters: params("MPS", `,"mps":{"isolation":"Shared"}`)}}},
	}
	if err := r.kube.Tracker().Update(resourceapi.SchemeGroupVersion.WithResource("resourceclaims"), two, two.Namespace); err != nil {
		t.Fatal(err)
	}
	p := k.prepare(t, two)
	if want := `requests "share" and "other" ask shares of device ` + pooled[2].Name + ` with other SharingConfig mps (isolation PerHolder; isolation Shared)`; !strings.Contains(p.GetError(), want) || len(r.activeReservations(two)) != 0 {
		t.Errorf("two isolations on one device: %q (%d reservations); want %q and nothing reserved", p.GetError(), len(r.activeReservations(two)), want)
	}
	for _, c := range []*resourceapi.ResourceClaim{own, shared} {
		if e := k.unprepare(t, c); e != "" {
			t.Fatal(e)
		}
	}
}

// A SharingConfig's mps becomes the nvidia-example plugin's Reserve options: the
// memory limit in whole MiB, rounded down; nothing for a config without mps.
func TestSharingConfigPluginOptions(t *testing.T) {
	for _, tc := range []struct {
		mps  string
		want map[string]string
	}{
		{``, nil},
		{`,"mps":{}`, nil},
		{`,"mps":{"isolation":"PerHolder"}`, map[string]string{"mps_isolation": "per-holder"}},
		{`,"mps":{"isolation":"Shared","activeThreadPercentage":30,"pinnedDeviceMemoryLimit":"10Gi"}`,
			map[string]string{"mps_isolation": "shared", "mps_thread_percentage": "30", "mps_memory_limit": "10240"}},
		{`,"mps":{"pinnedDeviceMemoryLimit":"1G"}`, map[string]string{"mps_memory_limit": "953"}},
		{`,"mps":{"activeThreadPercentage":100}`, map[string]string{"mps_thread_percentage": "100"}},
	} {
		c, err := parseSharingConfig([]byte(`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"MPS"` + tc.mps + `}`))
		if err != nil {
			t.Fatalf("%s: %v", tc.mps, err)
		}
		if got := c.pluginOptions(); !maps.Equal(got, tc.want) || (got == nil) != (tc.want == nil) {
			t.Errorf("mps %s: plugin options %v, want %v", tc.mps, got, tc.want)
		}
	}
}

// A claim's SharingConfig mps.activeThreadPercentage and mps.pinnedDeviceMemoryLimit
// lower its MPS limits: the Reserve carries them as the plugin options
// mps_thread_percentage and mps_memory_limit (MiB), and the claim's environment has the
// lowered values, Shared or PerHolder. A memory limit above what the claim's shares
// take fails it at Prepare, naming the field, before anything is reserved; a thread
// percentage above its shares' is the plugin's refusal, in the claim's error.
func TestSharingConfigMPSLimits(t *testing.T) {
	t.Setenv("GORACE", "atexit_sleep_ms=0") // the simulated MPS daemon's control clients
	r := newRigArgs(t, "-config", mpsAgentConfig(t))
	r.startDriver(nil)
	k := r.kubelet()
	pooled := r.pooledMPSDevices()
	share := pooled[0].Capacity["memory"].RequestPolicy.ValidRange.Step // one share: 20Gi
	twoShares := share.DeepCopy()
	twoShares.Add(*share)
	params := func(strategy, mps string) runtime.RawExtension {
		return runtime.RawExtension{Raw: []byte(`{"apiVersion":"devicehost.io/v1alpha1","kind":"SharingConfig","strategy":"` + strategy + `","mps":` + mps + `}`)}
	}

	for _, tc := range []struct {
		name, mps         string
		wantOpts          map[string]string
		wantThreads, mem  string
		wantPerHolderPipe bool
	}{
		{"own", `{"isolation":"PerHolder","activeThreadPercentage":30,"pinnedDeviceMemoryLimit":"10Gi"}`,
			map[string]string{"mps_isolation": "per-holder", "mps_thread_percentage": "30", "mps_memory_limit": "10240"}, "30", "0=10240M", true},
		{"shared", `{"isolation":"Shared","activeThreadPercentage":10,"pinnedDeviceMemoryLimit":"8Gi"}`,
			map[string]string{"mps_isolation": "shared", "mps_thread_percentage": "10", "mps_memory_limit": "8192"}, "10", "0=8192M", false},
	} {
		c := r.withClaimConfig(r.consumingClaim(tc.name, pooled[0].Name, twoShares.String()), params("MPS", tc.mps))
		if p := k.prepare(t, c); p.GetError() != "" {
			t.Fatalf("prepare of claim %s: %s", c.Name, p.GetError())
		}
		rs := r.activeReservations(c)
		if len(rs) != 1 {
			t.Fatalf("claim %s: reservations %v, want one", tc.name, rs)
		}
		if got := rs[0].GetPluginOptions(); !maps.Equal(got, tc.wantOpts) {
			t.Errorf("claim %s: reservation's plugin options %v, want %v", tc.name, got, tc.wantOpts)
		}
		envs := rs[0].GetReservation().GetEnvs()
		threads, mem := envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
		t.Logf("claim %s (2 shares, mps %s): CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%s CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%s", tc.name, tc.mps, threads, mem)
		if threads != tc.wantThreads || mem != tc.mem || strings.Contains(envs["CUDA_MPS_PIPE_DIRECTORY"], "/holder-") != tc.wantPerHolderPipe {
			t.Errorf("claim %s: threads %q, memory %q, pipe dir %q; want %q, %q, per-holder %v",
				tc.name, threads, mem, envs["CUDA_MPS_PIPE_DIRECTORY"], tc.wantThreads, tc.mem, tc.wantPerHolderPipe)
		}
		if e := k.unprepare(t, c); e != "" {
			t.Fatal(e)
		}
	}

	// One share: 20Gi and 25%.
	for _, tc := range []struct{ name, strategy, mps, want string }{
		{"memory-above", "MPS", `{"pinnedDeviceMemoryLimit":"30Gi"}`,
			`request "share": SharingConfig mps.pinnedDeviceMemoryLimit 30Gi is above the 20Gi the claim's 1 MPS share of device ` + pooled[1].Name + ` take (its capacity memory); it may lower the limit, not raise it`},
		{"threads-above", "MPS", `{"activeThreadPercentage":30}`,
			"option mps_thread_percentage = 30 is above 25, what the holder's 1 MPS share of "},
		{"threads-zero", "MPS", `{"activeThreadPercentage":0}`, `device config 0 (FromClaim) for ` + testDriver + `: mps.activeThreadPercentage 0: want 1 to 100`},
		{"memory-bad", "MPS", `{"pinnedDeviceMemoryLimit":"lots"}`, `device config 0 (FromClaim) for ` + testDriver + `: mps.pinnedDeviceMemoryLimit "lots": not a quantity`},
		{"not-mps", "TimeSlicing", `{"activeThreadPercentage":10}`, `device config 0 (FromClaim) for ` + testDriver + `: mps is for strategy MPS, not TimeSlicing`},
	} {
		c := r.withClaimConfig(r.consumingClaim(tc.name, pooled[1].Name, share.String()), params(tc.strategy, tc.mps))
		p := k.prepare(t, c)
		t.Logf("claim %s: %s", tc.name, p.GetError())
		if !strings.Contains(p.GetError(), tc.want) || len(r.activeReservations(c)) != 0 {
			t.Errorf("claim %s: %q (%d reservations); want %q and nothing reserved", tc.name, p.GetError(), len(r.activeReservations(c)), tc.want)
		}
	}
}
