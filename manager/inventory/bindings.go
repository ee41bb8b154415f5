package inventory

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/internal/idpattern"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/textline"
	"github.com/devicehost/devicehost/validate"
)

// Device bindings: a device ID is bound to the first plugin that reports it, and stays
// bound across that plugin's restarts, while it no longer reports it, and (with a
// BindingStore) across restarts of the host. Another plugin reporting that ID gets it
// refused, unless the plugin it is bound to is not one of this host's plugins any more:
// then the ID is bound to the reporter instead. (A reservation's owner is another thing:
// the allocation holding devices; the registry only reads holders.)

// MaxBoundPerPlugin bounds the device IDs bound to one plugin. A plugin reporting new IDs
// all the time would otherwise grow the binding records without end; past the bound
// it loses the IDs it no longer reports.
const MaxBoundPerPlugin = 2 * validate.MaxDevices

// BindingError names the device IDs of a fingerprint that are bound to other plugins,
// which were left out of the plugin's inventory.
type BindingError struct {
	Plugin   string              // the plugin that reported them
	ByPlugin map[string][]string // plugin the IDs are bound to -> refused IDs, sorted
	// NotAllowed are IDs that match none of the plugin's device_ids patterns, sorted.
	NotAllowed []string
	// Contested are IDs that another plugin reported too before the host was ready,
	// neither pinned by device_ids: bound to neither, sorted.
	Contested []string
}

func (e *BindingError) Error() string {
	var parts []string
	if len(e.NotAllowed) > 0 {
		parts = append(parts, fmt.Sprintf("device IDs outside the plugin's device_ids patterns refused: %s", ListIDs(e.NotAllowed)))
	}
	var bound []string
	for _, other := range slices.Sorted(maps.Keys(e.ByPlugin)) {
		bound = append(bound, fmt.Sprintf("%s bound to plugin %q", ListIDs(e.ByPlugin[other]), other))
	}
	if len(bound) > 0 {
		parts = append(parts, fmt.Sprintf("device IDs of other plugins refused: %s (an ID stays with the plugin that reported it first; pin each plugin's IDs with device_ids in its plugin block)", strings.Join(bound, "; ")))
	}
	if len(e.Contested) > 0 {
		parts = append(parts, contestedMessage(e.Contested))
	}
	return strings.Join(parts, "; ")
}

// contestedMessage says what is wrong with ids and what the operator does about it.
func contestedMessage(ids []string) string {
	return fmt.Sprintf("device IDs %s were reported by two plugins before the host was ready and are bound to neither: "+
		"pin the plugin they belong to with device_ids (e.g. device_ids = [\"GPU-*\"]) in its plugin block and reload the agent (SIGHUP)", ListIDs(ids))
}

// SetDeviceIDPatterns pins the device IDs plugin name may report to those matching one
// of patterns (idpattern syntax); none lifts the pin. It applies from the plugin's next
// fingerprint on.
func (r *Registry) SetDeviceIDPatterns(name string, patterns []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(patterns) == 0 {
		delete(r.patterns, name)
		return
	}
	r.patterns[name] = slices.Clone(patterns)
}

// allowedOnly drops from fp the devices whose IDs match none of patterns and returns
// them, sorted; fp is left alone (and nil returned) when every ID matches.
func allowedOnly(fp *fingerprint, patterns []string) []string {
	var out []string
	for id := range fp.devices {
		if !idpattern.MatchAny(patterns, id) {
			out = append(out, id)
		}
	}
	if len(out) == 0 {
		return nil
	}
	slices.Sort(out)
	devices := maps.Clone(fp.devices)
	for _, id := range out {
		delete(devices, id)
	}
	groups := make([]device.Group, 0, len(fp.groups))
	for _, g := range fp.groups {
		g.Devices = slices.DeleteFunc(slices.Clone(g.Devices), func(d device.DeviceInfo) bool { _, ok := devices[d.ID]; return !ok })
		if len(g.Devices) > 0 {
			groups = append(groups, g)
		}
	}
	fp.devices, fp.groups = devices, groups
	return out
}

// maxListedIDs is how many device IDs a log line or error lists before "and N more".
const maxListedIDs = 8

// ListIDs joins ids for a message, at most maxListedIDs of them.
func ListIDs(ids []string) string {
	if len(ids) <= maxListedIDs {
		return strings.Join(ids, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(ids[:maxListedIDs], ", "), len(ids)-maxListedIDs)
}

// Orphans returns, by plugin, how many device IDs are bound to plugins that are not
// this host's: any plugin that reports them gets them bound to it.
func (r *Registry) Orphans() map[string]int {
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

// Bound returns how many device IDs are bound to plugin (see MaxBoundPerPlugin).
func (r *Registry) Bound(plugin string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.bound[plugin]
}

// AwaitedPlugin returns the plugin every one of ids (not empty) is bound to when it is one
// of this host's plugins and has not fingerprinted since this host started, with its
// state: those devices are not in the inventory yet, but they are bound to it and will be
// in it once it reports them (right after a host restart, while it starts). ok is false
// otherwise.
func (r *Registry) AwaitedPlugin(ids []string) (state device.PluginState, ok bool) {
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

// SetFingerprint installs a fingerprint of the plugin that validate.Fingerprint accepted
// as its inventory, unless its charge against MaxSnapshotBytes (see budget.go) would take
// the host's Fingerprint message over it: then nothing changes and the error says so.
// Device IDs bound to no plugin are bound to this one, recorded in the store before they
// are published; IDs bound to a plugin this host does not run any more are bound to this
// one instead, with a log line; IDs bound to another of its plugins are left out of the
// inventory, and the returned *BindingError names them and those plugins.
func (r *Registry) SetFingerprint(name string, resp *pb.FingerprintResponse) (*BindingError, error) {
	return r.setFingerprint(name, fromFingerprint(name, resp))
}

func (r *Registry) setFingerprint(name string, fp fingerprint) (*BindingError, error) {
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
	d := decideBindings(name, fp, r.bindingStateLocked())
	r.mu.Unlock()

	r.recordBindings(name, d)

	r.mu.Lock()
	defer r.mu.Unlock()
	r.applyBindingsLocked(name, d)
	rec.fp, rec.down, rec.settled = d.fp, "", true
	r.recomputeLocked()
	r.publishLocked()
	r.checkReadyLocked()
	return d.bindingError(name), nil
}

// bindingState is what a binding decision reads of the registry. Its maps are the
// registry's own, read under its lock and never written by decideBindings.
type bindingState struct {
	bindings  map[string]string   // device ID -> the plugin it is bound to
	bound     map[string]int      // plugin -> how many IDs are bound to it
	patterns  map[string][]string // plugin -> the device ID patterns it is pinned to
	fresh     map[string]bool     // IDs first bound in this run before the host was ready
	contested map[string]bool     // IDs bound to neither of two plugins
	isPlugin  func(name string) bool
	ready     bool
}

// bindingStateLocked is the registry's bindingState; r.mu must be held while it is read.
func (r *Registry) bindingStateLocked() bindingState {
	return bindingState{
		bindings:  r.bindings,
		bound:     r.bound,
		patterns:  r.patterns,
		fresh:     r.fresh,
		contested: r.contested,
		isPlugin:  func(name string) bool { return r.plugins[name] != nil },
		ready:     r.isReady,
	}
}

// bindingDecision is what decideBindings decided for one fingerprint of a plugin.
type bindingDecision struct {
	fp         fingerprint         // the fingerprint less the IDs outside the plugin's patterns
	bind       map[string]string   // IDs to bind to the plugin and record
	taken      map[string][]string // plugin this host does not run any more -> IDs bound to it, in bind
	refused    map[string][]string // plugin the IDs are bound to -> refused IDs, sorted
	notAllowed []string            // IDs outside the plugin's patterns, sorted
	contest    map[string]string   // ID -> the plugin it is unbound from: contested from now on
	contested  []string            // IDs refused as contested, sorted
	forget     []string            // IDs the plugin no longer reports that it loses, sorted
	unbind     []string            // the keys of contest, sorted
}

// decideBindings decides which device IDs of fp, a fingerprint of plugin name, are bound
// to it, taken over from a plugin this host does not run, refused, or contested, and which
// IDs it loses, from the bindings in s. It writes nothing: applyBindingsLocked does.
func decideBindings(name string, fp fingerprint, s bindingState) bindingDecision {
	d := bindingDecision{
		bind:    make(map[string]string),
		taken:   make(map[string][]string),
		refused: make(map[string][]string),
		contest: make(map[string]string),
	}
	pinned := len(s.patterns[name]) > 0
	if pinned {
		d.notAllowed = allowedOnly(&fp, s.patterns[name])
	}
	d.fp = fp
	for _, id := range slices.Sorted(maps.Keys(fp.devices)) {
		if s.contested[id] {
			if pinned { // the operator decided: the ID matches this plugin's patterns
				d.bind[id] = name
			} else {
				d.contested = append(d.contested, id)
			}
			continue
		}
		switch other, ok := s.bindings[id]; {
		case !ok:
			d.bind[id] = name
		case other == name:
		case !s.isPlugin(other):
			d.bind[id] = name
			d.taken[other] = append(d.taken[other], id)
		case !s.ready && s.fresh[id] && len(s.patterns[other]) == 0:
			// Two plugins report the ID before the host is ready, and the first had it
			// only by reporting first. Pinned, this one gets it; else neither does.
			if pinned {
				d.bind[id] = name
			} else {
				d.contest[id] = other
				d.contested = append(d.contested, id)
			}
		default:
			d.refused[other] = append(d.refused[other], id)
		}
	}
	if s.bound[name]+len(d.bind) > MaxBoundPerPlugin {
		for id, p := range s.bindings {
			if _, still := fp.devices[id]; p == name && !still {
				d.forget = append(d.forget, id)
			}
		}
	}
	slices.Sort(d.forget)
	d.unbind = slices.Sorted(maps.Keys(d.contest)) // from the plugins that reported them first
	return d
}

// bindingError is the *BindingError for what d refused, nil when it refused nothing.
func (d bindingDecision) bindingError(name string) *BindingError {
	if len(d.refused) > 0 || len(d.notAllowed) > 0 || len(d.contested) > 0 {
		return &BindingError{Plugin: name, ByPlugin: d.refused, NotAllowed: d.notAllowed, Contested: d.contested}
	}
	return nil
}

// recordBindings writes d's changes to the store, when there is one, and logs the
// take-overs and forgotten IDs. It is called with bindMu held and mu not: the registry's
// readers never wait for the disk. A failed write is logged; the bindings hold in memory.
func (r *Registry) recordBindings(name string, d bindingDecision) {
	if r.store != nil && (len(d.bind) > 0 || len(d.forget) > 0 || len(d.unbind) > 0) {
		ctx, cancel := context.WithTimeout(context.Background(), r.storeTimeout)
		err := r.store.RecordDeviceBindings(ctx, d.bind, append(slices.Clone(d.forget), d.unbind...))
		cancel()
		if err != nil {
			r.log.Error("cannot record device bindings in the state file; they hold until the host stops",
				"plugin", name, "devices", ListIDs(slices.Sorted(maps.Keys(d.bind))), "error", textline.Line(err.Error(), 0))
		}
	}
	for _, prev := range slices.Sorted(maps.Keys(d.taken)) {
		r.log.Warn("device IDs bound to a plugin this host does not run any more are now bound to this plugin",
			"plugin", name, "previous_plugin", prev, "devices", ListIDs(d.taken[prev]))
	}
	if len(d.forget) > 0 {
		r.log.Warn("plugin reported more distinct device IDs than may be bound to one plugin; it loses those it no longer reports",
			"plugin", name, "limit", MaxBoundPerPlugin, "forgotten", len(d.forget))
	}
}

// applyBindingsLocked makes d the registry's bindings: it unbinds the forgotten and
// contested IDs, marks the contest on the plugins that lose them, and binds d.bind to
// plugin name. r.mu is held.
func (r *Registry) applyBindingsLocked(name string, d bindingDecision) {
	for _, id := range append(d.forget, d.unbind...) {
		if p, ok := r.bindings[id]; ok {
			delete(r.bindings, id)
			r.bound[p]--
		}
	}
	for id, other := range d.contest {
		r.contested[id] = true
		if rec := r.plugins[other]; rec != nil {
			rec.state.LastError, rec.state.LastErrorAt = ErrorLine(contestedMessage([]string{id})), r.now()
		}
	}
	if len(d.contest) > 0 {
		r.log.Error("device IDs reported by two plugins before the host was ready are bound to neither",
			"plugin", name, "devices", ListIDs(d.unbind), "fix", "device_ids in the plugin block of the plugin they belong to, then SIGHUP")
	}
	for id := range d.bind {
		if prev, ok := r.bindings[id]; ok {
			r.bound[prev]--
		}
		r.bindings[id] = name
		r.bound[name]++
		delete(r.contested, id)
		if !r.isReady {
			r.fresh[id] = true
		}
	}
}
