package validate

import (
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/textline"
)

// Limits on plugin output and requests. A list over its limit is reported once with
// RuleTooMany and only its first Max* entries are checked further, so the work (and the
// error) stays bounded however large the input is.
const (
	// MaxGroups bounds the device groups in one fingerprint.
	MaxGroups = 256
	// MaxDevicesPerGroup bounds the devices in one group, and the device IDs of one
	// Reserve request (a request names devices of a single group).
	MaxDevicesPerGroup = 1024
	// MaxDevices bounds the devices in one fingerprint, all groups together, and the
	// device entries in one stats message.
	MaxDevices = 4096
	// MaxAttributes bounds the attributes of one group.
	MaxAttributes = 64
	// MaxStatsValues bounds the values of one device in one stats message.
	MaxStatsValues = 128
	// MaxProcessesPerDevice bounds the processes of one device in one stats message.
	MaxProcessesPerDevice = 64
	// MaxNameLen bounds, in bytes, every name and ID: vendor, type, model name, device
	// IDs, attribute and metric names, env names, CDI device names, owner and
	// reservation IDs.
	MaxNameLen = 256
	// MaxStringValueLen bounds, in bytes, a string attribute or stats value and a health
	// reason.
	MaxStringValueLen = 1024
	// MaxEnvs bounds the env vars of one reservation.
	MaxEnvs = 256
	// MaxEnvValueLen bounds, in bytes, one env value. It leaves room for a list of a
	// thousand device UUIDs, as NVIDIA_VISIBLE_DEVICES can hold.
	MaxEnvValueLen = 64 << 10
	// MaxMounts bounds the mounts of one reservation.
	MaxMounts = 256
	// MaxDeviceNodes bounds the device nodes of one reservation: one per device plus
	// the control nodes a driver needs (nvidiactl, nvidia-uvm...).
	MaxDeviceNodes = 2 * MaxDevicesPerGroup
	// MaxCDIDevices bounds the CDI device names of one reservation.
	MaxCDIDevices = MaxDevicesPerGroup
	// MaxDeviceCDINames bounds the CDI names a plugin reports for one device in its
	// fingerprint (Device.cdi_devices): what an admin access hands out.
	MaxDeviceCDINames = 8
	// MaxPathLen bounds, in bytes, a mount or device node path (Linux PATH_MAX).
	MaxPathLen = 4096
	// MaxTakeOverPrefixes bounds the owner prefixes one Reserve may take devices over
	// from: the contract's limit.
	MaxTakeOverPrefixes = device.MaxTakeOverPrefixes
	// MaxStreamFilters bounds each filter list (groups, plugins) of one Fingerprint or
	// Stats request: matching costs groups × filters on every change, for every
	// distinct filter.
	MaxStreamFilters = 64
	// MaxCounterSets bounds the counter sets (shared capacity) of one fingerprint: one
	// per GPU is the common case.
	MaxCounterSets = 1024
	// MaxCountersPerSet bounds the counters of one set: a GPU's 8 memory slices, its
	// compute slices and a few more.
	MaxCountersPerSet = 64
	// MaxConsumptions bounds the counter sets one device consumes from.
	MaxConsumptions = 16
	// MaxCounterValue bounds a counter's capacity and a device's use of it, so that
	// the sum over every device of a fingerprint (MaxDevices) cannot overflow an int64.
	MaxCounterValue = 1 << 50

	// MaxFingerprintBytes bounds the encoded size (protobuf wire bytes) of one plugin's
	// fingerprint message, and MaxStatsBytes of one plugin's stats message. Every other
	// limit can be met by a message too big for the host's clients (4 MiB is gRPC's
	// default receive limit, grpcurl's and the CLI's included): 256 groups of 16 devices
	// with attributes within their limits came to 4,254,525 bytes. These caps keep one
	// plugin's share small enough that several plugins fit into one host API message;
	// the manager bounds the sum over plugins.
	MaxFingerprintBytes = 512 << 10
	MaxStatsBytes       = 512 << 10
)

// MaxStatsInterval is the longest interval a Stats request may ask for.
const MaxStatsInterval = 24 * time.Hour

// Unit says what a known unit measures: the base unit of its quantity, and what one of
// the unit is in that base unit.
type Unit struct {
	// Base is the quantity's base unit, named as Prometheus' conventions name it
	// ("bytes", "bytes_per_second", "hertz", "watts", "volts", "celsius", "seconds",
	// "ratio"; "rpm", which the conventions lack), or "" for a plain number (no unit,
	// or a count).
	Base string
	// Factor is one of the unit in Base: 1 KiB is 1024 bytes, 1 % is 0.01 ratio.
	Factor float64
}

// knownUnits is the one table of units: the set behind KnownUnits, KnownUnit and
// LookupUnit.
var knownUnits = map[string]Unit{
	"": {"", 1}, "count": {"", 1},
	"%": {"ratio", 0.01},
	"B": {"bytes", 1}, "KiB": {"bytes", 1 << 10}, "MiB": {"bytes", 1 << 20}, "GiB": {"bytes", 1 << 30}, "TiB": {"bytes", 1 << 40},
	"KB": {"bytes", 1e3}, "MB": {"bytes", 1e6}, "GB": {"bytes", 1e9},
	"MB/s": {"bytes_per_second", 1e6}, "GB/s": {"bytes_per_second", 1e9},
	"MHz": {"hertz", 1e6}, "GHz": {"hertz", 1e9},
	"W": {"watts", 1}, "mW": {"watts", 1e-3},
	"V": {"volts", 1}, "mV": {"volts", 1e-3},
	"C":  {"celsius", 1}, // degrees Celsius
	"ns": {"seconds", 1e-9}, "us": {"seconds", 1e-6}, "ms": {"seconds", 1e-3}, "s": {"seconds", 1},
	"rpm": {"rpm", 1},
}

// KnownUnits returns, sorted, the units an attribute or stats value may carry; ""
// means unitless. The slice is a fresh copy.
func KnownUnits() []string {
	out := make([]string, 0, len(knownUnits))
	for u := range knownUnits {
		out = append(out, u)
	}
	slices.Sort(out)
	return out
}

// KnownUnit reports whether unit is one of KnownUnits.
func KnownUnit(unit string) bool {
	_, ok := knownUnits[unit]
	return ok
}

// LookupUnit returns what unit measures; ok is false when it is not one of KnownUnits.
func LookupUnit(unit string) (u Unit, ok bool) {
	u, ok = knownUnits[unit]
	return u, ok
}

// The env deny list. A plugin is untrusted and its envs are set in every container that
// gets its devices, so it must not set anything that changes which code runs there or
// what that code trusts:
//   - deniedEnvPrefixes: the dynamic loaders' whole namespaces, LD_ (glibc and musl:
//     LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, LD_DEBUG_OUTPUT...; new ones appear, so a
//     prefix rather than a list) and DYLD_ (macOS), and GLIBC_ (GLIBC_TUNABLES, the
//     CVE-2023-4911 vector).
//   - deniedEnvNames: the rest of glibc's own "unsecure" list (the vars it drops for
//     setuid programs because they load code or redirect trusted files: GCONV_PATH,
//     LOCPATH, NLSPATH, HOSTALIASES, RES_OPTIONS...); PATH, which picks the binary the
//     container's command resolves to; and the startup hooks of the shells and
//     interpreters a container commonly runs (BASH_ENV, ENV, PS4 with SHELLOPTS=xtrace,
//     PYTHONPATH, NODE_OPTIONS, JAVA_TOOL_OPTIONS...), each a way to run code.
//
// Device plugins legitimately set vendor variables (NVIDIA_VISIBLE_DEVICES,
// CUDA_VISIBLE_DEVICES...), none of which is on the list. Names are compared exactly:
// env names are case-sensitive on Linux.
var (
	deniedEnvPrefixes = []string{"LD_", "DYLD_", "GLIBC_"}
	deniedEnvNames    = map[string]bool{
		// glibc unsecvars.h, less the LD_ ones.
		"GCONV_PATH": true, "GETCONF_DIR": true, "HOSTALIASES": true, "LOCALDOMAIN": true,
		"LOCPATH": true, "MALLOC_TRACE": true, "NIS_PATH": true, "NLSPATH": true,
		"RESOLV_HOST_CONF": true, "RES_OPTIONS": true, "TMPDIR": true, "TZDIR": true,
		// Command lookup.
		"PATH": true,
		// Shell startup and tracing hooks.
		"BASH_ENV": true, "ENV": true, "SHELLOPTS": true, "BASHOPTS": true, "PS4": true,
		"PROMPT_COMMAND": true, "IFS": true, "CDPATH": true,
		// Interpreter startup hooks and module paths.
		"PYTHONPATH": true, "PYTHONHOME": true, "PYTHONSTARTUP": true, "PYTHONUSERBASE": true,
		"PERL5LIB": true, "PERLLIB": true, "PERL5OPT": true,
		"RUBYLIB": true, "RUBYOPT": true,
		"NODE_OPTIONS": true, "NODE_PATH": true,
		"JAVA_TOOL_OPTIONS": true, "_JAVA_OPTIONS": true, "JDK_JAVA_OPTIONS": true, "CLASSPATH": true,
	}
)

// DeniedEnvPrefixes returns the name prefixes a plugin may not set (see EnvDenied). The
// slice is a fresh copy.
func DeniedEnvPrefixes() []string { return slices.Clone(deniedEnvPrefixes) }

// DeniedEnvNames returns, sorted, the exact names a plugin may not set besides the
// prefixes (see EnvDenied). The slice is a fresh copy.
func DeniedEnvNames() []string {
	out := make([]string, 0, len(deniedEnvNames))
	for n := range deniedEnvNames {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// EnvDenied reports whether a plugin may not set the env var name: it starts with one of
// DeniedEnvPrefixes or is one of DeniedEnvNames.
func EnvDenied(name string) bool {
	if deniedEnvNames[name] {
		return true
	}
	for _, p := range deniedEnvPrefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// validEnvName reports whether name matches [A-Za-z_][A-Za-z0-9_]*.
func validEnvName(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c == '_', 'A' <= c && c <= 'Z', 'a' <= c && c <= 'z':
		case '0' <= c && c <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}

// checkName checks an identifier: non-empty, at most MaxNameLen bytes, valid UTF-8,
// printable.
func (c *collector) checkName(item, s string) {
	if s == "" {
		c.add(item, RuleEmpty, "")
		return
	}
	c.checkText(item, s, MaxNameLen)
	if utf8.ValidString(s) && !textline.Printable(s) {
		c.add(item, RuleNotPrintable, "")
	}
}

// checkText checks free text (which may be empty): at most limit bytes, valid UTF-8.
func (c *collector) checkText(item, s string, limit int) {
	if len(s) > limit {
		c.add(item, RuleTooLong, tooLong(len(s), limit))
	}
	if !utf8.ValidString(s) {
		c.add(item, RuleInvalidUTF8, "")
	}
}
