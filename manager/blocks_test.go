package manager

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// twoPartitionedGPUs is plugin "parts" with GPUs G0 and G1, each in counter set
// "gpu-<i>" of 7 slices with capacity slices: the GPU consumes 7, partitions P<i>-<k>
// (k < 4) one each, and a double D<i> two; and shares that use one slice each under a
// compatibility group: T<i>-<k> (k < 2) group "time-slicing", M<i>-<k> group "mps".
func twoPartitionedGPUs(slicesCap int64) (*fakeDevices, []*pb.DeviceGroup, []*pb.CounterSet) {
	var gpus, parts, doubles, slices, shares []string
	for i := range 2 {
		gpus = append(gpus, fmt.Sprintf("G%d", i))
		doubles = append(doubles, fmt.Sprintf("D%d", i))
		for k := range 4 {
			parts = append(parts, fmt.Sprintf("P%d-%d", i, k))
		}
		for k := range 2 {
			slices = append(slices, fmt.Sprintf("T%d-%d", i, k))
			shares = append(shares, fmt.Sprintf("M%d-%d", i, k))
		}
	}
	use := func(id string, n int64) []*pb.CounterConsumption {
		return []*pb.CounterConsumption{{CounterSet: "gpu-" + id[1:2], Counters: map[string]int64{"slices": n}}}
	}
	gg, pg, dg := group("acme", "gpu", "G1", gpus...), group("acme", "mig", "1s", parts...), group("acme", "mig", "2s", doubles...)
	for _, d := range gg.Devices {
		d.Consumes = use(d.Id, 7)
	}
	for _, d := range pg.Devices {
		d.Consumes = use(d.Id, 1)
	}
	for _, d := range dg.Devices {
		d.Consumes = use(d.Id, 2)
	}
	tg, mg := group("acme", "gpu", "ts", slices...), group("acme", "gpu", "mps", shares...)
	for _, d := range tg.Devices {
		d.Consumes = use(d.Id, 1)
		d.Consumes[0].CompatibilityGroups = []string{"time-slicing"}
	}
	for _, d := range mg.Devices {
		d.Consumes = use(d.Id, 1)
		d.Consumes[0].CompatibilityGroups = []string{"mps"}
	}
	sets := []*pb.CounterSet{{Name: "gpu-0", Counters: map[string]int64{"slices": slicesCap}}, {Name: "gpu-1", Counters: map[string]int64{"slices": slicesCap}}}
	f := newFakeDevices("parts", gg, pg, dg, tg, mg)
	f.counterSets = sets
	return f, []*pb.DeviceGroup{gg, pg, dg, tg, mg}, sets
}

// wantBlockers works out, from scratch, which live reservations block each free
// device of snap: those using a counter the device would take past its capacity, or
// every user of a set the device cannot share with (no compatibility group in common).
func wantBlockers(snap device.Snapshot, live map[string]device.Reservation) map[string][]string {
	caps := make(map[device.CounterSetKey]map[string]int64)
	for _, cs := range snap.Inventory.CounterSets {
		caps[cs.Key] = cs.Capacity
	}
	held := make(map[string]bool)
	used := make(map[device.CounterSetKey]map[string]int64)
	for _, r := range live {
		for _, id := range r.DeviceIDs {
			held[id] = true
		}
		for _, c := range r.Consumes {
			if used[c.Set] == nil {
				used[c.Set] = make(map[string]int64)
			}
			for n, v := range c.Counters {
				used[c.Set][n] += v
			}
		}
	}
	out := make(map[string][]string)
	for _, g := range snap.Inventory.Groups {
		for _, d := range g.Devices {
			if held[d.ID] {
				continue
			}
			var by []string
			for _, c := range d.Consumes {
				common, compatible := c.Groups, true
				var users []string
				for id, r := range live {
					for _, rc := range r.Consumes {
						if rc.Set == c.Set {
							users = append(users, id)
							if compatible {
								common, compatible = device.Compatible(common, rc.Groups)
							}
						}
					}
				}
				if !compatible {
					by = append(by, users...)
					continue
				}
				for n, want := range c.Counters {
					if want <= 0 || used[c.Set][n]+want <= caps[c.Set][n] {
						continue
					}
					for id, r := range live {
						for _, rc := range r.Consumes {
							if rc.Set == c.Set && rc.Counters[n] > 0 {
								by = append(by, id)
							}
						}
					}
				}
			}
			slices.Sort(by)
			if by = slices.Compact(by); len(by) > 0 {
				out[d.ID] = by
			}
		}
	}
	return out
}

func gotBlockers(snap device.Snapshot) map[string][]string {
	out := make(map[string][]string)
	for id, st := range snap.State.Devices {
		for _, h := range st.BlockedBy {
			out[id] = append(out[id], h.ReservationID)
		}
	}
	return out
}

func diffBlockers(got, want map[string][]string) string {
	var d []string
	for id := range want {
		if !slices.Equal(got[id], want[id]) {
			d = append(d, fmt.Sprintf("%s: got %v, want %v", id, got[id], want[id]))
		}
	}
	for id := range got {
		if _, ok := want[id]; !ok {
			d = append(d, fmt.Sprintf("%s: got %v, want none", id, got[id]))
		}
	}
	slices.Sort(d)
	return strings.Join(d, "; ")
}

// The snapshot's blockers are kept per counter set between changes (deviceStatesLocked):
// after every Reserve and Release of a seeded random run over two GPUs, and after the
// plugin changes a set's capacity, every free device's blockers are what working them
// out from scratch gives.
func TestBlockedByFollowsEveryChange(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			plugin, groups, _ := twoPartitionedGPUs(7)
			cfg, _ := testConfig(t)
			m, _ := startInprocManager(t, cfg, plugin)
			waitReady(t, m)
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
			defer cancel()
			var ids []string
			keys := make(map[string]device.GroupKey)
			for _, g := range groups {
				for _, d := range g.Devices {
					ids = append(ids, d.Id)
					keys[d.Id] = device.GroupKey{Vendor: g.Vendor, Type: g.Type, Name: g.Name}
				}
			}
			live := make(map[string]device.Reservation)
			rng := rand.New(rand.NewPCG(seed, 19))
			check := func(step string) {
				t.Helper()
				snap := m.Snapshot()
				if d := diffBlockers(gotBlockers(snap), wantBlockers(snap, live)); d != "" {
					t.Fatalf("%s: blockers differ from a fresh count: %s", step, d)
				}
			}
			for step := range 60 {
				if len(live) > 0 && rng.IntN(3) == 0 {
					var held []string
					for id := range live {
						held = append(held, id)
					}
					slices.Sort(held)
					id := held[rng.IntN(len(held))]
					if _, err := m.Release(ctx, device.ReleaseRequest{ReservationID: id}); err != nil {
						t.Fatal(err)
					}
					delete(live, id)
					check(fmt.Sprintf("step %d, release %s", step, id))
					continue
				}
				dev := ids[rng.IntN(len(ids))]
				r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: fmt.Sprintf("o-%d", step), Group: keys[dev], DeviceIDs: []string{dev}})
				if err == nil {
					live[r.ID] = r
				}
				check(fmt.Sprintf("step %d, reserve %s (%v)", step, dev, err))
			}
			// A new capacity for both sets: every blocker is worked out again.
			plugin.set(func(f *fakeDevices) {
				f.counterSets = []*pb.CounterSet{{Name: "gpu-0", Counters: map[string]int64{"slices": 9}}, {Name: "gpu-1", Counters: map[string]int64{"slices": 9}}}
			})
			plugin.setGroups(groups...)
			testwait.WaitFor(t, "the new capacity in the snapshot", func() bool {
				return m.Snapshot().Inventory.CounterSets[0].Capacity["slices"] == 9
			})
			check("capacity 7 -> 9")
		})
	}
}
