package dra

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// A claim's opaque device config for this driver: devicehost's own parameters object,
// versioned, checked at Prepare against the devices the claim got.
//
//	config:
//	  - requests: ["gpu"]
//	    opaque:
//	      driver: devicehost.io
//	      parameters:
//	        apiVersion: devicehost.io/v1alpha1
//	        kind: SharingConfig
//	        strategy: TimeSlicing          # Exclusive, TimeSlicing or MPS
//	        timeSlicing: {interval: Default}
//	        # with strategy MPS instead:
//	        # mps:
//	        #   isolation: PerHolder             # Shared or PerHolder; default: the plugin's
//	        #   activeThreadPercentage: 30       # 1 to 100; default: what the shares give
//	        #   pinnedDeviceMemoryLimit: 10Gi    # at least 1Mi; default: what the shares give
//
// How a GPU is shared is chosen by the device the claim asks for (its DeviceClass:
// gpu.devicehost.io whole, gpu-shared.devicehost.io a time-sliced replica,
// gpu-mps.devicehost.io MPS shares), never by this config: the scheduler reads
// classes and selectors, not opaque configs, and it must know the mode so that a GPU
// held in one mode is not allocated in another (compatibility groups). The config
// states the mode the workload needs, and a Prepare whose devices are not in it fails
// with an error naming the request, the device, its mode and the class to ask for, in
// the pod's events; so does a parameter the plugin cannot honour (a time-slice
// interval other than Default: the plugin never changes a GPU's settings). MPS limits
// follow the memory the claim asks (capacity.requests.memory, in whole shares).
//
// With strategy MPS, mps.isolation chooses the claim's MPS control daemon: Shared, the
// device's one daemon mediating every claim that chose it, or PerHolder, a daemon of
// the claim's own whose default limits are its shares. It reaches the agent as the
// plugin option mps_isolation ("shared", "per-holder") of the Reserves of that
// request's shares; absent, the plugin's config (mps_isolation) decides. A value other
// than these two, or mps with another strategy, fails the claim before anything is
// reserved; so do two requests of one claim asking shares of one device with differing
// mps (its shares of a device are one Reserve, served by one daemon with one holder's
// limits). A plugin
// whose config forbids the isolation (mps_isolation_allowed) refuses the Reserve, and
// the claim fails with its message.
//
// mps.activeThreadPercentage and mps.pinnedDeviceMemoryLimit (NVIDIA's DRA driver's
// MpsConfig names them defaultActiveThreadPercentage and defaultPinnedDeviceMemoryLimit;
// here they are the claim's own, with no per-device overrides to be a default for)
// lower the claim's MPS limits below what its shares give: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
// and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT in its containers, and with PerHolder its daemon's
// default limits. They reach the agent as the plugin options mps_thread_percentage and
// mps_memory_limit (whole MiB, the quantity rounded down) of the Reserves of that
// request's shares. They can only lower: the shares are what the scheduler counted. A
// percentage outside 1 to 100, a quantity below 1Mi or one above the memory the claim's
// shares of the device take (its requests' capacity), fails the claim at Prepare
// naming the field; a percentage above what the shares give (100/N each, which the
// plugin knows) is the plugin's refusal, in the claim's error.

// Sharing config identity.
const (
	SharingConfigAPIVersion = "devicehost.io/v1alpha1"
	SharingConfigKind       = "SharingConfig"
	// maxSharingConfig bounds one config's parameters (Kubernetes allows 10 KiB).
	maxSharingConfig = 10 << 10
)

// Sharing strategies of SharingConfig.Strategy.
const (
	StrategyExclusive   = "Exclusive"
	StrategyTimeSlicing = "TimeSlicing"
	StrategyMPS         = "MPS"
)

// SharingConfig is the parameters of a claim's opaque config for this driver.
type SharingConfig struct {
	APIVersion  string             `json:"apiVersion"`
	Kind        string             `json:"kind"`
	Strategy    string             `json:"strategy"`
	TimeSlicing *TimeSlicingConfig `json:"timeSlicing,omitempty"`
	MPS         *MPSConfig         `json:"mps,omitempty"`
}

// MPSConfig is an MPS claim's parameters.
type MPSConfig struct {
	// Isolation is MPSIsolationShared or MPSIsolationPerHolder; empty: the plugin's
	// default.
	Isolation string `json:"isolation,omitempty"`
	// ActiveThreadPercentage, 1 to 100, lowers the claim's thread percentage below
	// what its shares give; nil: theirs.
	ActiveThreadPercentage *int `json:"activeThreadPercentage,omitempty"`
	// PinnedDeviceMemoryLimit, a quantity ("10Gi") of at least 1Mi, lowers the claim's
	// pinned device memory limit below what its shares give (rounded down to whole
	// MiB); empty: theirs.
	PinnedDeviceMemoryLimit string `json:"pinnedDeviceMemoryLimit,omitempty"`

	pinnedMiB int64 // PinnedDeviceMemoryLimit in MiB, set by parseSharingConfig
}

// Isolations of MPSConfig.Isolation.
const (
	MPSIsolationShared    = "Shared"
	MPSIsolationPerHolder = "PerHolder"
)

// The nvidia-example plugin's Reserve options for MPS shares: mpsIsolationOption
// chooses the isolation (its value for each of MPSConfig.Isolation's below), the
// others lower the holder's limits.
const (
	mpsIsolationOption = "mps_isolation"
	mpsThreadsOption   = "mps_thread_percentage"
	mpsMemoryOption    = "mps_memory_limit" // MiB
)

var mpsIsolationValues = map[string]string{MPSIsolationShared: "shared", MPSIsolationPerHolder: "per-holder"}

// pluginOptions are the agent's plugin options for the Reserves of a request under c
// (nil c: none).
func (c *SharingConfig) pluginOptions() map[string]string {
	if c == nil || c.MPS == nil {
		return nil
	}
	opts := make(map[string]string)
	if c.MPS.Isolation != "" {
		opts[mpsIsolationOption] = mpsIsolationValues[c.MPS.Isolation]
	}
	if c.MPS.ActiveThreadPercentage != nil {
		opts[mpsThreadsOption] = strconv.Itoa(*c.MPS.ActiveThreadPercentage)
	}
	if c.MPS.pinnedMiB > 0 {
		opts[mpsMemoryOption] = strconv.FormatInt(c.MPS.pinnedMiB, 10)
	}
	if len(opts) == 0 {
		return nil
	}
	return opts
}

// TimeSlicingConfig is a time-sliced claim's parameters.
type TimeSlicingConfig struct {
	// Interval is the GPU's time slice: only "Default" (or empty), the GPU's own.
	Interval string `json:"interval,omitempty"`
}

// parseSharingConfig decodes and checks one config's parameters: this version and
// kind, known fields only, a known strategy with only its own parameters.
func parseSharingConfig(raw []byte) (*SharingConfig, error) {
	if len(raw) > maxSharingConfig {
		return nil, fmt.Errorf("%d bytes, at most %d", len(raw), maxSharingConfig)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var c SharingConfig
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("not a %s %s: %v", SharingConfigAPIVersion, SharingConfigKind, err)
	}
	switch {
	case c.APIVersion != SharingConfigAPIVersion || c.Kind != SharingConfigKind:
		return nil, fmt.Errorf("apiVersion %q, kind %q: want %q, %q", c.APIVersion, c.Kind, SharingConfigAPIVersion, SharingConfigKind)
	case !slices.Contains([]string{StrategyExclusive, StrategyTimeSlicing, StrategyMPS}, c.Strategy):
		return nil, fmt.Errorf("strategy %q: want %s, %s or %s", c.Strategy, StrategyExclusive, StrategyTimeSlicing, StrategyMPS)
	case c.TimeSlicing != nil && c.Strategy != StrategyTimeSlicing:
		return nil, fmt.Errorf("timeSlicing is for strategy %s, not %s", StrategyTimeSlicing, c.Strategy)
	case c.TimeSlicing != nil && c.TimeSlicing.Interval != "" && c.TimeSlicing.Interval != "Default":
		return nil, fmt.Errorf("timeSlicing.interval %q: only Default (the GPU's own): the plugin never changes a GPU's settings", c.TimeSlicing.Interval)
	case c.MPS != nil && c.Strategy != StrategyMPS:
		return nil, fmt.Errorf("mps is for strategy %s, not %s", StrategyMPS, c.Strategy)
	case c.MPS != nil && c.MPS.Isolation != "" && mpsIsolationValues[c.MPS.Isolation] == "":
		return nil, fmt.Errorf("mps.isolation %q: want %s or %s", c.MPS.Isolation, MPSIsolationShared, MPSIsolationPerHolder)
	}
	if c.MPS != nil {
		if err := c.MPS.parseLimits(); err != nil {
			return nil, err
		}
	}
	return &c, nil
}

// parseLimits checks m's limits and sets pinnedMiB; the errors name the fields.
func (m *MPSConfig) parseLimits() error {
	var errs []error
	if p := m.ActiveThreadPercentage; p != nil && (*p < 1 || *p > 100) {
		errs = append(errs, fmt.Errorf("mps.activeThreadPercentage %d: want 1 to 100", *p))
	}
	if v := m.PinnedDeviceMemoryLimit; v != "" {
		q, err := resource.ParseQuantity(v)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("mps.pinnedDeviceMemoryLimit %q: not a quantity (e.g. 10Gi): %v", v, err))
		case q.Cmp(resource.MustParse("1Mi")) < 0:
			errs = append(errs, fmt.Errorf("mps.pinnedDeviceMemoryLimit %q: want at least 1Mi", v))
		default:
			m.pinnedMiB = q.Value() >> 20
		}
	}
	return errors.Join(errs...)
}

// limitsName describes the MPS options opts carry, for an error: "isolation PerHolder,
// activeThreadPercentage 30, pinnedDeviceMemoryLimit 10240Mi", or "the plugin's
// defaults".
func limitsName(opts map[string]string) string {
	var parts []string
	if _, ok := opts[mpsIsolationOption]; ok {
		parts = append(parts, "isolation "+isolationName(opts))
	}
	if v, ok := opts[mpsThreadsOption]; ok {
		parts = append(parts, "activeThreadPercentage "+v)
	}
	if v, ok := opts[mpsMemoryOption]; ok {
		parts = append(parts, "pinnedDeviceMemoryLimit "+v+"Mi")
	}
	if len(parts) == 0 {
		return "the plugin's defaults"
	}
	return strings.Join(parts, ", ")
}

// sharingConfigs returns the SharingConfig that applies to each request of c (by
// request name as the allocation results give it, "<request>" or
// "<request>/<subrequest>"): the configs for this driver, the class's first and the
// claim's after them, a later one replacing an earlier one for the requests it names
// (all when it names none). A config that does not parse fails the claim.
func sharingConfigs(c *resourceapi.ResourceClaim, driver string) (func(request string) *SharingConfig, error) {
	type entry struct {
		requests []string
		cfg      *SharingConfig
	}
	var entries []entry
	for _, source := range []resourceapi.AllocationConfigSource{resourceapi.AllocationConfigSourceClass, resourceapi.AllocationConfigSourceClaim} {
		for i, dc := range c.Status.Allocation.Devices.Config {
			if dc.Source != source || dc.Opaque == nil || dc.Opaque.Driver != driver {
				continue
			}
			cfg, err := parseSharingConfig(dc.Opaque.Parameters.Raw)
			if err != nil {
				return nil, fmt.Errorf("device config %d (%s) for %s: %w", i, source, driver, err)
			}
			entries = append(entries, entry{dc.Requests, cfg})
		}
	}
	return func(request string) *SharingConfig {
		var out *SharingConfig
		main, _, _ := strings.Cut(request, "/")
		for _, e := range entries {
			if len(e.requests) == 0 || slices.Contains(e.requests, request) || slices.Contains(e.requests, main) {
				out = e.cfg
			}
		}
		return out
	}, nil
}

// strategyOf is the sharing strategy device a is held in; "" for a device that is no
// GPU of the nvidia-example plugin's kinds.
func strategyOf(a allocated) string {
	switch {
	case a.ref.pool != nil && a.ref.pool.kind == poolMPS:
		return StrategyMPS
	case strings.HasSuffix(a.ref.group.typ, ".shared"):
		return StrategyTimeSlicing
	case a.ref.group.typ == "gpu" || a.ref.group.typ == "mig":
		return StrategyExclusive
	}
	return ""
}

// checkSharing checks each allocated device against the SharingConfig of its request:
// the device must be held in the strategy the config names.
func checkSharing(devs []allocated, configFor func(string) *SharingConfig) error {
	want := map[string]string{
		StrategyExclusive:   "gpu.devicehost.io (whole GPU) or mig.devicehost.io (MIG device)",
		StrategyTimeSlicing: "gpu-shared.devicehost.io",
		StrategyMPS:         "gpu-mps.devicehost.io (or mig-mps.devicehost.io)",
	}
	for _, a := range devs {
		cfg := configFor(a.request)
		if cfg == nil || a.admin {
			continue
		}
		got := strategyOf(a)
		switch {
		case got == "":
			return fmt.Errorf("request %q: a %s applies to GPUs; device %s is of type %s", a.request, SharingConfigKind, a.ref.name, a.ref.group.typ)
		case got != cfg.Strategy:
			return fmt.Errorf("request %q: %s strategy %s, but device %s (type %s) is held %s: for %s ask DeviceClass %s",
				a.request, SharingConfigKind, cfg.Strategy, a.ref.name, a.ref.group.typ, got, cfg.Strategy, want[cfg.Strategy])
		}
	}
	return nil
}

// isolationName is the SharingConfig mps.isolation that plugin options opts say, for an
// error: "Shared", "PerHolder", or "the plugin's default".
func isolationName(opts map[string]string) string {
	for name, v := range mpsIsolationValues {
		if opts[mpsIsolationOption] == v {
			return name
		}
	}
	return "the plugin's default"
}
