package client

import (
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"slices"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// ErrorDomain is the domain of the google.rpc.ErrorInfo detail the agent attaches to its
// errors.
const ErrorDomain = ServiceName

// The ErrorInfo reasons the agent attaches to its errors: the names of the pb.ErrorReason
// values (devicehost.proto says what each means), which are what goes on the wire.
var (
	ReasonInvalidRequest      = pb.ErrorReason_INVALID_REQUEST.String()
	ReasonDeviceUnknown       = pb.ErrorReason_DEVICE_UNKNOWN.String()
	ReasonReservationNotFound = pb.ErrorReason_RESERVATION_NOT_FOUND.String()
	ReasonDeviceUnhealthy     = pb.ErrorReason_DEVICE_UNHEALTHY.String()
	ReasonDeviceHeld          = pb.ErrorReason_DEVICE_HELD.String()
	ReasonCapacityExceeded    = pb.ErrorReason_CAPACITY_EXCEEDED.String()
	ReasonPluginUnavailable   = pb.ErrorReason_PLUGIN_UNAVAILABLE.String()
	ReasonShuttingDown        = pb.ErrorReason_SHUTTING_DOWN.String()
	ReasonPluginResponse      = pb.ErrorReason_PLUGIN_RESPONSE_INVALID.String()
	ReasonPermissionDenied    = pb.ErrorReason_PERMISSION_DENIED.String()
	ReasonDeviceCordoned      = pb.ErrorReason_DEVICE_CORDONED.String()
	ReasonNoCDIDevices        = pb.ErrorReason_NO_CDI_DEVICES.String()
	ReasonTooManyAccesses     = pb.ErrorReason_TOO_MANY_ADMIN_ACCESSES.String()
	ReasonOptionsDiffer       = pb.ErrorReason_PLUGIN_OPTIONS_DIFFER.String()
)

// Reason returns the ErrorInfo reason of the agent's error err (one of the Reason
// variables), or "" when err carries none: nil, not a gRPC status, or a failure of the
// connection rather than an answer of the agent.
func Reason(err error) string {
	if info := errorInfo(err); info != nil {
		return info.GetReason()
	}
	return ""
}

func errorInfo(err error) *errdetails.ErrorInfo {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return nil
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == ErrorDomain {
			return info
		}
	}
	return nil
}

// IsHeld reports whether err is a Reserve refused because requested devices are held:
// by live reservations of other owners, by a reservation of the same owner that the
// request overlaps without asking for exactly its devices, or by a Reserve still in
// flight. The detail names each holder (reservation ID, empty while in flight; owner ID;
// the requested devices it holds). An agent that sent no detail gives an empty one.
func IsHeld(err error) (*pb.DeviceHeld, bool) {
	if Reason(err) != ReasonDeviceHeld {
		return nil, false
	}
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if held, ok := d.(*pb.DeviceHeld); ok {
			return held, true
		}
	}
	return &pb.DeviceHeld{}, true
}

// IsCapacityExceeded reports whether err is a Reserve refused because the requested
// devices, with the live reservations, would use more of a shared counter (a GPU's
// slices, when it is partitioned) than it has. The detail names each counter, its
// capacity, its use and the reservations using it. An agent that sent no detail gives
// an empty one.
func IsCapacityExceeded(err error) (*pb.CapacityExceeded, bool) {
	if Reason(err) != ReasonCapacityExceeded {
		return nil, false
	}
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if ce, ok := d.(*pb.CapacityExceeded); ok {
			return ce, true
		}
	}
	return &pb.CapacityExceeded{}, true
}

// HeldError returns the contract's *device.HeldError for err, a Reserve refused because
// requested devices are held (IsHeld), converted from the DeviceHeld detail the agent
// sent: its Error is the wording the agent's message has, and its Holders names each
// holder for callers that say the rest in their own terms. ok is false when err is no
// such refusal, or the agent sent no holder (then its message is all there is).
func HeldError(err error) (e *device.HeldError, ok bool) {
	held, ok := IsHeld(err)
	if !ok || len(held.GetConflicts()) == 0 {
		return nil, false
	}
	e = &device.HeldError{OwnerID: held.GetOwnerId()}
	for _, c := range held.GetConflicts() {
		e.Conflicts = append(e.Conflicts, device.Conflict{
			Holder:  device.Holder{ReservationID: c.GetReservationId(), OwnerID: c.GetOwnerId()},
			Overlap: c.GetDeviceIds(),
			Held:    c.GetHeldDeviceIds(),
		})
	}
	return e, true
}

// CapacityError returns the contract's *device.CapacityError for err, a Reserve refused
// over a shared counter's capacity (IsCapacityExceeded), converted from the
// CapacityExceeded detail the agent sent: its Error is the wording the agent's message
// has, and its Counters names each counter for callers that say the rest in their own
// terms. ok is false when err is no such refusal, or the agent sent no counter.
func CapacityError(err error) (e *device.CapacityError, ok bool) {
	ce, ok := IsCapacityExceeded(err)
	if !ok || len(ce.GetOverruns()) == 0 {
		return nil, false
	}
	e = &device.CapacityError{OwnerID: ce.GetOwnerId()}
	for _, o := range ce.GetOverruns() {
		do := device.Overrun{
			Set:     device.CounterSetKey{Plugin: o.GetPlugin(), Name: o.GetCounterSet()},
			Counter: o.GetCounter(), Capacity: o.GetCapacity(), Used: o.GetUsed(), Requested: o.GetRequested(),
			Groups: slices.Clone(o.GetCompatibilityGroups()), UsersGroups: slices.Clone(o.GetUsersCompatibilityGroups()),
		}
		for _, u := range o.GetUsers() {
			do.Users = append(do.Users, device.Holder{ReservationID: u.GetReservationId(), OwnerID: u.GetOwnerId()})
		}
		e.Overruns = append(e.Overruns, do)
	}
	return e, true
}

// IsUnknownDevice reports whether err says a requested device, or its group, is not
// reported by any plugin.
func IsUnknownDevice(err error) bool { return Reason(err) == ReasonDeviceUnknown }

// IsUnhealthy reports whether err says a requested device is not healthy.
func IsUnhealthy(err error) bool { return Reason(err) == ReasonDeviceUnhealthy }

// IsReservationNotFound reports whether err says the agent has no reservation by the
// ID given (never made, or garbage-collected after its release).
func IsReservationNotFound(err error) bool { return Reason(err) == ReasonReservationNotFound }

// IsUnavailable reports whether err is worth retrying later: the agent cannot be reached
// or is shutting down, or the plugin that owns the devices is down or did not answer in
// time (status UNAVAILABLE).
func IsUnavailable(err error) bool { return err != nil && status.Code(err) == codes.Unavailable }
