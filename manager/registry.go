package manager

import (
	"context"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/manager/device"
)

// registry is the manager's inventory and state: the last good fingerprint of every
// plugin, which plugin owns which device ID, device health and plugin status. Every change
// makes a new immutable device.Snapshot and offers it to the watchers.
//
// Safe for concurrent use. Lock order: registry.mu, then the reservation store's lock
// (through holders), then the broadcast's lock.
type registry struct {
	log     hclog.Logger
	now     func() time.Time
	holders func() map[string]device.Holder // the live reservations, by device ID

	watchers broadcast[device.Snapshot]
	ready    chan struct{} // closed by markReadyLocked

	mu       sync.Mutex
	plugins  map[string]*pluginRecord
	names    []string                      // sorted plugin names
	owner    map[string]string             // device ID -> owning plugin; first claim wins
	devState map[string]device.DeviceState // by owned device ID; Holder unset
	seq      uint64
	snap     device.Snapshot
	isReady  bool
}

// pluginRecord is what the registry keeps per plugin.
type pluginRecord struct {
	state   device.PluginState // DeviceCount is computed when publishing
	fp      fingerprint        // last good fingerprint; zero until the first
	down    string             // non-empty: the plugin is not serving; its devices are unhealthy with this reason
	settled bool               // fingerprinted or failed once: no longer holds Ready
}

func newRegistry(log hclog.Logger, now func() time.Time, holders func() map[string]device.Holder) *registry {
	r := &registry{
		log:      log,
		now:      now,
		holders:  holders,
		ready:    make(chan struct{}),
		plugins:  make(map[string]*pluginRecord),
		owner:    make(map[string]string),
		devState: make(map[string]device.DeviceState),
	}
	r.publishLocked()
	return r
}

// addPlugin registers a plugin before its supervisor starts.
func (r *registry) addPlugin(name, path string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.plugins[name] = &pluginRecord{
		state: device.PluginState{Name: name, Path: path, Status: device.PluginStarting},
		down:  "plugin starting",
	}
	r.names = slices.Sorted(maps.Keys(r.plugins))
	r.publishLocked()
}

// snapshot returns the current snapshot.
func (r *registry) snapshot() device.Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.snap
}

// watch subscribes to snapshots, starting with the current one.
func (r *registry) watch(ctx context.Context) <-chan device.Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.watchers.subscribe(ctx, 1, &r.snap)
}

// refresh republishes after a change outside the registry (a reservation's holder).
// Only the holders changed: the current snapshot's inventory and plugin states (never
// written once made) are kept, and only the device states are rebuilt; Reserve and
// Release call it on every reservation change.
func (r *registry) refresh() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seq++
	snap := r.snap
	snap.Seq, snap.Time = r.seq, r.now()
	snap.State.Devices = make(map[string]device.DeviceState, len(r.devState))
	holders := r.holders()
	for id, st := range r.devState {
		if h, ok := holders[id]; ok {
			st.Holder = &h
		}
		snap.State.Devices[id] = st
	}
	r.snap = snap
	r.watchers.publish(snap)
}

// update runs fn on the named plugin's record and republishes.
func (r *registry) update(name string, fn func(rec *pluginRecord)) {
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

// launching records that a plugin is being (re)started; restarts counts relaunches.
func (r *registry) launching(name string, restarts int) {
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginStarting
		rec.state.Restarts = restarts
		rec.state.NextRetry = time.Time{}
	})
}

// running records a launched plugin's version. Its devices stay as they are until it
// fingerprints.
func (r *registry) running(name, version string) {
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginRunning
		rec.state.Version = version
	})
}

// down marks every device of a plugin unhealthy with reason, at once.
func (r *registry) down(name, reason string) {
	r.update(name, func(rec *pluginRecord) { rec.down = reason })
}

// restarting records a failed run and that the next attempt is due after delay.
func (r *registry) restarting(name string, err error, delay time.Duration) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginRestarting
		rec.state.LastError, rec.state.LastErrorAt = err.Error(), now
		rec.state.NextRetry = now.Add(delay)
	})
}

// failed records a permanent failure: the plugin will not be restarted.
func (r *registry) failed(name string, err error) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginFailed
		rec.state.LastError, rec.state.LastErrorAt = err.Error(), now
		rec.state.NextRetry = time.Time{}
		if rec.down == "" {
			rec.down = "plugin failed: " + err.Error()
		}
		rec.settled = true
	})
	r.checkReady()
}

// pluginError records an error that does not stop the plugin (a stats stream failure).
func (r *registry) pluginError(name string, err error) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.LastError, rec.state.LastErrorAt = err.Error(), now
	})
}

// setFingerprint installs a validated fingerprint as the plugin's inventory. Device IDs
// another plugin already owns are left out, with a log line naming both plugins; IDs
// the plugin no longer reports are freed and may go to another plugin that reports them.
func (r *registry) setFingerprint(name string, fp fingerprint) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, ok := r.plugins[name]
	if !ok {
		return
	}
	rec.fp, rec.down, rec.settled = fp, "", true

	var freed bool
	for id, owner := range r.owner {
		if _, still := fp.devices[id]; owner == name && !still {
			delete(r.owner, id)
			freed = true
		}
	}
	for _, id := range slices.Sorted(maps.Keys(fp.devices)) {
		switch owner, taken := r.owner[id]; {
		case !taken:
			r.owner[id] = name
		case owner != name:
			r.log.Error("device ID already owned by another plugin; ignoring it", "device", id, "plugin", name, "owner", owner)
		}
	}
	if freed {
		// Hand freed IDs to the first other plugin (by name) that reports them.
		for _, other := range r.names {
			for id := range r.plugins[other].fp.devices {
				if _, taken := r.owner[id]; !taken {
					r.owner[id] = other
					r.log.Info("device ID freed by one plugin now owned by another", "device", id, "plugin", other, "previous_owner", name)
				}
			}
		}
	}
	r.recomputeLocked()
	r.publishLocked()
	r.checkReadyLocked()
}

// known returns whether the plugin's last good fingerprint reported a device ID.
func (r *registry) known(name string) func(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	devices := r.plugins[name].fp.devices // replaced, never modified: safe to read unlocked
	return func(id string) bool { _, ok := devices[id]; return ok }
}

// checkReadyLocked closes ready once every plugin has settled.
func (r *registry) checkReadyLocked() {
	for _, rec := range r.plugins {
		if !rec.settled {
			return
		}
	}
	r.markReadyLocked()
}

// checkReady closes ready if every plugin has settled (or there are none).
func (r *registry) checkReady() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.checkReadyLocked()
}

// forceReady closes ready whatever the plugins' state, and returns the plugins that had
// not settled.
func (r *registry) forceReady() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var waiting []string
	for _, name := range r.names {
		if !r.plugins[name].settled {
			waiting = append(waiting, name)
		}
	}
	r.markReadyLocked()
	return waiting
}

func (r *registry) markReadyLocked() {
	if !r.isReady {
		r.isReady = true
		close(r.ready)
	}
}

// recomputeLocked derives every owned device's health from its plugin: what the plugin
// reported, or unhealthy with the plugin's down reason. Since moves only when the
// health changes.
func (r *registry) recomputeLocked() {
	now := r.now()
	next := make(map[string]device.DeviceState, len(r.owner))
	for id, name := range r.owner {
		rec := r.plugins[name]
		rd := rec.fp.devices[id]
		st := device.DeviceState{Health: rd.health, Reason: rd.reason, Since: now}
		if rec.down != "" {
			st.Health, st.Reason = device.HealthUnhealthy, rec.down
		}
		switch {
		case st.Health == device.HealthHealthy:
			st.Reason = ""
		case st.Reason == "" && st.Health == device.HealthUnhealthy:
			st.Reason = "reported unhealthy by plugin " + name
		}
		if prev, ok := r.devState[id]; ok && prev.Health == st.Health {
			st.Since = prev.Since
		}
		next[id] = st
	}
	r.devState = next
}

// publishLocked builds a new snapshot from the records and offers it to the watchers.
// Slices and maps shared with earlier snapshots are never written after being made.
func (r *registry) publishLocked() {
	r.seq++
	snap := device.Snapshot{
		Seq:   r.seq,
		Time:  r.now(),
		State: device.State{Devices: make(map[string]device.DeviceState, len(r.devState))},
	}
	holders := r.holders()
	for _, name := range r.names {
		rec := r.plugins[name]
		count := 0
		for _, g := range rec.fp.groups {
			owned := slices.DeleteFunc(slices.Clone(g.Devices), func(d device.DeviceInfo) bool { return r.owner[d.ID] != name })
			g.Devices = owned
			count += len(owned)
			snap.Inventory.Groups = append(snap.Inventory.Groups, g)
		}
		ps := rec.state
		ps.DeviceCount = count
		snap.State.Plugins = append(snap.State.Plugins, ps)
	}
	for id, st := range r.devState {
		if h, ok := holders[id]; ok {
			st.Holder = &h
		}
		snap.State.Devices[id] = st
	}
	r.snap = snap
	r.watchers.publish(snap)
}
