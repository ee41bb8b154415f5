package server

import (
	"context"
	"errors"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/manager/device"
)

// This file is the one place that maps the device contract's errors to gRPC codes.

// errorCodes is checked in order: the first sentinel an error wraps decides its code, so
// an error that wraps more than one (errors.Join) gets the most specific answer a caller
// can act on: fix the request, pick other devices, retry later.
var errorCodes = []struct {
	sentinel error
	code     codes.Code
}{
	{device.ErrShuttingDown, codes.Unavailable},
	{device.ErrInvalidRequest, codes.InvalidArgument},
	{device.ErrUnknownDevice, codes.NotFound},
	{device.ErrNotFound, codes.NotFound},
	{device.ErrUnhealthyDevice, codes.FailedPrecondition},
	{device.ErrDeviceHeld, codes.FailedPrecondition},
	{device.ErrPluginUnavailable, codes.Unavailable},
	// The plugin answered but broke a validation rule. The caller cannot fix that by
	// changing its request, and an immediate retry usually gets the same answer, so it is
	// reported as the host's own fault rather than UNAVAILABLE (which invites retries).
	{device.ErrPluginResponse, codes.Internal},
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{context.Canceled, codes.Canceled},
}

// toStatus converts a domain error into a gRPC status error. The message is err.Error(),
// which names the devices, holder, plugin or rule; an invalid request also carries a
// google.rpc.BadRequest detail listing every offending field. An error that is already a
// gRPC status passes through; anything unrecognised is UNKNOWN.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := err.(interface{ GRPCStatus() *status.Status }); ok {
		return err
	}
	code := codes.Unknown
	for _, m := range errorCodes {
		if errors.Is(err, m.sentinel) {
			code = m.code
			break
		}
	}
	st := status.New(code, err.Error())
	if code != codes.InvalidArgument {
		return st.Err()
	}
	fields := fieldErrors(err)
	if len(fields) == 0 {
		return st.Err()
	}
	br := &errdetails.BadRequest{}
	for _, fe := range fields {
		br.FieldViolations = append(br.FieldViolations, &errdetails.BadRequest_FieldViolation{
			Field:       fe.Field,
			Description: fe.Rule,
		})
	}
	if withDetails, derr := st.WithDetails(br); derr == nil {
		st = withDetails
	}
	return st.Err()
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
