package inventory

import (
	"maps"
	"slices"
	"time"

	"github.com/devicehost/devicehost/device"
)

// This file is what the manager tells the registry about its plugins: which are this
// host's (AddPlugin, RestartPlugin, RemovePlugin, AddMissing) and how each run goes
// (Launching, Running, Down, Restarting, Failed, PluginError, Rejected), as the plugin's
// status in the snapshot and its devices' health. Reasons and errors are kept as one
// bounded line (ErrorLine).

// AddPlugin registers a plugin before its supervisor starts, replacing a record of that
// name (a configured plugin whose binary was missing). A plugin added after Ready is
// closed does not hold anything up; one added before it holds Ready like the others.
func (r *Registry) AddPlugin(name, path string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.plugins[name] = &pluginRecord{
		state: device.PluginState{Name: name, Path: path, Status: device.PluginStarting},
		down:  "plugin starting",
	}
	r.names = slices.Sorted(maps.Keys(r.plugins))
	r.recomputeLocked()
	r.publishLocked()
}

// RestartPlugin readies the record of a plugin whose supervisor is being replaced (its
// binary or settings changed) for the new one: its devices stay in the inventory,
// unhealthy with reason, until the new process fingerprints; its status starts over
// (starting, no restarts, no last error) with the new path.
func (r *Registry) RestartPlugin(name, path, reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, ok := r.plugins[name]
	if !ok {
		return
	}
	rec.state = device.PluginState{Name: name, Path: path, Status: device.PluginStarting}
	rec.down = ErrorLine(reason)
	r.recomputeLocked()
	r.publishLocked()
}

// RemovePlugin forgets a plugin that left the host: its devices leave the inventory and
// their states go, while the IDs stay bound to it (another plugin reporting them may take
// them over, as for any plugin this host does not run). Its reservations are the
// ledger's and stay. Removing the last plugin that held Ready closes it.
func (r *Registry) RemovePlugin(name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.plugins[name]; !ok {
		return
	}
	delete(r.plugins, name)
	r.names = slices.Sorted(maps.Keys(r.plugins))
	r.recomputeLocked()
	r.publishLocked()
	r.checkReadyLocked()
}

// AddMissing registers a configured plugin that has no binary: it is listed as failed
// with reason, runs no supervisor, and does not hold Ready. The device IDs bound to it,
// if an earlier host recorded any, stay bound to it.
func (r *Registry) AddMissing(name, path, reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.plugins[name] = &pluginRecord{
		state:   device.PluginState{Name: name, Path: path, Status: device.PluginFailed, LastError: ErrorLine(reason), LastErrorAt: r.now()},
		settled: true,
	}
	r.names = slices.Sorted(maps.Keys(r.plugins))
	r.recomputeLocked()
	r.publishLocked()
}

// update runs fn on the named plugin's record and republishes.
func (r *Registry) update(name string, fn func(rec *pluginRecord)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, ok := r.plugins[name]
	if !ok {
		return
	}
	fn(rec)
	r.recomputeLocked()
	r.publishLocked()
}

// Launching records that a plugin is being (re)started; restarts counts relaunches.
func (r *Registry) Launching(name string, restarts int) {
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginStarting
		rec.state.Restarts = restarts
		rec.state.NextRetry = time.Time{}
	})
}

// Running records a launched plugin's version. Its devices stay as they are until it
// fingerprints.
func (r *Registry) Running(name, version string) {
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginRunning
		rec.state.Version = version
		rec.running = true
	})
	r.mu.Lock()
	r.checkStartedLocked()
	r.mu.Unlock()
}

// Down marks every device of a plugin unhealthy with reason (made one bounded line), at
// once.
func (r *Registry) Down(name, reason string) {
	r.update(name, func(rec *pluginRecord) { rec.down = ErrorLine(reason) })
}

// Restarting records a failed run and that the next attempt is due after delay. A
// failed run settles the plugin for Ready: it has had its try, and the other plugins'
// devices need not wait for its next one.
func (r *Registry) Restarting(name string, err error, delay time.Duration) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginRestarting
		rec.state.LastError, rec.state.LastErrorAt = ErrorLine(err.Error()), now
		rec.state.NextRetry = now.Add(delay)
		rec.settled = true
	})
	r.CheckReady()
}

// Failed records a permanent failure: the plugin will not be restarted.
func (r *Registry) Failed(name string, err error) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginFailed
		rec.state.LastError, rec.state.LastErrorAt = ErrorLine(err.Error()), now
		rec.state.NextRetry = time.Time{}
		if rec.down == "" {
			rec.down = ErrorLine("plugin failed: " + err.Error())
		}
		rec.settled = true
	})
	r.CheckReady()
}

// PluginError records an error that does not stop the plugin (a stats stream failure).
func (r *Registry) PluginError(name string, err error) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.LastError, rec.state.LastErrorAt = ErrorLine(err.Error()), now
	})
}

// Rejected records a fingerprint of the plugin that was refused (broke a rule, or the
// byte budget) as its last error. Like a failed run, it settles the plugin for Ready.
func (r *Registry) Rejected(name string, err error) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.LastError, rec.state.LastErrorAt = ErrorLine(err.Error()), now
		rec.settled = true
	})
	r.CheckReady()
}

// StatsGroupCost returns what the host adds to the plugin's stats for its last good
// fingerprint's groups (see budget.go), for StatsCost.
func (r *Registry) StatsGroupCost(name string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rec, ok := r.plugins[name]; ok {
		return rec.fp.statsGroupCost
	}
	return 0
}

// Known returns whether the plugin's last good fingerprint reported a device ID, as of
// now: a later fingerprint does not change what the returned func answers.
func (r *Registry) Known(name string) func(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	var devices map[string]reportedDevice // replaced, never modified: safe to read unlocked
	if rec, ok := r.plugins[name]; ok {
		devices = rec.fp.devices
	}
	return func(id string) bool { _, ok := devices[id]; return ok }
}
