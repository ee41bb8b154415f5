package shim

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/hashicorp/nomad/plugins/device"

	dev "github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// reserveShim serves snap and l on a fresh socket and returns a shim configured for it.
func reserveShim(t *testing.T, l *fakeLedger, ids ...string) *Plugin {
	t.Helper()
	path := socketPath(t)
	startAgent(t, fake(newSnapshots(snapshot(ids...)), l), path)
	return newShim(t, map[string]any{"address": "unix://" + path})
}

// Reserve finds the devices' group itself (Nomad gives only IDs), reserves for a
// "nomad/" owner, and maps the agent's answer to Nomad's reservation.
func TestReserveMapsReservation(t *testing.T) {
	l := newFakeLedger()
	p := reserveShim(t, l, "GPU-a", "GPU-b")
	got, err := p.Reserve([]string{"GPU-a", "GPU-b"})
	if err != nil {
		t.Fatal(err)
	}
	want := &device.ContainerReservation{
		Envs:    map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"},
		Mounts:  []*device.Mount{{TaskPath: "/usr/lib/libnvidia-ml.so.1", HostPath: "/usr/lib/libnvidia-ml.so.1", ReadOnly: true}},
		Devices: []*device.DeviceSpec{{TaskPath: "/dev/nvidia0", HostPath: "/dev/nvidia0", CgroupPerms: "rw"}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("reservation:\n got %+v\nwant %+v", got, want)
	}
	active, _ := l.state()
	if len(active) != 1 || !strings.HasPrefix(active[0].OwnerID, OwnerPrefix) || active[0].Group != h100 {
		t.Fatalf("ledger: %+v; want one reservation of a %q owner in group %s", active, OwnerPrefix, h100)
	}
	// A second allocation is a second owner: Nomad does not name allocations.
	if _, err := p.Reserve([]string{"GPU-a"}); err != nil {
		t.Fatal(err)
	}
	active, _ = l.state()
	if len(active) != 1 || active[0].OwnerID == l.reserves[0].OwnerID {
		t.Errorf("after a second Reserve: %+v; want one reservation of a new owner", active)
	}
}

// A device Nomad hands to a new allocation while an earlier Nomad reservation holds it
// is taken over in one call to the agent, which releases the earlier reservation with
// the new one's record: the shim releases nothing itself.
func TestReserveTakesOverNomadReservation(t *testing.T) {
	l := newFakeLedger()
	p := reserveShim(t, l, "GPU-a", "GPU-b", "GPU-c")
	old1 := l.hold("nomad/old-1", "GPU-a", "GPU-b")
	old2 := l.hold("nomad/old-2", "GPU-c")
	keep := l.hold("nomad/other", "GPU-d")
	holds := len(l.reserves)

	if _, err := p.Reserve([]string{"GPU-b", "GPU-c"}); err != nil {
		t.Fatalf("Reserve over earlier Nomad reservations: %v", err)
	}
	if reqs := l.reserves[holds:]; len(reqs) != 1 || !reflect.DeepEqual(reqs[0].TakeOverOwnerPrefixes, []string{OwnerPrefix}) || l.releases != 0 {
		t.Errorf("the shim made Reserves %+v and %d Release calls; want one Reserve taking over %q, no Release", reqs, l.releases, OwnerPrefix)
	}
	active, released := l.state()
	if !reflect.DeepEqual(released, []string{old1, old2}) {
		t.Errorf("released %q, want the two holders %q", released, []string{old1, old2})
	}
	if len(active) != 2 || active[0].ID != keep || !reflect.DeepEqual(active[1].DeviceIDs, []string{"GPU-b", "GPU-c"}) {
		t.Errorf("active reservations %+v; want %s untouched and the new one on GPU-b, GPU-c", active, keep)
	}
}

// A device held by an owner that is not a Nomad allocation is refused, naming the
// holder, and nothing is released.
func TestReserveRefusesOtherOwners(t *testing.T) {
	l := newFakeLedger()
	p := reserveShim(t, l, "GPU-a", "GPU-b")
	nomadRes := l.hold("nomad/old", "GPU-a")
	k8s := l.hold("k8s/default/train/main", "GPU-b")

	_, err := p.Reserve([]string{"GPU-a", "GPU-b"})
	if err == nil {
		t.Fatal("Reserve took a device held by a Kubernetes pod")
	}
	if want := `devicehost: reserve GPU-a, GPU-b: GPU-b held by reservation ` + k8s + ` of owner "k8s/default/train/main": device held`; err.Error() != want || !errors.Is(err, dev.ErrDeviceHeld) {
		t.Errorf("error %q\nwant %q, a device held", err, want)
	}
	active, released := l.state()
	if len(released) != 0 || len(active) != 2 || active[0].ID != nomadRes {
		t.Errorf("after the refusal: active %+v, released %q; want both holders untouched", active, released)
	}
}

// A Reserve still in flight for another owner is not taken over.
func TestReserveRefusesReserveInFlight(t *testing.T) {
	l := newFakeLedger()
	p := reserveShim(t, l, "GPU-a")
	l.inFlight["GPU-a"] = "nomad/racing"
	_, err := p.Reserve([]string{"GPU-a"})
	if err == nil || !strings.Contains(err.Error(), `GPU-a being reserved for owner "nomad/racing"`) {
		t.Fatalf("err = %v; want a refusal naming the Reserve in flight", err)
	}
}

// Devices the agent does not report, or of two groups, are refused with their IDs.
func TestReserveUnknownDevices(t *testing.T) {
	l := newFakeLedger()
	p := reserveShim(t, l, "GPU-a")
	_, err := p.Reserve([]string{"GPU-a", "GPU-zz"})
	if err == nil || !strings.Contains(err.Error(), "unknown devices GPU-zz") {
		t.Fatalf("err = %v; want unknown devices GPU-zz", err)
	}
	if _, err := p.Reserve(nil); err == nil {
		t.Fatal("Reserve of no devices succeeded")
	}
	if len(l.reserves) != 0 {
		t.Errorf("the agent was asked %d times; want none", len(l.reserves))
	}
}

// Devices in two groups cannot be one Reserve.
func TestInventoryGroupOf(t *testing.T) {
	var inv inventory
	inv.set(&pb.FingerprintResponse{Groups: []*pb.DeviceGroup{
		{Vendor: "nvidia", Type: "gpu", Name: h100.Name, Devices: []*pb.Device{{Id: "GPU-a"}}},
		{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA A100", Devices: []*pb.Device{{Id: "GPU-b"}, {Id: "GPU-x"}}},
		{Vendor: "acme", Type: "gpu", Name: "X", Devices: []*pb.Device{{Id: "GPU-x"}}},
	}})
	if _, err := inv.groupOf([]string{"GPU-x"}); err == nil || !strings.Contains(err.Error(), "more than one group") {
		t.Errorf("err = %v; want more than one group", err)
	}
	if _, err := inv.groupOf([]string{"GPU-a", "GPU-b"}); err == nil || !strings.Contains(err.Error(), "different groups") {
		t.Errorf("err = %v; want different groups", err)
	}
	k, err := inv.groupOf([]string{"GPU-b"})
	if err != nil || k.name != "NVIDIA A100" {
		t.Errorf("groupOf(GPU-b) = %v, %v", k, err)
	}
}

// Config errors name the key; the agent need not be running.
func TestSetConfig(t *testing.T) {
	for _, tc := range []struct {
		name   string
		config map[string]any
		want   string // "" for success
	}{
		{"defaults", map[string]any{}, ""},
		{"unix", map[string]any{"address": "unix:///run/x.sock"}, ""},
		{"tcp loopback insecure", map[string]any{"address": "tcp://127.0.0.1:7000", "insecure": true}, ""},
		{"bad scheme", map[string]any{"address": "http://x"}, `address "http://x"`},
		{"tcp without TLS", map[string]any{"address": "tcp://10.0.0.1:7000"}, `address "tcp://10.0.0.1:7000"`},
		{"insecure off loopback", map[string]any{"address": "tcp://10.0.0.1:7000", "insecure": true}, "loopback"},
		{"bad timeout", map[string]any{"reserve_timeout": "soon"}, `reserve_timeout: "soon"`},
		{"unknown key", map[string]any{"adress": "unix:///x.sock"}, `"adress"`},
		{"nomad settings", map[string]any{"nomad_address": "https://127.0.0.1:4646", "nomad_token": "t", "release_grace": "1m"}, ""},
		{"bad release grace", map[string]any{"release_grace": "0s"}, `release_grace: "0s"`},
		{"bad nomad address", map[string]any{"nomad_address": "ftp://x"}, `nomad_address`},
		{"nomad CA unreadable", map[string]any{"nomad_address": "https://127.0.0.1:4646", "nomad_cacert": "/nonexistent.pem"}, "nomad CA certificate"},
		{"not following", map[string]any{"follow_allocations": false, "nomad_address": "ftp://ignored"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := New(nil)
			defer p.Close()
			err := setConfig(p, tc.config)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("SetConfig: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("SetConfig error %v; want one containing %s", err, tc.want)
			}
			if tc.name == "defaults" && p.address() != DefaultAddress {
				t.Errorf("address %q, want the default %q", p.address(), DefaultAddress)
			}
		})
	}
}

// Before SetConfig nothing runs.
func TestUnconfigured(t *testing.T) {
	p := New(nil)
	if _, err := p.Fingerprint(context.Background()); err == nil {
		t.Error("Fingerprint before SetConfig succeeded")
	}
	if _, err := p.Reserve([]string{"x"}); err == nil {
		t.Error("Reserve before SetConfig succeeded")
	}
}

// A Reserve over shared capacity is refused naming each counter, its use and the first
// holders, with the rest counted; the shim's placeholder owner is not among them.
func TestCapacityRefusalMessage(t *testing.T) {
	users := func(n int) []dev.Holder {
		var out []dev.Holder
		for i := range n {
			out = append(out, dev.Holder{ReservationID: fmt.Sprintf("res-%d", i), OwnerID: fmt.Sprintf("nomad/default/job/alloc-%d/main", i)})
		}
		return out
	}
	set := dev.CounterSetKey{Plugin: "nvidia-example", Name: "GPU-0"}
	l := newFakeLedger()
	l.overruns = []dev.Overrun{
		{Set: set, Counter: "compute-slices", Capacity: 7, Used: 7, Requested: 7, Users: users(7)},
		{Set: set, Counter: "memory-slice-0", Capacity: 1, Used: 1, Requested: 1, Users: users(1)},
		{Set: set, Counter: "memory-slice-1", Capacity: 1, Used: 1, Requested: 1, Users: users(1)},
		{Set: set, Counter: "memory-slice-2", Capacity: 1, Used: 1, Requested: 1, Users: users(1)},
	}
	p := reserveShim(t, l, "GPU-a")
	_, err := p.Reserve([]string{"GPU-a"})
	if !errors.Is(err, dev.ErrCapacityExceeded) {
		t.Fatalf("Reserve over capacity: %v; want a capacity refusal", err)
	}
	got := err.Error()
	for _, want := range []string{
		`devicehost: reserve GPU-a: counter "compute-slices" of set "GPU-0" (plugin "nvidia-example"): 7 requested, 7 of 7 used by ` +
			`reservation res-0 of owner "nomad/default/job/alloc-0/main", `,
		`reservation res-2 of owner "nomad/default/job/alloc-2/main", 4 more; counter "memory-slice-0"`,
		"; and 2 more counters: shared capacity exceeded",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("message %q\nwant %q in it", got, want)
		}
	}
	if owner := l.reserves[0].OwnerID; strings.Contains(got, owner) || strings.Contains(got, "memory-slice-1") {
		t.Errorf("message %q names the placeholder owner %s or more than 2 counters", got, owner)
	}
}
