package manager

import (
	"reflect"
	"testing"

	"github.com/devicehost/devicehost/device"
)

// TestReserveAndReleasePublishHolderChanges: a Reserve and a Release each publish a new
// snapshot (a higher Seq) showing the holder change, with the inventory and plugin
// states as they were, and later registry changes still republish everything.
func TestReserveAndReleasePublishHolderChanges(t *testing.T) {
	cfg, _ := durableConfig(t)
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	before := m.Snapshot()

	r := reserve(t, m, "o1", "a0")
	held := m.Snapshot()
	want := device.Holder{ReservationID: r.ID, OwnerID: "o1"}
	switch {
	case held.Seq <= before.Seq:
		t.Errorf("snapshot after Reserve has Seq %d, want above %d", held.Seq, before.Seq)
	case held.State.Devices["a0"].Holder == nil || *held.State.Devices["a0"].Holder != want:
		t.Errorf("a0 after Reserve: %+v, want held by %+v", held.State.Devices["a0"], want)
	case held.State.Devices["a1"].Holder != nil:
		t.Errorf("a1 after Reserve: %+v, want no holder", held.State.Devices["a1"])
	}
	if !reflect.DeepEqual(held.Inventory, before.Inventory) || !reflect.DeepEqual(held.State.Plugins, before.State.Plugins) {
		t.Errorf("Reserve changed the inventory or plugin states:\n%+v\n%+v\nwant\n%+v\n%+v",
			held.Inventory, held.State.Plugins, before.Inventory, before.State.Plugins)
	}
	if before.State.Devices["a0"].Holder != nil {
		t.Errorf("the snapshot taken before Reserve changed: a0 %+v", before.State.Devices["a0"])
	}

	release(t, m, device.ReleaseRequest{ReservationID: r.ID})
	freed := m.Snapshot()
	if freed.Seq <= held.Seq || freed.State.Devices["a0"].Holder != nil {
		t.Errorf("snapshot after Release: Seq %d (want above %d), a0 %+v (want no holder)", freed.Seq, held.Seq, freed.State.Devices["a0"])
	}

	// A fingerprint change after the holder changes still reaches the inventory.
	alpha.setGroups(group("acme", "gpu", "A1", "a0", "a1", "a2"))
	waitSnapshot(t, m, "a2 in the inventory", func(s device.Snapshot) bool { return len(deviceIDs(s.Inventory)) == 3 })
}
