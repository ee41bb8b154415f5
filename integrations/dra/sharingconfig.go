package dra

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
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
//	        # mps: {isolation: PerHolder}  # Shared or PerHolder; default: the plugin's
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
// reserved; so do two requests of one claim asking shares of one device with two
// isolations (its shares of a device are one Reserve, served by one daemon). A plugin
// whose config forbids the isolation (mps_isolation_allowed) refuses the Reserve, and
// the claim fails with its message.

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
}

// Isolations of MPSConfig.Isolation.
const (
	MPSIsolationShared    = "Shared"
	MPSIsolationPerHolder = "PerHolder"
)

// mpsIsolationOption is the nvidia-example plugin's Reserve option that chooses the
// isolation, and its value for each of MPSConfig.Isolation's.
const mpsIsolationOption = "mps_isolation"

var mpsIsolationValues = map[string]string{MPSIsolationShared: "shared", MPSIsolationPerHolder: "per-holder"}

// pluginOptions are the agent's plugin options for the Reserves of a request under c
// (nil c: none).
func (c *SharingConfig) pluginOptions() map[string]string {
	if c == nil || c.MPS == nil || c.MPS.Isolation == "" {
		return nil
	}
	return map[string]string{mpsIsolationOption: mpsIsolationValues[c.MPS.Isolation]}
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
	return &c, nil
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
