package inventory

import (
	"context"
	"testing"

	"github.com/devicehost/devicehost/device"
)

// A cordon is apart from health: a cordoned device that turns unhealthy and recovers
// (its plugin's fingerprint says so, or the plugin goes down and comes back) stays
// cordoned, and only the cordons' source decides when it is not.
func TestCordonOutlivesHealth(t *testing.T) {
	cordons := map[string]device.Cordon{"g0": {Reason: "ECC storm", By: "admin"}}
	r := New(Config{Cordons: func() map[string]device.Cordon { return cordons }})
	r.AddPlugin("p", "/p")
	fp := func(h device.Health) fingerprint {
		return fingerprint{
			groups:  []device.Group{{GroupKey: acmeA1, Plugin: "p", Devices: []device.DeviceInfo{{ID: "g0"}, {ID: "g1"}}}},
			devices: map[string]reportedDevice{"g0": {group: acmeA1, health: h}, "g1": {group: acmeA1, health: device.HealthHealthy}},
		}
	}
	state := func(id string) device.DeviceState { return r.Snapshot().State.Devices[id] }
	for _, step := range []struct {
		what string
		do   func()
		want device.Health
	}{
		{"healthy", func() { r.setFingerprint("p", fp(device.HealthHealthy)) }, device.HealthHealthy},
		{"unhealthy", func() { r.setFingerprint("p", fp(device.HealthUnhealthy)) }, device.HealthUnhealthy},
		{"recovered", func() { r.setFingerprint("p", fp(device.HealthHealthy)) }, device.HealthHealthy},
		{"plugin down", func() { r.Down("p", "crashed") }, device.HealthUnhealthy},
		{"plugin back", func() { r.Running("p", "1"); r.setFingerprint("p", fp(device.HealthHealthy)) }, device.HealthHealthy},
	} {
		step.do()
		st := state("g0")
		if st.Health != step.want || st.Cordon == nil || st.Cordon.Reason != "ECC storm" {
			t.Errorf("%s: g0 %v, cordon %+v; want %v and still cordoned", step.what, st.Health, st.Cordon, step.want)
		}
		if c := state("g1").Cordon; c != nil {
			t.Errorf("%s: g1 cordoned %+v, want not", step.what, c)
		}
	}
	cordons = nil // uncordoned at the source
	r.Refresh(context.Background())
	if c := state("g0").Cordon; c != nil {
		t.Errorf("after the uncordon and a refresh: g0 cordoned %+v", c)
	}
}
