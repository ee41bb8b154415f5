package device

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Sentinel errors. A Manager wraps them with the details (device IDs, holder, plugin,
// rule), so callers test with errors.Is and show err.Error() to people.
var (
	// ErrInvalidRequest: the request itself is malformed. Wrapped in a *FieldError
	// where one field is to blame.
	ErrInvalidRequest = errors.New("invalid request")
	// ErrUnknownDevice: a device ID (or group) that no plugin reports.
	ErrUnknownDevice = errors.New("unknown device")
	// ErrUnhealthyDevice: the device exists but is not healthy.
	ErrUnhealthyDevice = errors.New("device unhealthy")
	// ErrDeviceHeld: the device is held by a live reservation of another owner, or the
	// request overlaps one only in part.
	ErrDeviceHeld = errors.New("device held")
	// ErrCapacityExceeded: the requested devices, with the live reservations, would use
	// more of a shared counter (a GPU's slices) than it has; see CapacityError.
	ErrCapacityExceeded = errors.New("shared capacity exceeded")
	// ErrPluginUnavailable: the plugin the devices are bound to is not running or did
	// not answer in time.
	ErrPluginUnavailable = errors.New("plugin unavailable")
	// ErrPluginResponse: the plugin answered, but its answer broke a validation rule.
	ErrPluginResponse = errors.New("invalid plugin response")
	// ErrNotFound: a reservation that the ledger does not have.
	ErrNotFound = errors.New("not found")
	// ErrShuttingDown: the manager is shutting down and takes no new work.
	ErrShuttingDown = errors.New("shutting down")
	// ErrPermissionDenied: the caller may not make this call, or not for this owner;
	// see PermissionError.
	ErrPermissionDenied = errors.New("permission denied")
	// ErrDeviceCordoned: a device an operator took out of service; see CordonedError.
	ErrDeviceCordoned = errors.New("device cordoned")
	// ErrNoCDIDevices: an admin access (ReserveRequest.AdminAccess) to a device whose
	// plugin reports no CDI names for it, so there is nothing to hand out.
	ErrNoCDIDevices = errors.New("no CDI devices")
	// ErrTooManyAccesses: an admin access to a device that has MaxAdminAccessPerDevice.
	ErrTooManyAccesses = errors.New("too many admin accesses")
	// ErrOptionsDiffer: a retried Reserve (its owner, exactly the devices its live
	// reservation holds) with other plugin options than that reservation's; see
	// OptionsDifferError.
	ErrOptionsDiffer = errors.New("plugin options differ")
)

// OptionsDifferError says that a retried Reserve asks for its owner's live reservation
// with other plugin options (ReserveRequest.PluginOptions) than the reservation was
// made with: the plugin prepared the devices for those, so the retry is refused rather
// than answered with a reservation that does not do what it asks. It matches
// ErrOptionsDiffer under errors.Is.
type OptionsDifferError struct {
	OwnerID       string
	ReservationID string
	Held          map[string]string // the reservation's options
	Requested     map[string]string // the retry's
}

// Error is `owner "o": reservation res-… holds the devices with plugin options
// {k="v"}, the request asks for {k="w"} (release it first, or ask with its options):
// plugin options differ`.
func (e *OptionsDifferError) Error() string {
	return fmt.Sprintf("owner %q: reservation %s holds the devices with plugin options %s, the request asks for %s (release it first, or ask with its options): %v",
		e.OwnerID, e.ReservationID, OptionsString(e.Held), OptionsString(e.Requested), ErrOptionsDiffer)
}

// Unwrap returns ErrOptionsDiffer.
func (e *OptionsDifferError) Unwrap() error { return ErrOptionsDiffer }

// OptionsString renders plugin options for a message: `{a="x", b="y"}`, keys sorted,
// keys and values quoted as Go strings (control characters escaped), or `{}` for none.
func OptionsString(opts map[string]string) string {
	keys := make([]string, 0, len(opts))
	for k := range opts {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = quoteKey(k) + "=" + strconv.Quote(opts[k])
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

// quoteKey leaves a key of the host API's form ([a-z][a-z0-9_]*) bare and quotes any
// other.
func quoteKey(k string) string {
	for i, c := range k {
		if !(c >= 'a' && c <= 'z' || i > 0 && (c >= '0' && c <= '9' || c == '_')) {
			return strconv.Quote(k)
		}
	}
	if k == "" {
		return `""`
	}
	return k
}

// MaxAdminAccessPerDevice bounds the live admin accesses of one device, so that no
// caller can grow every Fingerprint without end.
const MaxAdminAccessPerDevice = 32

// FieldError says which request field is wrong and why. It matches ErrInvalidRequest
// under errors.Is.
type FieldError struct {
	Field string // e.g. "owner_id", "device_ids[2]"
	Rule  string // e.g. "must not be empty"
}

// Error renders "invalid request: owner_id: must not be empty".
func (e *FieldError) Error() string {
	return fmt.Sprintf("%v: %s: %s", ErrInvalidRequest, e.Field, e.Rule)
}

// Is makes errors.Is(err, ErrInvalidRequest) true for any *FieldError.
func (e *FieldError) Is(target error) bool { return target == ErrInvalidRequest }

// HeldError says which live reservations, or Reserves still in flight, hold devices a
// Reserve asked for: a device held by another owner, or a request that overlaps a
// reservation of its own owner without asking for exactly its devices. It matches
// ErrDeviceHeld under errors.Is, so callers that need the holders use errors.As and
// never parse the message.
type HeldError struct {
	OwnerID   string     // the requesting owner
	Conflicts []Conflict // sorted by reservation ID
}

// Conflict is one holder a request collides with.
type Conflict struct {
	// Holder is the live reservation holding the devices. Its ReservationID is empty
	// while a Reserve for Holder.OwnerID is still in flight (not yet a reservation).
	Holder  Holder
	Overlap []string // the requested devices it holds, sorted
	Held    []string // every device it holds (or is being reserved), sorted
}

// Error is `owner "<OwnerID>": <Holders>: device held` (ErrDeviceHeld's text).
func (e *HeldError) Error() string {
	return fmt.Sprintf("owner %q: %s: %v", e.OwnerID, e.Holders(), ErrDeviceHeld)
}

// Holders names each holder and the requested devices it holds, joined by "; ": a
// reservation of another owner by its ID and owner, a Reserve in flight by its owner, a
// reservation of the requesting owner by its ID and all it holds. It is the one wording
// of a held device: Error's, and that of callers that say the rest in their own terms
// (the bridges, without the requesting owner they made up or derived).
func (e *HeldError) Holders() string {
	parts := make([]string, 0, len(e.Conflicts))
	for _, c := range e.Conflicts {
		switch {
		case c.Holder.ReservationID == "":
			parts = append(parts, fmt.Sprintf("%s being reserved for owner %q",
				strings.Join(c.Overlap, ", "), c.Holder.OwnerID))
		case c.Holder.OwnerID != e.OwnerID:
			parts = append(parts, fmt.Sprintf("%s held by reservation %s of owner %q",
				strings.Join(c.Overlap, ", "), c.Holder.ReservationID, c.Holder.OwnerID))
		default:
			parts = append(parts, fmt.Sprintf("%s overlap reservation %s of the same owner, which holds %s "+
				"(a retry must ask for exactly the devices reserved, or release them first)",
				strings.Join(c.Overlap, ", "), c.Holder.ReservationID, strings.Join(c.Held, ", ")))
		}
	}
	return strings.Join(parts, "; ")
}

// Unwrap returns ErrDeviceHeld.
func (e *HeldError) Unwrap() error { return ErrDeviceHeld }

// CapacityError says which shared counters a Reserve would take over their capacity,
// and which live reservations use them. It matches ErrCapacityExceeded under errors.Is.
type CapacityError struct {
	OwnerID  string    // the requesting owner
	Overruns []Overrun // sorted by set, then counter
}

// Overrun is one counter a request would take over its capacity or, with Counter
// empty, a counter set the request's devices cannot share with its live users: their
// compatibility groups (Consumption.Groups) have none in common.
type Overrun struct {
	Set       CounterSetKey
	Counter   string
	Capacity  int64
	Used      int64    // by live reservations
	Requested int64    // by the request
	Users     []Holder // the live reservations using it, sorted by reservation ID
	// With Counter empty: the request's groups and those its users share (nil: none).
	Groups, UsersGroups []string
}

// Error is `owner "<OwnerID>": <Counters>: ` and ErrCapacityExceeded's text.
func (e *CapacityError) Error() string {
	return fmt.Sprintf("owner %q: %s: %v", e.OwnerID, e.Counters(), ErrCapacityExceeded)
}

// Counters names each counter, its figures and its users, e.g. `counter
// "memory-slice-0" of set "GPU-1" (plugin "nvidia"): 1 requested, 1 of 1 used by
// reservation res-0f.. of owner "b"`, joined by "; ". It is the one wording of an
// overrun: Error's, and that of callers that say the rest in their own terms. It names
// at most maxListedOverruns counters and maxListedUsers users of each (the rest
// counted): a whole GPU beside seven partitions overruns a dozen counters, each used by
// seven.
func (e *CapacityError) Counters() string {
	const maxListedOverruns, maxListedUsers = 2, 3
	var parts []string
	for i, o := range e.Overruns {
		if i == maxListedOverruns {
			parts = append(parts, fmt.Sprintf("and %d more counters", len(e.Overruns)-i))
			break
		}
		var users []string
		for j, u := range o.Users {
			if j == maxListedUsers {
				users = append(users, fmt.Sprintf("%d more", len(o.Users)-j))
				break
			}
			users = append(users, fmt.Sprintf("reservation %s of owner %q", u.ReservationID, u.OwnerID))
		}
		by := ""
		if len(users) > 0 {
			by = " by " + strings.Join(users, ", ")
		}
		if o.Counter == "" {
			parts = append(parts, fmt.Sprintf("counter set %q (plugin %q) is held %s%s; the request's devices would hold it %s",
				o.Set.Name, o.Set.Plugin, SharedAs(o.UsersGroups), by, SharedAs(o.Groups)))
			continue
		}
		parts = append(parts, fmt.Sprintf("counter %q of set %q (plugin %q): %d requested, %d of %d used%s",
			o.Counter, o.Set.Name, o.Set.Plugin, o.Requested, o.Used, o.Capacity, by))
	}
	return strings.Join(parts, "; ")
}

// SharedAs says how a use with compatibility groups shares a counter set, for an
// error: `shared as "mps"`, `shared as "a" or "b"`, or "unshared" for none.
func SharedAs(groups []string) string {
	if len(groups) == 0 {
		return "unshared"
	}
	q := make([]string, len(groups))
	for i, g := range groups {
		q[i] = strconv.Quote(g)
	}
	return "shared as " + strings.Join(q, " or ")
}

// Unwrap returns ErrCapacityExceeded.
func (e *CapacityError) Unwrap() error { return ErrCapacityExceeded }

// PermissionError says why a caller may not make a call: where it called (the
// listener), who it is (the peer), what it asked and the grant it lacked. It matches
// ErrPermissionDenied under errors.Is. It is the one wording of a refusal by grant:
// the server's for a call outside its grants, the ledger's for a reservation of an
// owner outside them.
type PermissionError struct {
	Listener string   // the listener's name; empty where the refusal is the ledger's
	Peer     string   // the caller, e.g. "uid=1000,gid=1000,pid=42"; empty where unknown
	Call     string   // what was asked, e.g. "Reserve for owner \"nomad/x\""
	Lacks    string   // the grant that would allow it, e.g. "reserve:nomad/x"
	Has      []string // the grants the caller has, in the config's words
}

// Error is `permission denied: listener "NAME" peer PEER may not CALL: it lacks grant
// "LACKS" (it has: HAS)`, leaving out what is unknown.
func (e *PermissionError) Error() string {
	var b strings.Builder
	b.WriteString(ErrPermissionDenied.Error())
	b.WriteString(": ")
	if e.Listener != "" {
		fmt.Fprintf(&b, "listener %q ", e.Listener)
	}
	if e.Peer != "" {
		fmt.Fprintf(&b, "peer %s ", e.Peer)
	}
	if e.Listener == "" && e.Peer == "" {
		b.WriteString("the caller ")
	}
	fmt.Fprintf(&b, "may not %s: it lacks grant %q", e.Call, e.Lacks)
	if e.Has != nil {
		has := "nothing"
		if len(e.Has) > 0 {
			has = strings.Join(e.Has, ", ")
		}
		fmt.Fprintf(&b, " (it has: %s)", has)
	}
	return b.String()
}

// Unwrap makes errors.Is(err, ErrPermissionDenied) true.
func (e *PermissionError) Unwrap() error { return ErrPermissionDenied }

// CordonedError says that a Reserve asked for a cordoned device, why and by whom. It
// matches ErrDeviceCordoned under errors.Is.
type CordonedError struct {
	DeviceID string
	Cordon   Cordon
}

// Error is `device "ID" is cordoned since TIME by BY: REASON: device cordoned` (with
// "(drain)" after the time for a drain).
func (e *CordonedError) Error() string {
	drain := ""
	if e.Cordon.Drain {
		drain = " (drain)"
	}
	return fmt.Sprintf("device %q is cordoned since %s%s by %s: %s: %v", e.DeviceID,
		e.Cordon.Since.UTC().Format(time.RFC3339), drain, e.Cordon.By, e.Cordon.Reason, ErrDeviceCordoned)
}

// Unwrap makes errors.Is(err, ErrDeviceCordoned) true.
func (e *CordonedError) Unwrap() error { return ErrDeviceCordoned }
