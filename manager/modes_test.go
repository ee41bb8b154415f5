package manager

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// sharedGPU is plugin "parts" with GPU-0 offered whole, as time-sliced replicas
// (group acme/gpu/shared, compatibility group "time-slicing") and as MPS shares
// (acme/gpu/mps, group "mps"), all on counter set "gpu-0"; and group acme/gpu/mixed,
// one replica and one share of that GPU, so that one request can ask for both.
func sharedGPU() *fakeDevices {
	use := func(counter string, groups ...string) []*pb.CounterConsumption {
		return []*pb.CounterConsumption{{CounterSet: "gpu-0", Counters: map[string]int64{counter: 1}, CompatibilityGroups: groups}}
	}
	whole := group("acme", "gpu", "G1", "GPU-0")
	whole.Devices[0].Consumes = []*pb.CounterConsumption{{CounterSet: "gpu-0", Counters: map[string]int64{"time-slices": 2, "mps": 2}}}
	ts := group("acme", "gpu", "shared", "TS-0", "TS-1")
	mps := group("acme", "gpu", "mps", "MPS-0", "MPS-1")
	mixed := group("acme", "gpu", "mixed", "X-TS", "X-MPS")
	for _, d := range ts.Devices {
		d.Consumes = use("time-slices", "time-slicing")
	}
	for _, d := range mps.Devices {
		d.Consumes = use("mps", "mps")
	}
	mixed.Devices[0].Consumes = use("time-slices", "time-slicing")
	mixed.Devices[1].Consumes = use("mps", "mps")
	f := newFakeDevices("parts", whole, ts, mps, mixed)
	f.counterSets = []*pb.CounterSet{{Name: "gpu-0", Counters: map[string]int64{"time-slices": 2, "mps": 2}}}
	return f
}

// Through the manager: two time-sliced replicas share the GPU, and while either is
// held an MPS share and the whole GPU are blocked in the snapshot (by the holders) and
// refused before the plugin is asked; with both released, MPS takes the GPU and the
// replicas are blocked in their turn. One request for a replica and a share of one GPU
// is refused as invalid, naming both devices.
func TestSharingModesThroughTheManager(t *testing.T) {
	plugin := sharedGPU()
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, plugin)
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	tsKey := device.GroupKey{Vendor: "acme", Type: "gpu", Name: "shared"}
	mpsKey := device.GroupKey{Vendor: "acme", Type: "gpu", Name: "mps"}
	reserve := func(owner string, key device.GroupKey, ids ...string) (device.Reservation, error) {
		return m.Reserve(ctx, device.ReserveRequest{OwnerID: owner, Group: key, DeviceIDs: ids})
	}
	blockers := func(id string) []string {
		var out []string
		for _, h := range m.Snapshot().State.Devices[id].BlockedBy {
			out = append(out, h.ReservationID)
		}
		return out
	}
	a, err := reserve("job-a", tsKey, "TS-0")
	if err != nil {
		t.Fatal(err)
	}
	if len(a.Consumes) != 1 || a.Consumes[0].Groups[0] != "time-slicing" {
		t.Errorf("replica's use %+v, want its group recorded", a.Consumes)
	}
	b, err := reserve("job-b", tsKey, "TS-1")
	if err != nil {
		t.Fatalf("second replica: %v", err)
	}
	if got := blockers("MPS-0"); len(got) != 2 || !strings.Contains(strings.Join(got, " "), a.ID) || !strings.Contains(strings.Join(got, " "), b.ID) {
		t.Errorf("MPS-0 blocked by %v, want both replicas", got)
	}
	asked := plugin.reserveCalls()
	_, err = reserve("job-c", mpsKey, "MPS-0")
	if !errors.Is(err, device.ErrCapacityExceeded) || !strings.Contains(err.Error(), `is held shared as "time-slicing" by reservation`) ||
		!strings.Contains(err.Error(), `would hold it shared as "mps"`) {
		t.Fatalf("MPS share beside replicas: %v, want refused for the mode", err)
	}
	if _, err := reserve("job-c", gpuKey, "GPU-0"); !errors.Is(err, device.ErrCapacityExceeded) {
		t.Fatalf("whole GPU beside replicas: %v, want refused", err)
	}
	if n := plugin.reserveCalls(); n != asked {
		t.Errorf("the plugin was asked %d more times for refused Reserves", n-asked)
	}
	for _, r := range []device.Reservation{a, b} {
		if _, err := m.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}); err != nil {
			t.Fatal(err)
		}
	}
	c, err := reserve("job-c", mpsKey, "MPS-0")
	if err != nil {
		t.Fatalf("MPS share on the freed GPU: %v", err)
	}
	if got := blockers("TS-0"); len(got) != 1 || got[0] != c.ID {
		t.Errorf("TS-0 blocked by %v, want the MPS holder %s", got, c.ID)
	}
	if got := blockers("MPS-1"); len(got) != 0 {
		t.Errorf("MPS-1 blocked by %v, want free", got)
	}
	_, err = reserve("job-d", device.GroupKey{Vendor: "acme", Type: "gpu", Name: "mixed"}, "X-TS", "X-MPS")
	if !errors.Is(err, device.ErrInvalidRequest) || !strings.Contains(err.Error(), `devices "X-MPS" and "X-TS" use counter set "gpu-0"`) {
		t.Fatalf("a replica and a share in one request: %v, want invalid naming both", err)
	}
}
