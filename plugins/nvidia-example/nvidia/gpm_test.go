package nvidia

import (
	"context"
	"math"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

// byID indexes a stats sample by device ID.
func byID(resp *pb.StatsResponse) map[string]map[string]*pb.Value {
	out := make(map[string]map[string]*pb.Value)
	for _, d := range resp.GetDevices() {
		out[d.GetDeviceId()] = d.GetValues()
	}
	return out
}

// Tensor activity comes from GPM on Hopper: absent from the first sample (GPM needs
// two), then a % that follows the GPU's load, moves over time, and passes the host's
// checks; the A100 has no GPM and never reports it; the stream frees its samples.
func TestStatsTensorActive(t *testing.T) {
	t.Run("dgxh100", func(t *testing.T) {
		p, clk := newTestPlugin(t, Config{Simulate: "dgxh100"})
		sim := simOf(t, p)
		s := startStats(t, p, time.Second)
		first := s.next(t)
		for id, v := range byID(first) {
			if _, ok := v["tensor_active"]; ok {
				t.Errorf("first sample: %s has tensor_active %v, want none before a second GPM sample", id, v["tensor_active"])
			}
		}
		var samples []*pb.StatsResponse
		for _, step := range []time.Duration{time.Second, 40 * time.Second} {
			clk.Advance(step)
			samples = append(samples, s.next(t))
		}
		for i, resp := range samples {
			if err := validate.Stats(resp, func(string) bool { return true }); err != nil {
				t.Errorf("sample %d: validate.Stats: %v", i+1, err)
			}
			if got := len(resp.GetDevices()); got != 8 {
				t.Fatalf("sample %d has %d devices, want 8", i+1, got)
			}
			for id, v := range byID(resp) {
				ta, ok := v["tensor_active"]
				if !ok {
					t.Errorf("sample %d: %s has no tensor_active", i+1, id)
					continue
				}
				// Tensor work is 90% of the compute load, averaged over the interval; the
				// first interval is a second, so it is close to the utilization now.
				got, util := number(ta), number(v["gpu_utilization"])
				if ta.GetUnit() != "%" || got < 0 || got > 100 {
					t.Errorf("sample %d: %s tensor_active = %v %q, want a %% in [0, 100]", i+1, id, got, ta.GetUnit())
				}
				if i == 0 && math.Abs(got-tensorShare*util) > 3 {
					t.Errorf("sample %d: %s tensor_active = %v with gpu_utilization %v, want about %v", i+1, id, got, util, tensorShare*util)
				}
			}
		}
		moved := 0
		for id, v := range byID(samples[0]) {
			if number(v["tensor_active"]) != number(byID(samples[1])[id]["tensor_active"]) {
				moved++
			}
		}
		if moved != 8 {
			t.Errorf("tensor_active moved on %d GPUs in 40 s, want 8", moved)
		}
		if err := s.stop(t); err != nil {
			t.Errorf("Stats returned %v after cancel", err)
		}
		if n := sim.gpmSamples.Load(); n != 0 {
			t.Errorf("%d GPM samples left allocated after the stream ended, want 0", n)
		}
	})
	t.Run("dgxa100", func(t *testing.T) {
		p, clk := newTestPlugin(t, Config{Simulate: "dgxa100"})
		s := startStats(t, p, time.Second)
		for i := range 3 {
			for id, v := range byID(s.next(t)) {
				if _, ok := v["tensor_active"]; ok {
					t.Errorf("sample %d: %s (an A100, no GPM) has tensor_active", i, id)
				}
			}
			clk.Advance(time.Second)
		}
		if n := simOf(t, p).gpmSamples.Load(); n != 0 {
			t.Errorf("%d GPM samples allocated on an A100, want 0", n)
		}
	})
}

// migInstanceIDs returns the GPU instance ID at each placement of simulated GPU index.
func migInstanceIDs(sim *simLib, index int) map[uint32]uint32 {
	out := make(map[uint32]uint32)
	sim.mig.view(func(st *simMIGState) {
		for _, gi := range st.GPUs[index].GIs {
			out[gi.Start] = gi.ID
		}
	})
	return out
}

// A MIG device whose instance exists reports its GPU's index and UUID, its instance
// ID, its own memory and (from the second sample) tensor activity, and its GPU's
// temperature, but no utilization; placements without an instance report nothing,
// and a released one stops reporting and its GPM sample is freed.
func TestStatsOnDemandMIGDevices(t *testing.T) {
	p, clk := newTestPlugin(t, onDemand(filepath.Join(t.TempDir(), "sim.json")))
	sim := simOf(t, p)
	ctx := context.Background()
	held := onDemandIDs(2, "1g.10gb", 0, 4)
	held = append(held, onDemandIDs(5, "3g.40gb", 4)...)
	for _, id := range held {
		if _, err := p.Reserve(ctx, []string{id}); err != nil {
			t.Fatalf("Reserve(%s): %v", id, err)
		}
	}
	s := startStats(t, p, time.Second)
	first := s.next(t)
	clk.Advance(time.Second)
	second := s.next(t)

	gpuUUID := map[string]string{held[0]: simulatedUUID("dgxh100", 2), held[1]: simulatedUUID("dgxh100", 2), held[2]: simulatedUUID("dgxh100", 5)}
	gpuIndex := map[string]int64{held[0]: 2, held[1]: 2, held[2]: 5}
	start := map[string]uint32{held[0]: 0, held[1]: 4, held[2]: 4}
	memory := map[string]int64{held[0]: 10240, held[1]: 10240, held[2]: 40960} // the profiles' MiB in go-nvml's H100
	for i, resp := range []*pb.StatsResponse{first, second} {
		got := byID(resp)
		if len(got) != 8+3 {
			t.Errorf("sample %d: %d devices, want the 8 GPUs and the 3 instances: %v", i, len(got), got)
		}
		for id := range got {
			if strings.Contains(id, "-mig-") && gpuUUID[id] == "" {
				t.Errorf("sample %d reports %s, which has no instance", i, id)
			}
		}
		for _, id := range held {
			v, ok := got[id]
			if !ok {
				t.Errorf("sample %d: no stats of %s", i, id)
				continue
			}
			wantGI := migInstanceIDs(sim, int(gpuIndex[id]))[start[id]]
			if v["gpu_uuid"].GetStringValue() != gpuUUID[id] || v["index"].GetIntValue() != gpuIndex[id] ||
				v["gpu_instance_id"].GetIntValue() != int64(wantGI) || v["gpu_instance_id"].GetUnit() != "" {
				t.Errorf("sample %d: %s has gpu_uuid %v, index %v, gpu_instance_id %v; want %s, %d, %d",
					i, id, v["gpu_uuid"], v["index"], v["gpu_instance_id"], gpuUUID[id], gpuIndex[id], wantGI)
			}
			if total := v["memory_total"]; total.GetIntValue() != memory[id] || total.GetUnit() != "MiB" {
				t.Errorf("sample %d: %s memory_total = %v, want %d MiB (its profile's)", i, id, total, memory[id])
			}
			if used, free := number(v["memory_used"]), number(v["memory_free"]); used <= 0 || used+free > float64(memory[id]) {
				t.Errorf("sample %d: %s memory used %v, free %v of %d MiB", i, id, used, free, memory[id])
			}
			if number(v["temperature"]) != number(got[gpuUUID[id]]["temperature"]) {
				t.Errorf("sample %d: %s temperature %v, want its GPU's %v", i, id, v["temperature"], got[gpuUUID[id]]["temperature"])
			}
			if _, ok := v["gpu_utilization"]; ok {
				t.Errorf("sample %d: %s has gpu_utilization, which NVML has not for MIG devices", i, id)
			}
			ta, ok := v["tensor_active"]
			if ok != (i == 1) || (ok && (number(ta) < 0 || number(ta) > 100 || ta.GetUnit() != "%")) {
				t.Errorf("sample %d: %s tensor_active = %v (present %v), want a %% in the second sample only", i, id, ta, ok)
			}
		}
	}
	// Two instances of one GPU are loaded apart.
	if a, b := number(byID(second)[held[0]]["tensor_active"]), number(byID(second)[held[1]]["tensor_active"]); a == b {
		t.Errorf("instances %s and %s both have tensor_active %v", held[0], held[1], a)
	}

	if err := p.Release(ctx, "r", held[:1]); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second)
	third := byID(s.next(t))
	if _, ok := third[held[0]]; ok {
		t.Errorf("released %s still reports stats", held[0])
	}
	if _, ok := third[held[1]]; !ok {
		t.Errorf("%s stopped reporting when another instance was released", held[1])
	}
	// One sample per GPU and per instance: the released one's is freed.
	if n := sim.gpmSamples.Load(); n != 8+2 {
		t.Errorf("%d GPM samples held, want 10 (8 GPUs, 2 instances)", n)
	}
}

// A static layout's MIG devices report under their MIG UUIDs, with their instances.
func TestStatsStaticMIGDevices(t *testing.T) {
	p, clk := newTestPlugin(t, Config{Simulate: "dgxh100", MIGLayout: []byte(`{"3": ["3g.40gb", "3g.40gb"]}`)})
	sim := simOf(t, p)
	s := startStats(t, p, time.Second)
	s.next(t)
	clk.Advance(time.Second)
	got := byID(s.next(t))
	ids := migInstanceIDs(sim, 3)
	if len(ids) != 2 {
		t.Fatalf("GPU 3 has instances %v, want 2", ids)
	}
	n := 0
	for id, v := range got {
		if !strings.HasPrefix(id, "MIG-") {
			continue
		}
		n++
		gi := uint32(v["gpu_instance_id"].GetIntValue())
		if v["gpu_uuid"].GetStringValue() != simulatedUUID("dgxh100", 3) || v["index"].GetIntValue() != 3 || (ids[0] != gi && ids[4] != gi) {
			t.Errorf("%s: gpu_uuid %v, index %v, gpu_instance_id %v; want GPU 3's, and one of %v", id, v["gpu_uuid"], v["index"], gi, ids)
		}
		if _, ok := v["tensor_active"]; !ok {
			t.Errorf("%s has no tensor_active in the second sample", id)
		}
	}
	if n != 2 {
		t.Errorf("%d MIG devices report stats, want 2", n)
	}
}

// GpmMetricsGet refuses what NVML refuses: samples out of order, of two devices, or
// freed.
func TestSimGPMRefusesBadSamples(t *testing.T) {
	p, clk := newTestPlugin(t, Config{Simulate: "dgxh100"})
	sim := simOf(t, p)
	take := func(d *simDevice) nvml.GpmSample {
		s, _ := sim.GpmSampleAlloc()
		if ret := d.GpmSampleGet(s); ret != nvml.SUCCESS {
			t.Fatalf("GpmSampleGet: %v", ret)
		}
		t.Cleanup(func() { _ = s.Free() })
		return s
	}
	get := func(s1, s2 nvml.GpmSample) nvml.Return {
		mg := nvml.GpmMetricsGetType{Version: nvml.GPM_METRICS_GET_VERSION, NumMetrics: 1, Sample1: s1, Sample2: s2}
		mg.Metrics[0].MetricId = uint32(nvml.GPM_METRIC_ANY_TENSOR_UTIL)
		return sim.GpmMetricsGet(&mg)
	}
	a1 := take(sim.devices[0])
	same := take(sim.devices[0]) // at the same time
	clk.Advance(time.Second)
	a2 := take(sim.devices[0])
	b2 := take(sim.devices[1])
	for _, tt := range []struct {
		name   string
		s1, s2 nvml.GpmSample
		want   nvml.Return
	}{
		{"in order", a1, a2, nvml.SUCCESS},
		{"reversed", a2, a1, nvml.ERROR_INVALID_ARGUMENT},
		{"same time", a1, same, nvml.ERROR_INVALID_ARGUMENT},
		{"two GPUs", a1, b2, nvml.ERROR_INVALID_ARGUMENT},
	} {
		if got := get(tt.s1, tt.s2); got != tt.want {
			t.Errorf("%s: GpmMetricsGet = %v, want %v", tt.name, got, tt.want)
		}
	}
	if ret := a1.Free(); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	if got := get(a1, a2); got != nvml.ERROR_INVALID_ARGUMENT {
		t.Errorf("freed sample: GpmMetricsGet = %v, want ERROR_INVALID_ARGUMENT", got)
	}
}
