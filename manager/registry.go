package manager

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/manager/device"
	"github.com/devicehost/devicehost/validate"
)

// registry is the manager's inventory and state: the last good fingerprint of every
// plugin, which plugin each device ID is bound to, device health and plugin status. Every
// change makes a new immutable device.Snapshot and offers it to the watchers.
//
// Device bindings: a device ID is bound to the first plugin that reports it, and stays
// bound across that plugin's restarts, while it no longer reports it, and (with a
// bindingStore) across restarts of the host. Another plugin reporting that ID gets it
// refused, unless the plugin it is bound to is not one of this host's plugins any more:
// then the ID is bound to the reporter instead. (A reservation's owner is another thing:
// the allocation holding devices; the registry only reads holders.)
//
// Safe for concurrent use. Lock order: registry.bindMu, then registry.mu, then the
// reservation store's lock (through holders), then the broadcast's lock.
type registry struct {
	log     hclog.Logger
	now     func() time.Time
	holders func() map[string]device.Holder // the live reservations, by device ID
	store   bindingStore                    // nil: bindings are kept in memory only

	watchers broadcast[device.Snapshot]
	ready    chan struct{} // closed by markReadyLocked

	// bindMu serialises binding decisions with their write to the store, which is
	// done without mu so that readers of the snapshot never wait for the disk.
	bindMu sync.Mutex

	mu       sync.Mutex
	plugins  map[string]*pluginRecord      // this host's plugins; the manager adds and removes them
	names    []string                      // sorted plugin names
	bindings map[string]string             // device ID -> the plugin it is bound to, perhaps one not in plugins
	bound    map[string]int                // plugin -> how many IDs are bound to it
	devState map[string]device.DeviceState // by device ID bound to and reported by its plugin; Holder unset
	seq      uint64
	snap     device.Snapshot
	isReady  bool
}

// bindingStore keeps device bindings across host restarts; *ledger.Ledger is one.
type bindingStore interface {
	RecordDeviceBindings(ctx context.Context, bindings map[string]string, forget []string) error
}

// maxBoundPerPlugin bounds the device IDs bound to one plugin. A plugin reporting new IDs
// all the time would otherwise grow the binding records without end; past the bound
// it loses the IDs it no longer reports.
const maxBoundPerPlugin = 2 * validate.MaxDevices

// bindingError names the device IDs of a fingerprint that are bound to other plugins,
// which were left out of the plugin's inventory.
type bindingError struct {
	plugin   string
	byPlugin map[string][]string // plugin the IDs are bound to -> refused IDs, sorted
}

func (e *bindingError) Error() string {
	var parts []string
	for _, other := range slices.Sorted(maps.Keys(e.byPlugin)) {
		parts = append(parts, fmt.Sprintf("%s bound to plugin %q", listIDs(e.byPlugin[other]), other))
	}
	return fmt.Sprintf("device IDs of other plugins refused: %s (an ID stays with the plugin that reported it first)", strings.Join(parts, "; "))
}

// maxListedIDs is how many device IDs a log line or error lists before "and N more".
const maxListedIDs = 8

// listIDs joins ids for a message, at most maxListedIDs of them.
func listIDs(ids []string) string {
	if len(ids) <= maxListedIDs {
		return strings.Join(ids, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(ids[:maxListedIDs], ", "), len(ids)-maxListedIDs)
}

// pluginRecord is what the registry keeps per plugin.
type pluginRecord struct {
	state   device.PluginState // DeviceCount is computed when publishing
	fp      fingerprint        // last good fingerprint; zero until the first
	down    string             // non-empty: the plugin is not serving; its devices are unhealthy with this reason
	settled bool               // fingerprinted or failed once: no longer holds Ready
}

// newRegistry returns a registry with no plugins. bindings are the device bindings
// recorded by an earlier host (device ID -> plugin); store, when not nil, is where new
// ones are recorded.
func newRegistry(log hclog.Logger, now func() time.Time, holders func() map[string]device.Holder, store bindingStore, bindings map[string]string) *registry {
	r := &registry{
		log:      log,
		now:      now,
		holders:  holders,
		store:    store,
		ready:    make(chan struct{}),
		plugins:  make(map[string]*pluginRecord),
		bindings: maps.Clone(bindings),
		bound:    make(map[string]int),
		devState: make(map[string]device.DeviceState),
	}
	if r.bindings == nil {
		r.bindings = make(map[string]string)
	}
	for _, p := range r.bindings {
		r.bound[p]++
	}
	r.publishLocked()
	return r
}

// orphans returns, by plugin, how many device IDs are bound to plugins that are not
// this host's: any plugin that reports them gets them bound to it.
func (r *registry) orphans() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]int)
	for p, n := range r.bound {
		if _, ok := r.plugins[p]; !ok && n > 0 {
			out[p] = n
		}
	}
	return out
}

// addPlugin registers a plugin before its supervisor starts, replacing a record of that
// name (a configured plugin whose binary was missing). A plugin added after Ready is
// closed does not hold anything up; one added before it holds Ready like the others.
func (r *registry) addPlugin(name, path string) {
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

// restartPlugin readies the record of a plugin whose supervisor is being replaced (its
// binary or settings changed) for the new one: its devices stay in the inventory,
// unhealthy with reason, until the new process fingerprints; its status starts over
// (starting, no restarts, no last error) with the new path.
func (r *registry) restartPlugin(name, path, reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, ok := r.plugins[name]
	if !ok {
		return
	}
	rec.state = device.PluginState{Name: name, Path: path, Status: device.PluginStarting}
	rec.down = errorLine(reason)
	r.recomputeLocked()
	r.publishLocked()
}

// removePlugin forgets a plugin that left the host: its devices leave the inventory and
// their states go, while the IDs stay its own (another plugin reporting them may take
// them over, as for any plugin this host does not run). Its reservations are the
// store's and stay. Removing the last plugin that held Ready closes it.
func (r *registry) removePlugin(name string) {
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

// addMissing registers a configured plugin that has no binary: it is listed as failed
// with reason, runs no supervisor, and does not hold Ready. Its devices, if an earlier
// host recorded any, stay its own.
func (r *registry) addMissing(name, path, reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.plugins[name] = &pluginRecord{
		state:   device.PluginState{Name: name, Path: path, Status: device.PluginFailed, LastError: errorLine(reason), LastErrorAt: r.now()},
		settled: true,
	}
	r.names = slices.Sorted(maps.Keys(r.plugins))
	r.recomputeLocked()
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

// down marks every device of a plugin unhealthy with reason (made one bounded line), at
// once.
func (r *registry) down(name, reason string) {
	r.update(name, func(rec *pluginRecord) { rec.down = errorLine(reason) })
}

// restarting records a failed run and that the next attempt is due after delay. A
// failed run settles the plugin for Ready: it has had its try, and the other plugins'
// devices need not wait for its next one.
func (r *registry) restarting(name string, err error, delay time.Duration) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginRestarting
		rec.state.LastError, rec.state.LastErrorAt = errorLine(err.Error()), now
		rec.state.NextRetry = now.Add(delay)
		rec.settled = true
	})
	r.checkReady()
}

// failed records a permanent failure: the plugin will not be restarted.
func (r *registry) failed(name string, err error) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.Status = device.PluginFailed
		rec.state.LastError, rec.state.LastErrorAt = errorLine(err.Error()), now
		rec.state.NextRetry = time.Time{}
		if rec.down == "" {
			rec.down = errorLine("plugin failed: " + err.Error())
		}
		rec.settled = true
	})
	r.checkReady()
}

// pluginError records an error that does not stop the plugin (a stats stream failure).
func (r *registry) pluginError(name string, err error) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.LastError, rec.state.LastErrorAt = errorLine(err.Error()), now
	})
}

// rejected records a fingerprint of the plugin that was refused (broke a rule, or the
// byte budget) as its last error. Like a failed run, it settles the plugin for Ready.
func (r *registry) rejected(name string, err error) {
	now := r.now()
	r.update(name, func(rec *pluginRecord) {
		rec.state.LastError, rec.state.LastErrorAt = errorLine(err.Error()), now
		rec.settled = true
	})
	r.checkReady()
}

// statsGroupCost returns the statsGroupCost of the plugin's last good fingerprint.
func (r *registry) statsGroupCost(name string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rec, ok := r.plugins[name]; ok {
		return rec.fp.statsGroupCost
	}
	return 0
}

// setFingerprint installs a validated fingerprint as the plugin's inventory, unless its
// charge (fp.cost) would take the host's Fingerprint message over MaxSnapshotBytes: then
// nothing changes and a *budgetError says so. Device IDs bound to no plugin are bound to
// this one, recorded in the store before they are published; IDs bound to a plugin this
// host does not run any more are bound to this one instead, with a log line; IDs bound
// to another of its plugins are left out of the inventory, and the returned
// *bindingError names them and those plugins.
func (r *registry) setFingerprint(name string, fp fingerprint) (*bindingError, error) {
	r.bindMu.Lock()
	defer r.bindMu.Unlock()

	r.mu.Lock()
	rec, ok := r.plugins[name]
	if !ok {
		r.mu.Unlock()
		return nil, nil
	}
	others := 0
	for other, p := range r.plugins {
		if other != name {
			others += p.fp.cost
		}
	}
	if others+fp.cost+timestampBytes > MaxSnapshotBytes {
		r.mu.Unlock()
		return nil, &budgetError{plugin: name, what: "fingerprint", cost: fp.cost, others: others, limit: MaxSnapshotBytes}
	}
	bind := make(map[string]string)    // IDs to bind to the plugin and record
	taken := make(map[string][]string) // plugin no longer configured -> IDs bound to it
	refused := make(map[string][]string)
	for _, id := range slices.Sorted(maps.Keys(fp.devices)) {
		switch other, ok := r.bindings[id]; {
		case !ok:
			bind[id] = name
		case other == name:
		case r.plugins[other] == nil:
			bind[id] = name
			taken[other] = append(taken[other], id)
		default:
			refused[other] = append(refused[other], id)
		}
	}
	var forget []string
	if r.bound[name]+len(bind) > maxBoundPerPlugin {
		for id, p := range r.bindings {
			if _, still := fp.devices[id]; p == name && !still {
				forget = append(forget, id)
			}
		}
		slices.Sort(forget)
	}
	r.mu.Unlock()

	if r.store != nil && (len(bind) > 0 || len(forget) > 0) {
		ctx, cancel := context.WithTimeout(context.Background(), ledgerWriteTimeout)
		err := r.store.RecordDeviceBindings(ctx, bind, forget)
		cancel()
		if err != nil {
			r.log.Error("cannot record device bindings in the state file; they hold until the host stops",
				"plugin", name, "devices", listIDs(slices.Sorted(maps.Keys(bind))), "error", oneLine(err))
		}
	}
	for _, prev := range slices.Sorted(maps.Keys(taken)) {
		r.log.Warn("device IDs bound to a plugin this host does not run any more are now bound to this plugin",
			"plugin", name, "previous_plugin", prev, "devices", listIDs(taken[prev]))
	}
	if len(forget) > 0 {
		r.log.Warn("plugin reported more distinct device IDs than may be bound to one plugin; it loses those it no longer reports",
			"plugin", name, "limit", maxBoundPerPlugin, "forgotten", len(forget))
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	for _, id := range forget {
		delete(r.bindings, id)
		r.bound[name]--
	}
	for id := range bind {
		if prev, ok := r.bindings[id]; ok {
			r.bound[prev]--
		}
		r.bindings[id] = name
		r.bound[name]++
	}
	rec.fp, rec.down, rec.settled = fp, "", true
	r.recomputeLocked()
	r.publishLocked()
	r.checkReadyLocked()
	if len(refused) > 0 {
		return &bindingError{plugin: name, byPlugin: refused}, nil
	}
	return nil, nil
}

// known returns whether the plugin's last good fingerprint reported a device ID.
func (r *registry) known(name string) func(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	var devices map[string]reportedDevice // replaced, never modified: safe to read unlocked
	if rec, ok := r.plugins[name]; ok {
		devices = rec.fp.devices
	}
	return func(id string) bool { _, ok := devices[id]; return ok }
}

// awaitedPlugin returns the plugin every one of ids (not empty) is bound to when it is one
// of this host's plugins and has not fingerprinted since this host started, with its
// state: those devices are not in the inventory yet, but they are its own and will be
// once it reports them (right after a host restart, while it starts). ok is false
// otherwise.
func (r *registry) awaitedPlugin(ids []string) (state device.PluginState, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var name string
	for i, id := range ids {
		p, found := r.bindings[id]
		if !found || (i > 0 && p != name) {
			return device.PluginState{}, false
		}
		name = p
	}
	rec, found := r.plugins[name]
	if !found || rec.fp.devices != nil {
		return device.PluginState{}, false
	}
	return rec.state, true
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

// recomputeLocked derives every bound device's health from its plugin: what the plugin
// reported, or unhealthy with the plugin's down reason. Since moves only when the
// health changes.
func (r *registry) recomputeLocked() {
	now := r.now()
	next := make(map[string]device.DeviceState, len(r.devState))
	for name, rec := range r.plugins {
		for id, rd := range rec.fp.devices {
			if r.bindings[id] != name {
				continue
			}
			st := device.DeviceState{Health: rd.health, Reason: rd.reason, Since: now}
			if rec.down != "" {
				st.Health, st.Reason = device.HealthUnhealthy, rec.down
			}
			switch {
			case st.Health == device.HealthHealthy:
				st.Reason = ""
			case st.Reason == "" && st.Health == device.HealthUnhealthy:
				st.Reason = unhealthyByPlugin + name
			}
			if prev, ok := r.devState[id]; ok && prev.Health == st.Health {
				st.Since = prev.Since
			}
			next[id] = st
		}
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
			bound := slices.DeleteFunc(slices.Clone(g.Devices), func(d device.DeviceInfo) bool { return r.bindings[d.ID] != name })
			if len(bound) == 0 && len(g.Devices) > 0 {
				continue // every device of it is bound to other plugins
			}
			g.Devices = bound
			count += len(bound)
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
