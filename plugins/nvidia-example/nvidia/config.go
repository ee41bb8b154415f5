package nvidia

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/devicehost/devicehost/deviceplugin/cdi"
	"github.com/devicehost/devicehost/internal/suggest"
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
//	    mig                 = "on-demand"
//	    mig_layout          = { "0" = ["3g.40gb", "2g.20gb"] }
//	    replicas            = 4
//	    sharing             = "mps"        # or "time-slicing" (the default with replicas)
//	    mps_isolation       = "per-holder" # or "shared" (the default)
//	    mps_isolation_allowed = ["per-holder"] # what a Reserve's option may ask (default both)
//	    sim_state_file      = "/var/lib/devicehost/nvidia-sim.json"
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
	// MIG "on-demand" offers every MIG-capable GPU whose MIG mode is on as the whole
	// GPU plus each MIG profile at each placement, all consuming the GPU's shared
	// counters; Reserve creates the instance, Release destroys it. Empty: off. GPUs
	// named in MIGLayout are static instead.
	MIG string `json:"mig,omitempty"`
	// MIGLayout is a static layout, applied at SetConfig: a profile name ("1g.10gb":
	// as many of it as fit on every MIG-capable GPU) or an object from GPU index to a
	// list of profile names ({"0": ["3g.40gb", "2g.20gb"]}).
	MIGLayout json.RawMessage `json:"mig_layout,omitempty"`
	// MIGProfiles, with mig = "on-demand", offers only the placements of these profiles
	// (and the whole GPU); empty: every profile each GPU has. Fewer profiles are fewer
	// devices in the node's inventory and DRA slices, which the scheduler evaluates for
	// every claim (docs/benchmarks.md#fleet): a trade the operator makes, since a claim
	// for a profile left out cannot be placed. A name no on-demand GPU offers refuses the
	// config.
	MIGProfiles []string `json:"mig_profiles,omitempty"`
	// Replicas N (2 to MaxReplicas) offers each GPU that is not partitioned by MIG as
	// N time-sliced replicas besides the whole GPU, each consuming one of the GPU's N
	// shares. 0: off. With Sharing "mps" (2 to MaxMPSShares) the N shares are MPS
	// shares instead, of whole GPUs and of static MIG devices (see mps.go).
	Replicas int `json:"replicas,omitempty"`
	// Sharing is how replicas share a device: "time-slicing" (the default when
	// replicas is set) or "mps": each share is 1/N of the device's memory and compute,
	// served by an MPS control daemon the plugin runs (see mps.go). A list of both
	// (["time-slicing", "mps"]) offers each whole GPU both ways, N replicas and N MPS
	// shares, and lets the workload choose: a GPU serves the mode its first holder
	// chose until it is free again (their uses of the GPU's counters carry the
	// compatibility groups "time-slicing" and "mps", which the host never lets hold one
	// GPU at once).
	Sharing SharingModes `json:"sharing,omitempty"`
	// MPSIsolation, with sharing = "mps", is the isolation of a Reserve of MPS shares
	// that does not choose one (its option mps_isolation): "shared" (the default), one
	// control daemon per device mediating its holders, each holder's limits set in its
	// environment; or "per-holder", a control daemon per holder whose default limits are
	// its shares, which the holder cannot raise. A device may be served by its shared
	// daemon and by per-holder daemons at once.
	MPSIsolation string `json:"mps_isolation,omitempty"`
	// MPSIsolationAllowed, with sharing = "mps", lists the isolations a Reserve may ask
	// for in its option mps_isolation ("shared", "per-holder"); a Reserve asking another
	// is refused. Empty: both. It must hold mps_isolation (the default).
	MPSIsolationAllowed []string `json:"mps_isolation_allowed,omitempty"`
	// MPSDir is the absolute directory under which each control daemon gets its pipe
	// and log directories, mounted into the holders' containers. Unset means
	// DefaultMPSDir on real NVML, and DefaultSimMPSDir(simulate) with Simulate.
	MPSDir string `json:"mps_dir,omitempty"`
	// MPSControl is the absolute path of nvidia-cuda-mps-control. Unset means the one on
	// the PATH on real NVML, and the simulated daemon (this binary in another role)
	// with Simulate.
	MPSControl string `json:"mps_control,omitempty"`
	// SimStateFile is where a simulated machine keeps its MIG state, so that it
	// outlives the plugin process as a real GPU's does; "" keeps it in memory. Unset
	// means DefaultSimStateFile(simulate). Only valid with Simulate.
	SimStateFile *string `json:"sim_state_file,omitempty"`
	// SimMIGModeOff are GPU indexes whose MIG mode the simulated operator turns off
	// (nvidia-smi -i N -mig 0) rather than on: a node that mixes MIG-enabled and whole
	// GPUs. Only valid with Simulate; not for GPUs named in MIGLayout.
	SimMIGModeOff []int `json:"sim_mig_mode_off,omitempty"`
}

// MIG modes of Config.MIG.
const MIGOnDemand = "on-demand"

// MaxReplicas bounds Config.Replicas.
const MaxReplicas = 64

// Sharing modes of Config.Sharing, and isolations of Config.MPSIsolation.
const (
	SharingTimeSlicing = "time-slicing"
	SharingMPS         = "mps"
	MPSShared          = "shared"
	MPSPerHolder       = "per-holder"
)

// SharingModes is Config.Sharing: one mode, or several. In a config it is a string
// ("mps") or a list of strings (["time-slicing", "mps"]).
type SharingModes []string

// UnmarshalJSON reads a string or a list of strings.
func (m *SharingModes) UnmarshalJSON(b []byte) error {
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*m = SharingModes{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return errors.New("sharing: want a mode or a list of modes")
	}
	*m = many
	return nil
}

// MarshalJSON writes one mode as a string, several as a list.
func (m SharingModes) MarshalJSON() ([]byte, error) {
	if len(m) == 1 {
		return json.Marshal(m[0])
	}
	return json.Marshal([]string(m))
}

// String is the modes as a config writes them: "mps" or ["time-slicing", "mps"].
func (m SharingModes) String() string {
	q := make([]string, len(m))
	for i, s := range m {
		q[i] = strconv.Quote(s)
	}
	if len(m) == 1 {
		return q[0]
	}
	return "[" + strings.Join(q, ", ") + "]"
}

// MaxMPSShares bounds Config.Replicas with sharing = "mps": an MPS server takes at most
// 48 clients per device on Volta and later.
const MaxMPSShares = 48

// MaxOnDemandMPSShares bounds Config.Replicas with sharing = "mps" and mig =
// "on-demand": every placement of every profile is offered in shares (about 25
// placements per H100, 8 GPUs), which must stay inside the host's bounds on devices.
const MaxOnDemandMPSShares = 8

// DefaultMPSDir is where the control daemons' pipe and log directories go on real
// NVML: a tmpfs, gone at a reboot as the daemons are.
const DefaultMPSDir = "/run/devicehost/nvidia-mps"

// DefaultSimMPSDir is the MPS directory of simulated machine machine when mps_dir is
// not set.
func DefaultSimMPSDir(machine string) string {
	return filepath.Join(os.TempDir(), fmt.Sprintf("devicehost-mps-%s-%d", machine, os.Getuid()))
}

// maxMPSDir bounds mps_dir's length: each daemon's control pipe,
// <mps_dir>/<12 hex>/holder-<k>/pipe/control, must fit a Unix socket path (108 bytes).
const maxMPSDir = 64

// DefaultSimStateFile is the state file of simulated machine machine when
// sim_state_file is not set: in the temporary directory, which (like a real GPU's MIG
// instances) does not survive a reboot.
func DefaultSimStateFile(machine string) string {
	return filepath.Join(os.TempDir(), fmt.Sprintf("devicehost-nvidia-example-%s-%d.json", machine, os.Getuid()))
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
	// RecoveryAction, when set, makes the simulated driver report recovery actions
	// (nvml.FI_DEV_GET_GPU_RECOVERY_ACTION, on every GPU of the machine): from After
	// this GPU asks for this one (see RecoveryActions), until After+For when For is
	// set (the action done; no second XID), else for good. Without it on any fault,
	// the simulated driver is one that reports none, and the XID list applies.
	RecoveryAction string `json:"recovery_action,omitempty"`
}

// RecoveryActions are the values of FaultConfig.RecoveryAction, and the driver's
// actions they stand for.
var RecoveryActions = map[string]nvml.DeviceGpuRecoveryAction{
	"none":            nvml.GPU_RECOVERY_ACTION_NONE,
	"gpu_reset":       nvml.GPU_RECOVERY_ACTION_GPU_RESET,
	"node_reboot":     nvml.GPU_RECOVERY_ACTION_NODE_REBOOT,
	"drain_p2p":       nvml.GPU_RECOVERY_ACTION_DRAIN_P2P,
	"drain_and_reset": nvml.GPU_RECOVERY_ACTION_DRAIN_AND_RESET,
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
	migOnDemand       bool
	migProfiles       []string         // mig_profiles: the on-demand profiles offered; nil: all
	layoutAll         string           // mig_layout as one profile for every GPU
	layout            map[int][]string // mig_layout by GPU index
	replicas          int              // time-sliced replicas per GPU
	mps               mpsSettings      // mps.shares > 0: MPS shares instead
	simStateFile      string           // "" in memory
	simMIGModeOff     map[int]bool
}

// layoutFor returns the static layout of GPU index: the profiles it must hold, or
// fill (as many of one profile as fit); ok is false when the GPU has none.
func (s settings) layoutFor(index int) (profiles []string, fill string, ok bool) {
	if s.layoutAll != "" {
		return nil, s.layoutAll, true
	}
	profiles, ok = s.layout[index]
	return profiles, "", ok
}

// wantsMIG says whether the config partitions GPU index by MIG, statically or on
// demand.
func (s settings) wantsMIG(index int) bool {
	_, _, static := s.layoutFor(index)
	return static || s.migOnDemand && !s.simMIGModeOff[index]
}

// faultSpec is a parsed FaultConfig; gpuIndex is -1 when the fault names a GPU ID.
type faultSpec struct {
	key      string // "inject_faults[2]", for errors
	gpuID    string
	gpuIndex int
	xid      uint64
	after    time.Duration
	lasts    time.Duration
	action   *nvml.DeviceGpuRecoveryAction // nil: no recovery action
}

// unknownKeyHint is suggest.UnknownField over the config's keys; the key may be one
// of an inject_faults entry's: both sets are candidates.
func unknownKeyHint(err error) error {
	return suggest.UnknownField(err, slices.Concat(suggest.JSONKeys(Config{}), suggest.JSONKeys(FaultConfig{})))
}

// parseConfig decodes and checks a config block. Every problem is reported, each
// naming its key and value, joined with errors.Join.
func parseConfig(configJSON []byte) (settings, error) {
	var c Config
	if trimmed := bytes.TrimSpace(configJSON); len(trimmed) > 0 && !bytes.Equal(trimmed, []byte("null")) {
		dec := json.NewDecoder(bytes.NewReader(trimmed))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&c); err != nil {
			return settings{}, fmt.Errorf("config: %w", unknownKeyHint(err))
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
	switch c.MIG {
	case "":
	case MIGOnDemand:
		s.migOnDemand = true
	default:
		errs = append(errs, fmt.Errorf("config: mig = %q: want %q or nothing", c.MIG, MIGOnDemand))
	}
	if len(c.MIGProfiles) > 0 {
		if !s.migOnDemand {
			errs = append(errs, fmt.Errorf("config: mig_profiles %q: only with mig = %q", c.MIGProfiles, MIGOnDemand))
		}
		seen := map[string]bool{}
		for _, n := range c.MIGProfiles {
			if n == "" || seen[n] {
				errs = append(errs, fmt.Errorf("config: mig_profiles %q: %q is empty or given twice", c.MIGProfiles, n))
			}
			seen[n] = true
		}
		s.migProfiles = c.MIGProfiles
	}
	if len(c.MIGLayout) > 0 && !bytes.Equal(bytes.TrimSpace(c.MIGLayout), []byte("null")) {
		errs = append(errs, parseLayout(c.MIGLayout, &s)...)
	}
	if s.layoutAll != "" && s.migOnDemand {
		errs = append(errs, fmt.Errorf("config: mig_layout = %q and mig = %q: a layout for every GPU leaves none on demand; give mig_layout by GPU index", s.layoutAll, MIGOnDemand))
	}
	errs = append(errs, parseSharing(c, &s)...)
	switch {
	case c.SimStateFile != nil && c.Simulate == "":
		errs = append(errs, errors.New("config: sim_state_file: only valid with simulate"))
	case c.SimStateFile == nil && c.Simulate != "":
		s.simStateFile = DefaultSimStateFile(c.Simulate)
	case c.SimStateFile == nil || *c.SimStateFile == "":
	case !filepath.IsAbs(*c.SimStateFile):
		errs = append(errs, fmt.Errorf("config: sim_state_file = %q: must be an absolute path", *c.SimStateFile))
	default:
		s.simStateFile = filepath.Clean(*c.SimStateFile)
	}
	if len(c.SimMIGModeOff) > 0 && c.Simulate == "" {
		errs = append(errs, errors.New("config: sim_mig_mode_off: only valid with simulate"))
	}
	for i, idx := range c.SimMIGModeOff {
		switch _, _, static := s.layoutFor(idx); {
		case idx < 0:
			errs = append(errs, fmt.Errorf("config: sim_mig_mode_off[%d] = %d: a GPU index is 0 or more", i, idx))
		case static:
			errs = append(errs, fmt.Errorf("config: sim_mig_mode_off[%d] = %d: GPU %d has a mig_layout, which needs MIG mode on", i, idx, idx))
		default:
			if s.simMIGModeOff == nil {
				s.simMIGModeOff = make(map[int]bool)
			}
			s.simMIGModeOff[idx] = true
		}
	}
	if err := errors.Join(errs...); err != nil {
		return settings{}, err
	}
	return s, nil
}

// parseSharing reads replicas, sharing and the mps_ keys.
func parseSharing(c Config, s *settings) []error {
	var errs []error
	var ts, mps bool
	for i, m := range c.Sharing {
		switch {
		case m != SharingTimeSlicing && m != SharingMPS && len(c.Sharing) == 1:
			return []error{fmt.Errorf("config: sharing = %q: want %q or %q", m, SharingTimeSlicing, SharingMPS)}
		case m != SharingTimeSlicing && m != SharingMPS:
			return []error{fmt.Errorf("config: sharing = %s: %q: want %q or %q", c.Sharing, m, SharingTimeSlicing, SharingMPS)}
		case slices.Index(c.Sharing, m) < i:
			return []error{fmt.Errorf("config: sharing = %s: %q named twice", c.Sharing, m)}
		}
		ts, mps = ts || m == SharingTimeSlicing, mps || m == SharingMPS
	}
	if len(c.Sharing) == 0 {
		ts = true
	}
	if !mps {
		if c.Replicas != 0 && (c.Replicas < 2 || c.Replicas > MaxReplicas) {
			errs = append(errs, fmt.Errorf("config: replicas = %d: want 2 to %d, or 0 for none", c.Replicas, MaxReplicas))
		}
		if len(c.Sharing) > 0 && c.Replicas == 0 {
			errs = append(errs, fmt.Errorf("config: sharing = %s: needs replicas, the shares per GPU", c.Sharing))
		}
		s.replicas = c.Replicas
		for key, set := range map[string]bool{"mps_isolation": c.MPSIsolation != "", "mps_isolation_allowed": c.MPSIsolationAllowed != nil,
			"mps_dir": c.MPSDir != "", "mps_control": c.MPSControl != ""} {
			if set {
				errs = append(errs, fmt.Errorf("config: %s: only valid with sharing = %q", key, SharingMPS))
			}
		}
		slices.SortFunc(errs, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) })
		return errs
	}
	if ts {
		s.replicas = c.Replicas // both: as many replicas as MPS shares, bounded below
	}
	if c.Replicas < 2 || c.Replicas > MaxMPSShares {
		errs = append(errs, fmt.Errorf("config: replicas = %d: sharing = %s wants 2 to %d shares per device (an MPS server's clients)", c.Replicas, c.Sharing, MaxMPSShares))
	} else if c.MIG == MIGOnDemand && c.Replicas > MaxOnDemandMPSShares {
		errs = append(errs, fmt.Errorf("config: replicas = %d: sharing = %s with mig = %q wants 2 to %d shares per placement (each placement of each profile is offered in shares: more would pass the host's bound of 4096 devices per fingerprint on an 8-GPU machine)",
			c.Replicas, c.Sharing, MIGOnDemand, MaxOnDemandMPSShares))
	}
	m := mpsSettings{shares: c.Replicas, isolation: MPSShared, dir: c.MPSDir, control: c.MPSControl, allowed: []string{MPSShared, MPSPerHolder}}
	switch c.MPSIsolation {
	case "", MPSShared:
	case MPSPerHolder:
		m.isolation = MPSPerHolder
	default:
		errs = append(errs, fmt.Errorf("config: mps_isolation = %q: want %q or %q", c.MPSIsolation, MPSShared, MPSPerHolder))
	}
	if c.MPSIsolationAllowed != nil {
		allowed, err := parseIsolations(c.MPSIsolationAllowed)
		switch {
		case err != nil:
			errs = append(errs, err)
		case !slices.Contains(allowed, m.isolation):
			errs = append(errs, fmt.Errorf("config: mps_isolation_allowed = %s leaves out mps_isolation = %q, the isolation of a Reserve that asks for none; set mps_isolation to one it allows",
				quoteList(c.MPSIsolationAllowed), m.isolation))
		default:
			m.allowed = allowed
		}
	}
	switch {
	case m.dir == "" && c.Simulate != "":
		m.dir = DefaultSimMPSDir(c.Simulate)
	case m.dir == "":
		m.dir = DefaultMPSDir
	case !filepath.IsAbs(m.dir):
		errs = append(errs, fmt.Errorf("config: mps_dir = %q: must be an absolute path", m.dir))
	case len(filepath.Clean(m.dir)) > maxMPSDir:
		errs = append(errs, fmt.Errorf("config: mps_dir = %q: %d bytes, at most %d: the control pipes under it must fit a Unix socket path", m.dir, len(filepath.Clean(m.dir)), maxMPSDir))
	default:
		m.dir = filepath.Clean(m.dir)
	}
	if m.control != "" && !filepath.IsAbs(m.control) {
		errs = append(errs, fmt.Errorf("config: mps_control = %q: must be an absolute path", m.control))
	}
	s.mps = m
	return errs
}

// parseLayout reads mig_layout: a profile name, or an object from GPU index to a
// non-empty list of profile names. Whether the GPUs offer those profiles is checked
// when the layout is applied.
func parseLayout(raw json.RawMessage, s *settings) []error {
	var all string
	if err := json.Unmarshal(raw, &all); err == nil {
		if strings.TrimSpace(all) == "" {
			return []error{errors.New("config: mig_layout: empty profile name")}
		}
		s.layoutAll = all
		return nil
	}
	var byIndex map[string][]string
	if err := json.Unmarshal(raw, &byIndex); err != nil {
		return []error{fmt.Errorf("config: mig_layout = %s: want a profile name or an object from GPU index to a list of profile names", raw)}
	}
	var errs []error
	s.layout = make(map[int][]string)
	for _, k := range slices.Sorted(maps.Keys(byIndex)) {
		i, err := strconv.Atoi(k)
		if err != nil || i < 0 {
			errs = append(errs, fmt.Errorf("config: mig_layout[%q]: want a GPU index (0, 1, ...)", k))
			continue
		}
		if len(byIndex[k]) == 0 {
			errs = append(errs, fmt.Errorf("config: mig_layout[%q]: empty list of profiles", k))
		}
		for j, p := range byIndex[k] {
			if strings.TrimSpace(p) == "" {
				errs = append(errs, fmt.Errorf("config: mig_layout[%q][%d]: empty profile name", k, j))
			}
		}
		s.layout[i] = byIndex[k]
	}
	return errs
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
	if f.RecoveryAction != "" {
		a, ok := RecoveryActions[f.RecoveryAction]
		if !ok {
			errs = append(errs, fmt.Errorf("config: %s.recovery_action = %q: want one of %s", key, f.RecoveryAction,
				strings.Join(slices.Sorted(maps.Keys(RecoveryActions)), ", ")))
		}
		spec.action = &a
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

// parseIsolations checks mps_isolation_allowed: one or both of MPSShared and
// MPSPerHolder, none repeated.
func parseIsolations(list []string) ([]string, error) {
	var out []string
	for _, v := range list {
		switch {
		case v != MPSShared && v != MPSPerHolder:
			return nil, fmt.Errorf("config: mps_isolation_allowed = %s: %q is not an isolation; want %q, %q or both", quoteList(list), v, MPSShared, MPSPerHolder)
		case slices.Contains(out, v):
			return nil, fmt.Errorf("config: mps_isolation_allowed = %s: %q is listed twice", quoteList(list), v)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("config: mps_isolation_allowed = []: allows no isolation; leave it out for both")
	}
	return out, nil
}

// quoteList writes a list of strings as a config does: ["a", "b"].
func quoteList(list []string) string {
	q := make([]string, len(list))
	for i, s := range list {
		q[i] = strconv.Quote(s)
	}
	return "[" + strings.Join(q, ", ") + "]"
}
