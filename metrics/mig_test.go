package metrics_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/metrics"
)

var (
	mig1g   = device.GroupKey{Vendor: "nvidia", Type: "mig", Name: "1g.10gb"}
	h100Rep = device.GroupKey{Vendor: "nvidia", Type: "gpu.shared", Name: "NVIDIA H100 80GB HBM3"}
)

// migSnapshot is two H100s of the nvidia-example plugin, GPU-a partitioned on demand
// (placements 0 to 2 of 1g.10gb listed), GPU-b with a static MIG device MIG-s and a
// time-sliced replica; and plugin hostile, whose MIG devices' labels would be bad.
func migSnapshot() device.Snapshot {
	busA := device.Locality{PCIBusID: "0000:1b:00.0", NUMANode: 0}
	busB := device.Locality{PCIBusID: "0000:da:00.0", NUMANode: 1}
	model := map[string]device.Value{"gpu_model": {Kind: device.KindString, Str: "NVIDIA H100 80GB HBM3"}}
	return device.Snapshot{Time: t0, Inventory: device.Inventory{Groups: []device.Group{
		{GroupKey: mig1g, Plugin: "hostile", Attributes: model, Devices: []device.DeviceInfo{{ID: "h-long"}, {ID: "h-newline"}, {ID: "h-number"}}},
		{GroupKey: h100, Plugin: "nvidia-example", Devices: []device.DeviceInfo{{ID: "GPU-a", Locality: busA}, {ID: "GPU-b", Locality: busB}}},
		{GroupKey: h100Rep, Plugin: "nvidia-example", Devices: []device.DeviceInfo{{ID: "GPU-b::0", Locality: busB}}},
		{GroupKey: mig1g, Plugin: "nvidia-example", Attributes: model, Devices: []device.DeviceInfo{
			{ID: "GPU-a-mig-1g.10gb-0", Locality: busA}, {ID: "GPU-a-mig-1g.10gb-1", Locality: busA},
			{ID: "GPU-a-mig-1g.10gb-2", Locality: busA}, {ID: "MIG-s", Locality: busB},
		}},
	}}}
}

// migStats are the stats the nvidia-example plugin sends for migSnapshot's devices:
// the GPUs' (GPU-a's tensor activity read, GPU-b's not supported), each GPU instance's
// with its GPU's index and UUID and its instance ID (placement 1 has no instance, and
// placement 2 says it is instance 9 like placement 0: a plugin's mistake), none for
// the replica.
func migStats() device.StatsSnapshot {
	gpu := func(index int64) map[string]device.Value {
		return map[string]device.Value{"index": intValue(index, ""), "gpu_utilization": intValue(37, "%"), "temperature": intValue(55, "C")}
	}
	a := gpu(0)
	a["tensor_active"] = floatValue(42.5, "%")
	instance := func(index, gi int64, parent string, memUsed int64) map[string]device.Value {
		return map[string]device.Value{
			"index":           intValue(index, ""),
			"gpu_instance_id": intValue(gi, ""),
			"gpu_uuid":        {Kind: device.KindString, Str: parent},
			"memory_used":     intValue(memUsed, "MiB"),
			"temperature":     intValue(55, "C"),
		}
	}
	partition := instance(0, 9, "GPU-a", 1024)
	partition["tensor_active"] = floatValue(25, "%")
	return device.StatsSnapshot{Time: t0, Groups: []device.GroupStats{
		{GroupKey: mig1g, Plugin: "hostile", Devices: []device.DeviceStats{
			{ID: "h-long", Values: instance(0, 1, strings.Repeat("x", 300), 1)},
			{ID: "h-newline", Values: instance(0, 2, "GPU-a\nDCGM_FI_DEV_GPU_TEMP 1", 1)},
			{ID: "h-number", Values: map[string]device.Value{"gpu_instance_id": intValue(3, ""), "gpu_uuid": intValue(4, ""), "memory_used": intValue(1, "MiB")}},
		}},
		{GroupKey: h100, Plugin: "nvidia-example", Devices: []device.DeviceStats{{ID: "GPU-a", Values: a}, {ID: "GPU-b", Values: gpu(7)}}},
		{GroupKey: mig1g, Plugin: "nvidia-example", Devices: []device.DeviceStats{
			{ID: "GPU-a-mig-1g.10gb-0", Values: partition},
			{ID: "GPU-a-mig-1g.10gb-1", Values: map[string]device.Value{"memory_used": intValue(0, "MiB")}},
			{ID: "GPU-a-mig-1g.10gb-2", Values: instance(0, 9, "GPU-a", 2048)},
			{ID: "MIG-s", Values: instance(7, 3, "GPU-b", 512)},
		}},
	}}
}

// MIG devices are labelled as dcgm-exporter labels GPU instances: their GPU's labels
// plus GPU_I_PROFILE and GPU_I_ID; whole GPUs have neither label, and replicas no
// series of their own. Tensor activity is a ratio, absent where the plugin has none.
func TestDCGMMIGLabels(t *testing.T) {
	s := serve(t, metrics.Options{}, newFake(migSnapshot(), migStats()))
	f := s.scrape(t)

	model := "NVIDIA H100 80GB HBM3"
	// GPU_I_ID "" matches only a series without it.
	gpuA := map[string]string{"gpu": "0", "UUID": "GPU-a", "device": "nvidia0", "modelName": model, "pci_bus_id": "00000000:1B:00.0", "Hostname": "node-7", "GPU_I_ID": ""}
	partition := map[string]string{"gpu": "0", "UUID": "GPU-a", "device": "nvidia0", "modelName": model, "pci_bus_id": "00000000:1B:00.0",
		"GPU_I_PROFILE": "1g.10gb", "GPU_I_ID": "9", "Hostname": "node-7"}
	static := map[string]string{"gpu": "7", "UUID": "GPU-b", "device": "nvidia7", "modelName": model, "pci_bus_id": "00000000:DA:00.0",
		"GPU_I_PROFILE": "1g.10gb", "GPU_I_ID": "3", "Hostname": "node-7"}
	for _, tt := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"DCGM_FI_DEV_FB_USED", partition, 1024},
		{"DCGM_FI_DEV_FB_USED", static, 512},
		{"DCGM_FI_DEV_GPU_TEMP", static, 55},
		{"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", partition, 0.25},
		{"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", gpuA, 0.425},
	} {
		if got := f.value(t, tt.name, tt.labels); got != tt.want {
			t.Errorf("%s%v = %v, want %v", tt.name, tt.labels, got, tt.want)
		}
	}

	gpuLabels := []string{"Hostname", "UUID", "device", "gpu", "modelName", "pci_bus_id"}
	migLabels := []string{"GPU_I_ID", "GPU_I_PROFILE", "Hostname", "UUID", "device", "gpu", "modelName", "pci_bus_id"}
	for _, name := range []string{"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"} {
		for _, m := range f[name].GetMetric() {
			l := labels(m)
			want := gpuLabels
			if _, ok := l["GPU_I_PROFILE"]; ok || l["GPU_I_ID"] != "" {
				want = migLabels
			}
			if got := labelNames(m); !slices.Equal(got, want) {
				t.Errorf("%s%v has labels %v, want %v", name, l, got, want)
			}
		}
	}
	// GPU-a, GPU-b, GPU-a's instance 9, MIG-s: the replica, the placement without an
	// instance, the repeated instance and the hostile plugin's devices have none.
	if got := len(f.series("DCGM_FI_DEV_GPU_TEMP", nil)); got != 4 {
		t.Errorf("DCGM_FI_DEV_GPU_TEMP has %d series, want 4: %v", got, f["DCGM_FI_DEV_GPU_TEMP"])
	}
	if got := len(f.series("DCGM_FI_DEV_GPU_TEMP", map[string]string{"UUID": "GPU-a"})); got != 2 {
		t.Errorf("DCGM_FI_DEV_GPU_TEMP{UUID=GPU-a} has %d series, want 2 (the GPU and its instance 9)", got)
	}
	// Not supported on GPU-b nor read for MIG-s: absent, not 0.
	if got := len(f.series("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", nil)); got != 2 {
		t.Errorf("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE has %d series, want 2: %v", got, f["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"])
	}
	for _, m := range f.series("DCGM_FI_DEV_GPU_TEMP", nil) {
		if id := labels(m)["UUID"]; strings.Contains(id, "::") || strings.Contains(id, "mig") || strings.HasPrefix(id, "MIG-") {
			t.Errorf("DCGM_FI_DEV_GPU_TEMP has a series of %s: a replica's or a MIG device's own ID", id)
		}
	}
	// The labels' stats are not series; a placement with no instance keeps
	// devicehost's names.
	for _, prefix := range []string{"devicehost_device_gpu_instance_id", "devicehost_device_gpu_uuid", "devicehost_device_index"} {
		if got := f.names(prefix); len(got) > 0 {
			t.Errorf("%v exported; want those stats only as labels", got)
		}
	}
	if got := f.value(t, "devicehost_device_memory_used_bytes", map[string]string{"plugin": "nvidia-example", "device": "GPU-a-mig-1g.10gb-1"}); got != 0 {
		t.Errorf("memory_used of the placement without an instance = %v, want 0", got)
	}

	// Bad labels drop the device's dcgm-exporter series, counted; a repeated instance
	// is a duplicate.
	for _, tt := range []struct {
		plugin, reason string
		want           float64
	}{
		{"hostile", "invalid", 2 + 2 + 1}, // FB_USED and GPU_TEMP of h-long and h-newline, FB_USED of h-number
		{"nvidia-example", "duplicate", 2},
	} {
		if got := f.value(t, "devicehost_metrics_series_dropped", map[string]string{"plugin": tt.plugin, "reason": tt.reason}); got != tt.want {
			t.Errorf("devicehost_metrics_series_dropped{plugin=%q,reason=%q} = %v, want %v", tt.plugin, tt.reason, got, tt.want)
		}
	}
	for _, m := range f.series("DCGM_FI_DEV_FB_USED", nil) {
		if l := labels(m); len(l["UUID"]) > 256 || strings.ContainsAny(l["UUID"], "\n") {
			t.Errorf("DCGM_FI_DEV_FB_USED has a series with UUID %q", l["UUID"])
		}
	}
}
