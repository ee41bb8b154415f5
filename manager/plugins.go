package manager

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	goplugin "github.com/hashicorp/go-plugin"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/supervise"
	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// This file makes the manager's plugin set dynamic. What should run is computed from
// three inputs: the explicit binaries of Config.Binaries (fixed), the settled binaries of
// the plugin dir (pluginloader.DirWatch's) and the per-plugin settings
// (Config.Plugins, replaced by SetPlugins). reconcileLocked compares that with what runs
// and starts, restarts and stops supervisors to match.

// Reasons a supervisor is stopped, the cause of its context: they end up in its devices'
// down reason and its last run's error ("plugin stopped: plugin binary replaced").
var (
	errBinaryReplaced  = errors.New("plugin binary replaced")
	errSettingsChanged = errors.New("plugin settings changed")
	errPluginRemoved   = errors.New("plugin removed")
	errRetryFailed     = errors.New("another try for a failed plugin")
)

// pluginSpec is what one plugin runs with: its binary, its settings and, for a binary
// from the plugin dir, what the file was when it settled.
type pluginSpec struct {
	bin     pluginloader.Binary
	pc      PluginConfig
	fromDir bool
	file    pluginloader.FileState // zero unless fromDir
	missing bool                   // configured, but no binary: listed as failed, nothing runs
}

// slot is one plugin of this host: a supervisor running spec, or (missing) a configured
// plugin without a binary.
type slot struct {
	spec   pluginSpec
	sup    *supervise.Supervisor   // nil when missing
	cancel context.CancelCauseFunc // stops sup; nil when missing
	done   chan struct{}           // closed once sup's goroutine has ended; nil when missing

	mu     sync.Mutex
	failed bool // sup.Run returned a permanent error: nothing runs until the slot is replaced
}

func (sl *slot) hasFailed() bool {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	return sl.failed
}

// SetPlugins replaces the per-plugin settings (Config.Plugins) and applies them at once:
// a plugin whose settings changed is restarted with the new ones (its devices stay,
// unhealthy, until it fingerprints again, and its reservations are untouched); a
// configured plugin with no binary is listed as failed; a plugin that has neither a
// binary nor settings any more is stopped and leaves the inventory. A plugin that failed
// for good (see docs/plugins.md#how-the-manager-runs-a-plugin) gets another try. The
// plugin dir is listed again too, so a change there that went unnoticed is picked up.
//
// A plugin whose ConfigJSON changes is first asked, on its running process, whether it
// accepts the new config (CheckConfig, which changes nothing in it; see
// checkConfigsLocked): when it rejects it, SetPlugins fails with a *ConfigRejectedError
// per such plugin (joined), and the running plugins and settings stay as they were.
//
// It returns once the plugins to stop or restart have stopped and their replacements
// have been started (not fingerprinted). It fails, changing nothing, when a setting
// cannot be honoured (Reattach without StateDir), a plugin rejects its new config, or
// the manager is shutting down. Safe
// for concurrent use: calls, and the dir watcher's changes, are applied one at a time.
func (m *Manager) SetPlugins(plugins map[string]PluginConfig) error {
	if err := checkPlugins(m.cfg.StateDir, plugins); err != nil {
		return err
	}
	plugins = clonePlugins(plugins)
	m.reconfMu.Lock()
	defer m.reconfMu.Unlock()
	if m.stopping.Load() {
		return fmt.Errorf("set plugins: %w", device.ErrShuttingDown)
	}
	if err := m.checkConfigsLocked(plugins); err != nil {
		return err
	}
	m.pluginCfg = plugins
	m.reconcileLocked(true)
	if m.dir != nil {
		m.dir.Poke()
	}
	return nil
}

// checkConfigsLocked asks the running process of each plugin whose ConfigJSON next
// changes whether it accepts the new config (CheckConfig: the plugin validates it as
// SetConfig would, changing nothing), so that a config the plugin rejects is refused
// before the running process is stopped for it. It returns those rejections, each a
// *ConfigRejectedError, joined.
//
// A plugin is asked only when its process answers for what the new settings launch:
// the same binary and the same environment (see askRunning). Any other plugin, one not
// running, one without CheckConfig (UNIMPLEMENTED) and a check that fails otherwise are
// not checked: the new config is applied, and a rejection at its start goes to
// OnConfigRejected. No process is launched for a check. Plugins are asked at once,
// each within StartTimeout. Called with reconfMu held.
func (m *Manager) checkConfigsLocked(next map[string]PluginConfig) error {
	prev := m.pluginCfg
	m.pluginCfg = next
	want := m.desiredLocked()
	m.pluginCfg = prev
	type check struct {
		name string
		sup  *supervise.Supervisor
		cfg  []byte
	}
	var checks []check
	m.supsMu.RLock()
	for _, name := range slices.Sorted(maps.Keys(want)) {
		spec := want[name]
		sl := m.slots[name]
		if spec.missing || sl == nil || sl.sup == nil || !askRunning(sl.spec, spec) {
			continue
		}
		checks = append(checks, check{name: name, sup: sl.sup, cfg: spec.pc.ConfigJSON})
	}
	m.supsMu.RUnlock()

	errs := make([]error, len(checks))
	var wg sync.WaitGroup
	for i, c := range checks {
		wg.Go(func() { errs[i] = m.checkConfig(c.name, c.sup, c.cfg) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// askRunning reports whether a change from the settings a process runs with (run) to
// next is one to check on that process: its ConfigJSON changes, and the process is what
// next would launch but for the config, the same binary (path, arguments, file, SHA256
// pin) in the same environment (Env, InheritEnv). A process of another binary or
// environment could answer otherwise than the plugin's next start will; an Env or
// InheritEnv change alone is not checked.
func askRunning(run, next pluginSpec) bool {
	return !bytes.Equal(run.pc.ConfigJSON, next.pc.ConfigJSON) &&
		!run.missing && run.fromDir == next.fromDir &&
		run.bin.Path == next.bin.Path && slices.Equal(run.bin.Args, next.bin.Args) &&
		run.file.SameContent(next.file) && run.pc.SHA256 == next.pc.SHA256 &&
		slices.Equal(run.pc.Env, next.pc.Env) && run.pc.InheritEnv == next.pc.InheritEnv
}

// checkConfig asks sup's running process about configJSON, within StartTimeout: a
// *ConfigRejectedError when the plugin rejects it, nil otherwise (accepted, or not
// checked: then its start will say).
func (m *Manager) checkConfig(name string, sup *supervise.Supervisor, configJSON []byte) error {
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.StartTimeout)
	defer cancel()
	err := sup.CheckConfig(ctx, configJSON)
	switch {
	case err == nil:
		m.log.Debug("running plugin accepts its new config", "plugin", name)
	case errors.Is(err, pluginloader.ErrConfigRejected):
		return &ConfigRejectedError{Plugin: name, Err: err}
	case errors.Is(err, pluginloader.ErrConfigCheckUnsupported):
		m.log.Debug("plugin cannot check a config before it is applied; its new config is not checked", "plugin", name)
	default:
		m.log.Debug("new config not checked on the running plugin; its start will tell", "plugin", name, "error", err)
	}
	return nil
}

// setDirBinaries records the plugin dir's settled binaries and applies them. Called by
// the dir watcher.
func (m *Manager) setDirBinaries(bins map[string]pluginloader.DirBinary) {
	m.reconfMu.Lock()
	defer m.reconfMu.Unlock()
	m.dirBins = bins
	m.reconcileLocked(false)
}

// desiredLocked is what should run, by plugin name. Called with reconfMu held.
func (m *Manager) desiredLocked() map[string]pluginSpec {
	want := make(map[string]pluginSpec)
	for _, b := range m.cfg.Binaries {
		want[b.Name] = pluginSpec{bin: b, pc: m.pluginCfg[b.Name]}
	}
	for _, name := range slices.Sorted(maps.Keys(m.dirBins)) {
		db := m.dirBins[name]
		if prev, dup := want[name]; dup {
			if m.dupLogged[name] != db.Path {
				m.dupLogged[name] = db.Path
				m.log.Error("plugin binary in the plugin dir not run: a plugin of that name is already configured",
					"plugin", name, "path", db.Path, "running", prev.bin.Path)
			}
			continue
		}
		delete(m.dupLogged, name)
		want[name] = pluginSpec{bin: db.Binary, pc: m.pluginCfg[name], fromDir: true, file: db.File}
	}
	for name := range m.pluginCfg {
		if _, ok := want[name]; !ok {
			want[name] = pluginSpec{bin: pluginloader.Binary{Name: name, Path: missingPath(m.cfg.PluginDir, name)}, missing: true}
		}
	}
	return want
}

// sameRun reports whether a supervisor running a still runs what b asks for: same binary
// (path, arguments and, from the dir, the same file content) and same settings. A chmod
// or a rename onto the same inode does not count.
func sameRun(a, b pluginSpec) bool {
	return a.missing == b.missing && a.fromDir == b.fromDir &&
		a.bin.Path == b.bin.Path && slices.Equal(a.bin.Args, b.bin.Args) &&
		a.file.SameContent(b.file) && a.pc.equal(b.pc)
}

// pluginChange is one plugin to start, restart or stop in a reconcile.
type pluginChange struct {
	name string
	old  *slot       // nil: the plugin is new
	spec *pluginSpec // nil: the plugin is removed
	why  error       // why old stops; nil for a new plugin
}

// reconcileLocked starts, restarts and stops plugins until what runs is
// desiredLocked. retryFailed also restarts the plugins that failed for good; they are
// restarted anyway when their file changed in any way (a chmod fixing the trust check
// included). Called with reconfMu held; it waits for the stopped supervisors to end,
// all of them at once. Once Shutdown has begun it starts nothing.
func (m *Manager) reconcileLocked(retryFailed bool) {
	want := m.desiredLocked()
	m.supsMu.RLock()
	cur := maps.Clone(m.slots)
	m.supsMu.RUnlock()

	var changes []pluginChange
	for _, name := range slices.Sorted(maps.Keys(cur)) {
		sl := cur[name]
		spec, ok := want[name]
		switch {
		case !ok:
			changes = append(changes, pluginChange{name: name, old: sl, why: errPluginRemoved})
		case !sameRun(sl.spec, spec):
			why := errSettingsChanged
			switch {
			case spec.missing:
				why = errPluginRemoved
			case sl.spec.missing:
				why = nil // its binary has arrived: a start
			case !sl.spec.file.SameContent(spec.file):
				why = errBinaryReplaced
			}
			changes = append(changes, pluginChange{name: name, old: sl, spec: &spec, why: why})
		case sl.sup != nil && sl.hasFailed() && (retryFailed || sl.spec.file != spec.file):
			changes = append(changes, pluginChange{name: name, old: sl, spec: &spec, why: errRetryFailed})
		default:
			if sl.spec.file != spec.file { // only a chmod or the like: keep it for the next comparison
				m.supsMu.Lock()
				sl.spec.file = spec.file
				m.supsMu.Unlock()
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(want)) {
		if _, ok := cur[name]; !ok {
			spec := want[name]
			changes = append(changes, pluginChange{name: name, spec: &spec})
		}
	}
	if len(changes) == 0 {
		return
	}

	// Stop: removed plugins leave the inventory at once (their devices cannot be
	// reserved any more); a restarted one keeps its devices, unhealthy once its
	// supervisor has stopped. Every supervisor to stop is told at once, then waited for.
	now := m.cfg.Now()
	m.supsMu.Lock()
	for name, at := range m.gone {
		if now.Sub(at) >= m.cfg.RemovedPluginGrace {
			delete(m.gone, name) // given up on: the same as never seen
		}
	}
	for _, c := range changes {
		if c.old == nil {
			continue
		}
		if c.spec == nil {
			delete(m.slots, c.name)
			if _, configured := m.pluginCfg[c.name]; !configured {
				m.gone[c.name] = now
			}
		}
		if c.old.cancel != nil {
			c.old.cancel(c.why)
		}
	}
	m.supsMu.Unlock()
	for _, c := range changes {
		switch {
		case c.old == nil:
		case c.spec == nil:
			m.reg.RemovePlugin(c.name)
			m.log.Info("plugin removed; stopping it (its reservations stay listed)", "plugin", c.name, "path", c.old.spec.bin.Path)
		case c.spec.missing:
			m.log.Warn("plugin binary removed; stopping it (its reservations stay listed)", "plugin", c.name, "path", c.old.spec.bin.Path)
		case c.why != nil && c.old.sup != nil:
			m.log.Info("restarting plugin", "plugin", c.name, "reason", c.why.Error(), "path", c.spec.bin.Path)
		}
	}
	for _, c := range changes {
		if c.old != nil && c.old.done != nil {
			<-c.old.done
		}
	}

	// Start: every registry record first, then the supervisors, so that none of them
	// settles Ready before the others are listed.
	var starts []*slot
	for _, c := range changes {
		if c.spec == nil {
			continue
		}
		switch {
		case c.spec.missing:
			reason := missingReason(m.cfg.PluginDir)
			m.reg.AddMissing(c.name, c.spec.bin.Path, reason)
			if c.old == nil || !c.old.spec.missing {
				m.log.Error("plugin configured but not found; listed as failed", "plugin", c.name, "error", reason)
			}
			m.setSlot(c.name, &slot{spec: *c.spec})
		case c.old != nil && c.old.sup != nil:
			m.reg.RestartPlugin(c.name, c.spec.bin.Path, "plugin restarting: "+c.why.Error())
			starts = append(starts, m.newSlot(c.name, *c.spec))
		default:
			m.reg.AddPlugin(c.name, c.spec.bin.Path)
			if m.started {
				m.log.Info("plugin added", "plugin", c.name, "path", c.spec.bin.Path)
			}
			starts = append(starts, m.newSlot(c.name, *c.spec))
		}
	}
	for _, sl := range starts {
		m.startSlot(sl)
	}
}

// setSlot makes sl the named plugin's slot.
func (m *Manager) setSlot(name string, sl *slot) {
	m.supsMu.Lock()
	defer m.supsMu.Unlock()
	m.slots[name] = sl
	delete(m.gone, name)
}

// newSlot builds the supervisor of a plugin. Its first supervisor of a kept plugin gets
// the reattach record a crashed host left. Called with reconfMu held.
func (m *Manager) newSlot(name string, spec pluginSpec) *slot {
	pc := spec.pc
	log := m.log.With("plugin", name)
	m.reg.SetDeviceIDPatterns(name, pc.DeviceIDs)
	cfg := supervise.Config{
		Name:   name,
		Binary: spec.bin,
		Options: pluginloader.Options{
			Logger:          m.cfg.Logger,
			StartTimeout:    m.cfg.StartTimeout,
			SHA256:          pc.SHA256,
			Env:             pc.Env,
			InheritEnv:      pc.InheritEnv,
			ConfigJSON:      pc.ConfigJSON,
			DisableAutoMTLS: pc.Reattach,
			SurviveHost:     pc.Reattach,
		},
		Launch:             m.launch,
		Live:               func(ctx context.Context) ([]*pb.LiveReservation, error) { return m.liveReservations(ctx, name) },
		Inventory:          m.reg,
		Stats:              m.stats,
		Logger:             log,
		Now:                m.cfg.Now,
		RestartBaseDelay:   m.cfg.RestartBaseDelay,
		RestartMaxDelay:    m.cfg.RestartMaxDelay,
		StableRunReset:     m.cfg.StableRunReset,
		ServedReset:        m.cfg.ServedReset,
		StartTimeout:       m.cfg.StartTimeout,
		FingerprintTimeout: m.cfg.FingerprintTimeout,
		StatsInterval:      m.cfg.StatsInterval,
		ReserveTimeout:     m.cfg.ReserveTimeout,
		KillTimeout:        m.cfg.KillTimeout,
	}
	cfg.OnUp = func() {
		if m.gc != nil {
			m.gc.RetryNow()
		}
		m.intentsUp(name)
	}
	if pc.Reattach {
		saved := m.saved[name]
		delete(m.saved, name)
		cfg.Keeper = &keeper{name: name, led: m.ledger, log: log, saved: saved}
		if dir := m.socketDirLocked(); dir != "" {
			cfg.Options.Env = append(slices.Clone(pc.Env), goplugin.EnvUnixSocketDir+"="+dir)
		}
	}
	return &slot{spec: spec, sup: supervise.New(cfg), done: make(chan struct{})}
}

// startSlot runs sl's supervisor in a goroutine Shutdown waits for, and makes sl the
// plugin's slot. After Shutdown has begun it starts nothing (sl's done is closed).
func (m *Manager) startSlot(sl *slot) {
	ctx, cancel := context.WithCancelCause(context.Background())
	sl.cancel = cancel
	m.supsMu.Lock()
	defer m.supsMu.Unlock()
	if m.closed {
		cancel(nil)
		close(sl.done)
		return
	}
	name, fromDir := sl.sup.Name(), sl.spec.fromDir
	m.slots[name] = sl
	delete(m.gone, name)
	// Either New has not started waiting on wg yet, or the stats goroutine is running:
	// it runs until Shutdown, which sets closed under supsMu first. So the WaitGroup is
	// not at zero while Wait may be waiting.
	m.wg.Go(func() {
		defer close(sl.done)
		defer cancel(nil)
		err := sl.sup.Run(ctx)
		if err == nil {
			return
		}
		sl.mu.Lock()
		sl.failed = true
		sl.mu.Unlock()
		if errors.Is(err, pluginloader.ErrConfigRejected) && m.cfg.OnConfigRejected != nil {
			// Told before the failure is recorded, which may make the manager ready: a
			// caller that checks for rejections once Ready is closed sees this one.
			m.cfg.OnConfigRejected(&ConfigRejectedError{Plugin: name, Err: err})
			m.reg.Failed(name, err)
			return
		}
		m.reg.Failed(name, err)
		hint := "fix it and send the agent SIGHUP"
		if fromDir {
			hint = "replacing or fixing its file in the plugin dir (or SIGHUP) gives it another try"
		}
		m.log.With("plugin", name).Error("plugin failed and will not be restarted until its binary or settings change; "+hint, "error", err)
	})
}

// socketDirLocked is the dir kept plugins put their sockets in ("" for their temp
// dir), made the first time one is needed. Called with reconfMu held.
func (m *Manager) socketDirLocked() string {
	if !m.socketsMade {
		m.sockets = socketDir(m.cfg.StateDir, m.log)
		m.socketsMade = true
	}
	return m.sockets
}

// supervisor returns the named plugin's supervisor, or nil when the plugin is not one
// this host runs now (removed, or configured without a binary).
func (m *Manager) supervisor(name string) *supervise.Supervisor {
	m.supsMu.RLock()
	defer m.supsMu.RUnlock()
	if sl := m.slots[name]; sl != nil {
		return sl.sup
	}
	return nil
}

// cleanupTarget says what the GC's cleanup of a released reservation of plugin can do:
// s is its supervisor when it is one of this host's plugins; otherwise wait is the
// error that keeps the cleanup pending while the plugin may come back (it is
// configured, or was removed less than RemovedPluginGrace ago), and nil when nobody
// will ever clean up (the cleanup is then counted done).
func (m *Manager) cleanupTarget(plugin string) (s *supervise.Supervisor, wait error) {
	m.supsMu.RLock()
	defer m.supsMu.RUnlock()
	sl := m.slots[plugin]
	switch {
	case sl != nil && sl.sup != nil:
		return sl.sup, nil
	case sl != nil:
		return nil, fmt.Errorf("plugin %q is configured but has no binary; the cleanup waits for it: %w", plugin, device.ErrPluginUnavailable)
	}
	if at, ok := m.gone[plugin]; ok {
		if since := m.cfg.Now().Sub(at); since < m.cfg.RemovedPluginGrace {
			return nil, fmt.Errorf("plugin %q was removed %v ago; the cleanup waits for it to come back, up to %v: %w",
				plugin, since.Round(time.Second), m.cfg.RemovedPluginGrace, device.ErrPluginUnavailable)
		}
	}
	return nil, nil
}
