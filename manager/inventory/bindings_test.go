package inventory

import (
	"maps"
	"reflect"
	"slices"
	"testing"

	"github.com/devicehost/devicehost/device"
)

// reported is a fingerprint of plugin reporting ids, one group of them.
func reported(plugin string, ids ...string) fingerprint {
	fp := fingerprint{devices: map[string]reportedDevice{}}
	g := device.Group{GroupKey: acmeA1, Plugin: plugin}
	for _, id := range ids {
		g.Devices = append(g.Devices, device.DeviceInfo{ID: id})
		fp.devices[id] = reportedDevice{group: acmeA1, info: device.DeviceInfo{ID: id}, health: device.HealthHealthy}
	}
	fp.groups = []device.Group{g}
	return fp
}

// decided is what a test compares of a bindingDecision: empty maps and lists are nil,
// and the fingerprint is its device IDs.
type decided struct {
	devices    []string
	bind       []string
	taken      map[string][]string
	refused    map[string][]string
	notAllowed []string
	contest    map[string]string
	contested  []string
	forget     []string
	unbind     []string
}

func summarize(t *testing.T, name string, d bindingDecision) decided {
	t.Helper()
	for id, p := range d.bind {
		if p != name {
			t.Errorf("bind[%s] = %q, want the reporting plugin %q", id, p, name)
		}
	}
	nilIfEmpty := func(s []string) []string {
		if len(s) == 0 {
			return nil
		}
		return s
	}
	out := decided{
		devices:    nilIfEmpty(slices.Sorted(maps.Keys(d.fp.devices))),
		bind:       nilIfEmpty(slices.Sorted(maps.Keys(d.bind))),
		notAllowed: nilIfEmpty(d.notAllowed),
		contested:  nilIfEmpty(d.contested),
		forget:     nilIfEmpty(d.forget),
		unbind:     nilIfEmpty(d.unbind),
	}
	if len(d.taken) > 0 {
		out.taken = d.taken
	}
	if len(d.refused) > 0 {
		out.refused = d.refused
	}
	if len(d.contest) > 0 {
		out.contest = d.contest
	}
	return out
}

// TestDecideBindings: which IDs of a fingerprint are bound to the reporting plugin,
// taken over, refused, contested or forgotten, for the bindings the registry holds.
func TestDecideBindings(t *testing.T) {
	running := func(names ...string) func(string) bool {
		return func(name string) bool { return slices.Contains(names, name) }
	}
	tests := []struct {
		name  string
		state bindingState
		fp    fingerprint
		want  decided
	}{
		{
			name:  "unbound IDs are bound to the reporter",
			state: bindingState{isPlugin: running("a"), ready: true},
			fp:    reported("a", "d1", "d0"),
			want:  decided{devices: []string{"d0", "d1"}, bind: []string{"d0", "d1"}},
		},
		{
			name:  "IDs already bound to the reporter change nothing",
			state: bindingState{bindings: map[string]string{"d0": "a"}, bound: map[string]int{"a": 1}, isPlugin: running("a"), ready: true},
			fp:    reported("a", "d0"),
			want:  decided{devices: []string{"d0"}},
		},
		{
			name:  "IDs bound to a plugin the host does not run are taken over",
			state: bindingState{bindings: map[string]string{"d0": "gone", "d1": "gone"}, isPlugin: running("a"), ready: true},
			fp:    reported("a", "d1", "d0"),
			want: decided{devices: []string{"d0", "d1"}, bind: []string{"d0", "d1"},
				taken: map[string][]string{"gone": {"d0", "d1"}}},
		},
		{
			name:  "IDs bound to another of the host's plugins are refused, by plugin, sorted",
			state: bindingState{bindings: map[string]string{"d0": "b", "d1": "c", "d2": "b"}, isPlugin: running("a", "b", "c"), ready: true},
			fp:    reported("a", "d2", "d1", "d0", "d3"),
			want: decided{devices: []string{"d0", "d1", "d2", "d3"}, bind: []string{"d3"},
				refused: map[string][]string{"b": {"d0", "d2"}, "c": {"d1"}}},
		},
		{
			name: "before ready, an ID another unpinned plugin reported first is contested",
			state: bindingState{bindings: map[string]string{"d0": "b"}, fresh: map[string]bool{"d0": true},
				isPlugin: running("a", "b")},
			fp: reported("a", "d0"),
			want: decided{devices: []string{"d0"}, contest: map[string]string{"d0": "b"},
				contested: []string{"d0"}, unbind: []string{"d0"}},
		},
		{
			name: "before ready, a pinned reporter gets an ID another unpinned plugin reported first",
			state: bindingState{bindings: map[string]string{"d0": "b"}, fresh: map[string]bool{"d0": true},
				patterns: map[string][]string{"a": {"d*"}}, isPlugin: running("a", "b")},
			fp:   reported("a", "d0"),
			want: decided{devices: []string{"d0"}, bind: []string{"d0"}},
		},
		{
			name: "before ready, an ID a pinned plugin reported first is refused",
			state: bindingState{bindings: map[string]string{"d0": "b"}, fresh: map[string]bool{"d0": true},
				patterns: map[string][]string{"b": {"d*"}}, isPlugin: running("a", "b")},
			fp:   reported("a", "d0"),
			want: decided{devices: []string{"d0"}, refused: map[string][]string{"b": {"d0"}}},
		},
		{
			name:  "before ready, an ID bound by an earlier host is refused",
			state: bindingState{bindings: map[string]string{"d0": "b"}, isPlugin: running("a", "b")},
			fp:    reported("a", "d0"),
			want:  decided{devices: []string{"d0"}, refused: map[string][]string{"b": {"d0"}}},
		},
		{
			name: "once ready, an ID first bound before it is refused",
			state: bindingState{bindings: map[string]string{"d0": "b"}, fresh: map[string]bool{"d0": true},
				isPlugin: running("a", "b"), ready: true},
			fp:   reported("a", "d0"),
			want: decided{devices: []string{"d0"}, refused: map[string][]string{"b": {"d0"}}},
		},
		{
			name:  "a contested ID stays contested for an unpinned reporter",
			state: bindingState{contested: map[string]bool{"d0": true}, isPlugin: running("a", "b"), ready: true},
			fp:    reported("a", "d0", "d1"),
			want:  decided{devices: []string{"d0", "d1"}, bind: []string{"d1"}, contested: []string{"d0"}},
		},
		{
			name: "a contested ID is bound to a pinned reporter",
			state: bindingState{contested: map[string]bool{"d0": true}, patterns: map[string][]string{"a": {"d*"}},
				isPlugin: running("a", "b"), ready: true},
			fp:   reported("a", "d0"),
			want: decided{devices: []string{"d0"}, bind: []string{"d0"}},
		},
		{
			name:  "IDs outside the reporter's patterns are left out of its fingerprint",
			state: bindingState{patterns: map[string][]string{"a": {"GPU-*"}}, isPlugin: running("a"), ready: true},
			fp:    reported("a", "GPU-1", "x2", "x1"),
			want:  decided{devices: []string{"GPU-1"}, bind: []string{"GPU-1"}, notAllowed: []string{"x1", "x2"}},
		},
		{
			name: "past the bound, the reporter loses the IDs it no longer reports",
			state: bindingState{bindings: map[string]string{"old1": "a", "old0": "a", "kept": "a", "other": "b"},
				bound: map[string]int{"a": MaxBoundPerPlugin, "b": 1}, isPlugin: running("a", "b"), ready: true},
			fp: reported("a", "kept", "new"),
			want: decided{devices: []string{"kept", "new"}, bind: []string{"new"},
				forget: []string{"old0", "old1"}},
		},
		{
			name: "at the bound, nothing is forgotten",
			state: bindingState{bindings: map[string]string{"old": "a"},
				bound: map[string]int{"a": MaxBoundPerPlugin - 1}, isPlugin: running("a"), ready: true},
			fp:   reported("a", "new"),
			want: decided{devices: []string{"new"}, bind: []string{"new"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := tt.state
			before.bindings, before.bound = maps.Clone(tt.state.bindings), maps.Clone(tt.state.bound)
			before.fresh, before.contested = maps.Clone(tt.state.fresh), maps.Clone(tt.state.contested)
			fpIDs := slices.Sorted(maps.Keys(tt.fp.devices))

			got := summarize(t, "a", decideBindings("a", tt.fp, tt.state))
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("decideBindings:\n got %+v\nwant %+v", got, tt.want)
			}
			if !maps.Equal(tt.state.bindings, before.bindings) || !maps.Equal(tt.state.bound, before.bound) ||
				!maps.Equal(tt.state.fresh, before.fresh) || !maps.Equal(tt.state.contested, before.contested) {
				t.Errorf("decideBindings wrote the state it was given")
			}
			if ids := slices.Sorted(maps.Keys(tt.fp.devices)); !slices.Equal(ids, fpIDs) {
				t.Errorf("decideBindings wrote the fingerprint it was given")
			}
		})
	}
}

// TestBindingErrorNamesWhatWasRefused: a decision that refused nothing is no error; one
// that did names every refusal.
func TestBindingErrorNamesWhatWasRefused(t *testing.T) {
	if err := (bindingDecision{bind: map[string]string{"d0": "a"}}).bindingError("a"); err != nil {
		t.Errorf("bindingError of a decision that refused nothing = %v, want nil", err)
	}
	d := bindingDecision{
		refused:    map[string][]string{"b": {"d1"}},
		notAllowed: []string{"x"},
		contested:  []string{"d2"},
	}
	got := d.bindingError("a")
	want := &BindingError{Plugin: "a", ByPlugin: d.refused, NotAllowed: d.notAllowed, Contested: d.contested}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("bindingError = %+v, want %+v", got, want)
	}
}
