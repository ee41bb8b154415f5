// Package manager is the device manager: it runs every device plugin under its own
// supervisor (manager/supervise), keeps what they report in one inventory
// (manager/inventory) and their reservations in the durable ledger (manager/ledger),
// and routes Reserve to the plugin the devices are bound to. It implements the
// contract in package device; the gRPC server depends on that contract only.
//
// See docs/plugins.md#how-the-manager-runs-a-plugin for its failure rules per plugin,
// the changing plugin set and the reading order of its files.
package manager

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/gc"
	"github.com/devicehost/devicehost/manager/inventory"
	"github.com/devicehost/devicehost/manager/ledger"
	"github.com/devicehost/devicehost/manager/supervise"
	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/textline"
)

// Manager is the device manager. New starts it; Shutdown stops it. All methods are safe
// for concurrent use.
type Manager struct {
	cfg    Config
	log    hclog.Logger
	reg    *inventory.Registry
	stats  *inventory.Stats
	store  reservationStore // ledger, or a test's wrapper of it
	ledger *ledger.Ledger
	gc     *gc.GC // runs on ledger
	// tempState is the temporary directory holding ledger when no StateDir is set,
	// removed once the ledger is closed; "" with a StateDir.
	tempState string
	launch    supervise.LaunchFunc
	dir       *pluginloader.DirWatch // follows PluginDir; nil without one

	// reconfMu serialises changes to the plugin set (New, SetPlugins, the dir watcher);
	// it is held while they wait for stopped supervisors. It guards the fields below
	// down to supsMu.
	reconfMu    sync.Mutex
	pluginCfg   map[string]PluginConfig           // the per-plugin settings in force
	dirBins     map[string]pluginloader.DirBinary // the plugin dir's settled binaries
	dupLogged   map[string]string                 // dir binary not run for its name -> its path, logged
	saved       map[string]*reattachRecord        // reattach records for kept plugins' first supervisors
	sockets     string                            // socketDir's answer, once socketsMade
	socketsMade bool
	started     bool // New's first plugins are running: later ones are logged as added

	// supsMu guards slots, gone and closed. Lookups take it briefly; it is never held
	// while waiting for a plugin.
	supsMu sync.RWMutex
	slots  map[string]*slot     // this host's plugins, by name
	gone   map[string]time.Time // plugins removed (not configured), by name -> when
	closed bool                 // Shutdown has begun: no supervisor is started any more

	cancel   context.CancelFunc // ends the GC, the stats tick, the readiness timer and the dir watcher
	wg       sync.WaitGroup     // supervisors, the GC, the stats tick, the readiness timer and the dir watcher
	stopped  chan struct{}      // closed when wg is done and the ledger closed
	closeErr error              // closing the ledger; written before stopped is closed
	stopping atomic.Bool

	// intentMu guards intentUp: the plugins up since answerLeftIntents last looked,
	// woken through intentWake (buffered 1).
	intentMu   sync.Mutex
	intentUp   map[string]bool
	intentWake chan struct{}
	// answered is closed when the intents left by a stop have their answer (or ctx
	// ends); ready when that and the first fingerprints are in (Ready).
	answered chan struct{}
	ready    chan struct{}

	claimMu sync.Mutex
	claims  map[string]string // device ID -> owner with a Reserve in flight
	// cleaning: device ID -> closed when the plugin cleanup in flight for it ends.
	cleaning map[string]chan struct{}
	// setLocks serialise the Reserves of one counter set (lockCounterSets); created on
	// first use, under claimMu.
	setLocks map[device.CounterSetKey]chan struct{}
}

var _ device.Manager = (*Manager)(nil)

// New finds the plugins (cfg.PluginDir plus cfg.Binaries), opens the reservation ledger
// in cfg.StateDir (without one, in a temporary directory), and starts the manager: one
// supervisor per plugin (reattaching to kept plugins a crashed host left running), the
// plugin dir watcher, the ledger's garbage collector, the stats fan-out and the
// readiness timer. It fails when the config
// is invalid, the plugin dir cannot be read safely, two plugins share a name, or the
// state file cannot be used (a *ledger.StateFileError says why and how to recover). The
// caller must call Shutdown, which also stops the plugins started later.
func New(cfg Config) (*Manager, error) {
	return newManager(cfg, supervise.LaunchProcess)
}

// newManager is New with the plugin launcher chosen by the caller (tests run plugins
// in-process, or keep processes alive to play a crashed host).
func newManager(cfg Config, launch supervise.LaunchFunc) (*Manager, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	log := cfg.Logger.Named("manager")
	m := &Manager{
		cfg:        cfg,
		log:        log,
		launch:     launch,
		stats:      inventory.NewStats(cfg.StatsInterval, cfg.Now),
		pluginCfg:  cfg.Plugins,
		dupLogged:  make(map[string]string),
		slots:      make(map[string]*slot),
		gone:       make(map[string]time.Time),
		stopped:    make(chan struct{}),
		claims:     make(map[string]string),
		cleaning:   make(map[string]chan struct{}),
		intentUp:   make(map[string]bool),
		intentWake: make(chan struct{}, 1),
		answered:   make(chan struct{}),
		ready:      make(chan struct{}),
		setLocks:   make(map[device.CounterSetKey]chan struct{}),
	}
	var dirBins []pluginloader.Binary
	var refused string
	if cfg.PluginDir != "" {
		abs, err := filepath.Abs(cfg.PluginDir)
		if err != nil {
			return nil, fmt.Errorf("plugin dir %s: %w", cfg.PluginDir, err)
		}
		// Watch before listing, so that nothing added meanwhile is missed.
		if _, err := os.Stat(abs); errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("plugin dir %s: %w", abs, ErrNoPluginDir)
		}
		m.dir = pluginloader.WatchDir(abs, pluginloader.DirWatchConfig{
			Settle: cfg.PluginDirSettle, Rescan: cfg.PluginDirRescan, Log: log, Apply: m.setDirBinaries})
		if dirBins, refused, err = discoverDir(cfg.PluginDir, log); err != nil {
			m.dir.Close()
			return nil, err
		}
	}
	if err := checkNames(dirBins, cfg.Binaries); err != nil {
		m.closeDir()
		return nil, err
	}

	stateDir := cfg.StateDir
	if stateDir == "" {
		if stateDir, err = os.MkdirTemp("", "devicehost-state-"); err != nil {
			m.closeDir()
			return nil, fmt.Errorf("temporary state dir: %w", err)
		}
		m.tempState = stateDir
		log.Warn("no state dir: reservations are kept in a temporary ledger, removed at shutdown and lost when the process ends", "dir", stateDir)
	}
	if m.ledger, err = openLedger(stateDir, cfg); err != nil {
		m.closeDir()
		_ = m.removeTempState() // the open error is the one to report
		return nil, err
	}
	m.store = m.ledger
	m.gc, err = gc.New(m.ledger, gc.Config{
		Logger:          log.Named("gc"),
		Cleanup:         m.cleanup,
		MaxReservations: cfg.GCMaxReservations,
		Interval:        cfg.GCInterval,
		Parallel:        cfg.GCParallelDestroys,
		CleanupTimeout:  cfg.ReserveTimeout,
		RetryMin:        cfg.gcRetryMin,
	})
	if err != nil { // withDefaults refused what gc.New would
		_ = m.ledger.Close() // nothing was written; the config error is the one to report
		m.closeDir()
		_ = m.removeTempState() // the config error is the one to report
		return nil, fmt.Errorf("manager config: %w", err)
	}

	kept := make(map[string]bool)
	for _, bin := range append(slices.Clone(cfg.Binaries), dirBins...) {
		if cfg.Plugins[bin.Name].Reattach {
			kept[bin.Name] = true
		}
	}
	m.saved = loadReattachRecords(m.ledger, kept, log)
	bindings, err := m.ledger.DeviceBindings()
	if err != nil {
		// The readable records still hold; a damaged one costs its ID's protection.
		log.Error("device binding records unreadable; those IDs will be bound to the first plugin to report them", "error", textline.Line(err.Error(), 0))
	}
	m.reg = inventory.New(inventory.Config{
		Logger:       log,
		Now:          cfg.Now,
		Holders:      m.store.Holders,
		Cordons:      m.ledger.Cordons,
		AdminAccess:  m.ledger.AccessByDevice,
		CounterUse:   m.store.Usage,
		Store:        m.ledger,
		StoreTimeout: ledgerWriteTimeout,
		Bindings:     bindings,
	})

	// The first plugins: every record is made before any supervisor starts, so none of
	// them settles Ready alone.
	m.reconfMu.Lock()
	if m.dir != nil {
		m.dirBins = m.dir.Start(dirBins, refused)
	}
	m.reconcileLocked(false)
	m.started = true
	m.reconfMu.Unlock()
	m.reg.CheckReady()
	for plugin, n := range m.reg.Orphans() {
		log.Info("device IDs bound to a plugin this host does not run; they will be bound to the first plugin to report them",
			"previous_plugin", plugin, "devices", n)
	}

	ctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	m.wg.Go(func() {
		if err := m.gc.Run(ctx); err != nil {
			m.log.Error("garbage collector stopped", "error", err)
		}
	})
	if m.dir != nil {
		m.wg.Go(func() { m.dir.Run(ctx) })
	}
	m.wg.Go(func() { m.stats.Run(ctx, func() device.Inventory { return m.reg.Snapshot().Inventory }) })
	if left := intentIDs(m.ledger.Intents()); len(left) > 0 {
		log.Warn("reservations left without their answer by a stop: their devices stay held, and each plugin is asked again once it is up",
			"reservations", len(left))
		m.wg.Go(func() {
			defer close(m.answered)
			m.answerLeftIntents(ctx, left)
		})
	} else {
		close(m.answered)
	}
	m.wg.Go(func() { m.readyTimer(ctx) })
	go func() { // ends when the goroutines above have; Shutdown waits for it
		m.wg.Wait()
		m.closeErr = m.ledger.Close()
		if m.closeErr == nil {
			m.closeErr = m.removeTempState()
		}
		close(m.stopped)
	}()
	return m, nil
}

// closeDir stops watching the plugin dir, for a New that fails.
func (m *Manager) closeDir() {
	if m.dir != nil {
		m.dir.Close()
	}
}

// removeTempState removes the temporary state dir, if the manager made one.
func (m *Manager) removeTempState() error {
	if m.tempState == "" {
		return nil
	}
	if err := os.RemoveAll(m.tempState); err != nil {
		return fmt.Errorf("remove temporary state dir: %w", err)
	}
	return nil
}

// openLedger opens the reservation ledger in dir, creating the dir (0700).
func openLedger(dir string, cfg Config) (*ledger.Ledger, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("state dir: %w", err)
	}
	return ledger.Open(filepath.Join(dir, ledger.DefaultFileName), ledger.Options{
		Logger:      cfg.Logger.Named("manager").Named("ledger"),
		Now:         cfg.Now,
		OnCommit:    cfg.OnLedgerCommit,
		MaxEvents:   cfg.MaxEvents,
		MaxEventAge: cfg.MaxEventAge,
	})
}

// cleanup is the GC's plugin cleanup: the Release RPC of e's plugin, bounded by
// ctx (the GC's CleanupTimeout, which is ReserveTimeout) and the plugin's exit. An error
// (plugin down, silent or refusing) keeps the cleanup pending for a retry. So does a
// plugin that is not running but may come back: one configured without a binary, or
// one removed less than RemovedPluginGrace ago. Any other plugin cannot clean up: that
// is logged, once, and counted done. Called by the GC's workers, at most
// GCParallelDestroys at once.
//
// Devices the plugin says it keeps nothing for (device.DeviceInfo.NothingToRelease, in
// the inventory now) are left out of the call, and a cleanup of only such devices is
// done without one. Devices a newer live reservation holds are left out of the call
// too: what the plugin keeps for them is that reservation's now (a cleanup that ran
// before a host stop and is run again after it, or one owed while the device was
// reserved again). A Reserve of the devices waits while the plugin cleans up
// (claimForCleanup), so the plugin never prepares a device for a new holder while it
// cleans up after the old one.
func (m *Manager) cleanup(ctx context.Context, e gc.Entry) error {
	owed := owingRelease(m.reg.Snapshot(), e.Group, e.DeviceIDs)
	if len(owed) == 0 {
		return nil // the plugin keeps nothing for these devices (NothingToRelease)
	}
	s, wait := m.cleanupTarget(e.Plugin)
	switch {
	case s != nil:
		release, err := m.claimForCleanup(ctx, e.ReservationID, owed)
		if err != nil {
			return fmt.Errorf("cleanup waits for a Reserve of its devices: %w", err)
		}
		defer release()
		held := m.ledger.Holders()
		var ids []string
		for _, d := range owed {
			if _, ok := held[d]; !ok {
				ids = append(ids, d)
			}
		}
		if len(ids) < len(owed) {
			m.log.Info("plugin cleanup of a released reservation leaves out devices a newer reservation holds",
				"plugin", e.Plugin, "reservation_id", e.ReservationID, "devices", strings.Join(e.DeviceIDs, ","), "cleaned", strings.Join(ids, ","))
		}
		if len(ids) == 0 {
			return nil
		}
		return s.Release(ctx, e.ReservationID, ids)
	case wait != nil:
		return wait
	}
	m.log.Warn("plugin cleanup of a released reservation skipped: its plugin is not one of this host's any more",
		"plugin", e.Plugin, "reservation_id", e.ReservationID, "owner_id", e.OwnerID, "devices", strings.Join(e.DeviceIDs, ","))
	return nil
}

// missingReason is why a configured plugin has no binary, as its last error.
func missingReason(pluginDir string) string {
	if pluginDir == "" {
		return "no such plugin binary: no plugin dir is set"
	}
	return "no such plugin binary in " + pluginDir
}

// missingPath is where a configured plugin's binary would be; "" without a plugin dir.
func missingPath(pluginDir, name string) string {
	if pluginDir == "" {
		return ""
	}
	return filepath.Join(pluginDir, name)
}

// discoverDir lists the plugins in dir. It fails when none is usable and the dir or
// some binaries were refused; refused binaries beside usable ones are logged and left
// out, and refused is the error logged about them.
func discoverDir(dir string, log hclog.Logger) (bins []pluginloader.Binary, refused string, err error) {
	found, err := pluginloader.Discover(dir, log)
	switch {
	case err != nil && len(found) == 0:
		return nil, "", fmt.Errorf("discover plugins in %s: %w", dir, err)
	case err != nil:
		// Some binaries were refused (the trust check); run the others.
		log.Error("plugins refused and not run", "plugin_dir", dir, "error", textline.Line(err.Error(), 0))
		refused = textline.Line(err.Error(), 0)
	}
	return found, refused, nil
}

// checkNames refuses a plugin name that appears twice among the discovered and the
// explicit binaries.
func checkNames(found, explicit []pluginloader.Binary) error {
	seen := make(map[string]string)
	for _, b := range append(slices.Clone(found), explicit...) {
		if prev, dup := seen[b.Name]; dup {
			return fmt.Errorf("two plugins named %q: %s and %s", b.Name, prev, b.Path)
		}
		seen[b.Name] = b.Path
	}
	return nil
}

// readyTimer closes Ready after ReadyTimeout if the plugins have not settled by then.
func (m *Manager) readyTimer(ctx context.Context) {
	t := time.NewTimer(m.cfg.ReadyTimeout)
	defer t.Stop()
	fingerprinted, answered := m.reg.Ready(), m.answered
	for fingerprinted != nil || answered != nil {
		select {
		case <-ctx.Done():
			return
		case <-fingerprinted:
			fingerprinted = nil
		case <-answered:
			answered = nil
		case <-t.C:
			if waiting := m.reg.ForceReady(); len(waiting) > 0 {
				m.log.Warn("ready without a first fingerprint from some plugins", "timeout", m.cfg.ReadyTimeout, "plugins", strings.Join(waiting, ", "))
			}
			if answered != nil {
				left := m.ledger.Intents()
				m.log.Warn("ready with reservations still without their answer: they are listed once their plugins have answered again",
					"timeout", m.cfg.ReadyTimeout, "reservations", len(left))
			}
			fingerprinted, answered = nil, nil
		}
	}
	close(m.ready)
}

// Inventory returns the current inventory of every plugin.
func (m *Manager) Inventory() device.Inventory { return m.reg.Snapshot().Inventory }

// State returns the current device health and holders, and plugin status.
func (m *Manager) State() device.State { return m.reg.Snapshot().State }

// Snapshot returns the current inventory and state together.
func (m *Manager) Snapshot() device.Snapshot { return m.reg.Snapshot() }

// Watch delivers the current snapshot at once and then the latest one on every change;
// the channel is closed when ctx ends or the manager shuts down.
func (m *Manager) Watch(ctx context.Context) <-chan device.Snapshot { return m.reg.Watch(ctx) }

// WatchStats delivers the latest stats of every plugin at once and then every interval
// (at least the sampling interval, rounded up to a multiple of it; zero means the
// sampling interval). The channel is closed when ctx ends or the manager shuts down.
func (m *Manager) WatchStats(ctx context.Context, interval time.Duration) <-chan device.StatsSnapshot {
	return m.stats.Watch(ctx, interval, m.Inventory())
}

// LatestStats returns the latest stats of every plugin, grouped as the inventory groups
// them: what the plugins' stats streams last brought, read without asking any plugin
// and without waiting for the next sampling tick, so callers that poll (a metrics
// scrape) cost the plugins nothing however often they ask. Safe for concurrent use;
// the snapshot is immutable.
func (m *Manager) LatestStats() device.StatsSnapshot { return m.stats.Latest(m.Inventory()) }

// Ready is closed once every plugin has had its first attempt (fingerprinted, had a
// fingerprint refused, or failed a run) and the reservations a stop left without their
// answer have it again (see answerLeftIntents), or ReadyTimeout has passed.
func (m *Manager) Ready() <-chan struct{} { return m.ready }

// Started is closed once every plugin has been launched (its config accepted), failed a
// run, or failed for good, or when Ready closes: the moment the agent may serve without
// a plugin's rejection of its config still to come.
func (m *Manager) Started() <-chan struct{} { return m.reg.Started() }

// WaitForFirstFingerprint waits for Ready and returns the inventory then. It fails only
// when ctx ends first.
func (m *Manager) WaitForFirstFingerprint(ctx context.Context) (device.Inventory, error) {
	select {
	case <-m.ready:
		return m.Inventory(), nil
	case <-ctx.Done():
		return device.Inventory{}, fmt.Errorf("waiting for first fingerprints: %w", context.Cause(ctx))
	}
}

// Shutdown stops every plugin and goroutine the manager started, closes every watch
// channel and, once all of that has stopped, the ledger, removing its temporary
// directory when no StateDir was set (kept plugins are stopped too, and their reattach
// records deleted: a graceful stop means stop). It returns when they are all gone (with
// the error closing the ledger or removing that directory, if any), or with ctx's error when ctx ends
// first (the plugins are still being stopped then; a later Shutdown waits again).
func (m *Manager) Shutdown(ctx context.Context) error {
	m.stopping.Store(true)
	m.supsMu.Lock()
	m.closed = true
	for _, sl := range m.slots {
		if sl.cancel != nil {
			sl.cancel(nil)
		}
	}
	m.supsMu.Unlock()
	m.cancel()
	m.reg.Close()
	m.stats.Close()
	select {
	case <-m.stopped:
		return m.closeErr
	case <-ctx.Done():
		return fmt.Errorf("manager shutdown: %w", context.Cause(ctx))
	}
}
