package server

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// randomInventory is a new inventory (new slices) of 1-4 groups of 1-12 devices from 2
// plugins, each device consuming a counter set half the time.
func randomInventory(r *rand.Rand) device.Inventory {
	var inv device.Inventory
	sets := []device.CounterSetKey{{Plugin: "p0", Name: "gpu-0"}, {Plugin: "p1", Name: "gpu-1"}}
	for _, k := range sets {
		inv.CounterSets = append(inv.CounterSets, device.CounterSet{Key: k, Capacity: map[string]int64{"memory": 80, "slices": 7}})
	}
	for g := range 1 + r.IntN(4) {
		plugin := fmt.Sprintf("p%d", g%2)
		grp := device.Group{
			GroupKey:   device.GroupKey{Vendor: "nvidia", Type: []string{"gpu", "mig"}[g%2], Name: fmt.Sprintf("model-%d", g)},
			Plugin:     plugin,
			Attributes: map[string]device.Value{"memory": {Kind: device.KindInt, Int: int64(r.IntN(100)), Unit: "GiB"}},
		}
		for i := range 1 + r.IntN(12) {
			d := device.DeviceInfo{
				ID:         fmt.Sprintf("%s-g%d-d%d", plugin, g, i),
				Locality:   device.Locality{PCIBusID: fmt.Sprintf("0000:%02x:00.0", i), NUMANode: r.IntN(2)},
				CDIDevices: []string{fmt.Sprintf("nvidia.com/gpu=%d", i)},
			}
			if r.IntN(2) == 0 {
				d.Consumes = []device.Consumption{{Set: sets[g%2], Counters: map[string]int64{"slices": int64(1 + r.IntN(7))}}}
			}
			grp.Devices = append(grp.Devices, d)
		}
		inv.Groups = append(inv.Groups, grp)
	}
	return inv
}

// randomState gives some devices of inv random state, each part of it (health, holder,
// blockers, cordon, admin access) from a small set of values so that successive states
// often agree.
func randomState(r *rand.Rand, inv device.Inventory) device.State {
	base := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	holder := func() device.Holder {
		n := r.IntN(3)
		return device.Holder{ReservationID: fmt.Sprintf("res-%d", n), OwnerID: fmt.Sprintf("owner-%d", n), OwnerLabels: device.OwnerLabels{Pod: "x"}}
	}
	st := device.State{Devices: map[string]device.DeviceState{}, CounterUse: map[device.CounterSetKey]map[string]int64{}}
	for _, cs := range inv.CounterSets {
		if r.IntN(2) == 0 {
			st.CounterUse[cs.Key] = map[string]int64{"slices": int64(r.IntN(7))}
		}
	}
	for _, g := range inv.Groups {
		for _, d := range g.Devices {
			if r.IntN(5) == 0 {
				continue // a device the state does not mention
			}
			ds := device.DeviceState{Health: device.Health(r.IntN(3)), Since: base.Add(time.Duration(r.IntN(2)) * time.Second)}
			if ds.Health == device.HealthUnhealthy {
				ds.Reason = []string{"XID 79", "fell off the bus"}[r.IntN(2)]
			}
			if r.IntN(3) == 0 {
				h := holder()
				ds.Holder = &h
			}
			for range r.IntN(3) {
				ds.BlockedBy = append(ds.BlockedBy, holder())
			}
			if r.IntN(4) == 0 {
				ds.Cordon = &device.Cordon{Reason: "maintenance", By: "main/uid=0", Since: base, Drain: r.IntN(2) == 0}
			}
			for range r.IntN(2) {
				ds.AdminAccess = append(ds.AdminAccess, holder())
			}
			st.Devices[d.ID] = ds
		}
	}
	return st
}

// The encoder's message is snapshotToProto's, over random sequences of snapshots where
// the state changes under the same inventory and the inventory is now and then
// replaced, for every kind of filter; and its cache holds no device of an earlier
// inventory.
func TestSnapshotEncoderIsSnapshotToProto(t *testing.T) {
	filters := []streamFilter{{}, {plugins: []string{"p1"}}, {groups: []device.GroupKey{{Type: "gpu"}}}}
	for seed := range uint64(200) {
		r := rand.New(rand.NewPCG(seed, 1))
		f := filters[seed%uint64(len(filters))]
		e := newSnapshotEncoder(f)
		inv := randomInventory(r)
		st := randomState(r, inv)
		for step := range 30 {
			switch r.IntN(10) {
			case 0:
				inv = randomInventory(r)
				st = randomState(r, inv)
			case 1, 2, 3:
				st = randomState(r, inv)
			default: // one device's state changed, the rest as they were
				next := device.State{Devices: map[string]device.DeviceState{}, CounterUse: st.CounterUse}
				for k, v := range st.Devices {
					next.Devices[k] = v
				}
				g := inv.Groups[r.IntN(len(inv.Groups))]
				d := g.Devices[r.IntN(len(g.Devices))]
				ds := randomState(r, inv).Devices[d.ID]
				next.Devices[d.ID] = ds
				st = next
			}
			snap := device.Snapshot{Seq: uint64(step), Time: time.Unix(int64(step), 0), Inventory: inv, State: st}
			frame := e.encode(snap)
			if frame.Err() != nil {
				t.Fatalf("seed %d step %d: %v", seed, step, frame.Err())
			}
			var got pb.FingerprintResponse
			if err := proto.Unmarshal(frame.Data(), &got); err != nil {
				t.Fatalf("seed %d step %d: the encoder's bytes do not decode: %v", seed, step, err)
			}
			want := snapshotToProto(snap, f)
			if !proto.Equal(&got, want) {
				t.Fatalf("seed %d step %d (filter %+v): encoder's message\n%v\nwant snapshotToProto's\n%v", seed, step, f, &got, want)
			}
			for d := range e.devs {
				found := false
				for gi := range inv.Groups {
					for di := range inv.Groups[gi].Devices {
						found = found || d == &inv.Groups[gi].Devices[di]
					}
				}
				if !found {
					t.Fatalf("seed %d step %d: the encoder keeps device %s of an earlier inventory", seed, step, d.ID)
				}
			}
			for g := range e.groups {
				if !containsAddr(inv.Groups, g) {
					t.Fatalf("seed %d step %d: the encoder keeps group %s of an earlier inventory", seed, step, g.Name)
				}
			}
			for cs := range e.sets {
				if !containsAddr(inv.CounterSets, cs) {
					t.Fatalf("seed %d step %d: the encoder keeps counter set %s of an earlier inventory", seed, step, cs.Key.Name)
				}
			}
		}
	}
}

// containsAddr reports whether p points at an element of s.
func containsAddr[T any](s []T, p *T) bool {
	for i := range s {
		if &s[i] == p {
			return true
		}
	}
	return false
}

// BenchmarkFingerprintEncode encodes a snapshot of 8 groups of 29 devices (a DGX H100's
// GPUs and MIG placements: 232) after one device's holder changed: whole, as
// snapshotToProto and proto.Marshal do, and with the encoder's cache.
func BenchmarkFingerprintEncode(b *testing.B) {
	var inv device.Inventory
	st := device.State{Devices: map[string]device.DeviceState{}}
	for g := range 8 {
		grp := device.Group{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "mig", Name: fmt.Sprintf("profile-%d", g)}, Plugin: "nvidia"}
		for i := range 29 {
			id := fmt.Sprintf("MIG-%d-%d", g, i)
			grp.Devices = append(grp.Devices, device.DeviceInfo{
				ID: id, Locality: device.Locality{PCIBusID: "0000:17:00.0"}, CDIDevices: []string{"nvidia.com/gpu=" + id},
				Consumes: []device.Consumption{{Set: device.CounterSetKey{Plugin: "nvidia", Name: fmt.Sprintf("gpu-%d", i%8)}, Counters: map[string]int64{"memory": 10, "slices": 1}}},
			})
			st.Devices[id] = device.DeviceState{Health: device.HealthHealthy, Since: time.Unix(1, 0)}
		}
		inv.Groups = append(inv.Groups, grp)
	}
	held := device.State{Devices: map[string]device.DeviceState{}}
	for k, v := range st.Devices {
		held.Devices[k] = v
	}
	held.Devices["MIG-0-0"] = device.DeviceState{Health: device.HealthHealthy, Since: time.Unix(1, 0), Holder: &device.Holder{ReservationID: "res-1", OwnerID: "bench"}}
	snaps := []device.Snapshot{{Inventory: inv, State: st}, {Inventory: inv, State: held}}
	b.Run("whole", func(b *testing.B) {
		for i := 0; b.Loop(); i++ {
			if _, err := proto.Marshal(snapshotToProto(snaps[i%2], streamFilter{})); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("cached", func(b *testing.B) {
		e := newSnapshotEncoder(streamFilter{})
		for i := 0; b.Loop(); i++ {
			if f := e.encode(snaps[i%2]); f.Err() != nil {
				b.Fatal(f.Err())
			}
		}
	})
}
