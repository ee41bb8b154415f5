package manager

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/internal/backoff"
	"github.com/devicehost/devicehost/manager/device"
	"github.com/devicehost/devicehost/manager/inventory"
	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

// plugin is what a supervisor needs of a launched plugin process. *pluginloader.Plugin
// implements it; tests substitute in-process plugins.
type plugin interface {
	Client() pb.DevicePluginClient
	Info() *pb.GetPluginInfoResponse
	// Exited is closed once the process has exited; ExitReason then says why. They are
	// what pluginloader.CallContext and RPCError read to tell a plugin's exit from a
	// failed RPC.
	pluginloader.Process
	// Kill stops the process (gracefully, then forcefully when ctx ends); called exactly
	// once per launched plugin.
	Kill(ctx context.Context)
}

// launchFunc starts (or, with opts.Reattach, reattaches to) a plugin. ctx bounds the
// launch only. It is the seam where reattaching to plugins that survived a host restart
// plugs in.
type launchFunc func(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options) (plugin, error)

// launchProcess launches a real plugin process with pluginloader.
func launchProcess(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options) (plugin, error) {
	p, err := pluginloader.Launch(ctx, bin, opts)
	if err != nil {
		return nil, err // not a typed nil inside the interface
	}
	return p, nil
}

// permanent reports whether a launch error will not go away by retrying: the operator
// has to fix the binary, its checksum pin or its config, and restart the host.
func permanent(err error) bool {
	return errors.Is(err, pluginloader.ErrChecksumMismatch) ||
		errors.Is(err, pluginloader.ErrProtocolVersion) ||
		errors.Is(err, pluginloader.ErrConfigRejected) ||
		errors.Is(err, pluginloader.ErrInsecurePath) ||
		errors.Is(err, pluginloader.ErrNotPlugin)
}

const (
	// statsStallFactor × the sampling interval (at least minStatsStall) without a stats
	// message ends the stats stream as stalled; it is then retried with backoff.
	statsStallFactor = 5
	minStatsStall    = 2 * time.Second
)

// budgetRefusal stands for every byte-budget refusal in a row of refusals, whose texts
// differ only in sizes.
const budgetRefusal = "\x00over the byte budget"

var (
	errNoFirstFingerprint = errors.New("no first fingerprint in time")
	errStatsStalled       = errors.New("stats stream stalled")
	errReserveTimeout     = errors.New("reserve timed out")
	errPluginExited       = errors.New("plugin exited")
)

// supervisor owns one plugin: it launches it, consumes its fingerprints and stats, and
// restarts it with backoff when it fails. Run is its only long-lived goroutine (with the
// per-run stream goroutines it starts and joins). reserve and release may be called from
// any goroutine.
type supervisor struct {
	name   string
	bin    pluginloader.Binary
	opts   pluginloader.Options
	cfg    Config // with defaults
	launch launchFunc
	reg    *inventory.Registry
	stats  *inventory.Stats
	log    hclog.Logger
	jitter func() float64 // nil: random
	keep   *keeper        // nil: the plugin is not kept across host crashes
	onUp   func()         // nil, or called after each run's first good fingerprint

	mu  sync.Mutex
	cur plugin // the running plugin; nil between runs

	stopsMu sync.Mutex
	stops   repeats // the errors that ended runs, in a row: logged once per change
}

func (s *supervisor) current() plugin {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

func (s *supervisor) setCurrent(p plugin) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur = p
}

func (s *supervisor) backoff() restartBackoff {
	return restartBackoff{
		Backoff: backoff.Backoff{Base: s.cfg.RestartBaseDelay, Max: s.cfg.RestartMaxDelay, Jitter: s.jitter},
		stable:  s.cfg.StableRunReset, served: s.cfg.ServedReset,
	}
}

// Run supervises the plugin until ctx ends, restarting it with exponential backoff and
// jitter whenever a run fails. It returns nil when ctx ends, or the error of a launch
// that failed permanently (see permanent), after which the plugin is not restarted. No
// plugin process or goroutine it started outlives it.
//
// A run that ends with the same error as the one before is logged at DEBUG only; when
// the error changes, or the plugin fingerprints again, one line gives the count.
func (s *supervisor) Run(ctx context.Context) error {
	bo := s.backoff()
	for restarts := 0; ; restarts++ {
		s.reg.Launching(s.name, restarts)
		started := time.Now()
		served, err := s.runOnce(ctx, restarts == 0)
		if ctx.Err() != nil {
			return nil
		}
		if permanent(err) {
			return err
		}
		delay := bo.next(time.Since(started), served)
		s.reg.Restarting(s.name, err, delay)
		line := inventory.ErrorLine(err.Error())
		s.stopsMu.Lock()
		isNew, prev, times := s.stops.see(line)
		s.stopsMu.Unlock()
		if times > 1 {
			s.log.Warn("plugin stopped repeatedly with the same error", "error", prev, "times", times)
		}
		if isNew {
			s.log.Warn("plugin stopped; restarting", "error", line, "restart_in", delay, "restarts", restarts+1)
		} else {
			s.log.Debug("plugin stopped again with the same error; restarting", "error", line, "restart_in", delay, "restarts", restarts+1)
		}
		if !sleep(ctx, delay) {
			return nil
		}
	}
}

// up notes that the plugin fingerprinted: a streak of identical stops ends.
func (s *supervisor) up() {
	s.stopsMu.Lock()
	prev, times := s.stops.reset()
	s.stopsMu.Unlock()
	if times > 1 {
		s.log.Info("plugin serving again after stopping repeatedly with the same error", "error", prev, "times", times)
	}
}

// runOnce launches the plugin (on the first run, perhaps reattaches to it) and serves it
// until it exits, its fingerprint stream fails, or ctx ends. The plugin's devices are
// marked unhealthy with the reason before it returns, the process is killed and its
// reattach record, if any, deleted. served is how long the plugin ran after its first
// good fingerprint (zero when it sent none).
func (s *supervisor) runOnce(ctx context.Context, first bool) (served time.Duration, err error) {
	p, err := s.start(ctx, first)
	if err != nil {
		s.reg.Down(s.name, "plugin not running: "+err.Error())
		return 0, fmt.Errorf("launch: %w", err)
	}
	defer func() {
		s.setCurrent(nil)
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.KillTimeout)
		defer cancel()
		p.Kill(kctx)
		if s.keep != nil {
			s.keep.forget(ctx)
		}
	}()
	s.setCurrent(p)
	s.reg.Running(s.name, p.Info().GetPluginVersion())
	s.log.Info("plugin running", "version", p.Info().GetPluginVersion())

	g, gctx := errgroup.WithContext(ctx)
	fingerprinted := make(chan struct{})
	var upAt time.Time // written by the fingerprint goroutine; read after g.Wait
	g.Go(func() error {
		select {
		case <-p.Exited():
			return exitError(p)
		case <-gctx.Done():
			return nil
		}
	})
	g.Go(func() error { return s.fingerprint(gctx, p, fingerprinted, &upAt) })
	g.Go(func() error {
		select {
		case <-fingerprinted:
			return s.statsLoop(gctx, p)
		case <-gctx.Done():
			return nil
		}
	})
	err = g.Wait()
	if err == nil { // ctx ended
		err = fmt.Errorf("plugin stopped: %w", context.Cause(ctx))
	}
	s.reg.Down(s.name, err.Error())
	s.stats.Clear(s.name)
	if !upAt.IsZero() {
		served = time.Since(upAt)
	}
	return served, err
}

// start launches the plugin, bounded by StartTimeout. On the first run of a kept plugin
// it first tries, within another StartTimeout, to reattach to the process a crashed host
// left running; a freshly launched kept plugin gets its reattach record saved.
func (s *supervisor) start(ctx context.Context, first bool) (plugin, error) {
	if s.keep != nil && first {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.StartTimeout)
		p := s.keep.reattach(rctx, s.bin, s.opts, s.launch)
		cancel()
		if p != nil {
			return p, nil
		}
	}
	lctx, cancel := context.WithTimeout(ctx, s.cfg.StartTimeout)
	p, err := s.launch(lctx, s.bin, s.opts)
	cancel()
	if err != nil {
		return nil, err
	}
	if s.keep != nil {
		s.keep.save(ctx, s.bin.Path, p)
	}
	return p, nil
}

func exitError(p plugin) error {
	return fmt.Errorf("%w: %s", errPluginExited, p.ExitReason())
}

// rpcError explains why an RPC to p failed: the plugin exited (go-plugin's done-context
// rule, pluginloader.RPCError), ctx ended, or the RPC itself failed (then what names it).
func rpcError(ctx context.Context, p plugin, what string, err error) error {
	err = pluginloader.RPCError(ctx, p, err)
	switch {
	case errors.Is(err, pluginloader.ErrExited):
		return exitError(p)
	case ctx.Err() != nil:
		return context.Cause(ctx)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// fingerprint consumes the fingerprint stream for one run. The first message must come
// within FingerprintTimeout. Each message is validated and charged against the host's
// byte budget: a refused one is logged (once while the same refusal repeats) and the
// last good inventory stays; a good one replaces the plugin's inventory, less the
// device IDs bound to other plugins (logged once per change, naming them and those plugins).
// The first good one sets *upAt, closes fingerprinted and calls onUp. It returns only
// with an error: the stream is the plugin's lifeline, so its end ends the run (and the
// plugin is restarted).
func (s *supervisor) fingerprint(ctx context.Context, p plugin, fingerprinted chan<- struct{}, upAt *time.Time) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	firstTimer := time.AfterFunc(s.cfg.FingerprintTimeout, func() { cancel(errNoFirstFingerprint) })
	defer firstTimer.Stop()

	stream, err := p.Client().Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		return s.fingerprintError(ctx, p, err)
	}
	// Refusals are handled here, once: logged, and shown as the plugin's last error.
	// Only an accepted fingerprint stops the first-fingerprint timer, so a plugin that
	// never sends one is restarted, not left running deviceless.
	var refusals repeats
	var lastRefused string
	for {
		resp, err := stream.Recv()
		if err != nil {
			return s.fingerprintError(ctx, p, err)
		}
		if verr := validate.Fingerprint(resp); verr != nil {
			msg := oneLine(verr)
			if isNew, _, _ := refusals.see(msg); isNew {
				// State first, then the log: whoever reads the log line finds the
				// plugin's last error already saying it.
				s.reg.Rejected(s.name, fmt.Errorf("fingerprint rejected: %s", msg))
				s.log.Error("fingerprint rejected; keeping the last good inventory", "violations", msg)
			}
			continue
		}
		refused, err := s.reg.SetFingerprint(s.name, resp)
		if err != nil {
			// Keyed by kind, not text: the sizes in it change with every message.
			if isNew, _, _ := refusals.see(budgetRefusal); isNew {
				s.reg.Rejected(s.name, err)
				s.log.Error("fingerprint refused; keeping the last good inventory", "error", err)
			}
			continue
		}
		refusals.reset()
		switch {
		case refused == nil:
			lastRefused = ""
		case refused.Error() != lastRefused:
			lastRefused = refused.Error()
			s.reg.PluginError(s.name, refused)
			for _, other := range slices.Sorted(maps.Keys(refused.ByPlugin)) {
				s.log.Error("device IDs bound to another plugin refused", "bound_to", other, "devices", inventory.ListIDs(refused.ByPlugin[other]))
			}
		}
		firstTimer.Stop()
		if fingerprinted != nil {
			*upAt = time.Now()
			close(fingerprinted)
			fingerprinted = nil
			s.up()
			if s.onUp != nil {
				s.onUp()
			}
		}
	}
}

func (s *supervisor) fingerprintError(ctx context.Context, p plugin, err error) error {
	switch {
	case context.Cause(ctx) == errNoFirstFingerprint:
		return fmt.Errorf("no fingerprint within %v of start: %w", s.cfg.FingerprintTimeout, errNoFirstFingerprint)
	case errors.Is(err, io.EOF):
		return errors.New("fingerprint stream ended")
	}
	return rpcError(ctx, p, "fingerprint stream", err)
}

// statsLoop keeps one stats stream open to the plugin for the run, reopening it with
// backoff when it fails or stalls. Every failure is logged with the plugin's error and
// recorded as the plugin's last error. It returns when ctx ends (nil) or the plugin
// exits (that error, ending the run).
//
// A failure identical to the one before is logged at DEBUG only, and the plugin's last
// error is not touched again; when the error changes, one line gives the count.
func (s *supervisor) statsLoop(ctx context.Context, p plugin) error {
	bo := s.backoff()
	var failures repeats
	for {
		started := time.Now()
		err := s.statsStream(ctx, p)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, errPluginExited) {
			return err
		}
		delay := bo.next(time.Since(started), 0)
		line := inventory.ErrorLine(err.Error())
		isNew, prev, times := failures.see(line)
		if times > 1 {
			s.log.Warn("stats stream failed repeatedly with the same error", "error", prev, "times", times)
		}
		if isNew {
			s.reg.PluginError(s.name, err)
			s.log.Warn("stats stream failed; retrying", "error", line, "retry_in", delay)
		} else {
			s.log.Debug("stats stream failed again with the same error; retrying", "error", line, "retry_in", delay)
		}
		if !sleep(ctx, delay) {
			return nil
		}
	}
}

// statsStream opens one stats stream and stores every message that validates, until
// the stream fails, stalls or ctx ends. Rejected messages are logged (once per distinct
// error in a row) and the last good stats stay.
func (s *supervisor) statsStream(ctx context.Context, p plugin) error {
	stall := max(statsStallFactor*s.cfg.StatsInterval, minStatsStall)
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	watchdog := time.AfterFunc(stall, func() { cancel(errStatsStalled) })
	defer watchdog.Stop()

	stream, err := p.Client().Stats(ctx, &pb.StatsRequest{Interval: durationpb.New(s.cfg.StatsInterval)})
	if err != nil {
		return s.statsError(ctx, p, err, stall)
	}
	var lastRejection string
	for {
		resp, err := stream.Recv()
		if err != nil {
			return s.statsError(ctx, p, err, stall)
		}
		watchdog.Reset(stall)
		if verr := validate.Stats(resp, s.reg.Known(s.name)); verr != nil {
			if msg := oneLine(verr); msg != lastRejection {
				lastRejection = msg
				s.log.Error("stats rejected; keeping the last good stats", "violations", msg)
			}
			continue
		}
		if err := s.stats.Set(s.name, resp, s.cfg.Now(), s.reg.StatsGroupCost(s.name)); err != nil {
			if lastRejection != budgetRefusal { // logged once in a row: the sizes change every message
				lastRejection = budgetRefusal
				s.log.Error("stats refused; keeping the last good stats", "error", err)
				s.reg.PluginError(s.name, err)
			}
			continue
		}
		lastRejection = ""
	}
}

func (s *supervisor) statsError(ctx context.Context, p plugin, err error, stall time.Duration) error {
	switch {
	case context.Cause(ctx) == errStatsStalled:
		return fmt.Errorf("no stats within %v: %w", stall, errStatsStalled)
	case errors.Is(err, io.EOF):
		return errors.New("stats stream ended")
	}
	return rpcError(ctx, p, "stats stream", err)
}

// reserve asks the running plugin to prepare deviceIDs. The call is bounded by ctx,
// ReserveTimeout and the plugin's exit; errors wrap device.ErrPluginUnavailable when the
// plugin is down or silent, and device.ErrPluginResponse when it refused. The answer is
// not validated here.
func (s *supervisor) reserve(ctx context.Context, deviceIDs []string) (*pb.ContainerReservation, error) {
	var resp *pb.ReserveResponse
	err := s.call(ctx, "reserve", func(ctx context.Context, c pb.DevicePluginClient) error {
		var err error
		resp, err = c.Reserve(ctx, &pb.ReserveRequest{DeviceIds: deviceIDs})
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp.GetReservation(), nil
}

// release asks the running plugin to clean up after a reservation. A plugin without
// cleanup (UNIMPLEMENTED) counts as done. Bounded and wrapped like reserve.
func (s *supervisor) release(ctx context.Context, reservationID string, deviceIDs []string) error {
	err := s.call(ctx, "release", func(ctx context.Context, c pb.DevicePluginClient) error {
		_, err := c.Release(ctx, &pb.ReleaseRequest{ReservationId: reservationID, DeviceIds: deviceIDs})
		return err
	})
	if status.Code(errors.Unwrap(err)) == codes.Unimplemented {
		return nil
	}
	return err
}

// call runs one unary RPC on the running plugin, bounded by ctx, ReserveTimeout and the
// plugin's exit, and wraps its failure with the manager's sentinel errors. A failure
// that looks like a dead connection is an exit when pluginloader.RPCError says so.
func (s *supervisor) call(ctx context.Context, what string, rpc func(context.Context, pb.DevicePluginClient) error) error {
	p := s.current()
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
	}
	return fmt.Errorf("plugin %q refused %s: %s: %w", s.name, what, inventory.ErrorLine(status.Convert(err).Message()), device.ErrPluginResponse)
}
