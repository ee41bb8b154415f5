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
	// views is Usage's answer per counter set, made when first asked and dropped by add
	// when the set's use changes, so a Usage after one Reserve builds one set, not all.
	// add runs under the ledger's write lock; Usage fills it under the read lock and
	// viewMu. A view is never written after being made: callers share it.
	viewMu *sync.Mutex
	views  map[device.CounterSetKey]device.CounterUse
}

func newCounters() counters {
	return counters{used: make(map[counterKey]int64), users: make(map[counterKey]map[string]struct{}),
		viewMu: new(sync.Mutex), views: make(map[device.CounterSetKey]device.CounterUse)}
}

// add counts live reservation r's use (sign 1) or takes it back (sign -1).
func (c counters) add(r *device.Reservation, sign int64) {
	for _, cons := range r.Consumes {
		for name, v := range cons.Counters {
			if v == 0 {
				continue
			}
			k := counterKey{cons.Set, name}
			delete(c.views, cons.Set)
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
	for k, v := range c.used {
		if _, ok := c.views[k.set]; ok {
			continue
		}
		if stale == nil {
			stale = make(map[device.CounterSetKey]device.CounterUse)
		}
		u, ok := stale[k.set]
		if !ok {
			u = device.CounterUse{Used: make(map[string]int64), Users: make(map[string][]device.Holder)}
			stale[k.set] = u
		}
		u.Used[k.counter] = v
		ids := slices.Sorted(maps.Keys(c.users[k]))
		hs := make([]device.Holder, 0, len(ids))
		for _, id := range ids {
			if r := l.idx.live[id]; r != nil {
				hs = append(hs, device.Holder{ReservationID: id, OwnerID: r.OwnerID})
			}
		}
		u.Users[k.counter] = hs
	}
	maps.Copy(c.views, stale)
	return maps.Clone(c.views)
}

// overlayCounters is a batch's change to the counters: deltas over the index's.
type overlayCounters struct {
	used  map[counterKey]int64
	users map[counterKey]map[string]bool // true: added in the batch, false: removed
}

func (o *overlay) countersAdd(r *device.Reservation, sign int64) {
	if len(r.Consumes) == 0 {
		return
	}
	if o.ctr.used == nil {
		o.ctr = overlayCounters{used: make(map[counterKey]int64), users: make(map[counterKey]map[string]bool)}
	}
	for _, cons := range r.Consumes {
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

func (x *index) usedOf(k counterKey) int64 { return x.ctr.used[k] }
func (x *index) usersOf(k counterKey) []string {
	return slices.Sorted(maps.Keys(x.ctr.users[k]))
}

// CapacityError is the contract's device.CapacityError.
type CapacityError = device.CapacityError

// decideCapacity checks that consumes (a request's use, by set) fits, with what v's
// live reservations use less what victims (taken over in the same write) use, within
// caps: a *CapacityError naming every counter it would take over and its users
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
	var e *CapacityError
	for _, c := range consumes {
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
				e = &CapacityError{OwnerID: owner}
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
		for name, v := range c.Counters {
			if name == "" || v < 0 {
				return fmt.Errorf("counter set %q: counter %q uses %d", c.Set.Name, name, v)
			}
		}
	}
	return nil
}
