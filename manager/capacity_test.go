package manager

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/deviceplugin"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// partitionedGPU is a plugin "parts" with one GPU that can be had whole or as up to
// seven one-slice partitions, out of n placements: the GPU consumes all 7 slices of set
// "gpu-0", each partition one.
func partitionedGPU(n int) *fakeDevices {
	slices7 := map[string]int64{"slices": 7}
	one := []*pb.CounterConsumption{{CounterSet: "gpu-0", Counters: map[string]int64{"slices": 1}}}
	gpu := group("acme", "gpu", "G1", "GPU-0")
	gpu.Devices[0].Consumes = []*pb.CounterConsumption{{CounterSet: "gpu-0", Counters: slices7}}
	var partIDs []string
	for i := range n {
		partIDs = append(partIDs, fmt.Sprintf("P-%02d", i))
	}
	parts := group("acme", "mig", "1s", partIDs...)
	for _, d := range parts.Devices {
		d.Consumes = one
	}
	f := newFakeDevices("parts", gpu, parts)
	f.counterSets = []*pb.CounterSet{{Name: "gpu-0", Counters: slices7}}
	return f
}

var (
	gpuKey  = device.GroupKey{Vendor: "acme", Type: "gpu", Name: "G1"}
	partKey = device.GroupKey{Vendor: "acme", Type: "mig", Name: "1s"}
)

// Seven partitions of one GPU reserve; the whole GPU is then refused before its plugin
// is asked, naming the counter and the holders, and the snapshot shows it blocked;
// with the partitions released it reserves.
func TestReserveWithinSharedCounters(t *testing.T) {
	plugin := partitionedGPU(8)
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, plugin)
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	var ids []string
	for i := range 7 {
		r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: fmt.Sprintf("job-%d", i), Group: partKey, DeviceIDs: []string{fmt.Sprintf("P-%02d", i)}})
		if err != nil {
			t.Fatalf("partition %d: %v", i, err)
		}
		if len(r.Consumes) != 1 || r.Consumes[0].Counters["slices"] != 1 {
			t.Errorf("reservation %d uses %+v, want 1 slice of gpu-0", i, r.Consumes)
		}
		ids = append(ids, r.ID)
	}
	asked := plugin.reserveCalls()
	if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-7", Group: partKey, DeviceIDs: []string{"P-07"}}); !errors.Is(err, device.ErrCapacityExceeded) {
		t.Fatalf("an eighth partition: %v, want refused", err)
	}
	_, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "whole", Group: gpuKey, DeviceIDs: []string{"GPU-0"}})
	var ce *device.CapacityError
	if !errors.As(err, &ce) || ce.Overruns[0].Used != 7 || len(ce.Overruns[0].Users) != 7 {
		t.Fatalf("whole GPU beside 7 partitions: %v, want a capacity error naming the 7", err)
	}
	if n := plugin.reserveCalls(); n != asked {
		t.Errorf("the plugin was asked %d more times for a Reserve that cannot fit", n-asked)
	}
	snap := m.Snapshot()
	if st := snap.State.Devices["GPU-0"]; len(st.BlockedBy) != 7 {
		t.Errorf("GPU-0 blocked by %v, want the 7 partitions' reservations", st.BlockedBy)
	}
	if use := snap.State.CounterUse[device.CounterSetKey{Plugin: "parts", Name: "gpu-0"}]; use["slices"] != 7 {
		t.Errorf("counter use %v, want 7 slices", snap.State.CounterUse)
	}
	if len(snap.Inventory.CounterSets) != 1 || snap.Inventory.CounterSets[0].Capacity["slices"] != 7 {
		t.Errorf("counter sets %+v, want gpu-0 with 7 slices", snap.Inventory.CounterSets)
	}
	for _, id := range ids {
		if _, err := m.Release(ctx, device.ReleaseRequest{ReservationID: id}); err != nil {
			t.Fatal(err)
		}
	}
	if st := m.Snapshot().State.Devices["GPU-0"]; len(st.BlockedBy) != 0 {
		t.Errorf("GPU-0 still blocked by %v after every partition's release", st.BlockedBy)
	}
	if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "whole", Group: gpuKey, DeviceIDs: []string{"GPU-0"}}); err != nil {
		t.Fatalf("whole GPU with its partitions released: %v", err)
	}
	if st := m.Snapshot().State.Devices["P-03"]; len(st.BlockedBy) != 1 || st.BlockedBy[0].OwnerID != "whole" {
		t.Errorf("P-03 blocked by %v, want the whole GPU's reservation", st.BlockedBy)
	}
}

// 64 concurrent Reserves of 12 free placements, with 3 slices left: exactly 3 win,
// every time, and the plugin is asked only for those.
func TestConcurrentReservesForTheLastPartitions(t *testing.T) {
	plugin := partitionedGPU(16)
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, plugin)
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	for i := range 4 {
		if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: fmt.Sprintf("early-%d", i), Group: partKey, DeviceIDs: []string{fmt.Sprintf("P-%02d", i)}}); err != nil {
			t.Fatal(err)
		}
	}
	asked := plugin.reserveCalls()
	var mu sync.Mutex
	var won []string
	refused := 0
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Go(func() {
			// Twelve free placements, each asked for by several owners at once.
			dev := fmt.Sprintf("P-%02d", 4+i%12)
			_, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: fmt.Sprintf("racer-%d", i), Group: partKey, DeviceIDs: []string{dev}})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				won = append(won, dev)
			case errors.Is(err, device.ErrDeviceHeld) || errors.Is(err, device.ErrCapacityExceeded):
				refused++
			default:
				t.Errorf("racer %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	if len(won) != 3 || len(slices.Compact(slices.Sorted(slices.Values(won)))) != 3 || refused != 61 {
		t.Fatalf("won %v, %d refused; want 3 distinct placements and 61 refused", won, refused)
	}
	if n := plugin.reserveCalls() - asked; n != 3 {
		t.Errorf("the plugin was asked %d times, want 3", n)
	}
	if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "whole", Group: gpuKey, DeviceIDs: []string{"GPU-0"}}); !errors.Is(err, device.ErrCapacityExceeded) {
		t.Errorf("whole GPU with every slice used: %v", err)
	}
}

// Each start of a plugin hands it the live reservations of its devices before it
// serves a Reserve: none on the first, the partition reserved before its crash on the
// restart, so it can keep that instance and undo any other.
func TestPluginToldItsLiveReservationsOnEachStart(t *testing.T) {
	plugin := partitionedGPU(8)
	cfg, _ := testConfig(t)
	m, l := startInprocManager(t, cfg, plugin)
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if got := plugin.reconcileCalls(); len(got) != 1 || len(got[0]) != 0 {
		t.Fatalf("first start: Reconcile calls %v, want one with no reservations", got)
	}
	r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job", Group: partKey, DeviceIDs: []string{"P-02"}})
	if err != nil {
		t.Fatal(err)
	}
	p, _ := l.latest("parts")
	p.exit("signal: killed")
	waitSnapshot(t, m, "parts running again", func(s device.Snapshot) bool {
		np, n := l.latest("parts")
		return n == 2 && np != nil && pluginOf(s, "parts").Status == device.PluginRunning
	})
	got := plugin.reconcileCalls()
	want := []deviceplugin.LiveReservation{{ID: r.ID, DeviceIDs: []string{"P-02"}}}
	if len(got) != 2 || !reflect.DeepEqual(got[1], want) {
		t.Fatalf("Reconcile calls %+v, want a second one with %+v", got, want)
	}
}
