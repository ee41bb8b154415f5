package nvidia

import (
	"math"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// gpmSymbols are the NVML calls GPU performance monitoring needs (drivers from R520 on
// have them); without every one the plugin reads no GPM metric, since calling a
// symbol the loaded driver lacks would crash the process.
var gpmSymbols = []string{
	"nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleFree",
	"nvmlGpmSampleGet", "nvmlGpmMigSampleGet", "nvmlGpmMetricsGet",
}

// wholeGPU is the gpmKey.gi of a whole GPU's samples.
const wholeGPU = -1

// gpmKey names what a GPM sample is of: a GPU, or one of its GPU instances.
type gpmKey struct {
	gpu string // the GPU's UUID
	gi  int    // the GPU instance ID, or wholeGPU
}

// gpmSampler reads tensor activity through NVML's GPU performance monitoring (GPM:
// Hopper and later). A GPM metric is the difference between two samples, so the
// sampler keeps the last sample of every GPU and GPU instance it read: a device's
// first call gives no value, each later one the activity since the call before.
//
// One sampler belongs to one Stats stream and is used by its goroutine only; close
// frees its samples.
type gpmSampler struct {
	lib nvml.Interface // nil: GPM is off (no NVML, or a driver without it)
	// supported is GpmQueryDeviceSupport's answer per GPU UUID, asked once.
	supported map[string]bool
	last      map[gpmKey]nvml.GpmSample
	seen      map[gpmKey]bool // read in the current round
}

func newGPMSampler(lib nvml.Interface) *gpmSampler {
	return &gpmSampler{lib: lib, supported: make(map[string]bool), last: make(map[gpmKey]nvml.GpmSample), seen: make(map[gpmKey]bool)}
}

// supports says whether g can be sampled (a GPU NVML says GPM supports).
func (s *gpmSampler) supports(g gpu) bool {
	if s.lib == nil {
		return false
	}
	ok, asked := s.supported[g.uuid]
	if !asked {
		sup, ret := g.dev.GpmQueryDeviceSupport()
		ok = ret == nvml.SUCCESS && sup.IsSupportedDevice != 0
		s.supported[g.uuid] = ok
	}
	return ok
}

// tensorActive returns the share of time, in %, that any tensor pipe of g (gi
// wholeGPU) or of its GPU instance gi was active since the previous call for it. ok is
// false when GPM does not support g, a sample cannot be taken, or there is no
// previous sample.
func (s *gpmSampler) tensorActive(g gpu, gi int) (pct float64, ok bool) {
	if !s.supports(g) {
		return 0, false
	}
	key := gpmKey{g.uuid, gi}
	s.seen[key] = true
	cur, ret := s.lib.GpmSampleAlloc()
	if ret != nvml.SUCCESS {
		return 0, false
	}
	if gi == wholeGPU {
		ret = g.dev.GpmSampleGet(cur)
	} else {
		ret = g.dev.GpmMigSampleGet(gi, cur)
	}
	prev, had := s.last[key]
	if ret != nvml.SUCCESS {
		cur.Free()
		if had {
			prev.Free()
			delete(s.last, key)
		}
		return 0, false
	}
	s.last[key] = cur
	if !had {
		return 0, false
	}
	defer prev.Free()
	mg := nvml.GpmMetricsGetType{Version: nvml.GPM_METRICS_GET_VERSION, NumMetrics: 1, Sample1: prev, Sample2: cur}
	mg.Metrics[0].MetricId = uint32(nvml.GPM_METRIC_ANY_TENSOR_UTIL)
	if ret := s.lib.GpmMetricsGet(&mg); ret != nvml.SUCCESS || nvml.Return(mg.Metrics[0].NvmlReturn) != nvml.SUCCESS {
		return 0, false
	}
	v := mg.Metrics[0].Value
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, false
	}
	return min(max(v, 0), 100), true
}

// endRound frees the samples of devices the round since the last endRound did not
// read (a GPU instance destroyed, a GPU gone), so the sampler holds one sample per
// device that exists.
func (s *gpmSampler) endRound() {
	for key, sample := range s.last {
		if !s.seen[key] {
			sample.Free()
			delete(s.last, key)
		}
	}
	clear(s.seen)
}

// close frees every sample.
func (s *gpmSampler) close() {
	clear(s.seen)
	s.endRound()
}
