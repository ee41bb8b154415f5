package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
)

// sharedSnapshot is GPU-0 with MIG placements (one held by job-1, which blocks GPU-0
// whole), GPU-1 time-sliced by two replicas' holders (its whole GPU blocked), GPU-2
// unhealthy and cordoned.
func sharedSnapshot() device.Snapshot {
	gpu0 := device.CounterSetKey{Plugin: "nvidia", Name: "GPU-0"}
	gpu1 := device.CounterSetKey{Plugin: "nvidia", Name: "GPU-1"}
	slices := func(n int64) []device.Consumption {
		return []device.Consumption{{Set: gpu0, Counters: map[string]int64{"compute-slices": n, "memory-slice-0": 1}}}
	}
	ts := []device.Consumption{{Set: gpu1, Counters: map[string]int64{"time-slices": 1}, Groups: []string{"time-slicing"}}}
	held := func(r, o string) device.DeviceState {
		return device.DeviceState{Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: r, OwnerID: o}}
	}
	blocked := func(r, o string) device.DeviceState {
		return device.DeviceState{Health: device.HealthHealthy, BlockedBy: []device.Holder{{ReservationID: r, OwnerID: o}}}
	}
	return device.Snapshot{
		Inventory: device.Inventory{
			Groups: []device.Group{
				{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "H100"}, Plugin: "nvidia",
					Devices: []device.DeviceInfo{{ID: "GPU-0", Consumes: slices(7)}, {ID: "GPU-1", Consumes: []device.Consumption{{Set: gpu1, Counters: map[string]int64{"time-slices": 4}}}}, {ID: "GPU-2"}}},
				{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "gpu.shared", Name: "H100"}, Plugin: "nvidia",
					Devices: []device.DeviceInfo{{ID: "GPU-1::0", Consumes: ts}, {ID: "GPU-1::1", Consumes: ts}, {ID: "GPU-1::2", Consumes: ts}}},
				{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "mig", Name: "1g.10gb"}, Plugin: "nvidia",
					Devices: []device.DeviceInfo{{ID: "GPU-0-mig-0", Consumes: slices(1)}, {ID: "GPU-0-mig-1", Consumes: slices(1)}}},
			},
			CounterSets: []device.CounterSet{
				{Key: gpu0, Capacity: map[string]int64{"compute-slices": 7, "memory-slice-0": 2}},
				{Key: gpu1, Capacity: map[string]int64{"time-slices": 4}},
			},
		},
		State: device.State{
			Devices: map[string]device.DeviceState{
				"GPU-0":       blocked("r1", "job-1"),
				"GPU-1":       blocked("r2", "pod-a"),
				"GPU-2":       {Health: device.HealthUnhealthy, Reason: "XID 79", Cordon: &device.Cordon{Reason: "RMA"}},
				"GPU-1::0":    held("r2", "pod-a"),
				"GPU-1::1":    held("r3", "pod-b"),
				"GPU-1::2":    {Health: device.HealthHealthy},
				"GPU-0-mig-0": held("r1", "job-1"),
				"GPU-0-mig-1": {Health: device.HealthHealthy},
			},
			CounterUse: map[device.CounterSetKey]map[string]int64{
				gpu0: {"compute-slices": 1, "memory-slice-0": 1},
				gpu1: {"time-slices": 2},
			},
		},
	}
}

// `devicehost capacity` counts each group's devices by what a Reserve could get now and
// why not, names the holders, and shows each counter set in use with its holders, the
// mode they hold it in and its fullest counter.
func TestCapacityTable(t *testing.T) {
	addr := startAgent(t, &devicetest.Fake{WatchFunc: watchOnce(sharedSnapshot())})
	got := mustRunCLI(t, "capacity", "-address", addr)
	want := strings.Join([]string{
		"GROUP                   TOTAL  FREE  HELD  BLOCKED  UNHEALTHY  CORDONED  HOLDERS",
		"nvidia/gpu/H100         3      0     0     2        1          1         -",
		"nvidia/gpu.shared/H100  3      1     2     0        0          0         pod-a (1), pod-b (1)",
		"nvidia/mig/1g.10gb      2      1     1     0        0          0         job-1 (1)",
		"",
		"COUNTER SET  PLUGIN  HOLDERS       SHARED AS       FULLEST COUNTER",
		`GPU-0        nvidia  job-1         unshared        memory-slice-0 1/2`,
		`GPU-1        nvidia  pod-a, pod-b  "time-slicing"  time-slices 2/4`,
		"",
	}, "\n")
	if got != want {
		t.Errorf("capacity:\ngot\n%s\nwant\n%s", got, want)
	}
	var r capacityReport
	if err := json.Unmarshal([]byte(mustRunCLI(t, "capacity", "-json", "-address", addr)), &r); err != nil {
		t.Fatal(err)
	}
	if len(r.Groups) != 3 || r.Groups[1].Free != 1 || len(r.Groups[1].Holders) != 2 || len(r.CounterSets) != 2 || r.CounterSets[1].SharedAs[0] != "time-slicing" {
		t.Errorf("capacity -json: %+v", r)
	}
}
