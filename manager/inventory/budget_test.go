package inventory

import (
	"errors"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
)

var acmeA1 = device.GroupKey{Vendor: "acme", Type: "gpu", Name: "A1"}

// deviceIDs lists the IDs in inv, in inventory order, as "plugin/id".
func deviceIDs(inv device.Inventory) []string {
	var out []string
	for _, g := range inv.Groups {
		for _, d := range g.Devices {
			out = append(out, g.Plugin+"/"+d.ID)
		}
	}
	return out
}

// TestRefusedFingerprintKeepsTheLastGoodInventory: a plugin whose new fingerprint would
// take the snapshot over the budget keeps the inventory it had.
func TestRefusedFingerprintKeepsTheLastGoodInventory(t *testing.T) {
	r := New(Config{})
	r.AddPlugin("big", "/big")
	r.AddPlugin("grows", "/grows")
	fp := func(plugin string, cost int, ids ...string) fingerprint {
		f := fingerprint{cost: cost, devices: map[string]reportedDevice{}}
		g := device.Group{GroupKey: acmeA1, Plugin: plugin}
		for _, id := range ids {
			g.Devices = append(g.Devices, device.DeviceInfo{ID: id})
			f.devices[id] = reportedDevice{group: acmeA1, health: device.HealthHealthy}
		}
		f.groups = []device.Group{g}
		return f
	}
	if _, err := r.setFingerprint("big", fp("big", 3<<20, "b0")); err != nil {
		t.Fatal(err)
	}
	if _, err := r.setFingerprint("grows", fp("grows", 100<<10, "g0")); err != nil {
		t.Fatal(err)
	}
	_, err := r.setFingerprint("grows", fp("grows", 600<<10, "g0", "g1"))
	var be *budgetError
	if !errors.As(err, &be) || be.cost != 600<<10 || be.others != 3<<20 || be.limit != MaxSnapshotBytes {
		t.Fatalf("setFingerprint over the budget = %v, want a budgetError with the sizes and the limit", err)
	}
	for _, want := range []string{`plugin "grows"`, "614400 bytes", "3145728 bytes", "limit of 3670016 bytes"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %s", err, want)
		}
	}
	if got := deviceIDs(r.Snapshot().Inventory); strings.Join(got, " ") != "big/b0 grows/g0" {
		t.Errorf("inventory after the refusal = %v, want the last good one", got)
	}
	// Room is freed only by a smaller inventory: the same plugin fits again.
	if _, err := r.setFingerprint("grows", fp("grows", 500<<10, "g0", "g1")); err != nil {
		t.Errorf("setFingerprint within the budget: %v", err)
	}
}
