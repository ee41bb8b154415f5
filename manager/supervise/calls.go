package supervise

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/inventory"
	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Reserve asks the running plugin to prepare deviceIDs with the caller's options (nil
// for none). The call is bounded by ctx, ReserveTimeout and the plugin's exit; errors
// wrap device.ErrPluginUnavailable when the plugin is down or silent,
// device.ErrInvalidRequest when it refused the request as invalid (INVALID_ARGUMENT: an
// option it does not know, devices it will not hold together), with its message, and
// device.ErrPluginResponse when it refused otherwise. The answer is not validated here.
func (s *Supervisor) Reserve(ctx context.Context, deviceIDs []string, options map[string]string) (*pb.ContainerReservation, error) {
	var resp *pb.ReserveResponse
	err := s.call(ctx, "reserve", func(ctx context.Context, c pb.DevicePluginClient) error {
		var err error
		resp, err = c.Reserve(ctx, &pb.ReserveRequest{DeviceIds: deviceIDs, Options: options})
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp.GetReservation(), nil
}

// Release asks the running plugin to clean up after a reservation. A plugin without
// cleanup (UNIMPLEMENTED) counts as done. Bounded and wrapped like Reserve.
func (s *Supervisor) Release(ctx context.Context, reservationID string, deviceIDs []string) error {
	err := s.call(ctx, "release", func(ctx context.Context, c pb.DevicePluginClient) error {
		_, err := c.Release(ctx, &pb.ReleaseRequest{ReservationId: reservationID, DeviceIds: deviceIDs})
		return err
	})
	if status.Code(errors.Unwrap(err)) == codes.Unimplemented {
		return nil
	}
	return err
}

// ErrNotRunning is CheckConfig's error, wrapped, when no process of the plugin runs
// (between runs, or after it failed for good).
var ErrNotRunning = errors.New("plugin not running")

// CheckConfig asks the running process whether it would accept configJSON, changing
// nothing in it (see pluginloader's (*Plugin).CheckConfig for its errors), bounded by
// ctx and the process's exit. It fails with ErrNotRunning when no process runs.
func (s *Supervisor) CheckConfig(ctx context.Context, configJSON []byte) error {
	p := s.Current()
	if p == nil {
		return fmt.Errorf("plugin %q: %w", s.name, ErrNotRunning)
	}
	return p.CheckConfig(ctx, configJSON)
}

// call runs one unary RPC on the running plugin, bounded by ctx, ReserveTimeout and the
// plugin's exit, and wraps its failure with the manager's sentinel errors. A failure
// that looks like a dead connection is an exit when pluginloader.RPCError says so.
func (s *Supervisor) call(ctx context.Context, what string, rpc func(context.Context, pb.DevicePluginClient) error) error {
	p := s.Current()
	if p == nil {
		return fmt.Errorf("plugin %q is not running: %w", s.name, device.ErrPluginUnavailable)
	}
	cctx, cancel := context.WithTimeoutCause(ctx, s.cfg.ReserveTimeout, errReserveTimeout)
	defer cancel()
	cctx, stop := pluginloader.CallContext(cctx, p)
	defer stop()

	err := rpc(cctx, p.Client())
	if err == nil {
		return nil
	}
	switch cause := context.Cause(cctx); {
	case ctx.Err() != nil:
		return fmt.Errorf("%s on plugin %q: %w", what, s.name, context.Cause(ctx))
	case cause == errReserveTimeout || status.Code(err) == codes.DeadlineExceeded:
		// The plugin's side may see the propagated deadline a moment before ours fires.
		return fmt.Errorf("plugin %q did not answer %s within %v: %w", s.name, what, s.cfg.ReserveTimeout, device.ErrPluginUnavailable)
	case errors.Is(pluginloader.RPCError(cctx, p, err), pluginloader.ErrExited):
		return fmt.Errorf("plugin %q exited during %s (%s): %w", s.name, what, inventory.ErrorLine(p.ExitReason()), device.ErrPluginUnavailable)
	}
	// What the plugin or its connection said is made one bounded line: it ends up in
	// the caller's answer and in the log line of that call.
	switch status.Code(err) {
	case codes.Unavailable, codes.Canceled:
		return fmt.Errorf("%s on plugin %q: %s: %w", what, s.name, inventory.ErrorLine(err.Error()), device.ErrPluginUnavailable)
	case codes.Unimplemented:
		return fmt.Errorf("%s on plugin %q: %w", what, s.name, err)
	case codes.InvalidArgument:
		// The request is what the plugin refused (an option it does not know): the
		// caller's to fix, as the host's own checks' refusals are.
		return fmt.Errorf("plugin %q refused %s: %s: %w", s.name, what, pluginSaid(err, what), device.ErrInvalidRequest)
	}
	return fmt.Errorf("plugin %q refused %s: %s: %w", s.name, what, pluginSaid(err, what), device.ErrPluginResponse)
}

// pluginSaid is a plugin's error message as one bounded line, less a leading "what: "
// (nvidia-example's "reserve: ...") that would repeat the host's own words.
func pluginSaid(err error, what string) string {
	return strings.TrimPrefix(inventory.ErrorLine(status.Convert(err).Message()), what+": ")
}

// reconcile hands p, started but not yet serving Reserves, the live reservations of its
// devices, so it can undo what it prepared for a Reserve the host never recorded (the
// host killed between the plugin's answer and its ledger commit) and keep the rest. A
// plugin without Reconcile (UNIMPLEMENTED) has nothing to undo. A failure is logged and
// the plugin serves anyway: its devices stay usable, what it could not undo waits for
// the next start.
func (s *Supervisor) reconcile(ctx context.Context, p Plugin) {
	if s.cfg.Live == nil {
		return
	}
	live, err := s.cfg.Live(ctx)
	if err != nil {
		s.log.Warn("plugin not told its live reservations: the ledger could not list them", "error", inventory.ErrorLine(err.Error()))
		return
	}
	cctx, cancel := context.WithTimeout(ctx, s.cfg.ReserveTimeout)
	defer cancel()
	cctx, stop := pluginloader.CallContext(cctx, p)
	defer stop()
	_, err = p.Client().Reconcile(cctx, &pb.ReconcileRequest{Reservations: live})
	switch {
	case err == nil:
		s.log.Debug("plugin told its live reservations", "reservations", len(live))
	case status.Code(err) == codes.Unimplemented:
	default:
		s.log.Warn("plugin could not reconcile its live reservations; it serves anyway",
			"reservations", len(live), "error", inventory.ErrorLine(status.Convert(err).Message()))
	}
}
