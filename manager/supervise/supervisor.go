// Package supervise runs one device plugin for the manager: a Supervisor launches it (or
// reattaches to the process a crashed host left running, through a Keeper), consumes its
// fingerprint and stats streams into the inventory, restarts it with backoff when a run
// fails, and makes its unary RPCs bounded by the plugin's exit. Reading order:
// supervisor.go, streams.go, calls.go, backoff.go, repeats.go.
// See docs/plugins.md#how-the-manager-runs-a-plugin.
package supervise

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sync/errgroup"

	"github.com/devicehost/devicehost/backoff"
	"github.com/devicehost/devicehost/manager/inventory"
	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Plugin is what a supervisor needs of a launched plugin process. *pluginloader.Plugin
// implements it; tests substitute in-process plugins.
type Plugin interface {
	Client() pb.DevicePluginClient
	Info() *pb.GetPluginInfoResponse
	// Exited is closed once the process has exited; ExitReason then says why. They are
	// what pluginloader.CallContext and RPCError read to tell a plugin's exit from a
	// failed RPC.
	pluginloader.Process
	// CheckConfig asks the process whether it would accept configJSON, changing
	// nothing in it; its errors are pluginloader's (*Plugin).CheckConfig's.
	CheckConfig(ctx context.Context, configJSON []byte) error
	// Kill stops the process (gracefully, then forcefully when ctx ends); called exactly
	// once per launched plugin.
	Kill(ctx context.Context)
}

// LaunchFunc starts (or, with opts.Reattach, reattaches to) a plugin. ctx bounds the
// launch only. It is the seam where reattaching to plugins that survived a host restart
// plugs in, and where tests run plugins in-process.
type LaunchFunc func(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options) (Plugin, error)

// LaunchProcess launches a real plugin process with pluginloader.
func LaunchProcess(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options) (Plugin, error) {
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

var (
	errNoFirstFingerprint = errors.New("no first fingerprint in time")
	errStatsStalled       = errors.New("stats stream stalled")
	errReserveTimeout     = errors.New("reserve timed out")
	errPluginExited       = errors.New("plugin exited")
)

// Keeper keeps one plugin's process across host crashes (manager's PluginConfig.Reattach).
// Only the plugin's supervisor goroutine calls it.
type Keeper interface {
	// Reattach attaches to the process a crashed host left running, if there is one
	// and it checks out, and returns it; nil otherwise. launch is called with
	// opts.Reattach set; ctx bounds the whole attempt.
	Reattach(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options, launch LaunchFunc) Plugin
	// Save records a freshly launched p (from path) for a later host to reattach to.
	Save(ctx context.Context, path string, p Plugin)
	// Forget deletes that record: the process is gone or not to be used.
	Forget(ctx context.Context)
}

// Config is what a Supervisor runs with. Every field is required unless it says
// otherwise; the durations are the manager's Config's, with defaults filled in.
type Config struct {
	Name    string
	Binary  pluginloader.Binary
	Options pluginloader.Options
	Launch  LaunchFunc
	// Inventory and Stats get what the plugin reports and how its runs go.
	Inventory *inventory.Registry
	Stats     *inventory.Stats
	Logger    hclog.Logger // the plugin's: With("plugin", name)
	Keeper    Keeper       // nil: the plugin is not kept across host crashes
	OnUp      func()       // nil, or called after each run's first good fingerprint
	// Live, when set, returns the live reservations of the plugin's devices, which the
	// plugin is handed (Reconcile) after each start, before any Reserve reaches it.
	Live func(ctx context.Context) ([]*pb.LiveReservation, error)
	Now  func() time.Time

	RestartBaseDelay, RestartMaxDelay time.Duration // restart backoff, ±20% jitter
	StableRunReset, ServedReset       time.Duration // see restartBackoff
	StartTimeout                      time.Duration // a launch, and a reattach
	FingerprintTimeout                time.Duration // the first fingerprint of a run
	StatsInterval                     time.Duration // the sampling interval asked of the plugin
	ReserveTimeout                    time.Duration // one Reserve or Release RPC
	KillTimeout                       time.Duration // a graceful stop, before the kill
}

// Supervisor owns one plugin: it launches it, consumes its fingerprints and stats, and
// restarts it with backoff when it fails. Run is its only long-lived goroutine (with the
// per-run stream goroutines it starts and joins). Reserve, Release, CheckConfig and
// Current may be called from any goroutine.
type Supervisor struct {
	name   string
	bin    pluginloader.Binary
	opts   pluginloader.Options
	cfg    Config
	launch LaunchFunc
	reg    *inventory.Registry
	stats  *inventory.Stats
	log    hclog.Logger
	keep   Keeper // nil: the plugin is not kept across host crashes
	onUp   func() // nil, or called after each run's first good fingerprint

	mu  sync.Mutex
	cur Plugin // the running plugin; nil between runs

	stopsMu sync.Mutex
	stops   repeats // the errors that ended runs, in a row: logged once per change
}

// New returns the supervisor of cfg's plugin; Run runs it.
func New(cfg Config) *Supervisor {
	return &Supervisor{
		name:   cfg.Name,
		bin:    cfg.Binary,
		opts:   cfg.Options,
		cfg:    cfg,
		launch: cfg.Launch,
		reg:    cfg.Inventory,
		stats:  cfg.Stats,
		log:    cfg.Logger,
		keep:   cfg.Keeper,
		onUp:   cfg.OnUp,
	}
}

// Name returns the plugin's name.
func (s *Supervisor) Name() string { return s.name }

// Current returns the running plugin; nil between runs.
func (s *Supervisor) Current() Plugin {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

func (s *Supervisor) setCurrent(p Plugin) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur = p
}

func (s *Supervisor) backoff() restartBackoff {
	return restartBackoff{
		Backoff: backoff.Backoff{Base: s.cfg.RestartBaseDelay, Max: s.cfg.RestartMaxDelay, Jitter: nil},
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
func (s *Supervisor) Run(ctx context.Context) error {
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
func (s *Supervisor) up() {
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
func (s *Supervisor) runOnce(ctx context.Context, first bool) (served time.Duration, err error) {
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
			s.keep.Forget(ctx)
		}
	}()
	s.reconcile(ctx, p)
	s.setCurrent(p)
	s.reg.Running(s.name, p.Info().GetPluginVersion())
	s.log.Info("plugin running", "version", p.Info().GetPluginVersion())

	g, gctx := errgroup.WithContext(ctx)
	fingerprinted := make(chan struct{})
	var upAt time.Time // written by the fingerprint goroutine; read after g.Wait
	g.Go(func() error {
		select {
		case <-p.ExitContext().Done():
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
func (s *Supervisor) start(ctx context.Context, first bool) (Plugin, error) {
	if s.keep != nil && first {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.StartTimeout)
		p := s.keep.Reattach(rctx, s.bin, s.opts, s.launch)
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
		s.keep.Save(ctx, s.bin.Path, p)
	}
	return p, nil
}

func exitError(p Plugin) error {
	return fmt.Errorf("%w: %s", errPluginExited, p.ExitReason())
}

// rpcError explains why an RPC to p failed: the plugin exited (go-plugin's done-context
// rule, pluginloader.RPCError), ctx ended, or the RPC itself failed (then what names it).
func rpcError(ctx context.Context, p Plugin, what string, err error) error {
	err = pluginloader.RPCError(ctx, p, err)
	switch {
	case errors.Is(err, pluginloader.ErrExited):
		return exitError(p)
	case ctx.Err() != nil:
		return context.Cause(ctx)
	}
	return fmt.Errorf("%s: %w", what, err)
}
