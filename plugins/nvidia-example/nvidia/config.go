package nvidia

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/devicehost/devicehost/deviceplugin/cdi"
)

// Defaults for the duration keys of Config.
const (
	DefaultFingerprintPeriod = time.Minute
	DefaultHealthQuietPeriod = 5 * time.Minute
)

// Config is the plugin's config block. The host converts the HCL block to JSON with
// these key names and hands it over in SetConfig; the zero value (or no block at all)
// means real NVML with the defaults below. Durations are Go duration strings ("90s",
// "5m"). Unknown keys are rejected, so a typo does not pass silently.
//
//	plugin "nvidia-example" {
//	  config {
//	    simulate            = "dgxh100"
//	    fingerprint_period  = "30s"
//	    health_quiet_period = "2m"
//	    ignored_gpu_ids     = ["GPU-..."]
//	    inject_faults = [
//	      { gpu_index = 3, xid = 79, after = "1m", for = "30s" },
//	    ]
//	    cdi_spec_dir        = "/var/run/cdi"
//	  }
//	}
type Config struct {
	// Simulate names a simulated machine built on go-nvml's mock servers: "dgxa100",
	// "dgxh100", "dgxh200" or "dgxb200" (8 GPUs each). Empty means real NVML.
	Simulate string `json:"simulate,omitempty"`
	// FingerprintPeriod is how often the devices are read again; a fingerprint is sent
	// only when something changed. Empty means DefaultFingerprintPeriod.
	FingerprintPeriod string `json:"fingerprint_period,omitempty"`
	// IgnoredGPUIDs are GPU UUIDs that the plugin neither reports nor reserves.
	IgnoredGPUIDs []string `json:"ignored_gpu_ids,omitempty"`
	// HealthQuietPeriod is how long a GPU stays unhealthy after its last critical XID.
	// Empty means DefaultHealthQuietPeriod.
	HealthQuietPeriod string `json:"health_quiet_period,omitempty"`
	// InjectFaults raises XID events on simulated GPUs; only valid with Simulate.
	InjectFaults []FaultConfig `json:"inject_faults,omitempty"`
	// CDISpecDir is the absolute path of the directory the plugin writes its CDI spec
	// to, so the CDI names Reserve hands out resolve in container runtimes; "" writes
	// none. Unset means DefaultCDISpecDir on real NVML, and none with Simulate
	// (simulated GPUs must not enter the host's real CDI registry).
	CDISpecDir *string `json:"cdi_spec_dir,omitempty"`
}

// FaultConfig is one injected fault: the simulated GPU named by exactly one of GPUID
// and GPUIndex raises XID After the plugin was configured and, when For is set, raises
// it again at After+For (a fault that lasts For). The GPU is healthy again
// health_quiet_period after the last one. Application XIDs (13, 31, 43, 45, 68, 109)
// are delivered too but, as on real hardware, do not make the GPU unhealthy.
type FaultConfig struct {
	GPUID    string `json:"gpu_id,omitempty"`    // a simulated GPU's UUID
	GPUIndex *int   `json:"gpu_index,omitempty"` // or its NVML index, 0-based
	XID      uint64 `json:"xid"`
	After    string `json:"after"`
	For      string `json:"for,omitempty"`
}

// DefaultCDISpecDir is where the plugin writes its CDI spec on real NVML: the
// directory container runtimes read generated specs from.
const DefaultCDISpecDir = cdi.DefaultDir

// settings is a parsed, checked Config.
type settings struct {
	simulate          string
	cdiDir            string // "" writes no CDI spec
	fingerprintPeriod time.Duration
	quietPeriod       time.Duration
	ignored           map[string]bool
	faults            []faultSpec
}

// faultSpec is a parsed FaultConfig; gpuIndex is -1 when the fault names a GPU ID.
type faultSpec struct {
	key      string // "inject_faults[2]", for errors
	gpuID    string
	gpuIndex int
	xid      uint64
	after    time.Duration
	lasts    time.Duration
}

// parseConfig decodes and checks a config block. Every problem is reported, each
// naming its key and value, joined with errors.Join.
func parseConfig(configJSON []byte) (settings, error) {
	var c Config
	if trimmed := bytes.TrimSpace(configJSON); len(trimmed) > 0 && !bytes.Equal(trimmed, []byte("null")) {
		dec := json.NewDecoder(bytes.NewReader(trimmed))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&c); err != nil {
			return settings{}, fmt.Errorf("config: %w", err)
		}
		if dec.More() {
			return settings{}, errors.New("config: trailing data after the JSON object")
		}
	}

	s := settings{ignored: make(map[string]bool)}
	var errs []error
	if c.Simulate != "" {
		if _, ok := machines[c.Simulate]; !ok {
			errs = append(errs, fmt.Errorf("config: simulate = %q: unknown machine, want one of %s",
				c.Simulate, strings.Join(machineNames(), ", ")))
		}
		s.simulate = c.Simulate
	}
	var err error
	if s.fingerprintPeriod, err = parsePositive("fingerprint_period", c.FingerprintPeriod, DefaultFingerprintPeriod); err != nil {
		errs = append(errs, err)
	}
	if s.quietPeriod, err = parsePositive("health_quiet_period", c.HealthQuietPeriod, DefaultHealthQuietPeriod); err != nil {
		errs = append(errs, err)
	}
	for i, id := range c.IgnoredGPUIDs {
		if strings.TrimSpace(id) == "" {
			errs = append(errs, fmt.Errorf("config: ignored_gpu_ids[%d] = %q: empty GPU ID", i, id))
			continue
		}
		s.ignored[id] = true
	}
	switch {
	case c.CDISpecDir == nil && c.Simulate == "":
		s.cdiDir = DefaultCDISpecDir
	case c.CDISpecDir == nil || *c.CDISpecDir == "":
	case !filepath.IsAbs(*c.CDISpecDir):
		errs = append(errs, fmt.Errorf("config: cdi_spec_dir = %q: must be an absolute path (container runtimes read /var/run/cdi and /etc/cdi)", *c.CDISpecDir))
	default:
		s.cdiDir = filepath.Clean(*c.CDISpecDir)
	}
	if len(c.InjectFaults) > 0 && c.Simulate == "" {
		errs = append(errs, errors.New("config: inject_faults: only valid with simulate"))
	}
	for i, f := range c.InjectFaults {
		spec, ferrs := parseFault(fmt.Sprintf("inject_faults[%d]", i), f)
		errs = append(errs, ferrs...)
		s.faults = append(s.faults, spec)
	}
	if err := errors.Join(errs...); err != nil {
		return settings{}, err
	}
	return s, nil
}

func parseFault(key string, f FaultConfig) (faultSpec, []error) {
	spec := faultSpec{key: key, gpuID: f.GPUID, gpuIndex: -1, xid: f.XID}
	var errs []error
	switch {
	case f.GPUID != "" && f.GPUIndex != nil:
		errs = append(errs, fmt.Errorf("config: %s: set gpu_id or gpu_index, not both", key))
	case f.GPUID == "" && f.GPUIndex == nil:
		errs = append(errs, fmt.Errorf("config: %s: gpu_id or gpu_index is required", key))
	case f.GPUIndex != nil && *f.GPUIndex < 0:
		errs = append(errs, fmt.Errorf("config: %s.gpu_index = %d: must not be negative", key, *f.GPUIndex))
	case f.GPUIndex != nil:
		spec.gpuIndex = *f.GPUIndex
	}
	if f.XID == 0 {
		errs = append(errs, fmt.Errorf("config: %s.xid: required, a positive XID number", key))
	}
	var err error
	if f.After == "" {
		errs = append(errs, fmt.Errorf("config: %s.after: required, a duration such as \"30s\"", key))
	} else if spec.after, err = parseNonNegative(key+".after", f.After); err != nil {
		errs = append(errs, err)
	}
	if f.For != "" {
		if spec.lasts, err = parseNonNegative(key+".for", f.For); err != nil {
			errs = append(errs, err)
		}
	}
	return spec, errs
}

// parsePositive parses a duration key that must be above zero; empty means def.
func parsePositive(key, value string, def time.Duration) (time.Duration, error) {
	if value == "" {
		return def, nil
	}
	d, err := time.ParseDuration(value)
	if err != nil {
		return 0, fmt.Errorf("config: %s = %q: %w", key, value, err)
	}
	if d <= 0 {
		return 0, fmt.Errorf("config: %s = %q: must be positive", key, value)
	}
	return d, nil
}

func parseNonNegative(key, value string) (time.Duration, error) {
	d, err := time.ParseDuration(value)
	if err != nil {
		return 0, fmt.Errorf("config: %s = %q: %w", key, value, err)
	}
	if d < 0 {
		return 0, fmt.Errorf("config: %s = %q: must not be negative", key, value)
	}
	return d, nil
}

func machineNames() []string {
	names := make([]string, 0, len(machines))
	for name := range machines {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}
