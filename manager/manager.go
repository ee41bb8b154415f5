// Package manager is the device manager: it runs every device plugin under its own
// supervisor, aggregates their fingerprints into one inventory, keeps device health and
// plugin status, samples stats once per plugin and fans them out, and routes Reserve to
// the plugin that owns the devices.
//
// It implements the contract in manager/device; the gRPC server depends on that contract
// only.
//
// Failure rules, per plugin:
//   - The process exiting, its fingerprint stream ending or failing, or no first
//     fingerprint within FingerprintTimeout ends the run: the plugin's devices turn
//     unhealthy at once with the reason ("plugin exited: signal: killed"), the process is
//     killed, and it is relaunched after a backoff (RestartBaseDelay doubling up to
//     RestartMaxDelay, ±20% jitter, reset after a run of StableRunReset or one that
//     served, after its first accepted fingerprint, for ServedReset). The fingerprint
//     stream is the plugin's health signal, so losing it is treated like a crash rather
//     than retried on a process the manager can no longer vouch for.
//   - A launch refused for a reason retrying cannot fix (pluginloader's
//     ErrChecksumMismatch, ErrProtocolVersion, ErrConfigRejected, ErrInsecurePath, ErrNotPlugin) marks
//     the plugin failed and it is not restarted: the operator fixes the binary or config
//     and restarts the host.
//   - A stats stream that fails or stays silent is reopened with the same backoff on the
//     running process; stats are not a health signal.
//   - A fingerprint or stats message that breaks a validation rule is logged with the
//     plugin and the rules and dropped; the last good one stays. So is one that would
//     take the host API's Fingerprint or Stats message over MaxSnapshotBytes or
//     MaxStatsSnapshotBytes (see budget.go), with the plugin, its size and the limit.
//   - A device ID belongs to the first plugin that reported it, for good: across that
//     plugin's restarts, while it does not report it, and, with StateDir, across host
//     restarts (the ledger's owners records). Another plugin reporting it gets it
//     refused (logged at ERROR with both plugins and the IDs, and its last error), so
//     Reserve of it only ever reaches the owner. An ID whose owner is not one of this
//     host's plugins any more (no binary and no config block) goes to the next plugin
//     that reports it.
//   - A plugin's last error and its devices' down reason are kept as one line of at
//     most 300 bytes. A run or stats stream that fails with the same error as the one
//     before is logged at DEBUG; the count is logged when the error changes.
//   - Ready waits for each plugin's first attempt only: a plugin settles when it
//     fingerprints, when a fingerprint of it is refused, or when its first run fails
//     (its start and first-fingerprint deadlines bound a hang). A configured plugin
//     without a binary is listed failed and settled from the start.
//
// Reservations, with StateDir set, live in the durable ledger (manager/ledger): Reserve
// answers once the reservation is fsynced, and Release once the release is. The ledger's
// garbage collector, run by the manager, owns the plugin side of a release: it calls the
// owning plugin's Release RPC (bounded by ReserveTimeout) for every released reservation
// whose cleanup is pending, keeps the cleanup pending and retries it with backoff while
// the plugin is down or refuses, retries at once when the plugin fingerprints again, and
// deletes released reservations per GCInterval and GCMaxReservations. A plugin answering
// UNIMPLEMENTED has nothing to clean. A reservation whose plugin is no longer configured
// is logged once and counted as cleaned: no plugin of this host can do it, and keeping
// it pending would keep it from ever being deleted.
package manager

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	goplugin "github.com/hashicorp/go-plugin"

	"github.com/devicehost/devicehost/manager/device"
	"github.com/devicehost/devicehost/manager/ledger"
	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/validate"
)

// Manager is the device manager. New starts it; Shutdown stops it. All methods are safe
// for concurrent use.
type Manager struct {
	cfg    Config
	log    hclog.Logger
	reg    *registry
	stats  *statsHub
	store  reservationStore
	ledger *ledger.Ledger         // the durable store behind store; nil without StateDir
	gc     *ledger.GC             // runs on ledger; nil without it
	sups   map[string]*supervisor // by plugin name; fixed after New

	cancel   context.CancelFunc // ends every goroutine New started
	wg       sync.WaitGroup     // supervisors, the GC, the stats tick and the readiness timer
	stopped  chan struct{}      // closed when wg is done and the ledger closed
	closeErr error              // closing the ledger; written before stopped is closed
	stopping atomic.Bool

	claimMu sync.Mutex
	claims  map[string]string // device ID -> owner with a Reserve in flight
}

var _ device.Manager = (*Manager)(nil)

// New finds the plugins (cfg.PluginDir plus cfg.Binaries), opens the reservation ledger
// in cfg.StateDir, and starts the manager: one supervisor per plugin (reattaching to
// kept plugins a crashed host left running), the ledger's garbage collector, the stats
// fan-out and the readiness timer. It fails when the config is invalid, the plugin dir
// cannot be read safely, two plugins share a name, or the state file cannot be used (a
// *ledger.StateFileError says why and how to recover). The caller must call Shutdown.
func New(cfg Config) (*Manager, error) {
	return newManager(cfg, launchProcess)
}

// newManager is New with the plugin launcher chosen by the caller (tests run plugins
// in-process, or keep processes alive to play a crashed host).
func newManager(cfg Config, launch launchFunc) (*Manager, error) {
	cfg, notes, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	log := cfg.Logger.Named("manager")
	for _, n := range notes {
		log.Warn(n)
	}
	bins, err := pluginBinaries(cfg, log)
	if err != nil {
		return nil, err
	}
	missing := make(map[string]string) // configured plugin without a binary -> why
	for _, name := range cfg.pluginNames() {
		if !slices.ContainsFunc(bins, func(b pluginloader.Binary) bool { return b.Name == name }) {
			missing[name] = missingReason(cfg.PluginDir)
			log.Error("plugin configured but not found; listed as failed", "plugin", name, "error", missing[name])
		}
	}

	m := &Manager{
		cfg:     cfg,
		log:     log,
		stats:   newStatsHub(cfg.StatsInterval, cfg.Now),
		sups:    make(map[string]*supervisor, len(bins)),
		stopped: make(chan struct{}),
		claims:  make(map[string]string),
	}
	if cfg.StateDir == "" {
		log.Warn("no state dir: reservations are kept in memory only, lost when the process ends, and never garbage-collected or cleaned up by their plugins")
		m.store = newMemStore()
	} else {
		if m.ledger, err = openLedger(cfg); err != nil {
			return nil, err
		}
		m.store = m.ledger
		m.gc, err = ledger.NewGC(m.ledger, ledger.GCConfig{
			Logger:          log.Named("gc"),
			Cleanup:         m.cleanup,
			MaxReservations: cfg.GCMaxReservations,
			Interval:        cfg.GCInterval,
			Parallel:        cfg.GCParallelDestroys,
			CleanupTimeout:  cfg.ReserveTimeout,
			RetryMin:        cfg.gcRetryMin,
		})
		if err != nil { // withDefaults refused what NewGC would
			_ = m.ledger.Close() // nothing was written; the config error is the one to report
			return nil, fmt.Errorf("manager config: %w", err)
		}
	}

	var saved map[string]*reattachRecord
	var sockets string
	if m.ledger != nil {
		kept := make(map[string]bool)
		for _, bin := range bins {
			if cfg.Plugins[bin.Name].Reattach {
				kept[bin.Name] = true
			}
		}
		saved = loadReattachRecords(m.ledger, kept, log)
		if len(kept) > 0 {
			sockets = socketDir(cfg.StateDir, log)
		}
	}
	var owners map[string]string
	var ownerRecords ownerStore
	if m.ledger != nil {
		ownerRecords = m.ledger
		if owners, err = m.ledger.DeviceOwners(); err != nil {
			// The readable records still hold; a damaged one costs its ID's protection.
			log.Error("device owner records unreadable; the first plugin to report those IDs will own them", "error", oneLine(err))
		}
	}
	m.reg = newRegistry(log, cfg.Now, m.store.Holders, ownerRecords, owners)
	for name, reason := range missing {
		m.reg.addMissing(name, missingPath(cfg.PluginDir, name), reason)
	}
	for _, bin := range bins {
		pc := cfg.Plugins[bin.Name]
		m.reg.addPlugin(bin.Name, bin.Path)
		s := &supervisor{
			name: bin.Name,
			bin:  bin,
			opts: pluginloader.Options{
				Logger:          cfg.Logger,
				StartTimeout:    cfg.StartTimeout,
				SHA256:          pc.SHA256,
				Env:             pc.Env,
				InheritEnv:      pc.InheritEnv,
				ConfigJSON:      pc.ConfigJSON,
				DisableAutoMTLS: pc.Reattach,
				SurviveHost:     pc.Reattach,
			},
			cfg:    cfg,
			launch: launch,
			reg:    m.reg,
			stats:  m.stats,
			log:    log.With("plugin", bin.Name),
		}
		if m.gc != nil {
			s.onUp = m.gc.RetryNow
		}
		if pc.Reattach {
			s.keep = &keeper{name: bin.Name, led: m.ledger, log: s.log, saved: saved[bin.Name]}
			if sockets != "" {
				s.opts.Env = append(slices.Clone(pc.Env), goplugin.EnvUnixSocketDir+"="+sockets)
			}
		}
		m.sups[bin.Name] = s
	}
	m.reg.checkReady()
	for plugin, n := range m.reg.orphans() {
		log.Info("device IDs owned by a plugin this host does not run; the first plugin to report them will own them",
			"previous_owner", plugin, "devices", n)
	}

	ctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	if m.gc != nil {
		m.wg.Go(func() {
			if err := m.gc.Run(ctx); err != nil {
				m.log.Error("garbage collector stopped", "error", err)
			}
		})
	}
	for _, s := range m.sups {
		m.wg.Go(func() {
			if err := s.Run(ctx); err != nil {
				m.reg.failed(s.name, err)
				s.log.Error("plugin failed and will not be restarted; fix it and restart the host", "error", err)
			}
		})
	}
	m.wg.Go(func() { m.stats.run(ctx, func() device.Inventory { return m.reg.snapshot().Inventory }) })
	m.wg.Go(func() { m.readyTimer(ctx) })
	go func() { // ends when the goroutines above have; Shutdown waits for it
		m.wg.Wait()
		if m.ledger != nil {
			m.closeErr = m.ledger.Close()
		}
		close(m.stopped)
	}()
	return m, nil
}

// openLedger opens the reservation ledger in cfg.StateDir, creating the dir (0700).
func openLedger(cfg Config) (*ledger.Ledger, error) {
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("state dir: %w", err)
	}
	return ledger.Open(filepath.Join(cfg.StateDir, ledger.DefaultFileName), ledger.Options{
		Logger:   cfg.Logger.Named("manager").Named("ledger"),
		Now:      cfg.Now,
		OnCommit: cfg.OnLedgerCommit,
	})
}

// cleanup is the GC's plugin cleanup: the owning plugin's Release RPC for e, bounded by
// ctx (the GC's CleanupTimeout, which is ReserveTimeout) and the plugin's exit. An error
// (plugin down, silent or refusing) keeps the cleanup pending for a retry. A plugin this
// manager does not run any more cannot clean up: that is logged, once, and counted done.
// Called by the GC's workers, at most GCParallelDestroys at once.
func (m *Manager) cleanup(ctx context.Context, e ledger.GCEntry) error {
	s, ok := m.sups[e.Plugin]
	if !ok {
		m.log.Warn("plugin cleanup of a released reservation skipped: its plugin is not configured any more",
			"plugin", e.Plugin, "reservation_id", e.ReservationID, "owner_id", e.OwnerID, "devices", strings.Join(e.DeviceIDs, ","))
		return nil
	}
	return s.release(ctx, e.ReservationID, e.DeviceIDs)
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

// pluginBinaries lists the discovered plugins and the explicit ones, refusing a name
// that appears twice.
func pluginBinaries(cfg Config, log hclog.Logger) ([]pluginloader.Binary, error) {
	var bins []pluginloader.Binary
	if cfg.PluginDir != "" {
		found, err := pluginloader.Discover(cfg.PluginDir, log)
		switch {
		case err != nil && len(found) == 0:
			return nil, fmt.Errorf("discover plugins in %s: %w", cfg.PluginDir, err)
		case err != nil:
			// Some binaries were refused (the trust check); run the others.
			log.Error("plugins refused and not run", "plugin_dir", cfg.PluginDir, "error", oneLine(err))
		}
		bins = append(bins, found...)
	}
	for _, b := range cfg.Binaries {
		if b.Name == "" {
			b.Name = filepath.Base(b.Path)
		}
		bins = append(bins, b)
	}
	seen := make(map[string]string, len(bins))
	for _, b := range bins {
		if prev, dup := seen[b.Name]; dup {
			return nil, fmt.Errorf("two plugins named %q: %s and %s", b.Name, prev, b.Path)
		}
		seen[b.Name] = b.Path
	}
	return bins, nil
}

// readyTimer closes Ready after ReadyTimeout if the plugins have not settled by then.
func (m *Manager) readyTimer(ctx context.Context) {
	t := time.NewTimer(m.cfg.ReadyTimeout)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-m.reg.ready:
	case <-t.C:
		if waiting := m.reg.forceReady(); len(waiting) > 0 {
			m.log.Warn("ready without a first fingerprint from some plugins", "timeout", m.cfg.ReadyTimeout, "plugins", strings.Join(waiting, ", "))
		}
	}
}

// Inventory returns the current inventory of every plugin.
func (m *Manager) Inventory() device.Inventory { return m.reg.snapshot().Inventory }

// State returns the current device health and holders, and plugin status.
func (m *Manager) State() device.State { return m.reg.snapshot().State }

// Snapshot returns the current inventory and state together.
func (m *Manager) Snapshot() device.Snapshot { return m.reg.snapshot() }

// Watch delivers the current snapshot at once and then the latest one on every change;
// the channel is closed when ctx ends or the manager shuts down.
func (m *Manager) Watch(ctx context.Context) <-chan device.Snapshot { return m.reg.watch(ctx) }

// WatchStats delivers the latest stats of every plugin at once and then every interval
// (at least the sampling interval, rounded up to a multiple of it; zero means the
// sampling interval). The channel is closed when ctx ends or the manager shuts down.
func (m *Manager) WatchStats(ctx context.Context, interval time.Duration) <-chan device.StatsSnapshot {
	return m.stats.watch(ctx, interval, m.Inventory())
}

// Ready is closed once every plugin has had its first attempt (fingerprinted, had a
// fingerprint refused, or failed a run), or ReadyTimeout has passed.
func (m *Manager) Ready() <-chan struct{} { return m.reg.ready }

// WaitForFirstFingerprint waits for Ready and returns the inventory then. It fails only
// when ctx ends first.
func (m *Manager) WaitForFirstFingerprint(ctx context.Context) (device.Inventory, error) {
	select {
	case <-m.reg.ready:
		return m.Inventory(), nil
	case <-ctx.Done():
		return device.Inventory{}, fmt.Errorf("waiting for first fingerprints: %w", context.Cause(ctx))
	}
}

// Shutdown stops every plugin and goroutine the manager started, closes every watch
// channel and, once all of that has stopped, the ledger (kept plugins are stopped too,
// and their reattach records deleted: a graceful stop means stop). It returns when they
// are all gone (with the ledger's close error, if any), or with ctx's error when ctx ends
// first (the plugins are still being stopped then; a later Shutdown waits again).
func (m *Manager) Shutdown(ctx context.Context) error {
	m.stopping.Store(true)
	m.cancel()
	m.reg.watchers.close()
	m.stats.watchers.close()
	select {
	case <-m.stopped:
		return m.closeErr
	case <-ctx.Done():
		return fmt.Errorf("manager shutdown: %w", context.Cause(ctx))
	}
}

// Reserve reserves req's devices for req.OwnerID through the plugin that owns them. A
// retried request (same owner, same devices) gets the live reservation back. Checks, in
// order: the request (ErrInvalidRequest), holders (ErrDeviceHeld), the inventory
// (ErrUnknownDevice: unknown group, devices not in it or spread over two plugins), the
// plugin (ErrPluginUnavailable) and health (ErrUnhealthyDevice); then the plugin is asked,
// bounded by ctx, ReserveTimeout and its exit; its answer is validated
// (ErrPluginResponse) and the reservation recorded in the store. A concurrent Reserve
// touching the same devices is refused with ErrDeviceHeld while the first is in flight.
func (m *Manager) Reserve(ctx context.Context, req device.ReserveRequest) (device.Reservation, error) {
	if m.stopping.Load() {
		return device.Reservation{}, fmt.Errorf("reserve: %w", device.ErrShuttingDown)
	}
	if err := validate.ReserveRequest(req); err != nil {
		return device.Reservation{}, err
	}
	ids := slices.Clone(req.DeviceIDs)
	// Claim before checking the store: a Reserve that commits between the check and the
	// claim would otherwise leave this one asking the plugin for a device already held.
	release, err := m.claim(req.OwnerID, ids)
	if err != nil {
		return device.Reservation{}, err
	}
	defer release()
	if existing, err := m.store.Check(req.OwnerID, ids); err != nil || existing != nil {
		if existing != nil {
			return *existing, nil
		}
		return device.Reservation{}, err
	}
	plugin, err := route(m.reg.snapshot(), req.Group, ids)
	if err != nil {
		return device.Reservation{}, err
	}

	res, err := m.sups[plugin].reserve(ctx, ids)
	if err != nil {
		return device.Reservation{}, err
	}
	if err := validate.Reservation(res, ids); err != nil {
		return device.Reservation{}, fmt.Errorf("plugin %q answered Reserve with a reservation that breaks the rules: %s: %w", plugin, oneLine(err), device.ErrPluginResponse)
	}
	r, err := m.store.Commit(ctx, device.Reservation{
		ID:        ledger.NewID(),
		OwnerID:   req.OwnerID,
		Group:     req.Group,
		Plugin:    plugin,
		DeviceIDs: ids,
		Container: fromContainerReservation(res),
		State:     device.ReservationActive,
		CreatedAt: m.cfg.Now(),
	})
	if err != nil {
		return device.Reservation{}, fmt.Errorf("record reservation: %w", err)
	}
	m.reg.refresh()
	return r, nil
}

// route finds the one plugin that owns every device in ids (not empty) within group, and
// checks that it is running and the devices are healthy.
func route(snap device.Snapshot, group device.GroupKey, ids []string) (string, error) {
	owner := make(map[string]string) // device ID -> plugin, within group
	for _, g := range snap.Inventory.Groups {
		if g.GroupKey != group {
			continue
		}
		for _, d := range g.Devices {
			owner[d.ID] = g.Plugin
		}
	}
	if len(owner) == 0 {
		return "", fmt.Errorf("no device group %s: %w", group, device.ErrUnknownDevice)
	}
	var unknown []string
	plugins := make(map[string]bool)
	for _, id := range ids {
		p, ok := owner[id]
		if !ok {
			unknown = append(unknown, id)
			continue
		}
		plugins[p] = true
	}
	switch {
	case len(unknown) > 0:
		return "", fmt.Errorf("devices %s are not in group %s: %w", strings.Join(unknown, ", "), group, device.ErrUnknownDevice)
	case len(plugins) > 1:
		return "", fmt.Errorf("devices %s of group %s belong to more than one plugin (%s): %w",
			strings.Join(ids, ", "), group, strings.Join(slices.Sorted(maps.Keys(plugins)), ", "), device.ErrUnknownDevice)
	}
	plugin := owner[ids[0]]
	if st := pluginState(snap, plugin); st.Status != device.PluginRunning {
		return "", fmt.Errorf("plugin %q is %s (last error: %s): %w", plugin, st.Status, st.LastError, device.ErrPluginUnavailable)
	}
	var unhealthy []string
	for _, id := range ids {
		if st := snap.State.Devices[id]; st.Health != device.HealthHealthy {
			unhealthy = append(unhealthy, fmt.Sprintf("%s (%s: %s)", id, st.Health, st.Reason))
		}
	}
	if len(unhealthy) > 0 {
		return "", fmt.Errorf("devices not healthy: %s: %w", strings.Join(unhealthy, ", "), device.ErrUnhealthyDevice)
	}
	return plugin, nil
}

func pluginState(snap device.Snapshot, name string) device.PluginState {
	for _, p := range snap.State.Plugins {
		if p.Name == name {
			return p
		}
	}
	return device.PluginState{}
}

// claim marks ids as being reserved by owner until the returned func is called, so two
// concurrent Reserves never both ask a plugin for the same device. A device already
// claimed is a *device.HeldError whose holder has no reservation ID yet.
func (m *Manager) claim(owner string, ids []string) (func(), error) {
	m.claimMu.Lock()
	defer m.claimMu.Unlock()
	busy := make(map[string][]string) // claiming owner -> requested devices it claims
	for _, id := range ids {
		if o, ok := m.claims[id]; ok {
			busy[o] = append(busy[o], id)
		}
	}
	if len(busy) > 0 {
		e := &device.HeldError{OwnerID: owner}
		for _, o := range slices.Sorted(maps.Keys(busy)) {
			devs := busy[o]
			slices.Sort(devs)
			e.Conflicts = append(e.Conflicts, device.Conflict{Holder: device.Holder{OwnerID: o}, Overlap: devs, Held: devs})
		}
		return nil, e
	}
	for _, id := range ids {
		m.claims[id] = owner
	}
	return func() {
		m.claimMu.Lock()
		defer m.claimMu.Unlock()
		for _, id := range ids {
			delete(m.claims, id)
		}
	}, nil
}

// Release ends the reservations req names, durably, frees their devices (watchers get a
// snapshot without the holder) and says which it released and which were released
// before (those are not released twice), each list oldest first. The plugin cleanup is
// not done here: it is left pending in the ledger for the garbage collector, which runs
// it once, with retries (see the package doc). Without StateDir no cleanup ever runs.
func (m *Manager) Release(ctx context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
	if m.stopping.Load() {
		return device.ReleaseResult{}, fmt.Errorf("release: %w", device.ErrShuttingDown)
	}
	if err := validate.ReleaseRequest(req); err != nil {
		return device.ReleaseResult{}, err
	}
	released, already, err := m.store.Release(ctx, req, m.cfg.Now())
	if err != nil {
		return device.ReleaseResult{}, err
	}
	if len(released) > 0 {
		m.reg.refresh()
	}
	var res device.ReleaseResult
	for _, r := range released {
		res.Released = append(res.Released, r.ID)
	}
	for _, r := range already {
		res.AlreadyReleased = append(res.AlreadyReleased, r.ID)
	}
	return res, nil
}

// Reservations lists the reservations matching f, oldest first.
func (m *Manager) Reservations(ctx context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
	if err := validate.ReservationFilter(f); err != nil {
		return nil, err
	}
	return m.store.List(ctx, f)
}
