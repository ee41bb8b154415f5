// Package validate holds pure functions that check what crosses a trust boundary: plugin
// output (in the plugin protocol's types, before anything is converted or stored) and
// host API requests (in the contract's domain types). Each returns nil or the errors.Join
// of every violation found (up to MaxViolations): *Violation or *device.FieldError values
// naming the item and one of the Rule constants (StreamFilter and StatsInterval, whose
// rules are limits, state the limit instead), so callers can test errors.Is(err, RuleX)
// and list them with Violations. The functions keep no state, do not modify their input,
// are safe for concurrent use, and their work is bounded by the Max* limits.
// See docs/plugins.md#what-a-plugin-cannot-do-to-the-agent.
package validate

import (
	"time"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Fingerprint checks a plugin's fingerprint. It reports:
//   - a nil response or nil group or device (RuleMissing);
//   - per group: vendor, type and name non-empty, at most MaxNameLen bytes, valid UTF-8
//     and printable; no two groups with the same vendor, type and name (RuleDuplicate);
//     at most MaxAttributes attributes;
//   - per attribute: a name like a group's vendor; a value with its kind set, a finite
//     float, a string of at most MaxStringValueLen valid UTF-8 bytes, a unit in
//     KnownUnits;
//   - per device: an ID like a group's vendor and unique across the whole response
//     (RuleDuplicate, with where it was first seen); a health value of the enum; a
//     health reason of at most MaxStringValueLen valid UTF-8 bytes; a NUMA node of -1
//     or more; a PCI bus ID either empty or dddd:bb:dd.f (or NVML's
//     dddddddd:bb:dd.f);
//   - more than MaxGroups groups, MaxDevicesPerGroup devices in a group, or MaxDevices
//     devices in all;
//   - shared capacity: more than MaxCounterSets counter sets; a set with a name like a
//     device ID, unique (RuleDuplicate), 1 to MaxCountersPerSet counters named like
//     attributes, each capacity 0 to MaxCounterValue (RuleCounterRange); per device at
//     most MaxConsumptions consumptions, each of a declared set (RuleUnknownCounterSet)
//     named once, of counters the set has (RuleUnknownCounter), each use 0 to the
//     counter's capacity (RuleCounterRange, RuleOverCapacity). Sets are the plugin's
//     own (the host keys them by plugin), so no set spans two plugins, and a set
//     refers to nothing, so there are no cycles;
//   - an encoded size over MaxFingerprintBytes (RuleTooLarge on item "fingerprint").
//
// An unhealthy device without a reason is not a violation: rejecting the fingerprint
// would keep the last good inventory, which may show that device healthy, a worse
// outcome than a missing reason. The caller fills in a reason of its own.
func Fingerprint(resp *pb.FingerprintResponse) error { return fingerprint(resp) }

// Stats checks a plugin's stats message; known reports whether a device ID is one the
// plugin fingerprinted (nil means none is). It reports a nil response or entry; an
// empty, unknown (RuleUnknownDevice) or repeated (RuleDuplicate) device ID; an invalid
// timestamp; an encoded size over MaxStatsBytes (RuleTooLarge on item "stats"); more
// than MaxDevices entries or MaxStatsValues values in one; and each
// value's name and value by the rules of Fingerprint's attributes (no NaN or Inf,
// known units, valid UTF-8, kind set); more than MaxProcessesPerDevice processes of a
// device, a nil one, a pid 0 (RuleEmpty) or repeated (RuleDuplicate), used_bytes
// outside 0 to MaxCounterValue (RuleCounterRange).
func Stats(resp *pb.StatsResponse, known func(deviceID string) bool) error {
	return stats(resp, known)
}

// Reservation checks a plugin's answer to Reserve(requested). It reports:
//   - a nil reservation, mount or device node (RuleMissing);
//   - an env name that is not [A-Za-z_][A-Za-z0-9_]* (RuleEnvName), is longer than
//     MaxNameLen, or that EnvDenied rejects (RuleEnvDenied); an env value longer than
//     MaxEnvValueLen, not valid UTF-8 or holding a NUL;
//   - a mount or device node path, host or container side, that is empty, longer than
//     MaxPathLen, not valid UTF-8, holds a NUL, is relative (RuleNotAbsolute), has a
//     ".." element (RuleDotDot) or is not clean (RuleNotClean);
//   - device node permissions that are empty or not a subset of "rwm" without repeats
//     (RulePermissions);
//   - a CDI device name that is not vendor.tld/class=name (RuleCDIName) or whose name
//     part is not one of requested (RuleNotRequested);
//   - more than MaxEnvs envs, MaxMounts mounts, MaxDeviceNodes device nodes or
//     MaxCDIDevices CDI names.
func Reservation(res *pb.ContainerReservation, requested []string) error {
	return reservation(res, requested)
}

// ReserveRequest checks a host API Reserve request; violations are *device.FieldError
// (so errors.Is(err, device.ErrInvalidRequest) holds) with the proto field names
// "owner_id", "vendor", "type", "name", "device_ids" and "device_ids[i]", and a Rule
// that starts with one of the Rule constants. owner_id, vendor, type, name and every
// device ID must be non-empty, at most MaxNameLen bytes, valid UTF-8 and printable;
// owner_id must also not be blank or start or end with a space (RuleSpaces);
// device_ids must hold 1 to MaxDevicesPerGroup IDs, none repeated.
// take_over_owner_prefixes may hold up to MaxTakeOverPrefixes prefixes, none repeated,
// reported as "take_over_owner_prefixes[i]": each follows owner_id's rules, ends with
// "/", does not start with "/" and has no empty segment (RuleOwnerPrefix).
// plugin_options may hold up to device.MaxPluginOptions options, reported as
// "plugin_options[key]": each key matches device.PluginOptionKeyPattern
// (RuleOptionKey), each value is at most device.MaxPluginOptionLen bytes, valid UTF-8
// and printable; not with admin_access (RuleAdminTakeOver, on "plugin_options").
func ReserveRequest(req device.ReserveRequest) error { return reserveRequest(req) }

// ReleaseRequest checks a host API Release request; violations are *device.FieldError.
// Exactly one of reservation_id and owner_id must be set (RuleExactlyOne, reported on
// "reservation_id"); the one set must be at most MaxNameLen bytes, valid UTF-8 and
// printable, and an owner_id not blank or space-padded (RuleSpaces).
func ReleaseRequest(req device.ReleaseRequest) error { return releaseRequest(req) }

// ReownRequest checks a host API ReownReservation request; violations are
// *device.FieldError. reservation_id, owner_id and new_owner_id must be set and follow
// ReserveRequest's rules for IDs; both owners must also not be blank or space-padded
// (RuleSpaces).
func ReownRequest(req device.ReownRequest) error { return reownRequest(req) }

// CordonRequest checks a host API CordonDevice request; violations are
// *device.FieldError. device_id must be set and follow ReserveRequest's rules for IDs;
// reason must be set, printable, at most MaxNameLen bytes, and not blank or
// space-padded.
func CordonRequest(req device.CordonRequest) error { return cordonRequest(req) }

// EventFilter checks a host API WatchEvents request's filters; violations are
// *device.FieldError. owner_id and device_id may be empty but otherwise follow
// ReserveRequest's rules for IDs.
func EventFilter(f device.EventFilter) error { return eventFilter(f) }

// UncordonRequest checks the device_id of a host API UncordonDevice request by
// CordonRequest's rule for it; a violation is a *device.FieldError.
func UncordonRequest(deviceID string) error { return uncordonRequest(deviceID) }

// ReservationFilter checks a host API ListReservations filter; violations are
// *device.FieldError. owner_id and device_id may be empty but otherwise follow
// ReserveRequest's rules for IDs; state must be one of the ReservationState values
// (RuleState).
func ReservationFilter(f device.ReservationFilter) error { return reservationFilter(f) }

// StreamFilter checks the filter lists of a host API Fingerprint or Stats request, by
// their lengths, so that a request is refused before its lists are converted: at most
// MaxStreamFilters group filters ("groups") and MaxStreamFilters plugin names
// ("plugins"). Violations are *device.FieldError.
func StreamFilter(groups, plugins int) error { return streamFilter(groups, plugins) }

// StatsInterval checks the interval of a host API Stats request ("interval"): not
// negative and at most MaxStatsInterval; zero asks for the agent's own. A violation is
// a *device.FieldError.
func StatsInterval(d time.Duration) error { return statsInterval(d) }
