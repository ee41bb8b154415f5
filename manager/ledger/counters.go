package ledger

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/devicehost/devicehost/device"
)

// This file is shared capacity (GPU partitioning): what live reservations use of their
// plugins' counter sets, kept by the index as reservations come and go, so the check a
// Reserve makes costs the counters it asks for, never a scan of the ledger.

// counterKey names one counter of one set.
type counterKey struct {
	set     device.CounterSetKey
	counter string
}

// counters is what live reservations use, per counter, and which use it.
type counters struct {
	used  map[counterKey]int64
	users map[counterKey]map[string]struct{} // live reservation IDs using it (a use above 0)
	// sets is every live reservation using a set (any use, 0 included), with the
	// compatibility groups it uses the set under (nil: none).
	sets map[device.CounterSetKey]map[string][]string
	// views is Usage's answer per counter set, made when first asked and dropped by add
	// when the set's use changes, so a Usage after one Reserve builds one set, not all.
	// add runs under the ledger's write lock; Usage fills it under the read lock and
	// viewMu. A view is never written after being made: callers share it.
	viewMu *sync.Mutex
	views  map[device.CounterSetKey]device.CounterUse
}

func newCounters() counters {
	return counters{used: make(map[counterKey]int64), users: make(map[counterKey]map[string]struct{}),
		sets:   make(map[device.CounterSetKey]map[string][]string),
		viewMu: new(sync.Mutex), views: make(map[device.CounterSetKey]device.CounterUse)}
}

// add counts live reservation r's use (sign 1) or takes it back (sign -1).
func (c counters) add(r *device.Reservation, sign int64) {
	for _, cons := range r.Consumes {
		delete(c.views, cons.Set)
		switch m := c.sets[cons.Set]; {
		case sign > 0 && m == nil:
			c.sets[cons.Set] = map[string][]string{r.ID: cons.Groups}
		case sign > 0:
			m[r.ID] = cons.Groups
		default:
			delete(m, r.ID)
			if len(m) == 0 {
				delete(c.sets, cons.Set)
			}
		}
		for name, v := range cons.Counters {
			if v == 0 {
				continue
			}
			k := counterKey{cons.Set, name}
			c.used[k] += sign * v
			u := c.users[k]
			switch {
			case sign > 0 && u == nil:
				c.users[k] = map[string]struct{}{r.ID: {}}
			case sign > 0:
				u[r.ID] = struct{}{}
			default:
				delete(u, r.ID)
				if len(u) == 0 {
					delete(c.users, k)
					delete(c.used, k)
				}
			}
		}
	}
}

// Usage returns what live reservations use of every counter set any of them uses. The
// answer's maps and lists are shared with later answers while their set's use stays
// the same: callers must not change them.
func (l *Ledger) Usage() map[device.CounterSetKey]device.CounterUse {
	l.mu.RLock()
	defer l.mu.RUnlock()
	c := &l.idx.ctr
	c.viewMu.Lock()
	defer c.viewMu.Unlock()
	var stale map[device.CounterSetKey]device.CounterUse
	for set, users := range c.sets {
		if _, ok := c.views[set]; ok {
			continue
		}
		if stale == nil {
			stale = make(map[device.CounterSetKey]device.CounterUse)
		}
		u := device.CounterUse{Used: make(map[string]int64), Users: make(map[string][]device.Holder)}
		u.SetUsers = l.holders(slices.Sorted(maps.Keys(users)))
		u.Groups = sharedGroups(users)
		stale[set] = u
	}
	for k, v := range c.used {
		u, ok := stale[k.set]
		if !ok {
			continue // a view already made
		}
		u.Used[k.counter] = v
		u.Users[k.counter] = l.holders(slices.Sorted(maps.Keys(c.users[k])))
	}
	maps.Copy(c.views, stale)
	return maps.Clone(c.views)
}

// holders are the live reservations of ids, in their order.
func (l *Ledger) holders(ids []string) []device.Holder {
	hs := make([]device.Holder, 0, len(ids))
	for _, id := range ids {
		if r := l.idx.live[id]; r != nil {
			hs = append(hs, device.Holder{ReservationID: id, OwnerID: r.OwnerID})
		}
	}
	return hs
}

// sharedGroups are the compatibility groups all of users (reservation ID: groups) use
// a set under: nil when none (the ledger admits no users without one in common).
func sharedGroups(users map[string][]string) []string {
	var common []string
	first := true
	for _, id := range slices.Sorted(maps.Keys(users)) {
		if first {
			common, first = users[id], false
			continue
		}
		if c, ok := device.Compatible(common, users[id]); ok {
			common = c
		}
	}
	return slices.Clone(common)
}

// overlayCounters is a batch's change to the counters: deltas over the index's.
type overlayCounters struct {
	used  map[counterKey]int64
	users map[counterKey]map[string]bool // true: added in the batch, false: removed
	// sets: per set, reservations added to its users in the batch (with their
	// groups) or removed (absent from the map's value: a nil entry in removed).
	sets map[device.CounterSetKey]map[string]setChange
}

// setChange is a batch's change to one reservation's use of a set.
type setChange struct {
	in     bool
	groups []string
}

func (o *overlay) countersAdd(r *device.Reservation, sign int64) {
	if len(r.Consumes) == 0 {
		return
	}
	if o.ctr.used == nil {
		o.ctr = overlayCounters{used: make(map[counterKey]int64), users: make(map[counterKey]map[string]bool),
			sets: make(map[device.CounterSetKey]map[string]setChange)}
	}
	for _, cons := range r.Consumes {
		if o.ctr.sets[cons.Set] == nil {
			o.ctr.sets[cons.Set] = make(map[string]setChange)
		}
		o.ctr.sets[cons.Set][r.ID] = setChange{in: sign > 0, groups: cons.Groups}
		for name, v := range cons.Counters {
			if v == 0 {
				continue
			}
			k := counterKey{cons.Set, name}
			o.ctr.used[k] += sign * v
			if o.ctr.users[k] == nil {
				o.ctr.users[k] = make(map[string]bool)
			}
			o.ctr.users[k][r.ID] = sign > 0
		}
	}
}

// usedOf and usersOf are the counters as of the batch.
func (o *overlay) usedOf(k counterKey) int64 { return o.base.ctr.used[k] + o.ctr.used[k] }

func (o *overlay) usersOf(k counterKey) []string {
	ids := maps.Clone(o.base.ctr.users[k])
	for id, in := range o.ctr.users[k] {
		if in {
			if ids == nil {
				ids = make(map[string]struct{})
			}
			ids[id] = struct{}{}
		} else {
			delete(ids, id)
		}
	}
	return slices.Sorted(maps.Keys(ids))
}

// setUsersOf is every reservation using set as of the batch, with its groups.
func (o *overlay) setUsersOf(set device.CounterSetKey) map[string][]string {
	users := maps.Clone(o.base.ctr.sets[set])
	for id, ch := range o.ctr.sets[set] {
		if ch.in {
			if users == nil {
				users = make(map[string][]string)
			}
			users[id] = ch.groups
		} else {
			delete(users, id)
		}
	}
	return users
}

func (x *index) usedOf(k counterKey) int64 { return x.ctr.used[k] }
func (x *index) setUsersOf(set device.CounterSetKey) map[string][]string {
	return x.ctr.sets[set]
}
func (x *index) usersOf(k counterKey) []string {
	return slices.Sorted(maps.Keys(x.ctr.users[k]))
}

// decideCapacity checks that consumes (a request's use, by set) fits, with what v's
// live reservations use less what victims (taken over in the same write) use, within
// caps: a *device.CapacityError naming every counter it would take over and its users
// otherwise. A set or counter caps does not have counts as a capacity of 0 (a set the
// plugin no longer reports can take nothing new).
func decideCapacity(v view, owner string, consumes []device.Consumption, caps device.Capacity, victims []*device.Reservation) error {
	if len(consumes) == 0 {
		return nil
	}
	freed := make(map[counterKey]int64)
	gone := make(map[string]bool, len(victims))
	for _, r := range victims {
		gone[r.ID] = true
		for _, c := range r.Consumes {
			for name, n := range c.Counters {
				freed[counterKey{c.Set, name}] += n
			}
		}
	}
	var e *device.CapacityError
	for _, c := range consumes {
		if o, ok := groupConflict(v, c, gone); !ok {
			if e == nil {
				e = &device.CapacityError{OwnerID: owner}
			}
			e.Overruns = append(e.Overruns, o)
		}
		for _, name := range slices.Sorted(maps.Keys(c.Counters)) {
			want := c.Counters[name]
			if want == 0 {
				continue
			}
			k := counterKey{c.Set, name}
			capacity := caps[c.Set][name]
			used := v.usedOf(k) - freed[k]
			if used+want <= capacity {
				continue
			}
			if e == nil {
				e = &device.CapacityError{OwnerID: owner}
			}
			o := device.Overrun{Set: c.Set, Counter: name, Capacity: capacity, Used: used, Requested: want}
			for _, id := range v.usersOf(k) {
				if r := v.get(id); r != nil && !gone[id] {
					o.Users = append(o.Users, device.Holder{ReservationID: id, OwnerID: r.OwnerID})
				}
			}
			e.Overruns = append(e.Overruns, o)
		}
	}
	if e == nil {
		return nil
	}
	slices.SortFunc(e.Overruns, func(a, b device.Overrun) int {
		return cmp.Or(strings.Compare(a.Set.Plugin, b.Set.Plugin), strings.Compare(a.Set.Name, b.Set.Name),
			strings.Compare(a.Counter, b.Counter))
	})
	return e
}

// groupConflict checks that use c can share its set with the set's live users other
// than gone: that c's compatibility groups and those the users share (sharedGroups)
// have one in common (none counting as a group of its own). It returns the Overrun
// that says why not, and false, otherwise.
func groupConflict(v view, c device.Consumption, gone map[string]bool) (device.Overrun, bool) {
	users := v.setUsersOf(c.Set)
	live := make(map[string][]string, len(users))
	var holders []device.Holder
	for _, id := range slices.Sorted(maps.Keys(users)) {
		if r := v.get(id); r != nil && !gone[id] {
			live[id] = users[id]
			holders = append(holders, device.Holder{ReservationID: id, OwnerID: r.OwnerID})
		}
	}
	if len(live) == 0 {
		return device.Overrun{}, true
	}
	common := sharedGroups(live)
	if _, ok := device.Compatible(c.Groups, common); ok {
		return device.Overrun{}, true
	}
	return device.Overrun{Set: c.Set, Groups: slices.Clone(c.Groups), UsersGroups: common, Users: holders}, false
}

// checkConsumes checks the invariants of a stored reservation's use of counters: each
// set of the reservation's plugin, named once, with uses of 0 or more.
func checkConsumes(plugin string, consumes []device.Consumption) error {
	seen := make(map[string]bool, len(consumes))
	for _, c := range consumes {
		switch {
		case c.Set.Name == "":
			return errors.New("a counter set without a name")
		case c.Set.Plugin != plugin:
			return fmt.Errorf("counter set %q of plugin %q in a reservation of plugin %q", c.Set.Name, c.Set.Plugin, plugin)
		case seen[c.Set.Name]:
			return fmt.Errorf("counter set %q named twice", c.Set.Name)
		}
		seen[c.Set.Name] = true
		if len(c.Groups) > device.MaxCompatibilityGroups || slices.Contains(c.Groups, "") ||
			!slices.IsSorted(c.Groups) || len(slices.Compact(slices.Clone(c.Groups))) != len(c.Groups) {
			return fmt.Errorf("counter set %q: compatibility groups %q: not at most %d names, sorted, each once",
				c.Set.Name, c.Groups, device.MaxCompatibilityGroups)
		}
		for name, v := range c.Counters {
			if name == "" || v < 0 {
				return fmt.Errorf("counter set %q: counter %q uses %d", c.Set.Name, name, v)
			}
		}
	}
	return nil
}
