package nvidia

import (
	"math"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// The simulated machine's GPU performance monitoring (GPM) and its MIG devices' own
// memory. go-nvml's mock servers have neither, so they are answered here: GPM where
// the machine's GPUs have it (Hopper and later: not the A100), tensor activity that
// follows each GPU's load, and for each GPU instance a load of its own.

// Periods and shifts of the simulated loads (see simDevice.wave).
const (
	tensorPeriod   = 2 * time.Minute // the GPU's compute load's: tensor work is part of it
	instancePeriod = 3 * time.Minute
)

// tensorShare is the part of a busy GPU's time its tensor pipes are busy.
const tensorShare = 0.9

// simGpmSample is one GPM sample of a simulated GPU or GPU instance. It is filled by
// GpmSampleGet or GpmMigSampleGet and read by GpmMetricsGet, from the goroutine that
// owns it (as NVML's own samples).
type simGpmSample struct {
	nvml.GpmSample // nil: only the methods below are called

	lib   *simLib
	dev   *simDevice // nil until taken
	gi    int        // wholeGPU, or the GPU instance sampled
	at    time.Time
	freed bool
}

func (l *simLib) GpmSampleAlloc() (nvml.GpmSample, nvml.Return) {
	l.gpmSamples.Add(1)
	return &simGpmSample{lib: l, gi: wholeGPU}, nvml.SUCCESS
}

func (l *simLib) GpmSampleFree(s nvml.GpmSample) nvml.Return { return s.Free() }

func (s *simGpmSample) Free() nvml.Return {
	if s.freed {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	s.freed = true
	s.lib.gpmSamples.Add(-1)
	return nvml.SUCCESS
}

func (s *simGpmSample) Get(dev nvml.Device) nvml.Return { return dev.GpmSampleGet(s) }

func (s *simGpmSample) MigGet(dev nvml.Device, gi int) nvml.Return {
	return dev.GpmMigSampleGet(gi, s)
}

// sampleOf returns s as this machine's sample, if it is one that is not freed.
func (d *simDevice) sampleOf(s nvml.GpmSample) (*simGpmSample, bool) {
	sample, ok := s.(*simGpmSample)
	return sample, ok && sample.lib == d.lib && !sample.freed
}

func (d *simDevice) GpmQueryDeviceSupport() (nvml.GpmSupport, nvml.Return) {
	sup := nvml.GpmSupport{Version: nvml.GPM_SUPPORT_VERSION}
	if d.spec.gpm {
		sup.IsSupportedDevice = 1
	}
	return sup, nvml.SUCCESS
}

func (d *simDevice) GpmSampleGet(s nvml.GpmSample) nvml.Return {
	sample, ok := d.sampleOf(s)
	switch {
	case !ok:
		return nvml.ERROR_INVALID_ARGUMENT
	case !d.spec.gpm:
		return nvml.ERROR_NOT_SUPPORTED
	}
	sample.dev, sample.gi, sample.at = d, wholeGPU, d.lib.clock.Now()
	return nvml.SUCCESS
}

func (d *simDevice) GpmMigSampleGet(gi int, s nvml.GpmSample) nvml.Return {
	sample, ok := d.sampleOf(s)
	switch {
	case !ok || gi < 0:
		return nvml.ERROR_INVALID_ARGUMENT
	case !d.spec.gpm:
		return nvml.ERROR_NOT_SUPPORTED
	case !d.migEnabled():
		return nvml.ERROR_NOT_SUPPORTED
	}
	exists := false
	d.lib.mig.view(func(st *simMIGState) { exists = d.migGPU(st).gi(uint32(gi)) != nil })
	if !exists {
		return nvml.ERROR_NOT_FOUND
	}
	sample.dev, sample.gi, sample.at = d, gi, d.lib.clock.Now()
	return nvml.SUCCESS
}

// GpmMetricsGet answers GPM_METRIC_ANY_TENSOR_UTIL, in %, for two samples of one GPU
// (or one GPU instance), the second taken after the first: the mean of the simulated
// tensor load between them. Other metrics are not supported.
func (l *simLib) GpmMetricsGet(mg *nvml.GpmMetricsGetType) nvml.Return {
	if mg == nil || mg.Version != nvml.GPM_METRICS_GET_VERSION || int(mg.NumMetrics) > len(mg.Metrics) {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	s1, ok1 := mg.Sample1.(*simGpmSample)
	s2, ok2 := mg.Sample2.(*simGpmSample)
	if !ok1 || !ok2 || s1.lib != l || s2.lib != l || s1.freed || s2.freed || s1.dev == nil ||
		s1.dev != s2.dev || s1.gi != s2.gi || !s2.at.After(s1.at) {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	for i := range mg.NumMetrics {
		m := &mg.Metrics[i]
		if m.MetricId != uint32(nvml.GPM_METRIC_ANY_TENSOR_UTIL) {
			m.NvmlReturn = uint32(nvml.ERROR_NOT_SUPPORTED)
			continue
		}
		m.Value = 100 * s1.dev.tensorLoad(s1.gi, s1.at, s2.at)
		m.NvmlReturn = uint32(nvml.SUCCESS)
	}
	return nvml.SUCCESS
}

// tensorLoad is the mean share of time, in [0, 1], that the tensor pipes of the GPU
// (gi wholeGPU) or of its GPU instance gi were busy from from to to: a part of the
// GPU's compute load, or a load of the instance's own.
func (d *simDevice) tensorLoad(gi int, from, to time.Time) float64 {
	if gi == wholeGPU {
		return tensorShare * d.waveMean(tensorPeriod, 0, from, to)
	}
	return tensorShare * d.waveMean(instancePeriod, 0.7*float64(gi), from, to)
}

// waveMean is the mean of wave(period, shift) from from to to (its value at from when
// they are equal).
func (d *simDevice) waveMean(period time.Duration, shift float64, from, to time.Time) float64 {
	phase := func(t time.Time) float64 {
		return 2*math.Pi*float64(t.UnixNano()%int64(period))/float64(period) + shift + 0.9*float64(d.index)
	}
	span := to.Sub(from).Seconds()
	if span <= 0 {
		return 0.5 + 0.45*math.Sin(phase(from))
	}
	// The integral of sin over the span, over the span: the wave's period is whole
	// cycles of 2π, so the phases' cosines give it.
	p := period.Seconds()
	return 0.5 + 0.45*p/(2*math.Pi*span)*(math.Cos(phase(from))-math.Cos(phase(to)))
}

// GetMemoryInfo is the MIG device's own memory: its GPU instance profile's, used in
// part by a load of its own.
func (m *simMigDevice) GetMemoryInfo() (nvml.Memory, nvml.Return) {
	var profile uint32
	found := false
	m.parent.lib.mig.view(func(st *simMIGState) {
		if gi := m.parent.migGPU(st).gi(m.gi); gi != nil {
			profile, found = gi.ProfileID, true
		}
	})
	if !found {
		return nvml.Memory{}, nvml.ERROR_NOT_FOUND
	}
	info, ret := m.parent.GetGpuInstanceProfileInfo(int(profile))
	if ret != nvml.SUCCESS {
		return nvml.Memory{}, ret
	}
	total := info.MemorySizeMB << 20
	used := uint64(float64(total) * (0.1 + 0.8*m.parent.wave(instancePeriod, 0.7*float64(m.gi)+1.3)))
	return nvml.Memory{Total: total, Used: used, Free: total - used}, nvml.SUCCESS
}
