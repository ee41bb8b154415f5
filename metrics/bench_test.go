package metrics_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/metrics"
)

// BenchmarkScrape measures one /metrics request served in-process (gather and
// encode): the agent's cost of a scrape, for 8 GPUs as agent -dev has them and for a
// plugin of 1024 devices with 16 stats each.
func BenchmarkScrape(b *testing.B) {
	big := func() (device.Snapshot, device.StatsSnapshot) {
		g := device.Group{GroupKey: widget, Plugin: "acme"}
		gs := device.GroupStats{GroupKey: widget, Plugin: "acme"}
		st := device.State{Devices: map[string]device.DeviceState{}}
		for i := range 1024 {
			id := fmt.Sprintf("w%04d", i)
			g.Devices = append(g.Devices, device.DeviceInfo{ID: id})
			st.Devices[id] = device.DeviceState{Health: device.HealthHealthy}
			values := map[string]device.Value{}
			for j := range 16 {
				values[fmt.Sprintf("stat_%02d", j)] = intValue(int64(i*j), "MiB")
			}
			gs.Devices = append(gs.Devices, device.DeviceStats{ID: id, Values: values})
		}
		return device.Snapshot{Inventory: device.Inventory{Groups: []device.Group{g}}, State: st},
			device.StatsSnapshot{Groups: []device.GroupStats{gs}}
	}
	for _, bc := range []struct {
		name string
		mk   func() (device.Snapshot, device.StatsSnapshot)
	}{
		{"2 GPUs and a widget", func() (device.Snapshot, device.StatsSnapshot) { return gpuSnapshot(), gpuStats() }},
		{"1024 devices x 16 stats", big},
	} {
		b.Run(bc.name, func(b *testing.B) {
			snap, stats := bc.mk()
			m, err := metrics.New(metrics.Options{Hostname: "h"})
			if err != nil {
				b.Fatal(err)
			}
			if err := m.CollectManager(newFake(snap, stats)); err != nil {
				b.Fatal(err)
			}
			req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
			b.ReportAllocs()
			for b.Loop() {
				w := httptest.NewRecorder()
				m.Handler().ServeHTTP(w, req)
				if w.Code != http.StatusOK {
					b.Fatalf("status %d", w.Code)
				}
			}
		})
	}
}
