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
//     RestartMaxDelay, ±20% jitter, reset after a run of StableRunReset). The fingerprint
//     stream is the plugin's health signal, so losing it is treated like a crash rather
//     than retried on a process the manager can no longer vouch for.
//   - A launch refused for a reason retrying cannot fix (pluginloader's
//     ErrChecksumMismatch, ErrProtocolVersion, ErrConfigRejected, ErrInsecurePath) marks
//     the plugin failed and it is not restarted: the operator fixes the binary or config
//     and restarts the host.
//   - A stats stream that fails or stays silent is reopened with the same backoff on the
//     running process; stats are not a health signal.
//   - A fingerprint or stats message that breaks a validation rule is logged with the
//     plugin and the rules and dropped; the last good one stays.
package manager

import (
	"context"
	"crypto/rand"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/manager/device"
	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/validate"
)

// Manager is the device manager. New starts it; Shutdown stops it. All methods are safe
// for concurrent use.
type Manager struct {
	cfg   Config
	log   hclog.Logger
	reg   *registry
	stats *statsHub
	store reservationStore
	sups  map[string]*supervisor // by plugin name; fixed after New

	cancel   context.CancelFunc // ends every goroutine New started
	wg       sync.WaitGroup     // supervisors, the stats tick and the readiness timer
	stopped  chan struct{}      // closed when wg is done
	stopping atomic.Bool

	claimMu sync.Mutex
	claims  map[string]string // device ID -> owner with a Reserve in flight
}

var _ device.Manager = (*Manager)(nil)

// New finds the plugins (cfg.PluginDir plus cfg.Binaries) and starts the manager: one
// supervisor per plugin, the stats fan-out and the readiness timer. It fails when the
// config is invalid, the plugin dir cannot be read safely, or two plugins share a name.
// The caller must call Shutdown.
func New(cfg Config) (*Manager, error) {
	return newManager(cfg, newMemStore(), launchProcess)
}

// newManager is New with the reservation store and the plugin launcher chosen by the
// caller (tests, and later the durable ledger and reattaching launcher).
func newManager(cfg Config, store reservationStore, launch launchFunc) (*Manager, error) {
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
	for _, name := range cfg.pluginNames() {
		if !slices.ContainsFunc(bins, func(b pluginloader.Binary) bool { return b.Name == name }) {
			log.Warn("config given for a plugin that was not found", "plugin", name)
		}
	}

	m := &Manager{
		cfg:     cfg,
		log:     log,
		stats:   newStatsHub(cfg.StatsInterval, cfg.Now),
		store:   store,
		sups:    make(map[string]*supervisor, len(bins)),
		stopped: make(chan struct{}),
		claims:  make(map[string]string),
	}
	m.reg = newRegistry(log, cfg.Now, store.Holders)
	for _, bin := range bins {
		pc := cfg.Plugins[bin.Name]
		m.reg.addPlugin(bin.Name, bin.Path)
		m.sups[bin.Name] = &supervisor{
			name: bin.Name,
			bin:  bin,
			opts: pluginloader.Options{
				Logger:       cfg.Logger,
				StartTimeout: cfg.StartTimeout,
				SHA256:       pc.SHA256,
				Env:          pc.Env,
				InheritEnv:   pc.InheritEnv,
				ConfigJSON:   pc.ConfigJSON,
			},
			cfg:    cfg,
			launch: launch,
			reg:    m.reg,
			stats:  m.stats,
			log:    log.With("plugin", bin.Name),
		}
	}
	m.reg.checkReady()

	ctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
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
		close(m.stopped)
	}()
	return m, nil
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
			// Some binaries were refused (world-writable); run the others.
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

// Ready is closed once every plugin has fingerprinted or failed, or ReadyTimeout has
// passed.
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

// Shutdown stops every plugin and goroutine the manager started and closes every watch
// channel. It returns when they are all gone, or with ctx's error when ctx ends first
// (the plugins are still being stopped then; a later Shutdown waits again).
func (m *Manager) Shutdown(ctx context.Context) error {
	m.stopping.Store(true)
	m.cancel()
	m.reg.watchers.close()
	m.stats.watchers.close()
	select {
	case <-m.stopped:
		return nil
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
	sup := m.sups[plugin]

	release, err := m.claim(req.OwnerID, ids)
	if err != nil {
		return device.Reservation{}, err
	}
	defer release()

	res, err := sup.reserve(ctx, ids)
	if err != nil {
		return device.Reservation{}, err
	}
	if err := validate.Reservation(res, ids); err != nil {
		return device.Reservation{}, fmt.Errorf("plugin %q answered Reserve with a reservation that breaks the rules: %s: %w", plugin, oneLine(err), device.ErrPluginResponse)
	}
	r, err := m.store.Commit(ctx, device.Reservation{
		ID:        rand.Text(),
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
// concurrent Reserves never both ask a plugin for the same device.
func (m *Manager) claim(owner string, ids []string) (func(), error) {
	m.claimMu.Lock()
	defer m.claimMu.Unlock()
	var busy []string
	for _, id := range ids {
		if o, ok := m.claims[id]; ok {
			busy = append(busy, fmt.Sprintf("%s (being reserved for owner %s)", id, o))
		}
	}
	if len(busy) > 0 {
		return nil, fmt.Errorf("reserve in progress: %s: %w", strings.Join(busy, ", "), device.ErrDeviceHeld)
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

// Release ends the reservations req names and returns their IDs, then asks each plugin
// to clean up after the ones whose cleanup is pending. A cleanup that fails (the plugin
// is down or refuses) stays pending and is tried again by the next Release naming the
// reservation.
func (m *Manager) Release(ctx context.Context, req device.ReleaseRequest) ([]string, error) {
	if err := validate.ReleaseRequest(req); err != nil {
		return nil, err
	}
	released, err := m.store.Release(ctx, req, m.cfg.Now())
	if err != nil {
		return nil, err
	}
	m.reg.refresh()
	ids := make([]string, 0, len(released))
	for _, r := range released {
		ids = append(ids, r.ID)
		if !r.CleanupPending {
			continue
		}
		sup, ok := m.sups[r.Plugin]
		if !ok {
			continue
		}
		if err := sup.release(ctx, r.ID, r.DeviceIDs); err != nil {
			m.log.Warn("plugin cleanup after release failed; it stays pending", "plugin", r.Plugin, "reservation", r.ID, "error", err)
			continue
		}
		if err := m.store.CleanupDone(ctx, r.ID); err != nil {
			return ids, fmt.Errorf("record cleanup of reservation %s: %w", r.ID, err)
		}
	}
	return ids, nil
}

// Reservations lists the reservations matching f, oldest first.
func (m *Manager) Reservations(ctx context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
	if err := validate.ReservationFilter(f); err != nil {
		return nil, err
	}
	return m.store.List(ctx, f)
}
