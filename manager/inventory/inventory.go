// Package inventory is what the manager knows about the devices of its plugins: each
// plugin's last good fingerprint, device-ID bindings, device health, plugin status,
// readiness, the latest stats and the byte budgets of the host API's messages. Every
// change makes a new immutable device.Snapshot, offered to the watchers. It decides
// nothing about running plugins nor about reservations (it reads their holders through
// a function). Reading order: Registry (this file), plugins.go, bindings.go, ready.go,
// budget.go, convert.go, stats.go, broadcast.go. See docs/plugins.md.
package inventory

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/device"
)

// Registry is the manager's inventory and state: the last good fingerprint of every
// plugin, which plugin each device ID is bound to (bindings.go), device health, plugin
// status and readiness (ready.go). Every change makes a new immutable device.Snapshot and
// offers it to the watchers.
//
// Safe for concurrent use. Lock order: bindMu, then mu, then the reservation store's
// lock (through Config.Holders), then the broadcast's lock.
type Registry struct {
	log          hclog.Logger
	now          func() time.Time
	holders      func() map[string]device.Holder
	cordons      func() map[string]device.Cordon
	adminAccess  func() map[string][]device.Holder
	counterUse   func() map[device.CounterSetKey]device.CounterUse
	store        BindingStore
	storeTimeout time.Duration

	watchers broadcast[device.Snapshot]
	ready    chan struct{} // closed by markReadyLocked
	started  chan struct{} // closed by markStartedLocked

	// bindMu serialises binding decisions with their write to the store, which is
	// done without mu so that readers of the snapshot never wait for the disk.
	bindMu sync.Mutex

	mu        sync.Mutex
	plugins   map[string]*pluginRecord           // this host's plugins; the manager adds and removes them
	names     []string                           // sorted plugin names
	bindings  map[string]string                  // device ID -> the plugin it is bound to, perhaps one not in plugins
	bound     map[string]int                     // plugin -> how many IDs are bound to it
	patterns  map[string][]string                // plugin -> the device ID patterns it is pinned to
	fresh     map[string]bool                    // IDs first bound in this run before the host was ready
	contested map[string]bool                    // IDs two unpinned plugins reported before it was: bound to neither
	devState  map[string]device.DeviceState      // by device ID bound to and reported by its plugin; Holder unset
	blocks    map[device.CounterSetKey]setBlocks // deviceStatesLocked's blockers per counter set, for snap's inventory
	seq       uint64
	published uint64 // the Seq of the snapshot the watchers were last offered
	snap      device.Snapshot
	isReady   bool
	isStarted bool
}

// Config is what New needs. The zero value is usable: no log, the wall clock, no
// holders, and bindings kept in memory only.
type Config struct {
	Logger hclog.Logger     // nil discards logs
	Now    func() time.Time // nil: time.Now
	// Holders returns the live reservations' holders, by device ID; nil: none. It is
	// called with the registry's lock held, so it must not call the registry.
	Holders func() map[string]device.Holder
	// Cordons returns the cordoned devices' cordons, by device ID; nil: none. Called
	// like Holders, with the registry's lock held.
	Cordons func() map[string]device.Cordon
	// AdminAccess returns the live admin accesses, by device ID, each sorted by ID;
	// nil: none. Called like Holders, with the registry's lock held.
	AdminAccess func() map[string][]device.Holder
	// CounterUse returns what live reservations use of the plugins' shared counters;
	// nil: nothing. Called like Holders, with the registry's lock held.
	CounterUse func() map[device.CounterSetKey]device.CounterUse
	// Store, when not nil, is where new device bindings are recorded, so that they
	// outlive the host; StoreTimeout bounds one write (zero: 5 s).
	Store        BindingStore
	StoreTimeout time.Duration
	// Bindings are the device bindings an earlier host recorded (device ID -> plugin).
	// New copies them.
	Bindings map[string]string
}

// BindingStore keeps device bindings across host restarts; *ledger.Ledger is one.
type BindingStore interface {
	RecordDeviceBindings(ctx context.Context, bindings map[string]string, forget []string) error
}

// pluginRecord is what the registry keeps per plugin.
type pluginRecord struct {
	state   device.PluginState // DeviceCount is computed when publishing
	fp      fingerprint        // last good fingerprint; zero until the first
	down    string             // non-empty: the plugin is not serving; its devices are unhealthy with this reason
	settled bool               // fingerprinted or failed once: no longer holds Ready
	running bool               // launched (its config accepted) once: no longer holds Started
}

// New returns a registry with no plugins.
func New(cfg Config) *Registry {
	r := &Registry{
		log:          cfg.Logger,
		now:          cfg.Now,
		holders:      cfg.Holders,
		cordons:      cfg.Cordons,
		adminAccess:  cfg.AdminAccess,
		counterUse:   cfg.CounterUse,
		store:        cfg.Store,
		storeTimeout: cfg.StoreTimeout,
		ready:        make(chan struct{}),
		started:      make(chan struct{}),
		plugins:      make(map[string]*pluginRecord),
		bindings:     maps.Clone(cfg.Bindings),
		bound:        make(map[string]int),
		patterns:     make(map[string][]string),
		fresh:        make(map[string]bool),
		contested:    make(map[string]bool),
		devState:     make(map[string]device.DeviceState),
	}
	if r.log == nil {
		r.log = hclog.NewNullLogger()
	}
	if r.now == nil {
		r.now = time.Now
	}
	if r.holders == nil {
		r.holders = func() map[string]device.Holder { return nil }
	}
	if r.cordons == nil {
		r.cordons = func() map[string]device.Cordon { return nil }
	}
	if r.adminAccess == nil {
		r.adminAccess = func() map[string][]device.Holder { return nil }
	}
	if r.counterUse == nil {
		r.counterUse = func() map[device.CounterSetKey]device.CounterUse { return nil }
	}
	if r.storeTimeout <= 0 {
		r.storeTimeout = 5 * time.Second
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

// Snapshot returns the current snapshot.
func (r *Registry) Snapshot() device.Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.snap
}

// Watch subscribes to snapshots, starting with the current one. The channel is closed
// when ctx ends or Close is called.
func (r *Registry) Watch(ctx context.Context) <-chan device.Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.publishPendingLocked() // so that the new watcher does not get it twice
	return r.watchers.subscribe(ctx, 1, &r.snap)
}

// Close closes every watcher's channel; later Watch calls get a closed channel.
func (r *Registry) Close() { r.watchers.close() }

// Refresh makes a new snapshot after a change outside the registry (a reservation's
// holder). Only the holders changed: the current snapshot's inventory and plugin states
// (never written once made) are kept, and only the device states are rebuilt; Reserve
// and Release call it on every reservation change.
//
// Snapshot and Watch show the new snapshot once Refresh returns; the watchers already
// subscribed are offered it after the reply of ctx's call (device.AfterReply), so that
// the caller whose change it is does not wait for their goroutines to be woken.
func (r *Registry) Refresh(ctx context.Context) {
	r.mu.Lock()
	r.seq++
	snap := r.snap
	snap.Seq, snap.Time = r.seq, r.now()
	snap.State.Devices, snap.State.CounterUse = r.deviceStatesLocked(snap.Inventory)
	r.snap = snap
	r.mu.Unlock()
	device.AfterReply(ctx, r.publishLatest)
}

// publishLatest offers the watchers the current snapshot, unless they had it already.
func (r *Registry) publishLatest() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.publishPendingLocked()
}

// publishPendingLocked offers the watchers the current snapshot if it is newer than the
// last they were offered (a Refresh whose publication waits for its call's reply).
func (r *Registry) publishPendingLocked() {
	if r.snap.Seq > r.published {
		r.published = r.snap.Seq
		r.watchers.publish(r.snap)
	}
}

// deviceStatesLocked is the state of every bound device, with the live reservations'
// holders, and what they use of inv's counter sets with, for each free device that
// consumes shared counters, the reservations that leave too little for it.
//
// The blockers are worked out per counter set and kept (r.blocks) until that set's use
// changes or a new inventory replaces inv, so a Reserve's refresh redoes only the set it
// touched: with every other GPU of a machine cut into held partitions, their devices'
// blockers are not worked out again on each change.
func (r *Registry) deviceStatesLocked(inv device.Inventory) (map[string]device.DeviceState, map[device.CounterSetKey]map[string]int64) {
	states := make(map[string]device.DeviceState, len(r.devState))
	holders := r.holders()
	cordons := r.cordons()
	access := r.adminAccess()
	for id, st := range r.devState {
		if h, ok := holders[id]; ok {
			st.Holder = &h
		}
		if c, ok := cordons[id]; ok {
			st.Cordon = &c
		}
		st.AdminAccess = access[id]
		states[id] = st
	}
	if len(inv.CounterSets) == 0 {
		r.blocks = nil
		return states, nil
	}
	use := r.counterUse()
	if len(use) == 0 {
		r.blocks = nil
		return states, nil
	}
	if r.blocks == nil {
		r.blocks = make(map[device.CounterSetKey]setBlocks)
	}
	for k, memo := range r.blocks {
		if u, ok := use[k]; !ok || !sameUse(memo.use, u) {
			delete(r.blocks, k)
		}
	}
	caps := make(map[device.CounterSetKey]map[string]int64, len(inv.CounterSets))
	for _, cs := range inv.CounterSets {
		caps[cs.Key] = cs.Capacity
	}
	used := make(map[device.CounterSetKey]map[string]int64, len(use))
	for k, u := range use {
		used[k] = u.Used
	}
	for _, g := range inv.Groups {
		for _, d := range g.Devices {
			st, ok := states[d.ID]
			if !ok || st.Holder != nil || len(d.Consumes) == 0 {
				continue
			}
			var blockers []device.Holder
			for _, c := range d.Consumes {
				u, ok := use[c.Set]
				if !ok {
					continue // nothing uses the set: it fits (the agent checks capacity itself)
				}
				memo, ok := r.blocks[c.Set]
				if !ok {
					memo = setBlocks{use: u, devices: make(map[string][]device.Holder)}
					r.blocks[c.Set] = memo
				}
				hs, ok := memo.devices[d.ID]
				if !ok {
					hs = blockedBy(c, caps[c.Set], u)
					memo.devices[d.ID] = hs
				}
				if len(d.Consumes) == 1 {
					blockers = hs // shared with the memo: never written
				} else {
					blockers = append(blockers, hs...)
				}
			}
			if len(d.Consumes) > 1 && len(blockers) > 1 {
				slices.SortFunc(blockers, func(a, b device.Holder) int { return strings.Compare(a.ReservationID, b.ReservationID) })
				blockers = slices.Compact(blockers)
			}
			if len(blockers) > 0 {
				st.BlockedBy = blockers
				states[d.ID] = st
			}
		}
	}
	return states, used
}

// setBlocks is what deviceStatesLocked worked out for one counter set at one use of
// it: each consuming device's blockers (nil: it fits). The lists are never written
// after being made: snapshots share them.
type setBlocks struct {
	use     device.CounterUse
	devices map[string][]device.Holder
}

// sameUse says whether two uses of a counter set are the same sums by the same
// reservations under the same groups.
func sameUse(a, b device.CounterUse) bool {
	if !maps.Equal(a.Used, b.Used) || len(a.Users) != len(b.Users) ||
		!slices.Equal(a.SetUsers, b.SetUsers) || !slices.Equal(a.Groups, b.Groups) {
		return false
	}
	for name, hs := range a.Users {
		if other, ok := b.Users[name]; !ok || !slices.Equal(hs, other) {
			return false
		}
	}
	return true
}

// blockedBy returns the live reservations that use so much of a counter c needs (the
// set's capacity caps, its use u) that it does not fit, or every user of the set when
// c's compatibility groups have none in common with theirs, sorted by reservation ID;
// none when it fits.
func blockedBy(c device.Consumption, caps map[string]int64, u device.CounterUse) []device.Holder {
	if _, ok := device.Compatible(c.Groups, u.Groups); !ok && len(u.SetUsers) > 0 {
		return u.SetUsers // shared with the use: never written
	}
	var out []device.Holder
	for name, want := range c.Counters {
		if want > 0 && u.Used[name]+want > caps[name] {
			out = append(out, u.Users[name]...)
		}
	}
	if len(out) < 2 {
		return out
	}
	slices.SortFunc(out, func(a, b device.Holder) int { return strings.Compare(a.ReservationID, b.ReservationID) })
	return slices.Compact(out)
}

// recomputeLocked derives every bound device's health from its plugin: what the plugin
// reported, or unhealthy with the plugin's down reason. Since moves only when the
// health changes.
func (r *Registry) recomputeLocked() {
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
func (r *Registry) publishLocked() {
	r.seq++
	snap := device.Snapshot{Seq: r.seq, Time: r.now()}
	for _, name := range r.names {
		rec := r.plugins[name]
		snap.Inventory.CounterSets = append(snap.Inventory.CounterSets, rec.fp.counterSets...)
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
	r.blocks = nil // a new inventory: what devices consume and the capacities may differ
	snap.State.Devices, snap.State.CounterUse = r.deviceStatesLocked(snap.Inventory)
	r.snap = snap
	r.published = snap.Seq
	r.watchers.publish(snap)
}
