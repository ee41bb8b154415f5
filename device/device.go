// Package device is the device manager's contract: the Manager interface, the domain
// types it speaks in (Inventory, static; State and Stats, dynamic), the Factory that
// builds one, and the sentinel errors callers test with errors.Is. It imports only the
// standard library and hclog, so the gRPC server, a simulator or a test double can
// depend on it without the real manager. Every value a Manager hands out is immutable
// once returned: it may be shared between goroutines and must not be modified.
//
// See docs/api.md#the-server-serves-any-manager.
package device

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
)

// Manager owns a node's devices through their plugins.
//
// All methods are safe for concurrent use. Watch channels are closed when their context
// ends or the manager shuts down; the manager never blocks on a slow reader.
//
// Requests reach a Manager already checked: the host API's server, the trust boundary,
// validates each one (package validate: ReserveRequest, ReleaseRequest, ReownRequest,
// ReservationFilter) before it calls the Manager, so an implementation does not check
// them again. The ErrInvalidRequest a Manager returns is about state (a released
// reservation, another owner's), not about the request's shape.
type Manager interface {
	// Inventory returns the current static inventory of every plugin.
	Inventory() Inventory
	// State returns current device health and holders, and plugin status.
	State() State
	// Snapshot returns the current inventory and state together, consistent with each
	// other, as Watch delivers them: what a reader of both (a metrics scrape) asks for
	// rather than Inventory and State apart, which a change between them could split.
	Snapshot() Snapshot
	// LatestStats returns the latest stats the manager holds for every plugin, grouped
	// as WatchStats delivers them, without asking any plugin or waiting for the next
	// sample: a caller that polls (a metrics scrape) costs the plugins nothing however
	// often it asks.
	LatestStats() StatsSnapshot
	// Watch delivers a Snapshot at once and then on every change. Delivery is
	// latest-value: a reader that falls behind gets the newest snapshot, never a backlog.
	// The channel is closed when ctx ends or the manager shuts down.
	Watch(ctx context.Context) <-chan Snapshot
	// WatchStats delivers the latest stats of every plugin each interval (rounded up to
	// the manager's sampling interval; zero means the sampling interval). Latest-value
	// delivery, closed like Watch.
	WatchStats(ctx context.Context, interval time.Duration) <-chan StatsSnapshot
	// Reserve reserves devices of one group for an owner and returns the reservation,
	// durable before it returns. Errors wrap ErrInvalidRequest, ErrUnknownDevice,
	// ErrUnhealthyDevice, ErrDeviceHeld, ErrOptionsDiffer, ErrPluginUnavailable or
	// ErrPluginResponse; a held device is a *HeldError naming the holders, and a plugin
	// that refuses the request (req.PluginOptions it does not take) ErrInvalidRequest
	// with its message. A retry (same owner, exactly the devices it holds) gets the
	// reservation back when it carries the same PluginOptions, an *OptionsDifferError
	// otherwise. With
	// req.TakeOverOwnerPrefixes, holders of those owners are released atomically with
	// the new reservation's record, and their IDs come back in Reservation.TakenOver.
	Reserve(ctx context.Context, req ReserveRequest) (Reservation, error)
	// Release ends the reservations named by req, durably before it returns, and says
	// which of them this call released and which were released already. It is
	// idempotent: releasing an already released reservation is not an error, lists it
	// in AlreadyReleased and keeps its first release time. An unknown reservation ID
	// wraps ErrNotFound; an owner with no reservations gives an empty result.
	Release(ctx context.Context, req ReleaseRequest) (ReleaseResult, error)
	// Reservations lists the ledger's reservations that match f.
	Reservations(ctx context.Context, f ReservationFilter) ([]Reservation, error)
	// Reown hands the live reservation req names from req.OwnerID to req.NewOwnerID,
	// durably before it returns, and returns it: the same ID, devices and container
	// data, another owner (for a runtime that learns who the allocation is only after
	// Reserve, as the kubelet's device plugins do). Reowning to the owner it already has
	// is not an error. An unknown reservation ID wraps ErrNotFound; a released
	// reservation, or one whose owner is not req.OwnerID, is a *FieldError.
	Reown(ctx context.Context, req ReownRequest) (Reservation, error)
	// Cordon takes a known device out of service, durably before it returns: it keeps
	// its holder, but Reserve refuses it to any new one (a *CordonedError) and the
	// snapshots show the cordon, whatever the device's health, until Uncordon.
	// Cordoning a cordoned device replaces its cordon. An unknown device wraps
	// ErrUnknownDevice.
	Cordon(ctx context.Context, req CordonRequest) (Cordon, error)
	// Uncordon lifts a device's cordon, durably before it returns, and returns it; nil
	// when the device was not cordoned (not an error).
	Uncordon(ctx context.Context, deviceID string) (*Cordon, error)
	// Events returns a page of the audit trail (every change to the ledger and to the
	// cordons, with who made it), oldest first, from the events the ledger still holds
	// (bounded by count and age).
	Events(ctx context.Context, f EventFilter) (EventsResult, error)
	// EventsAfter returns a channel closed once the trail holds an event with a Seq
	// larger than seq (at once if it does), or the manager shuts down.
	EventsAfter(seq uint64) <-chan struct{}
	// Ready is closed once every configured plugin has fingerprinted, failed, or
	// exceeded the readiness timeout.
	Ready() <-chan struct{}
	// Shutdown stops every plugin and goroutine the manager started and closes every
	// watch channel. It returns when all of them are gone or ctx ends.
	Shutdown(ctx context.Context) error
}

// Factory builds a Manager. cmd/devicehost passes one that wraps manager.New with the
// configuration it read; tests and simulators pass their own.
type Factory func(log hclog.Logger) (Manager, error)

// GroupKey names a group of identical devices.
type GroupKey struct {
	Vendor string // e.g. "nvidia"
	Type   string // e.g. "gpu"
	Name   string // model, e.g. "NVIDIA H100 80GB HBM3"
}

// String renders the key as vendor/type/name.
func (k GroupKey) String() string { return k.Vendor + "/" + k.Type + "/" + k.Name }

// ValueKind says which field of a Value is set.
type ValueKind int

// The kinds of Value. The zero value is an unset value.
const (
	KindUnset ValueKind = iota
	KindInt
	KindFloat
	KindString
	KindBool
)

// Value is a typed attribute or statistic with an optional unit ("MiB", "W", "%"...).
type Value struct {
	Kind  ValueKind
	Int   int64
	Float float64
	Str   string
	Bool  bool
	Unit  string
}

// Locality says where a device sits on the machine.
type Locality struct {
	PCIBusID string // e.g. "0000:17:00.0"; empty when unknown
	NUMANode int    // -1 when unknown
}

// Inventory is the static description of every plugin's devices.
type Inventory struct {
	Groups []Group // sorted by plugin, then GroupKey
	// CounterSets is the shared capacity the plugins declare (GPU partitioning), sorted
	// by plugin, then name.
	CounterSets []CounterSet
}

// CounterSet is capacity that several devices of one plugin share, e.g. one GPU's
// memory and compute slices, which the whole GPU and each of its partitions consume.
type CounterSet struct {
	Key      CounterSetKey
	Capacity map[string]int64 // per counter
}

// Group is a set of identical devices owned by one plugin.
type Group struct {
	GroupKey
	Plugin     string
	Attributes map[string]Value
	Devices    []DeviceInfo // sorted by ID
}

// DeviceInfo is the static part of one device.
type DeviceInfo struct {
	ID       string
	Locality Locality
	// Consumes is what holding the device uses of its plugin's counter sets, sorted by
	// set name; empty when it shares nothing.
	Consumes []Consumption
	// CDIDevices are the CDI names (kind=name) the plugin says expose the device to a
	// container; empty when it keeps no CDI spec. What an admin access hands out.
	CDIDevices []string
	// NothingToRelease: the plugin's Reserve keeps nothing for the device that its
	// Release would clean up, so the host's cleanup after a reservation leaves the
	// device out of the plugin's Release (and makes no call for a reservation of only
	// such devices).
	NothingToRelease bool
}

// Health of a device. The zero value is HealthUnknown.
type Health int

// Device health values.
const (
	HealthUnknown Health = iota
	HealthHealthy
	HealthUnhealthy
)

// String returns "unknown", "healthy" or "unhealthy".
func (h Health) String() string {
	switch h {
	case HealthHealthy:
		return "healthy"
	case HealthUnhealthy:
		return "unhealthy"
	default:
		return "unknown"
	}
}

// State is the dynamic state of every device and plugin.
type State struct {
	Devices map[string]DeviceState // by device ID
	Plugins []PluginState          // sorted by name
	// CounterUse is what live reservations use of each counter set, per counter
	// (counters none uses are absent).
	CounterUse map[CounterSetKey]map[string]int64
}

// DeviceState is the dynamic part of one device.
type DeviceState struct {
	Health Health
	Reason string    // why it is not healthy; empty when healthy
	Since  time.Time // when Health last changed
	Holder *Holder   // the live reservation holding it; nil when free
	// BlockedBy, for a free device that consumes shared counters, are the live
	// reservations whose use of a counter leaves too little of it for this device:
	// it cannot be reserved until they are released. Sorted by reservation ID.
	BlockedBy []Holder
	// Cordon is set while the device is cordoned (Manager.Cordon).
	Cordon *Cordon
	// AdminAccess are the live admin accesses of the device (ReserveRequest.AdminAccess),
	// sorted by ID; they are not holders.
	AdminAccess []Holder
}

// AdminAccess is a live admin access (ReserveRequest.AdminAccess): an owner that sees
// devices without holding them.
type AdminAccess struct {
	ID         string // "acc-" and 16 hex digits
	OwnerID    string
	Group      GroupKey
	Plugin     string // the devices' plugin when the access was given
	DeviceIDs  []string
	CDIDevices []string // what the owner was handed: the devices' CDI names
	Since      time.Time
	By         string // who asked: the caller's listener and peer
}

// Reservation is a as a listing shows it (Reservation.AdminAccess set): live, holding
// nothing, its container reservation the CDI names it handed out.
func (a AdminAccess) Reservation() Reservation {
	return Reservation{ID: a.ID, OwnerID: a.OwnerID, Group: a.Group, Plugin: a.Plugin, DeviceIDs: a.DeviceIDs,
		Container: ContainerReservation{Envs: map[string]string{}, CDIDevices: a.CDIDevices},
		State:     ReservationActive, CreatedAt: a.Since, AdminAccess: true}
}

// Cordon is a device taken out of service by an operator.
type Cordon struct {
	Reason string    // why, as the operator said it
	By     string    // who: the caller's listener and peer
	Since  time.Time // when
	Drain  bool      // the holder's runtime is asked to let go where a path can
}

// CordonRequest names a device to cordon, why and by whom.
type CordonRequest struct {
	DeviceID string
	Reason   string
	By       string
	Drain    bool
}

// Holder names the live reservation that holds a device.
type Holder struct {
	ReservationID string
	OwnerID       string
	// OwnerLabels are the reservation's (ReserveRequest.OwnerLabels).
	OwnerLabels OwnerLabels
}

// PluginStatus is where a plugin is in its life. The zero value is PluginStarting.
type PluginStatus int

// Plugin status values.
const (
	PluginStarting PluginStatus = iota
	PluginRunning
	PluginRestarting
	PluginFailed
)

// String returns "starting", "running", "restarting" or "failed".
func (s PluginStatus) String() string {
	switch s {
	case PluginRunning:
		return "running"
	case PluginRestarting:
		return "restarting"
	case PluginFailed:
		return "failed"
	default:
		return "starting"
	}
}

// PluginState is the dynamic state of one plugin.
type PluginState struct {
	Name        string
	Version     string
	Path        string
	Status      PluginStatus
	Restarts    int
	LastError   string
	LastErrorAt time.Time
	NextRetry   time.Time // zero unless Status is PluginRestarting
	DeviceCount int
}

// Snapshot is one consistent view of the inventory and its state, as Watch delivers it.
type Snapshot struct {
	Seq       uint64 // grows by one or more with every change
	Time      time.Time
	Inventory Inventory
	State     State
}

// StatsSnapshot is the latest stats of every plugin, as WatchStats delivers it.
type StatsSnapshot struct {
	Time   time.Time
	Groups []GroupStats
}

// GroupStats holds the stats of one group's devices.
type GroupStats struct {
	GroupKey
	Plugin  string
	Devices []DeviceStats
}

// DeviceStats holds the sampled values of one device.
type DeviceStats struct {
	ID     string
	Values map[string]Value // by metric name, e.g. "gpu_utilization"
	Time   time.Time        // when the plugin sampled them
	// Processes are the processes on the device and the memory each uses, where the
	// plugin reports them (validated: at most 64, PIDs unique and not 0).
	Processes []ProcessMemory
}

// ProcessMemory is one process on a device: its PID (the host's PID namespace), the
// device memory it uses and, where the plugin reports it (HasSMUtil), the share of the
// device's SMs it kept busy over the plugin's last sample (SMUtil, 0 to 100 %).
type ProcessMemory struct {
	PID       uint32
	UsedBytes int64
	SMUtil    uint32
	HasSMUtil bool
}

// ReserveRequest asks for devices of one group for one owner.
type ReserveRequest struct {
	OwnerID   string
	Group     GroupKey
	DeviceIDs []string
	// TakeOverOwnerPrefixes, when set, lets the Reserve take the devices over from live
	// reservations whose owner starts with one of these prefixes (each ends with "/"):
	// they are released in the same durable write that records the new reservation,
	// all or nothing, with their plugin cleanup owed as after a Release. A holder of
	// any other owner still refuses the Reserve (a *HeldError naming only such
	// holders), and then nothing is released. Until that write the taken-over
	// reservations keep holding their devices. Empty: nothing is taken over. At most
	// MaxTakeOverPrefixes.
	TakeOverOwnerPrefixes []string
	// AdminAccess asks for the devices' CDI names (DeviceInfo.CDIDevices) without
	// holding them, as Kubernetes' DRA admin access does for monitoring and debugging
	// workloads: nothing is asked of the plugin, no holder is recorded, a held or
	// cordoned device is given too, and it refuses no other Reserve. The access is
	// recorded (an "acc-" ID, DeviceState.AdminAccess) until a Release of its ID or its
	// owner. A device with no CDI names fails with ErrNoCDIDevices. Not with
	// TakeOverOwnerPrefixes.
	AdminAccess bool
	// OwnerLabels name the owner's workload on the metrics of the devices it holds
	// (keys among OwnerLabelKeys, values at most MaxOwnerLabelLen bytes): the pods a DRA
	// claim is reserved for, whose owner ID names only the claim. Recorded with the
	// reservation; a retry keeps the first Reserve's.
	OwnerLabels map[string]string
	// PluginOptions are options for the plugin that owns the devices, passed to its
	// Reserve (a plugin refuses one it does not know) and recorded with the reservation
	// (Reservation.PluginOptions). A retry must carry the same ones: other options are
	// an *OptionsDifferError. Not with AdminAccess. The host API's bounds are
	// validate.ReserveRequest's.
	PluginOptions map[string]string
}

// ReservationEnv is the env var the host adds to every reservation's container
// answer: the reservation's ID, so that a process the container starts can be told
// apart from another holder's of the same device (per-holder GPU memory in the
// metrics). It overrides a plugin's answer of the same name.
const ReservationEnv = "DEVICEHOST_RESERVATION_ID"

// OwnerLabelKeys are the keys ReserveRequest.OwnerLabels may have: the labels
// dcgm-exporter gives a pod's series, in the order of OwnerLabels' fields.
var OwnerLabelKeys = []string{"pod", "namespace"}

// OwnerLabels are a reservation's owner labels (ReserveRequest.OwnerLabels, by key).
// Comparable, so that Holders stay comparable.
type OwnerLabels struct {
	Pod       string // "pod": a pod, or several joined by ","
	Namespace string // "namespace"
}

// OwnerLabelsOf returns the owner labels of a Reserve's map (keys OwnerLabelKeys).
func OwnerLabelsOf(m map[string]string) OwnerLabels {
	return OwnerLabels{Pod: m["pod"], Namespace: m["namespace"]}
}

// Map returns l by key (OwnerLabelKeys), leaving out empty values; nil when all are.
func (l OwnerLabels) Map() map[string]string {
	if l == (OwnerLabels{}) {
		return nil
	}
	m := make(map[string]string, 2)
	if l.Pod != "" {
		m["pod"] = l.Pod
	}
	if l.Namespace != "" {
		m["namespace"] = l.Namespace
	}
	return m
}

// MaxOwnerLabelLen bounds, in bytes, one owner label's value (several pod names
// joined by ",").
const MaxOwnerLabelLen = 1024

// Bounds of ReserveRequest.PluginOptions (validate.ReserveRequest checks them): at most
// MaxPluginOptions options, each key PluginOptionKeyPattern, each value at most
// MaxPluginOptionLen bytes of printable UTF-8.
const (
	MaxPluginOptions       = 8
	MaxPluginOptionLen     = 256
	PluginOptionKeyPattern = `^[a-z][a-z0-9_]{0,62}$`
)

// MaxTakeOverPrefixes is the most owner prefixes one Reserve may take devices over from
// (ReserveRequest.TakeOverOwnerPrefixes). The host API refuses a request with more
// (validate.ReserveRequest); a caller with more holders to take over uses shorter,
// broader prefixes.
const MaxTakeOverPrefixes = 16

// TakesOver reports whether a reservation of owner may be taken over by a Reserve
// with the given owner prefixes (see ReserveRequest.TakeOverOwnerPrefixes). An empty
// prefix matches nothing, so a malformed request can never take over every owner.
func TakesOver(prefixes []string, owner string) bool {
	for _, p := range prefixes {
		if p != "" && strings.HasPrefix(owner, p) {
			return true
		}
	}
	return false
}

// ContainerReservation says how a container gets the reserved devices.
type ContainerReservation struct {
	Envs       map[string]string
	Mounts     []Mount
	Devices    []DeviceSpec
	CDIDevices []string // e.g. "nvidia.com/gpu=GPU-<uuid>"
}

// Mount is a bind mount into the container.
type Mount struct {
	HostPath      string
	ContainerPath string
	ReadOnly      bool
}

// DeviceSpec is a device node to expose in the container.
type DeviceSpec struct {
	HostPath      string
	ContainerPath string
	Permissions   string // subset of "rwm"
}

// ReservationState is where a reservation is in its life. The zero value matches any
// state in a ReservationFilter.
type ReservationState int

// Reservation states.
const (
	ReservationAny ReservationState = iota
	ReservationActive
	ReservationReleased
)

// String returns "any", "active" or "released".
func (s ReservationState) String() string {
	switch s {
	case ReservationActive:
		return "active"
	case ReservationReleased:
		return "released"
	default:
		return "any"
	}
}

// Reservation is one entry of the reservation ledger.
type Reservation struct {
	ID        string
	OwnerID   string
	Group     GroupKey
	Plugin    string
	DeviceIDs []string
	// Consumes is what the reservation uses of its plugin's shared counters: the sum
	// of its devices' consumption when it was made, by set, sorted by set name. Empty
	// for devices that share nothing.
	Consumes       []Consumption
	Container      ContainerReservation
	State          ReservationState
	CreatedAt      time.Time
	ReleasedAt     time.Time // zero while active
	CleanupPending bool      // released, plugin cleanup not yet done
	// AdminAccess marks an admin access listed with the reservations
	// (ReservationFilter.IncludeAdminAccess): it holds none of its devices.
	AdminAccess bool
	// TakenOver is set only in the answer of the Reserve that made this reservation:
	// the IDs of the reservations it took over (released in the same write), sorted.
	// It is never stored: listings and a retried Reserve leave it empty.
	TakenOver []string
	// OwnerLabels are the Reserve's (ReserveRequest.OwnerLabels); zero for none.
	OwnerLabels OwnerLabels
	// PluginOptions are the Reserve's (ReserveRequest.PluginOptions); nil for none.
	PluginOptions map[string]string
}

// CounterSetKey names a counter set (shared capacity, e.g. one GPU's slices): the plugin
// that reports it and its name there. Sets of two plugins never mix.
type CounterSetKey struct {
	Plugin string
	Name   string
}

// Consumption is what a device or a reservation uses of one counter set, per counter,
// and the compatibility groups it shares the set under (Groups).
type Consumption struct {
	Set      CounterSetKey
	Counters map[string]int64
	// Groups are the compatibility groups of the use, as Kubernetes' DRA names them
	// (DeviceCounterConsumption.compatibilityGroups): devices that use one counter set
	// may be held at once only if all their uses of it share at least one group. None
	// (nil) is a group of its own: such uses share the set only with others that have
	// none. A plugin offers one GPU time-sliced (group "time-slicing") and in MPS
	// shares (group "mps") this way: the GPU serves the mode its first holder chose
	// until it is free again. Sorted, at most MaxCompatibilityGroups.
	Groups []string
}

// MaxCompatibilityGroups bounds Consumption.Groups, as Kubernetes does.
const MaxCompatibilityGroups = 2

// Compatible returns the groups common to a and b, where nil stands for the group of
// uses that have none; ok is false when they have none in common (they cannot be held
// at once on one counter set).
func Compatible(a, b []string) (common []string, ok bool) {
	if len(a) == 0 || len(b) == 0 {
		return nil, len(a) == 0 && len(b) == 0
	}
	for _, g := range a {
		if slices.Contains(b, g) {
			common = append(common, g)
		}
	}
	return common, len(common) > 0
}

// CounterUse is what live reservations use of one counter set: per counter, the sum
// and the reservations using it (sorted by reservation ID); and every live reservation
// that uses the set with the compatibility groups all of them share (Groups, nil when
// they have none: a new use must have none too).
type CounterUse struct {
	Used     map[string]int64
	Users    map[string][]Holder
	SetUsers []Holder // sorted by reservation ID
	Groups   []string
}

// Capacity is the capacity of counter sets, per counter.
type Capacity map[CounterSetKey]map[string]int64

// ReleaseRequest names what to release: exactly one of the two fields is set.
type ReleaseRequest struct {
	ReservationID string
	OwnerID       string
	// OwnerPrefixes, when not nil, are the owners the caller may release for: a
	// reservation (named by ReservationID) whose owner starts with none of them is not
	// released, and the error is a *PermissionError. Checked with the release, in one
	// step, so an owner cannot change in between.
	OwnerPrefixes []string
}

// OwnerMatches reports whether owner is one that filter, an owner filter of a listing,
// selects: empty selects every owner, one ending in "/" every owner that starts with it
// ("nomad/default/train/": a Nomad job's), any other that owner alone.
func OwnerMatches(filter, owner string) bool {
	if strings.HasSuffix(filter, "/") {
		return strings.HasPrefix(owner, filter)
	}
	return filter == "" || owner == filter
}

// OwnerUnder reports whether owner starts with one of prefixes; a nil prefixes means
// any owner (ReleaseRequest.OwnerPrefixes).
func OwnerUnder(owner string, prefixes []string) bool {
	if prefixes == nil {
		return true
	}
	for _, p := range prefixes {
		if strings.HasPrefix(owner, p) {
			return true
		}
	}
	return false
}

// ReownRequest names a live reservation, the owner it has, and the owner to give it.
type ReownRequest struct {
	ReservationID string
	OwnerID       string // the owner the caller expects it to have
	NewOwnerID    string
}

// ReleaseResult is what a Release did with the reservations its request named. Every
// named reservation is in exactly one of the two lists, each oldest first.
type ReleaseResult struct {
	Released        []string // IDs of the reservations this call released
	AlreadyReleased []string // IDs of those that were released before it
}

// ReservationFilter selects reservations; zero fields match anything.
type ReservationFilter struct {
	OwnerID  string // ending in "/": every owner that starts with it
	DeviceID string
	State    ReservationState
	// IncludeAdminAccess also lists the live admin accesses that match, after the
	// reservations, by ID (Reservation.AdminAccess set).
	IncludeAdminAccess bool
}
