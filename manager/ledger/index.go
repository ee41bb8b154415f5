package ledger

import (
	"cmp"
	"hash/maphash"
	"maps"
	"slices"

	"github.com/devicehost/devicehost/device"
)

// index is the in-memory view of the durable reservations. The live ones are kept as
// *device.Reservation values, never modified once stored (a change stores a new value;
// their slices and maps may be shared between values, so every value leaving the
// package is deep-copied with clone). The released ones, which may be many more, are
// kept packed (see packed).
//
// A reservation's ID is one string from when the index first stores it: the values get
// returns carry it, a change stores a copy of such a value, and the owner index and the
// GC keep that same string rather than copies.
type index struct {
	live     map[string]*device.Reservation // by reservation ID
	released map[string]releasedRec         // by reservation ID
	held     map[string]string              // device ID -> live reservation ID
	owners   map[uint64]idSet               // ownerKey(owner ID) -> reservation IDs, every state
	seed     maphash.Seed                   // ownerKey's
	pending  int                            // released reservations whose cleanup is owed
	ctr      counters                       // what the live ones use of shared counters
	// intent: the live ones recorded as intents only (intent.go): their devices held,
	// their plugin's answer not yet in the file.
	intent map[string]struct{}
}

// releasedRec is a released reservation in the index.
type releasedRec struct {
	id string // the index's key for it
	p  packed
}

func newIndex() *index {
	return &index{
		live:     make(map[string]*device.Reservation),
		released: make(map[string]releasedRec),
		held:     make(map[string]string),
		owners:   make(map[uint64]idSet),
		seed:     maphash.MakeSeed(),
		ctr:      newCounters(),
		intent:   make(map[string]struct{}),
	}
}

// isIntent reports whether live reservation id is an intent (see intent.go).
func (x *index) isIntent(id string) bool {
	_, ok := x.intent[id]
	return ok
}

// get returns reservation id (nil when there is none). A released one is unpacked
// afresh on each call.
func (x *index) get(id string) *device.Reservation {
	if r := x.live[id]; r != nil {
		return r
	}
	if rr, ok := x.released[id]; ok {
		return rr.p.unpack(rr.id)
	}
	return nil
}

// has reports whether the index holds reservation id, without unpacking it.
func (x *index) has(id string) bool {
	if _, ok := x.live[id]; ok {
		return true
	}
	_, ok := x.released[id]
	return ok
}

// copyOf returns a deep copy of reservation id for a caller (nil when there is none).
func (x *index) copyOf(id string) *device.Reservation {
	if r := x.live[id]; r != nil {
		c := clone(r)
		return &c
	}
	if rr, ok := x.released[id]; ok {
		return rr.p.unpack(rr.id) // unpacked afresh: the caller's
	}
	return nil
}

func (x *index) holder(dev string) string { return x.held[dev] }

// clash returns a device that live reservation r holds and some other live reservation
// already holds, and that other reservation's ID; "" when there is none.
func (x *index) clash(r *device.Reservation) (dev, other string) {
	if r.State != device.ReservationActive {
		return "", ""
	}
	for _, d := range r.DeviceIDs {
		if id := x.held[d]; id != "" && id != r.ID {
			return d, id
		}
	}
	return "", ""
}

// add stores r, replacing any record with its ID.
func (x *index) add(r *device.Reservation) {
	id := r.ID
	x.remove(id)
	if r.State == device.ReservationActive {
		x.live[id] = r
		x.addOwner(r.OwnerID, id)
		for _, d := range r.DeviceIDs {
			x.held[d] = id
		}
		x.ctr.add(r, 1)
		return
	}
	p := pack(r)
	x.released[id] = releasedRec{id: id, p: p}
	x.addOwner(p.owner(), id)
	if p.cleanupPending() {
		x.pending++
	}
}

func (x *index) remove(id string) {
	delete(x.intent, id)
	var owner string
	if r := x.live[id]; r != nil {
		delete(x.live, id)
		owner = r.OwnerID
		for _, d := range r.DeviceIDs {
			if x.held[d] == id {
				delete(x.held, d)
			}
		}
		x.ctr.add(r, -1)
	} else if rr, ok := x.released[id]; ok {
		delete(x.released, id)
		owner = rr.p.owner()
		if rr.p.cleanupPending() {
			x.pending--
		}
	} else {
		return
	}
	k := x.ownerKey(owner)
	if ids := x.owners[k]; ids.remove(id) {
		delete(x.owners, k)
	} else {
		x.owners[k] = ids
	}
}

func (x *index) addOwner(owner, id string) {
	k := x.ownerKey(owner)
	ids := x.owners[k]
	ids.add(id)
	x.owners[k] = ids
}

// apply makes a committed overlay part of the index.
func (x *index) apply(o *overlay) {
	for id, r := range o.recs {
		if r == nil {
			x.remove(id)
		} else {
			x.add(r)
		}
	}
	for id, is := range o.intents {
		if is {
			x.intent[id] = struct{}{}
		} else {
			delete(x.intent, id)
		}
	}
}

func (x *index) counts() Counts {
	return Counts{
		Total:          len(x.live) + len(x.released),
		Live:           len(x.live),
		Released:       len(x.released),
		CleanupPending: x.pending,
	}
}

// ownerIDs returns the IDs of owner's reservations, every state, and maybe of other
// owners' (those whose ownerKey is the same): callers check each reservation's owner.
func (x *index) ownerIDs(owner string) []string {
	return x.owners[x.ownerKey(owner)].all()
}

// ownerKey is owner's key in the owner index: a hash, so that the index's keys hold no
// pointer for Go's garbage collector to follow, nor keep an owner's string alive.
func (x *index) ownerKey(owner string) uint64 { return maphash.String(x.seed, owner) }

// idSet is one owner's reservation IDs. Most owners have one reservation, so the first
// is kept without a map.
type idSet struct {
	one  string              // "" when the set is empty
	more map[string]struct{} // the others; nil unless there are
}

func (s *idSet) add(id string) {
	switch {
	case s.one == "" || s.one == id:
		s.one = id
	default:
		if s.more == nil {
			s.more = make(map[string]struct{})
		}
		s.more[id] = struct{}{}
	}
}

// remove takes id out and reports whether the set is now empty.
func (s *idSet) remove(id string) (empty bool) {
	if s.one == id {
		s.one = ""
		for other := range s.more { // any one of the others takes its place
			s.one = other
			delete(s.more, other)
			break
		}
	} else {
		delete(s.more, id)
	}
	if len(s.more) == 0 {
		s.more = nil
	}
	return s.one == ""
}

// all returns the IDs, in no order.
func (s idSet) all() []string {
	if s.one == "" {
		return nil
	}
	out := make([]string, 0, 1+len(s.more))
	out = append(out, s.one)
	for id := range s.more {
		out = append(out, id)
	}
	return out
}

// overlay is one batch's changes on top of the index, visible to the later requests of
// the same batch and applied to the index only once the batch has committed.
type overlay struct {
	base *index
	recs map[string]*device.Reservation // nil value: deleted in this batch
	held map[string]string              // "" value: freed in this batch
	ctr  overlayCounters                // the batch's change to the shared counters' use
	ev   eventDelta                     // the batch's events (events.go)
	// told: the reservations a caller's write (not a deferred one) changed in this
	// batch, the candidates for the change feeds (feedChanges).
	told map[string]struct{}
	// intents: the reservations whose intent state this batch changed: true, recorded
	// as an intent; false, no longer one (answered, released or withdrawn).
	intents map[string]bool
}

func newOverlay(base *index) *overlay {
	return &overlay{base: base, recs: make(map[string]*device.Reservation), held: make(map[string]string), told: make(map[string]struct{})}
}

// isIntent reports whether live reservation id is an intent as of this batch.
func (o *overlay) isIntent(id string) bool {
	if is, ok := o.intents[id]; ok {
		return is
	}
	return o.base.isIntent(id)
}

// setIntent records that id becomes an intent (is) or stops being one.
func (o *overlay) setIntent(id string, is bool) {
	if o.intents == nil {
		o.intents = make(map[string]bool)
	}
	o.intents[id] = is
}

func (o *overlay) get(id string) *device.Reservation {
	if r, ok := o.recs[id]; ok {
		return r
	}
	return o.base.get(id)
}

func (o *overlay) holder(dev string) string {
	if id, ok := o.held[dev]; ok {
		return id
	}
	return o.base.held[dev]
}

// feedChanges returns the IDs of o's changes that the change feeds are told of (see
// Ledger.subscribe): those of callers' writes (o.told), less the live reservations
// that were not released before o (a new reservation, a live one reowned or taken over
// by its owner). The feeds' reader, the GC, keeps released reservations only; telling
// it of a new one would wake it for nothing on every Reserve, on the other core while
// the Reserve's reply is being sent. Its own deferred writes (a cleanup recorded done,
// a deletion) are not told either: it learns their outcome from their notify, and
// they ride on callers' commits, which would each wake it for them. Called before o is
// applied to its base.
func (o *overlay) feedChanges() []string {
	ids := make([]string, 0, len(o.told))
	for id := range o.told {
		if r := o.recs[id]; r != nil && r.State == device.ReservationActive {
			if _, was := o.base.released[id]; !was {
				continue
			}
		}
		ids = append(ids, id)
	}
	return ids
}

func (o *overlay) put(r *device.Reservation) {
	o.drop(r.ID)
	o.recs[r.ID] = r
	if r.State == device.ReservationActive {
		for _, d := range r.DeviceIDs {
			o.held[d] = r.ID
		}
		o.countersAdd(r, 1)
	}
}

func (o *overlay) drop(id string) {
	old, inBatch := o.recs[id]
	switch {
	case inBatch && old == nil:
		return // dropped already in this batch
	case !inBatch:
		if _, released := o.base.released[id]; released {
			o.recs[id] = nil // a released reservation holds no device: no need to unpack it
			return
		}
		if old = o.base.live[id]; old == nil {
			return
		}
	}
	o.recs[id] = nil
	for _, d := range old.DeviceIDs {
		if o.holder(d) == id {
			o.held[d] = ""
		}
	}
	if old.State == device.ReservationActive {
		o.countersAdd(old, -1)
	}
}

// ownerIDs returns the IDs of owner's reservations as of this batch, oldest first.
func (o *overlay) ownerIDs(owner string) []string {
	ids := o.base.ownerIDs(owner)
	for id, r := range o.recs {
		if r != nil && r.OwnerID == owner {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	var out []*device.Reservation
	for _, id := range ids {
		if r := o.get(id); r != nil && r.OwnerID == owner {
			out = append(out, r)
		}
	}
	sortReservations(out)
	ids = ids[:0]
	for _, r := range out {
		ids = append(ids, r.ID)
	}
	return ids
}

// sortReservations orders oldest first, then by ID.
func sortReservations(rs []*device.Reservation) {
	slices.SortFunc(rs, func(a, b *device.Reservation) int {
		return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(a.ID, b.ID))
	})
}

// clone deep-copies r, so the copy shares no slice or map with the index.
func clone(r *device.Reservation) device.Reservation {
	c := *r
	c.DeviceIDs = slices.Clone(r.DeviceIDs)
	c.TakenOver = slices.Clone(r.TakenOver)
	c.Container.Envs = maps.Clone(r.Container.Envs)
	c.Container.Mounts = slices.Clone(r.Container.Mounts)
	c.Container.Devices = slices.Clone(r.Container.Devices)
	c.Container.CDIDevices = slices.Clone(r.Container.CDIDevices)
	c.Consumes = cloneConsumes(r.Consumes)
	c.PluginOptions = maps.Clone(r.PluginOptions)
	return c
}

func cloneConsumes(cs []device.Consumption) []device.Consumption {
	if cs == nil {
		return nil
	}
	out := make([]device.Consumption, len(cs))
	for i, c := range cs {
		out[i] = device.Consumption{Set: c.Set, Counters: maps.Clone(c.Counters), Groups: slices.Clone(c.Groups)}
	}
	return out
}
