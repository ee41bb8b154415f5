package metrics_test

import (
	"context"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/metrics"
)

var (
	h100   = device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3"}
	widget = device.GroupKey{Vendor: "acme", Type: "widget", Name: "Widget 9000"}
)

// gpuSnapshot is two H100s of the nvidia-example plugin (GPU-b held by job-1, GPU-a
// healthy) and one widget of plugin acme (unhealthy), with the plugins' states.
func gpuSnapshot() device.Snapshot {
	return device.Snapshot{
		Time: t0,
		Inventory: device.Inventory{Groups: []device.Group{
			{GroupKey: widget, Plugin: "acme", Devices: []device.DeviceInfo{{ID: "w0", Locality: device.Locality{NUMANode: -1}}}},
			{GroupKey: h100, Plugin: "nvidia-example", Devices: []device.DeviceInfo{
				{ID: "GPU-a", Locality: device.Locality{PCIBusID: "0000:1b:00.0", NUMANode: 0}},
				{ID: "GPU-b", Locality: device.Locality{PCIBusID: "0000:da:00.0", NUMANode: 1}},
			}},
		}},
		State: device.State{
			Devices: map[string]device.DeviceState{
				"w0":    {Health: device.HealthUnhealthy, Reason: "widget on fire"},
				"GPU-a": {Health: device.HealthHealthy},
				"GPU-b": {Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "res-1", OwnerID: "job-1"},
					Cordon:      &device.Cordon{Reason: "ECC storm", By: "admin", Since: t0},
					AdminAccess: []device.Holder{{ReservationID: "acc-1", OwnerID: "k8s-claim/mon/dcgm/u1"}, {ReservationID: "acc-2", OwnerID: "k8s-claim/mon/debug/u2"}}},
			},
			Plugins: []device.PluginState{
				{Name: "acme", Status: device.PluginRestarting, Restarts: 3, LastError: "exit 1", LastErrorAt: t0, DeviceCount: 1},
				{Name: "nvidia-example", Status: device.PluginRunning, DeviceCount: 2},
			},
		},
	}
}

// gpuStats are stats of the snapshot's devices as the nvidia-example plugin sends them
// (GPU-b's memory in GiB, to see conversion), and the widget's.
func gpuStats() device.StatsSnapshot {
	gpu := func(index int64, memUsed device.Value) map[string]device.Value {
		return map[string]device.Value{
			"index":                  intValue(index, ""),
			"gpu_utilization":        intValue(37, "%"),
			"memory_utilization":     intValue(12, "%"),
			"memory_used":            memUsed,
			"memory_free":            intValue(61440, "MiB"),
			"memory_total":           intValue(81920, "MiB"),
			"temperature":            intValue(55, "C"),
			"power":                  floatValue(312.5, "W"),
			"sm_clock":               intValue(1755, "MHz"),
			"memory_clock":           intValue(2619, "MHz"),
			"last_xid":               intValue(79, ""),
			"ecc_errors_corrected":   intValue(4, "count"),
			"ecc_errors_uncorrected": intValue(0, "count"),
			"pcie_replays":           intValue(2, "count"), // not a dcgm-exporter field here
		}
	}
	return device.StatsSnapshot{Time: t0, Groups: []device.GroupStats{
		{GroupKey: widget, Plugin: "acme", Devices: []device.DeviceStats{{ID: "w0", Time: t0, Values: map[string]device.Value{
			"temperature": floatValue(40, "C"),
		}}}},
		{GroupKey: h100, Plugin: "nvidia-example", Devices: []device.DeviceStats{
			{ID: "GPU-a", Time: t0, Values: gpu(0, intValue(20480, "MiB"))},
			{ID: "GPU-b", Time: t0, Values: gpu(7, floatValue(1.5, "GiB"))},
		}},
	}}
}

func newFake(snap device.Snapshot, stats device.StatsSnapshot) *fakeManager {
	f := &fakeManager{}
	f.set(snap, stats)
	return f
}

// NVIDIA GPUs get dcgm-exporter's names, labels, types and units, so its dashboards
// work unchanged.
func TestDCGMNamesAndLabels(t *testing.T) {
	s := serve(t, metrics.Options{}, newFake(gpuSnapshot(), gpuStats()))
	f := s.scrape(t)

	gpuA := map[string]string{"gpu": "0", "UUID": "GPU-a", "device": "nvidia0", "modelName": "NVIDIA H100 80GB HBM3",
		"pci_bus_id": "00000000:1B:00.0", "Hostname": "node-7"}
	gpuB := map[string]string{"gpu": "7", "UUID": "GPU-b", "device": "nvidia7", "modelName": "NVIDIA H100 80GB HBM3",
		"pci_bus_id": "00000000:DA:00.0", "Hostname": "node-7"}
	for _, tt := range []struct {
		name string
		typ  dto.MetricType
		gpu  map[string]string
		want float64
	}{
		{"DCGM_FI_DEV_GPU_UTIL", dto.MetricType_GAUGE, gpuA, 37},
		{"DCGM_FI_DEV_MEM_COPY_UTIL", dto.MetricType_GAUGE, gpuA, 12},
		{"DCGM_FI_DEV_FB_USED", dto.MetricType_GAUGE, gpuA, 20480},
		{"DCGM_FI_DEV_FB_USED", dto.MetricType_GAUGE, gpuB, 1536}, // 1.5 GiB in MiB
		{"DCGM_FI_DEV_FB_FREE", dto.MetricType_GAUGE, gpuA, 61440},
		{"DCGM_FI_DEV_FB_TOTAL", dto.MetricType_GAUGE, gpuA, 81920},
		{"DCGM_FI_DEV_GPU_TEMP", dto.MetricType_GAUGE, gpuA, 55},
		{"DCGM_FI_DEV_POWER_USAGE", dto.MetricType_GAUGE, gpuB, 312.5},
		{"DCGM_FI_DEV_SM_CLOCK", dto.MetricType_GAUGE, gpuA, 1755},
		{"DCGM_FI_DEV_MEM_CLOCK", dto.MetricType_GAUGE, gpuB, 2619},
		{"DCGM_FI_DEV_XID_ERRORS", dto.MetricType_GAUGE, gpuA, 79},
		{"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", dto.MetricType_COUNTER, gpuA, 4},
		{"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", dto.MetricType_COUNTER, gpuB, 0},
	} {
		if got := f[tt.name].GetType(); got != tt.typ {
			t.Errorf("%s is a %v, want a %v", tt.name, got, tt.typ)
		}
		if got := f.value(t, tt.name, tt.gpu); got != tt.want {
			t.Errorf("%s{UUID=%q} = %v, want %v", tt.name, tt.gpu["UUID"], got, tt.want)
		}
		for _, m := range f[tt.name].GetMetric() {
			if got, want := labelNames(m), []string{"Hostname", "UUID", "device", "gpu", "modelName", "pci_bus_id"}; !slices.Equal(got, want) {
				t.Errorf("%s has labels %v, want dcgm-exporter's %v", tt.name, got, want)
			}
		}
	}
	// A stat with no dcgm-exporter field keeps devicehost's name; the index is a label.
	if got := f.value(t, "devicehost_device_pcie_replays", map[string]string{"plugin": "nvidia-example", "device": "GPU-b"}); got != 2 {
		t.Errorf("devicehost_device_pcie_replays of GPU-b = %v, want 2", got)
	}
	if got := f.names("devicehost_device_index"); len(got) > 0 {
		t.Errorf("the GPU index is exported as %v; want it only as the gpu label", got)
	}
	// Other vendors' stats are not dcgm-exporter's.
	if got := f.value(t, "devicehost_device_temperature_celsius", map[string]string{
		"plugin": "acme", "vendor": "acme", "type": "widget", "name": "Widget 9000", "device": "w0"}); got != 40 {
		t.Errorf("the widget's temperature = %v, want 40", got)
	}
	if n := len(f.series("DCGM_FI_DEV_GPU_TEMP", nil)); n != 2 {
		t.Errorf("DCGM_FI_DEV_GPU_TEMP has %d series, want 2 (the GPUs only)", n)
	}
}

// Other plugins' stats are devicehost_device_<stat> with the unit in the name,
// converted to Prometheus' base units.
func TestStatNamesAndUnits(t *testing.T) {
	values := map[string]device.Value{}
	want := map[string]float64{}
	for _, tt := range []struct {
		stat  string
		value device.Value
		name  string
		want  float64
	}{
		{"temperature", floatValue(40.5, "C"), "devicehost_device_temperature_celsius", 40.5},
		{"board_temp_celsius", intValue(41, "C"), "devicehost_device_board_temp_celsius", 41},
		{"memory_used", intValue(2, "MiB"), "devicehost_device_memory_used_bytes", 2 << 20},
		{"hbm", intValue(3, "GB"), "devicehost_device_hbm_bytes", 3e9},
		{"utilization", intValue(50, "%"), "devicehost_device_utilization_ratio", 0.5},
		{"core_clock", floatValue(1.5, "GHz"), "devicehost_device_core_clock_hertz", 1.5e9},
		{"power", intValue(500, "mW"), "devicehost_device_power_watts", 0.5},
		{"vdd", intValue(850, "mV"), "devicehost_device_vdd_volts", 0.85},
		{"latency", intValue(3, "ms"), "devicehost_device_latency_seconds", 0.003},
		{"link", intValue(2, "GB/s"), "devicehost_device_link_bytes_per_second", 2e9},
		{"fan", intValue(900, "rpm"), "devicehost_device_fan_rpm", 900},
		{"errors", intValue(3, "count"), "devicehost_device_errors", 3},
		{"Busy", device.Value{Kind: device.KindBool, Bool: true}, "devicehost_device_busy", 1},
	} {
		values[tt.stat] = tt.value
		want[tt.name] = tt.want
	}
	values["pstate"] = device.Value{Kind: device.KindString, Str: "P0"}
	stats := device.StatsSnapshot{Groups: []device.GroupStats{{GroupKey: widget, Plugin: "acme",
		Devices: []device.DeviceStats{{ID: "w0", Values: values}}}}}
	s := serve(t, metrics.Options{}, newFake(gpuSnapshot(), stats))
	f := s.scrape(t)
	for name, v := range want {
		got := f.value(t, name, map[string]string{"plugin": "acme", "vendor": "acme", "type": "widget", "name": "Widget 9000", "device": "w0"})
		if math.Abs(got-v) > 1e-9*math.Abs(v) {
			t.Errorf("%s = %v, want %v", name, got, v)
		}
		if typ := f[name].GetType(); typ != dto.MetricType_GAUGE {
			t.Errorf("%s is a %v, want a gauge", name, typ)
		}
	}
	if got, want := len(f.names("devicehost_device_"))-4, len(want); got != want { // less healthy, reserved, cordoned and admin_access
		t.Errorf("stat families %v, want %d", f.names("devicehost_device_"), want)
	}
	if got := f.value(t, "devicehost_metrics_series_dropped", map[string]string{"plugin": "acme", "reason": "not_a_number"}); got != 1 {
		t.Errorf("dropped not_a_number = %v, want 1 (the string pstate)", got)
	}
}

// Device health and holders, and plugin status, restarts and last error time, follow
// the manager's snapshot at each scrape.
func TestDeviceAndPluginState(t *testing.T) {
	mgr := newFake(gpuSnapshot(), device.StatsSnapshot{})
	s := serve(t, metrics.Options{}, mgr)
	dev := func(id string) map[string]string {
		for _, g := range gpuSnapshot().Inventory.Groups {
			for _, d := range g.Devices {
				if d.ID == id {
					return map[string]string{"plugin": g.Plugin, "vendor": g.Vendor, "type": g.Type, "name": g.Name, "device": id}
				}
			}
		}
		t.Fatalf("no device %s", id)
		return nil
	}
	with := func(l map[string]string, kv ...string) map[string]string {
		out := map[string]string{}
		for k, v := range l {
			out[k] = v
		}
		for i := 0; i < len(kv); i += 2 {
			out[kv[i]] = kv[i+1]
		}
		return out
	}

	f := s.scrape(t)
	for id, want := range map[string]float64{"GPU-a": 1, "GPU-b": 1, "w0": 0} {
		if got := f.value(t, "devicehost_device_healthy", dev(id)); got != want {
			t.Errorf("healthy{%s} = %v, want %v", id, got, want)
		}
	}
	if got := f.value(t, "devicehost_device_reserved", with(dev("GPU-b"), "owner", "job-1", "reservation", "res-1")); got != 1 {
		t.Errorf("reserved{GPU-b, job-1} = %v, want 1", got)
	}
	if got := f.value(t, "devicehost_device_reserved", with(dev("GPU-a"), "owner", "", "reservation", "")); got != 0 {
		t.Errorf("reserved{GPU-a} = %v, want 0", got)
	}
	if n := len(f.series("devicehost_device_reserved", nil)); n != 3 {
		t.Errorf("devicehost_device_reserved has %d series, want one per device (3)", n)
	}
	// A cordoned device keeps its holder's series and has its own cordoned one.
	for id, want := range map[string]float64{"GPU-a": 0, "GPU-b": 1, "w0": 0} {
		if got := f.value(t, "devicehost_device_cordoned", dev(id)); got != want {
			t.Errorf("cordoned{%s} = %v, want %v", id, got, want)
		}
	}
	// Admin accesses are counted apart from the holder, which they are not.
	for id, want := range map[string]float64{"GPU-a": 0, "GPU-b": 2, "w0": 0} {
		if got := f.value(t, "devicehost_device_admin_access", dev(id)); got != want {
			t.Errorf("admin_access{%s} = %v, want %v", id, got, want)
		}
	}
	for _, st := range []string{"starting", "running", "restarting", "failed"} {
		want := 0.0
		if st == "restarting" {
			want = 1
		}
		if got := f.value(t, "devicehost_plugin_status", map[string]string{"plugin": "acme", "status": st}); got != want {
			t.Errorf("plugin_status{acme, %s} = %v, want %v", st, got, want)
		}
	}
	if got := f.value(t, "devicehost_plugin_restarts_total", map[string]string{"plugin": "acme"}); got != 3 {
		t.Errorf("restarts{acme} = %v, want 3", got)
	}
	if got := f.value(t, "devicehost_plugin_last_error_timestamp_seconds", map[string]string{"plugin": "acme"}); got != float64(t0.Unix()) {
		t.Errorf("last error time{acme} = %v, want %v", got, t0.Unix())
	}
	if got := f.series("devicehost_plugin_last_error_timestamp_seconds", map[string]string{"plugin": "nvidia-example"}); len(got) != 0 {
		t.Errorf("a plugin without errors has a last error time: %v", got)
	}
	if got := f.value(t, "devicehost_plugin_devices", map[string]string{"plugin": "nvidia-example"}); got != 2 {
		t.Errorf("devices{nvidia-example} = %v, want 2", got)
	}

	// GPU-b released and taken by another owner, GPU-a down with its plugin.
	snap := gpuSnapshot()
	snap.State.Devices["GPU-a"] = device.DeviceState{Health: device.HealthUnhealthy, Reason: "plugin exited"}
	snap.State.Devices["GPU-b"] = device.DeviceState{Health: device.HealthUnhealthy, Holder: &device.Holder{ReservationID: "res-2", OwnerID: "job-2"}}
	snap.State.Plugins[1].Status = device.PluginRestarting
	snap.State.Plugins[1].Restarts = 1
	mgr.set(snap, device.StatsSnapshot{})
	f = s.scrape(t)
	if got := f.value(t, "devicehost_device_healthy", dev("GPU-a")); got != 0 {
		t.Errorf("healthy{GPU-a} after its plugin died = %v, want 0", got)
	}
	if got := f.series("devicehost_device_reserved", map[string]string{"device": "GPU-b"}); len(got) != 1 || labels(got[0])["owner"] != "job-2" {
		t.Errorf("reserved{GPU-b} after a new holder: %v, want one series of owner job-2", got)
	}
	if got := f.value(t, "devicehost_plugin_restarts_total", map[string]string{"plugin": "nvidia-example"}); got != 1 {
		t.Errorf("restarts{nvidia-example} = %v, want 1", got)
	}
}

// A plugin that sends hostile stat names costs itself some series, never the scrape:
// names are reduced to Prometheus' charset, collisions and the agent's own names are
// left out and counted, and the other plugins' series are all there.
func TestHostileStatNamesDoNotBreakTheScrape(t *testing.T) {
	evil := map[string]device.Value{
		"temp °C":                   floatValue(41, "C"),   // devicehost_device_temp_c_celsius
		"a-b":                       intValue(1, ""),       // devicehost_device_a_b
		"a_b":                       intValue(2, ""),       // the same name: left out
		"A B":                       intValue(3, ""),       // and again
		"°°°":                       intValue(4, ""),       // nothing usable
		"日本":                        intValue(5, ""),       // nothing usable
		"healthy":                   intValue(0, ""),       // devicehost_device_healthy is the agent's
		"reserved":                  intValue(1, ""),       // so is devicehost_device_reserved
		`x{y="1"} 2`:                intValue(6, ""),       // devicehost_device_x_y_1_2
		"__name__":                  intValue(7, ""),       // devicehost_device_name
		"\n# TYPE up gauge":         intValue(8, ""),       // devicehost_device_type_up_gauge
		"distance":                  intValue(9, "parsec"), // a unit that does not convert
		strings.Repeat("long_", 60): intValue(10, ""),
	}
	stats := device.StatsSnapshot{Groups: []device.GroupStats{
		{GroupKey: widget, Plugin: "acme", Devices: []device.DeviceStats{
			{ID: "w0", Values: evil},
			{ID: "bad\xffid", Values: map[string]device.Value{"ok": intValue(1, "")}}, // not UTF-8: Prometheus refuses it
		}},
		{GroupKey: h100, Plugin: "nvidia-example", Devices: []device.DeviceStats{
			{ID: "GPU-a", Values: map[string]device.Value{"index": intValue(0, ""), "temperature": intValue(50, "C"), "power": intValue(1, "C")}},
		}},
	}}
	s := serve(t, metrics.Options{}, newFake(gpuSnapshot(), stats))
	code, body := get(t, s.url)
	if code != 200 {
		t.Fatalf("scrape: %d %s", code, body)
	}
	f := parse(t, body)

	w0 := map[string]string{"plugin": "acme", "device": "w0"}
	for name, want := range map[string]float64{
		"devicehost_device_temp_c_celsius": 41,
		"devicehost_device_a_b":            3, // "A B" sorts before "a-b" and "a_b": its value wins
		"devicehost_device_x_y_1_2":        6,
		"devicehost_device_name":           7,
		"devicehost_device_type_up_gauge":  8,
		"devicehost_device_" + strings.TrimSuffix(strings.Repeat("long_", 60), "_")[:128]: 10,
	} {
		if got := f.value(t, name, w0); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	// The agent's own families are untouched by the stats named after them.
	if n := len(f.series("devicehost_device_healthy", nil)); n != 3 {
		t.Errorf("devicehost_device_healthy has %d series, want 3 (one per device, none from stats)", n)
	}
	dropped := map[string]float64{}
	for _, m := range f.series("devicehost_metrics_series_dropped", map[string]string{"plugin": "acme"}) {
		dropped[labels(m)["reason"]] = metricValue(m)
	}
	if want := map[string]float64{"duplicate": 2, "name": 2, "reserved": 2, "unit": 1, "invalid": 1}; fmt.Sprint(dropped) != fmt.Sprint(want) {
		t.Errorf("acme's dropped series = %v, want %v", dropped, want)
	}
	// The other plugin is whole; its stat in the wrong unit is left out alone.
	if got := f.value(t, "DCGM_FI_DEV_GPU_TEMP", map[string]string{"UUID": "GPU-a"}); got != 50 {
		t.Errorf("DCGM_FI_DEV_GPU_TEMP of GPU-a = %v, want 50", got)
	}
	if got := f.value(t, "devicehost_metrics_series_dropped", map[string]string{"plugin": "nvidia-example", "reason": "unit"}); got != 1 {
		t.Errorf("nvidia-example's power in C: dropped{unit} = %v, want 1", got)
	}
	// Nothing went wrong inside the registry either.
	if got := f.value(t, "promhttp_metric_handler_errors_total", map[string]string{"cause": "gathering"}); got != 0 {
		t.Errorf("gathering errors = %v, want 0", got)
	}
}

// A plugin gets at most MaxSeriesPerPlugin stat series; the rest are left out and
// counted, and the other plugins keep theirs.
func TestSeriesPerPluginAreBounded(t *testing.T) {
	var devs []device.DeviceStats
	for i := range 50 {
		values := map[string]device.Value{}
		for j := range 20 {
			values[fmt.Sprintf("stat_%02d", j)] = intValue(int64(j), "")
		}
		devs = append(devs, device.DeviceStats{ID: fmt.Sprintf("w%02d", i), Values: values})
	}
	stats := gpuStats()
	stats.Groups[0].Devices = devs // acme: 1000 series
	s := serve(t, metrics.Options{MaxSeriesPerPlugin: 100}, newFake(gpuSnapshot(), stats))
	f := s.scrape(t)

	got := 0
	for _, name := range f.names("devicehost_device_stat_") {
		got += len(f.series(name, map[string]string{"plugin": "acme"}))
	}
	if got != 100 {
		t.Errorf("acme has %d stat series, want 100 (its limit)", got)
	}
	if d := f.value(t, "devicehost_metrics_series_dropped", map[string]string{"plugin": "acme", "reason": "limit"}); d != 900 {
		t.Errorf("acme dropped{limit} = %v, want 900", d)
	}
	if n := len(f.series("DCGM_FI_DEV_GPU_UTIL", nil)); n != 2 {
		t.Errorf("nvidia-example has %d DCGM_FI_DEV_GPU_UTIL series, want 2: another plugin's flood cost it nothing", n)
	}
}

// Every scrape reads the manager's latest stats; nothing asks for a stats stream.
func TestScrapesReadTheLatestStatsOnly(t *testing.T) {
	mgr := newFake(gpuSnapshot(), gpuStats())
	var watched atomic.Bool
	mgr.WatchStatsFunc = func(context.Context, time.Duration) <-chan device.StatsSnapshot {
		watched.Store(true)
		ch := make(chan device.StatsSnapshot)
		close(ch)
		return ch
	}
	s := serve(t, metrics.Options{}, mgr)
	for range 10 {
		s.scrape(t)
	}
	if got := mgr.statsCalls.Load(); got != 10 {
		t.Errorf("LatestStats called %d times in 10 scrapes, want 10", got)
	}
	if watched.Load() {
		t.Error("a scrape subscribed to WatchStats")
	}
}

// The collector reads what device.Manager promises every manager has (Snapshot,
// LatestStats), so any manager is exported in full: a plain devicetest.Fake, and one
// wrapped by Instrument, as the agent wires it, on which a type assertion for those
// methods would find nothing. A Fake that holds no stats (no LatestStatsFunc) has its
// devices and plugins exported and no stats; a nil manager is refused when wired.
func TestEveryManagerIsCollected(t *testing.T) {
	snap, stats := gpuSnapshot(), gpuStats()
	fake := func() *devicetest.Fake {
		return &devicetest.Fake{
			SnapshotFunc:    func() device.Snapshot { return snap },
			LatestStatsFunc: func() device.StatsSnapshot { return stats },
		}
	}
	tests := []struct {
		name      string
		mgr       func(*metrics.Metrics) device.Manager
		wantStats bool
	}{
		{"Fake", func(*metrics.Metrics) device.Manager { return fake() }, true},
		{"Instrument(Fake)", func(m *metrics.Metrics) device.Manager { return m.Instrument(fake()) }, true},
		{"Fake without stats", func(*metrics.Metrics) device.Manager {
			return &devicetest.Fake{
				InventoryFunc: func() device.Inventory { return snap.Inventory },
				StateFunc:     func() device.State { return snap.State },
			}
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := metrics.New(metrics.Options{Hostname: "node-7"})
			if err != nil {
				t.Fatal(err)
			}
			if err := m.CollectManager(tt.mgr(m)); err != nil {
				t.Fatalf("CollectManager: %v", err)
			}
			f := scrapeHandler(t, m)
			if n := len(f.series("devicehost_device_healthy", nil)); n != 3 {
				t.Errorf("devicehost_device_healthy has %d series, want 3", n)
			}
			if n := len(f.series("devicehost_plugin_restarts_total", nil)); n != 2 {
				t.Errorf("devicehost_plugin_restarts_total has %d series, want 2", n)
			}
			n := len(f.series("DCGM_FI_DEV_GPU_UTIL", nil))
			if tt.wantStats && n != 2 {
				t.Errorf("DCGM_FI_DEV_GPU_UTIL has %d series, want 2 (one per GPU)", n)
			}
			if got := f.names("DCGM_"); !tt.wantStats && len(got) != 0 {
				t.Errorf("stats exported from a manager that holds none: %v", got)
			}
		})
	}

	m, err := metrics.New(metrics.Options{Hostname: "node-7"})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.CollectManager(nil); err == nil {
		t.Error("CollectManager(nil) = nil, want an error")
	}
}

// The dcgm-exporter series of a held device name its workload as dcgm-exporter does:
// pod, namespace and container for the kubelet bridge's holder, the claim for the DRA
// driver's (and the pods it is reserved for, where the driver gave them as owner labels),
// the allocation for Nomad's; an unheld device, or one of another owner, keeps
// dcgm-exporter's device labels alone; NoHolderLabels turns them off.
func TestDCGMSeriesNameTheirHolder(t *testing.T) {
	snapWith := func(a, b string) device.Snapshot {
		snap := gpuSnapshot()
		snap.State.Devices = maps.Clone(snap.State.Devices)
		for id, owner := range map[string]string{"GPU-a": a, "GPU-b": b} {
			st := snap.State.Devices[id]
			st.Holder = nil
			if owner != "" {
				st.Holder = &device.Holder{ReservationID: "res-" + id, OwnerID: owner}
			}
			if owner == "k8s-claim/ml/pair-gpus/uid-1" {
				st.Holder.OwnerLabels = device.OwnerLabels{Pod: "trainer-0,trainer-1", Namespace: "ml"}
			}
			snap.State.Devices[id] = st
		}
		return snap
	}
	fake := newFake(snapWith("k8s/ml/trainer-0/main", "nomad/default/train/8f3c/worker"), gpuStats())
	s := serve(t, metrics.Options{}, fake)
	util := func(f families, uuid string) map[string]string {
		t.Helper()
		for _, m := range f["DCGM_FI_DEV_GPU_UTIL"].GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			if l["UUID"] == uuid {
				return l
			}
		}
		t.Fatalf("no DCGM_FI_DEV_GPU_UTIL series of %s", uuid)
		return nil
	}
	holder := func(l map[string]string) map[string]string {
		out := map[string]string{}
		for _, k := range []string{"pod", "namespace", "container", "dra_claim_name", "dra_claim_namespace",
			"nomad_namespace", "nomad_job", "nomad_alloc_id", "nomad_task"} {
			if v, ok := l[k]; ok {
				out[k] = v
			}
		}
		return out
	}
	for _, tt := range []struct {
		a, b         string
		wantA, wantB map[string]string
	}{
		{"k8s/ml/trainer-0/main", "nomad/default/train/8f3c/worker",
			map[string]string{"pod": "trainer-0", "namespace": "ml", "container": "main"},
			map[string]string{"nomad_namespace": "default", "nomad_job": "train", "nomad_alloc_id": "8f3c", "nomad_task": "worker"}},
		{"k8s-claim/ml/pair-gpus/uid-1", "k8s-claim/ml/solo/uid-2",
			map[string]string{"dra_claim_name": "pair-gpus", "dra_claim_namespace": "ml", "pod": "trainer-0,trainer-1", "namespace": "ml"},
			map[string]string{"dra_claim_name": "solo", "dra_claim_namespace": "ml"}},
		{"k8s-claim/ml/pair-gpus/uid-1", "", // a claim's labels with no holder of the other GPU
			map[string]string{"dra_claim_name": "pair-gpus", "dra_claim_namespace": "ml", "pod": "trainer-0,trainer-1", "namespace": "ml"}, map[string]string{}},
		{"job-42", "kubelet/nvidia.com/gpu/0123", map[string]string{}, map[string]string{}},
	} {
		fake.set(snapWith(tt.a, tt.b), gpuStats())
		f := s.scrape(t)
		if got := holder(util(f, "GPU-a")); !maps.Equal(got, tt.wantA) {
			t.Errorf("GPU-a held by %q: holder labels %v, want %v", tt.a, got, tt.wantA)
		}
		if got := holder(util(f, "GPU-b")); !maps.Equal(got, tt.wantB) {
			t.Errorf("GPU-b held by %q: holder labels %v, want %v", tt.b, got, tt.wantB)
		}
		if got := util(f, "GPU-a")["gpu"]; got != "0" {
			t.Errorf("GPU-a's gpu label %q: the device labels must stay", got)
		}
	}

	off := serve(t, metrics.Options{NoHolderLabels: true}, newFake(snapWith("k8s/ml/trainer-0/main", ""), gpuStats()))
	if got := holder(util(off.scrape(t), "GPU-a")); len(got) != 0 {
		t.Errorf("holder labels with NoHolderLabels: %v", got)
	}
}

// A time-sliced GPU's dcgm series come once per workload that holds replicas of it,
// each naming the workload and, as devicehost_share_compute_ratio, the share it holds;
// holders that give no labels share one set; the devicehost_device_ series stay one.
func TestDCGMSeriesPerShareHolder(t *testing.T) {
	snap := gpuSnapshot()
	gpuA := device.CounterSetKey{Plugin: "nvidia-example", Name: "GPU-a"}
	slice := []device.Consumption{{Set: gpuA, Counters: map[string]int64{"time-slices": 1}}}
	shared := device.GroupKey{Vendor: "nvidia", Type: "gpu.shared", Name: h100.Name}
	snap.Inventory.Groups = append(snap.Inventory.Groups, device.Group{GroupKey: shared, Plugin: "nvidia-example", Devices: []device.DeviceInfo{
		{ID: "GPU-a-r0", Consumes: slice}, {ID: "GPU-a-r1", Consumes: slice}, {ID: "GPU-a-r2", Consumes: slice}, {ID: "GPU-a-r3", Consumes: slice},
	}})
	snap.Inventory.CounterSets = []device.CounterSet{{Key: gpuA, Capacity: map[string]int64{"time-slices": 4}}}
	snap.State.Devices = maps.Clone(snap.State.Devices)
	for id, owner := range map[string]string{"GPU-a-r0": "k8s/ml/p1/main", "GPU-a-r1": "k8s/ml/p1/main", "GPU-a-r2": "k8s/ml/p2/main", "GPU-a-r3": "job-42"} {
		snap.State.Devices[id] = device.DeviceState{Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "res-" + id, OwnerID: owner}}
	}
	s := serve(t, metrics.Options{}, newFake(snap, gpuStats()))
	f := s.scrape(t)
	pods := map[string]int{}
	for _, m := range f["DCGM_FI_DEV_GPU_UTIL"].GetMetric() {
		l := map[string]string{}
		for _, p := range m.GetLabel() {
			l[p.GetName()] = p.GetValue()
		}
		if l["UUID"] == "GPU-a" {
			pods[l["pod"]]++
		}
	}
	if want := map[string]int{"p1": 1, "p2": 1, "": 1}; !maps.Equal(pods, want) {
		t.Errorf("GPU-a's DCGM_FI_DEV_GPU_UTIL series by pod = %v, want one each for p1, p2 and the unlabelled holder %v", pods, want)
	}
	ratios := map[string]float64{}
	for _, m := range f["devicehost_share_compute_ratio"].GetMetric() {
		l := map[string]string{}
		for _, p := range m.GetLabel() {
			l[p.GetName()] = p.GetValue()
		}
		if l["UUID"] != "GPU-a" {
			t.Errorf("a share ratio series of %s, want GPU-a's only", l["UUID"])
		}
		ratios[l["pod"]] = m.GetGauge().GetValue()
	}
	if want := map[string]float64{"p1": 0.5, "p2": 0.25, "": 0.25}; !maps.Equal(ratios, want) {
		t.Errorf("share ratios by pod = %v, want %v", ratios, want)
	}
	if n := len(f.series("devicehost_device_pcie_replays", map[string]string{"device": "GPU-a"})); n != 1 {
		t.Errorf("GPU-a's devicehost_device_pcie_replays has %d series, want 1 whatever its holders", n)
	}

	off := serve(t, metrics.Options{NoHolderLabels: true}, newFake(snap, gpuStats()))
	if f := off.scrape(t); len(f["devicehost_share_compute_ratio"].GetMetric()) != 0 {
		t.Errorf("share ratios with NoHolderLabels: %v", f["devicehost_share_compute_ratio"].GetMetric())
	}
}

// An MPS-shared GPU's series come once per workload that holds shares of it, each
// with the compute ratio and the memory its shares may use; a replica group's shares
// carry no memory limit.
func TestMPSShareLimitsPerHolder(t *testing.T) {
	snap := gpuSnapshot()
	gpuA := device.CounterSetKey{Plugin: "nvidia-example", Name: "GPU-a"}
	use := []device.Consumption{{Set: gpuA, Counters: map[string]int64{"mps-memory-mib": 20480, "mps-compute-percent": 25}}}
	mpsKey := device.GroupKey{Vendor: "nvidia", Type: "gpu.mps", Name: h100.Name}
	snap.Inventory.Groups = append(snap.Inventory.Groups, device.Group{GroupKey: mpsKey, Plugin: "nvidia-example",
		Attributes: map[string]device.Value{"memory": {Kind: device.KindInt, Int: 20480, Unit: "MiB"}},
		Devices: []device.DeviceInfo{
			{ID: "GPU-a::mps::0", Consumes: use}, {ID: "GPU-a::mps::1", Consumes: use}, {ID: "GPU-a::mps::2", Consumes: use}, {ID: "GPU-a::mps::3", Consumes: use},
		}})
	snap.Inventory.CounterSets = []device.CounterSet{{Key: gpuA, Capacity: map[string]int64{"mps-memory-mib": 81920, "mps-compute-percent": 100}}}
	snap.State.Devices = maps.Clone(snap.State.Devices)
	for id, owner := range map[string]string{"GPU-a::mps::0": "k8s/ml/p1/main", "GPU-a::mps::1": "k8s/ml/p1/main", "GPU-a::mps::3": "k8s/ml/p2/main"} {
		snap.State.Devices[id] = device.DeviceState{Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "res-" + id, OwnerID: owner}}
	}
	f := serve(t, metrics.Options{}, newFake(snap, gpuStats())).scrape(t)
	byPod := func(name string) map[string]float64 {
		out := map[string]float64{}
		for _, m := range f[name].GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			if l["UUID"] != "GPU-a" {
				if strings.HasPrefix(name, "devicehost_share_") {
					t.Errorf("%s series of %s, want GPU-a's only", name, l["UUID"])
				}
				continue
			}
			out[l["pod"]] = m.GetGauge().GetValue()
		}
		return out
	}
	if got, want := byPod("devicehost_share_memory_limit_bytes"), map[string]float64{"p1": 2 * 20480 << 20, "p2": 20480 << 20}; !maps.Equal(got, want) {
		t.Errorf("memory limits by pod = %v, want %v", got, want)
	}
	if got, want := byPod("devicehost_share_compute_ratio"), map[string]float64{"p1": 0.5, "p2": 0.25}; !maps.Equal(got, want) {
		t.Errorf("compute ratios by pod = %v, want %v", got, want)
	}
	if got := byPod("DCGM_FI_DEV_FB_USED"); len(got) != 2 {
		t.Errorf("GPU-a's DCGM_FI_DEV_FB_USED series by pod = %v, want one per holder", got)
	}
}

// A share of an on-demand MIG placement draws on a few counters of its GPU's set: its
// holder is no share of the GPU, so the GPU's series stay one plain set.
func TestSharesOfPlacementsAreNoShareOfTheGPU(t *testing.T) {
	snap := gpuSnapshot()
	gpuA := device.CounterSetKey{Plugin: "nvidia-example", Name: "GPU-a"}
	use := []device.Consumption{{Set: gpuA, Counters: map[string]int64{"memory-slice-0": 1, "compute-slices": 1}}}
	key := device.GroupKey{Vendor: "nvidia", Type: "mig", Name: "1g.10gb.mps"}
	snap.Inventory.Groups = append(snap.Inventory.Groups, device.Group{GroupKey: key, Plugin: "nvidia-example",
		Attributes: map[string]device.Value{"memory": {Kind: device.KindInt, Int: 4864, Unit: "MiB"}},
		Devices:    []device.DeviceInfo{{ID: "GPU-a-mig-1g.10gb-0::mps::0", Consumes: use}}})
	snap.Inventory.CounterSets = []device.CounterSet{{Key: gpuA, Capacity: map[string]int64{"memory-slice-0": 2, "memory-slice-1": 2, "compute-slices": 14}}}
	snap.State.Devices = maps.Clone(snap.State.Devices)
	snap.State.Devices["GPU-a-mig-1g.10gb-0::mps::0"] = device.DeviceState{Health: device.HealthHealthy,
		Holder: &device.Holder{ReservationID: "res-1", OwnerID: "k8s/ml/p1/main"}}
	f := serve(t, metrics.Options{}, newFake(snap, gpuStats())).scrape(t)
	if got := f["devicehost_share_compute_ratio"].GetMetric(); len(got) != 0 {
		t.Errorf("share ratios %v, want none: the share is of a placement, not of the GPU", got)
	}
	for _, m := range f["DCGM_FI_DEV_FB_USED"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "pod" {
				t.Errorf("GPU series %v carries a pod label", m.GetLabel())
			}
		}
	}
}

// Where the plugin reports a shared GPU's processes, each workload's
// DCGM_FI_DEV_FB_USED is the memory of its own processes (by the reservation each
// process's container was given), not the GPU's; a process of no reservation counts for
// none, and a workload whose processes use nothing shows 0.
func TestFBUsedPerHolderFromProcesses(t *testing.T) {
	snap := gpuSnapshot()
	gpuA := device.CounterSetKey{Plugin: "nvidia-example", Name: "GPU-a"}
	use := []device.Consumption{{Set: gpuA, Counters: map[string]int64{"mps-memory-mib": 20480, "mps-compute-percent": 25}}}
	snap.Inventory.Groups = append(snap.Inventory.Groups, device.Group{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "gpu.mps", Name: h100.Name}, Plugin: "nvidia-example",
		Attributes: map[string]device.Value{"memory": {Kind: device.KindInt, Int: 20480, Unit: "MiB"}},
		Devices:    []device.DeviceInfo{{ID: "GPU-a::mps::0", Consumes: use}, {ID: "GPU-a::mps::1", Consumes: use}, {ID: "GPU-a::mps::2", Consumes: use}}})
	snap.Inventory.CounterSets = []device.CounterSet{{Key: gpuA, Capacity: map[string]int64{"mps-memory-mib": 81920, "mps-compute-percent": 100}}}
	snap.State.Devices = maps.Clone(snap.State.Devices)
	for id, h := range map[string]device.Holder{
		"GPU-a::mps::0": {ReservationID: "res-p1", OwnerID: "k8s/ml/p1/main"}, "GPU-a::mps::1": {ReservationID: "res-p1", OwnerID: "k8s/ml/p1/main"},
		"GPU-a::mps::2": {ReservationID: "res-p2", OwnerID: "k8s/ml/p2/main"},
	} {
		snap.State.Devices[id] = device.DeviceState{Health: device.HealthHealthy, Holder: &h}
	}
	stats := gpuStats()
	stats.Groups = slices.Clone(stats.Groups)
	for i, g := range stats.Groups {
		if g.GroupKey != h100 {
			continue
		}
		g.Devices = slices.Clone(g.Devices)
		g.Devices[0].Processes = []device.ProcessMemory{{PID: 101, UsedBytes: 3 << 30}, {PID: 102, UsedBytes: 1 << 30}, {PID: 104, UsedBytes: 5 << 30}}
		stats.Groups[i] = g
	}
	procs := map[uint32]string{101: "res-p1", 102: "res-p1", 104: "res-gone"}
	seen := func(pid uint32) (string, bool) { return procs[pid], true }
	fbByPod := func(opts metrics.Options) map[string]float64 {
		t.Helper()
		return serve(t, opts, newFake(snap, stats)).scrape(t).byPod("DCGM_FI_DEV_FB_USED", "GPU-a")
	}
	if got, want := fbByPod(metrics.Options{ProcessReservation: seen}), map[string]float64{"p1": 4096, "p2": 0}; !maps.Equal(got, want) {
		t.Errorf("GPU-a's DCGM_FI_DEV_FB_USED by pod = %v MiB, want %v: each pod's processes", got, want)
	}
	if got, want := fbByPod(metrics.Options{NoHolderLabels: true, ProcessReservation: seen}), map[string]float64{"": 20480}; !maps.Equal(got, want) {
		t.Errorf("without holder labels: GPU-a's DCGM_FI_DEV_FB_USED = %v MiB, want the GPU's, %v", got, want)
	}
	// An agent that sees none of the processes (no host PID namespace) cannot tell whose
	// they are: each workload's series is the GPU's figure, as without processes.
	unseen := func(uint32) (string, bool) { return "", false }
	if got, want := fbByPod(metrics.Options{ProcessReservation: unseen}), map[string]float64{"p1": 20480, "p2": 20480}; !maps.Equal(got, want) {
		t.Errorf("processes not visible: GPU-a's DCGM_FI_DEV_FB_USED by pod = %v MiB, want the GPU's on each, %v", got, want)
	}
}

// A GPU offered both time-sliced and in MPS shares (each mode's use in a compatibility
// group, on counters of its own): the workloads holding its replicas still get a set
// of its series each, with the share they hold, as with one mode.
func TestSharesOfAGPUInTwoModes(t *testing.T) {
	snap := gpuSnapshot()
	gpuA := device.CounterSetKey{Plugin: "nvidia-example", Name: "GPU-a"}
	slice := []device.Consumption{{Set: gpuA, Counters: map[string]int64{"time-slices": 1}, Groups: []string{"time-slicing"}}}
	shared := device.GroupKey{Vendor: "nvidia", Type: "gpu.shared", Name: h100.Name}
	snap.Inventory.Groups = append(snap.Inventory.Groups, device.Group{GroupKey: shared, Plugin: "nvidia-example", Devices: []device.DeviceInfo{
		{ID: "GPU-a::0", Consumes: slice}, {ID: "GPU-a::1", Consumes: slice},
	}})
	snap.Inventory.CounterSets = []device.CounterSet{{Key: gpuA, Capacity: map[string]int64{"time-slices": 4, "mps-memory-mib": 81920, "mps-compute-percent": 100}}}
	snap.State.Devices = maps.Clone(snap.State.Devices)
	for id, owner := range map[string]string{"GPU-a::0": "k8s/ml/p1/main", "GPU-a::1": "k8s/ml/p2/main"} {
		snap.State.Devices[id] = device.DeviceState{Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "res-" + id, OwnerID: owner}}
	}
	ratios := serve(t, metrics.Options{}, newFake(snap, gpuStats())).scrape(t).byPod("devicehost_share_compute_ratio", "")
	if want := map[string]float64{"p1": 0.25, "p2": 0.25}; !maps.Equal(ratios, want) {
		t.Errorf("share ratios by pod = %v, want %v", ratios, want)
	}
}

// Where the plugin reports each process's share of a shared GPU's SMs, each workload's
// DCGM_FI_DEV_GPU_UTIL is its own processes' sum, not the GPU's: the workloads' values
// add up to the GPU's (37 % here), and a workload with no process shows 0. Without the
// processes' utilization each shows the GPU's, as before.
func TestGPUUtilPerHolderFromProcesses(t *testing.T) {
	snap := gpuSnapshot()
	gpuA := device.CounterSetKey{Plugin: "nvidia-example", Name: "GPU-a"}
	use := []device.Consumption{{Set: gpuA, Counters: map[string]int64{"mps-memory-mib": 20480, "mps-compute-percent": 25}}}
	snap.Inventory.Groups = append(snap.Inventory.Groups, device.Group{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "gpu.mps", Name: h100.Name}, Plugin: "nvidia-example",
		Attributes: map[string]device.Value{"memory": {Kind: device.KindInt, Int: 20480, Unit: "MiB"}},
		Devices: []device.DeviceInfo{{ID: "GPU-a::mps::0", Consumes: use}, {ID: "GPU-a::mps::1", Consumes: use},
			{ID: "GPU-a::mps::2", Consumes: use}, {ID: "GPU-a::mps::3", Consumes: use}}})
	snap.Inventory.CounterSets = []device.CounterSet{{Key: gpuA, Capacity: map[string]int64{"mps-memory-mib": 81920, "mps-compute-percent": 100}}}
	snap.State.Devices = maps.Clone(snap.State.Devices)
	for id, h := range map[string]device.Holder{
		"GPU-a::mps::0": {ReservationID: "res-p1", OwnerID: "k8s/ml/p1/main"}, "GPU-a::mps::1": {ReservationID: "res-p1", OwnerID: "k8s/ml/p1/main"},
		"GPU-a::mps::2": {ReservationID: "res-p2", OwnerID: "k8s/ml/p2/main"}, "GPU-a::mps::3": {ReservationID: "res-p3", OwnerID: "k8s/ml/p3/main"},
	} {
		snap.State.Devices[id] = device.DeviceState{Health: device.HealthHealthy, Holder: &h}
	}
	procs := map[uint32]string{101: "res-p1", 102: "res-p1", 103: "res-p2"}
	seen := func(pid uint32) (string, bool) { return procs[pid], true }
	utilByPod := func(withUtil bool) map[string]float64 {
		t.Helper()
		stats := gpuStats()
		stats.Groups = slices.Clone(stats.Groups)
		for i, g := range stats.Groups {
			if g.GroupKey != h100 {
				continue
			}
			g.Devices = slices.Clone(g.Devices)
			g.Devices[0].Processes = []device.ProcessMemory{{PID: 101, SMUtil: 20, HasSMUtil: withUtil},
				{PID: 102, SMUtil: 10, HasSMUtil: withUtil}, {PID: 103, SMUtil: 7, HasSMUtil: withUtil}}
			stats.Groups[i] = g
		}
		return serve(t, metrics.Options{ProcessReservation: seen}, newFake(snap, stats)).scrape(t).byPod("DCGM_FI_DEV_GPU_UTIL", "GPU-a")
	}
	got := utilByPod(true)
	if want := map[string]float64{"p1": 30, "p2": 7, "p3": 0}; !maps.Equal(got, want) {
		t.Errorf("GPU-a's DCGM_FI_DEV_GPU_UTIL by pod = %v, want %v: each pod's processes", got, want)
	}
	if sum := got["p1"] + got["p2"] + got["p3"]; sum != 37 {
		t.Errorf("the pods' utilization adds up to %v, want the GPU's 37", sum)
	}
	if got, want := utilByPod(false), map[string]float64{"p1": 37, "p2": 37, "p3": 37}; !maps.Equal(got, want) {
		t.Errorf("without the processes' utilization: by pod = %v, want the GPU's on each, %v", got, want)
	}
}
