package server

import (
	"context"
	"errors"
	"slices"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// This file is the one place that maps the device contract's errors to gRPC codes.

// ErrorDomain is the domain of the google.rpc.ErrorInfo detail every mapped error
// carries; its reason is the name of a pb.ErrorReason (the list, with what each means, is
// in devicehost.proto). Callers branch on it where a code alone is ambiguous
// (FAILED_PRECONDITION is a held or an unhealthy device).
const ErrorDomain = ServiceName

// errorCodes is checked in order: the first sentinel an error wraps decides its code and
// reason, so an error that wraps more than one (errors.Join) gets the most specific
// answer a caller can act on: fix the request, pick other devices, retry later.
var errorCodes = []struct {
	sentinel error
	code     codes.Code
	reason   pb.ErrorReason // ERROR_REASON_UNSPECIFIED for none
}{
	{device.ErrShuttingDown, codes.Unavailable, pb.ErrorReason_SHUTTING_DOWN},
	{device.ErrPermissionDenied, codes.PermissionDenied, pb.ErrorReason_PERMISSION_DENIED},
	{device.ErrInvalidRequest, codes.InvalidArgument, pb.ErrorReason_INVALID_REQUEST},
	{device.ErrUnknownDevice, codes.NotFound, pb.ErrorReason_DEVICE_UNKNOWN},
	{device.ErrNotFound, codes.NotFound, pb.ErrorReason_RESERVATION_NOT_FOUND},
	{device.ErrUnhealthyDevice, codes.FailedPrecondition, pb.ErrorReason_DEVICE_UNHEALTHY},
	{device.ErrDeviceCordoned, codes.FailedPrecondition, pb.ErrorReason_DEVICE_CORDONED},
	{device.ErrNoCDIDevices, codes.FailedPrecondition, pb.ErrorReason_NO_CDI_DEVICES},
	{device.ErrTooManyAccesses, codes.ResourceExhausted, pb.ErrorReason_TOO_MANY_ADMIN_ACCESSES},
	{device.ErrDeviceHeld, codes.FailedPrecondition, pb.ErrorReason_DEVICE_HELD},
	{device.ErrCapacityExceeded, codes.FailedPrecondition, pb.ErrorReason_CAPACITY_EXCEEDED},
	{device.ErrOptionsDiffer, codes.FailedPrecondition, pb.ErrorReason_PLUGIN_OPTIONS_DIFFER},
	{device.ErrPluginUnavailable, codes.Unavailable, pb.ErrorReason_PLUGIN_UNAVAILABLE},
	// The plugin answered but broke a validation rule. The caller cannot fix that by
	// changing its request, and an immediate retry usually gets the same answer, so it is
	// reported as the host's own fault rather than UNAVAILABLE (which invites retries).
	{device.ErrPluginResponse, codes.Internal, pb.ErrorReason_PLUGIN_RESPONSE_INVALID},
	{context.DeadlineExceeded, codes.DeadlineExceeded, pb.ErrorReason_ERROR_REASON_UNSPECIFIED},
	{context.Canceled, codes.Canceled, pb.ErrorReason_ERROR_REASON_UNSPECIFIED},
}

// toStatus converts a domain error into a gRPC status error. The message is err.Error(),
// which names the devices, holder, plugin or rule. The status carries a
// google.rpc.ErrorInfo with the reason for the sentinel err wraps; an invalid request
// also a google.rpc.BadRequest listing every offending field, and a held device a
// DeviceHeld naming every holder (from the *device.HeldError in err, never from its
// text). An error that is already a gRPC status passes through; anything unrecognised is
// UNKNOWN.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := err.(interface{ GRPCStatus() *status.Status }); ok {
		return err
	}
	code, reason := codes.Unknown, pb.ErrorReason_ERROR_REASON_UNSPECIFIED
	for _, m := range errorCodes {
		if errors.Is(err, m.sentinel) {
			code, reason = m.code, m.reason
			break
		}
	}
	st := status.New(code, err.Error())
	var details []protoadapt.MessageV1
	if reason != pb.ErrorReason_ERROR_REASON_UNSPECIFIED {
		details = append(details, &errdetails.ErrorInfo{Reason: reason.String(), Domain: ErrorDomain})
	}
	switch reason {
	case pb.ErrorReason_INVALID_REQUEST:
		if br := badRequest(err); br != nil {
			details = append(details, br)
		}
	case pb.ErrorReason_DEVICE_HELD:
		var held *device.HeldError
		if errors.As(err, &held) {
			details = append(details, heldToProto(held))
		}
	case pb.ErrorReason_CAPACITY_EXCEEDED:
		var ce *device.CapacityError
		if errors.As(err, &ce) {
			details = append(details, capacityToProto(ce))
		}
	}
	if len(details) == 0 {
		return st.Err()
	}
	if withDetails, derr := st.WithDetails(details...); derr == nil {
		st = withDetails
	}
	return st.Err()
}

// badRequest lists err's field errors, or returns nil when it has none.
func badRequest(err error) *errdetails.BadRequest {
	fields := fieldErrors(err)
	if len(fields) == 0 {
		return nil
	}
	br := &errdetails.BadRequest{}
	for _, fe := range fields {
		br.FieldViolations = append(br.FieldViolations, &errdetails.BadRequest_FieldViolation{
			Field:       fe.Field,
			Description: fe.Rule,
		})
	}
	return br
}

// heldToProto is the DeviceHeld detail of e.
func heldToProto(e *device.HeldError) *pb.DeviceHeld {
	out := &pb.DeviceHeld{OwnerId: e.OwnerID}
	for _, c := range e.Conflicts {
		out.Conflicts = append(out.Conflicts, &pb.DeviceConflict{
			ReservationId: c.Holder.ReservationID,
			OwnerId:       c.Holder.OwnerID,
			DeviceIds:     c.Overlap,
			HeldDeviceIds: c.Held,
		})
	}
	return out
}

// capacityToProto is the CapacityExceeded detail of e.
func capacityToProto(e *device.CapacityError) *pb.CapacityExceeded {
	out := &pb.CapacityExceeded{OwnerId: e.OwnerID}
	for _, o := range e.Overruns {
		po := &pb.CounterOverrun{
			Plugin: o.Set.Plugin, CounterSet: o.Set.Name, Counter: o.Counter,
			Capacity: o.Capacity, Used: o.Used, Requested: o.Requested,
			CompatibilityGroups: slices.Clone(o.Groups), UsersCompatibilityGroups: slices.Clone(o.UsersGroups),
		}
		for _, u := range o.Users {
			po.Users = append(po.Users, &pb.Holder{ReservationId: u.ReservationID, OwnerId: u.OwnerID})
		}
		out.Overruns = append(out.Overruns, po)
	}
	return out
}

// fieldErrors collects every *device.FieldError in err's tree, in order.
func fieldErrors(err error) []*device.FieldError {
	var out []*device.FieldError
	var walk func(error)
	walk = func(e error) {
		switch x := e.(type) {
		case nil:
		case *device.FieldError:
			out = append(out, x)
		case interface{ Unwrap() []error }:
			for _, inner := range x.Unwrap() {
				walk(inner)
			}
		case interface{ Unwrap() error }:
			walk(x.Unwrap())
		}
	}
	walk(err)
	return out
}
