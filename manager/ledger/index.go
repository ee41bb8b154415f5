package ledger

import (
	"cmp"
	"maps"
	"slices"

	"github.com/devicehost/devicehost/manager/device"
)

// index is the in-memory view of the durable reservations. The *device.Reservation
// values it holds are never modified once stored: a change stores a new value. Their
// slices and maps may be shared between index entries, so every value leaving the
// package is deep-copied with clone.
type index struct {
	recs   map[string]*device.Reservation        // by reservation ID, every state
	held   map[string]string                     // device ID -> live reservation ID
	gone   map[string]struct{}                   // IDs of the released reservations
	owners map[string]map[string]struct{}        // owner ID -> reservation IDs, every state
	n      struct{ live, released, pending int } // counts over recs
}

func newIndex() *index {
	return &index{
		recs:   make(map[string]*device.Reservation),
		held:   make(map[string]string),
		gone:   make(map[string]struct{}),
		owners: make(map[string]map[string]struct{}),
	}
}

func (x *index) get(id string) *device.Reservation { return x.recs[id] }
func (x *index) holder(dev string) string          { return x.held[dev] }

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
	x.remove(r.ID)
	x.recs[r.ID] = r
	ids := x.owners[r.OwnerID]
	if ids == nil {
		ids = make(map[string]struct{})
		x.owners[r.OwnerID] = ids
	}
	ids[r.ID] = struct{}{}
	x.count(r, 1)
	if r.State == device.ReservationActive {
		for _, d := range r.DeviceIDs {
			x.held[d] = r.ID
		}
	} else {
		x.gone[r.ID] = struct{}{}
	}
}

func (x *index) remove(id string) {
	old := x.recs[id]
	if old == nil {
		return
	}
	delete(x.recs, id)
	delete(x.gone, id)
	if ids := x.owners[old.OwnerID]; ids != nil {
		delete(ids, id)
		if len(ids) == 0 {
			delete(x.owners, old.OwnerID)
		}
	}
	x.count(old, -1)
	for _, d := range old.DeviceIDs {
		if x.held[d] == id {
			delete(x.held, d)
		}
	}
}

func (x *index) count(r *device.Reservation, delta int) {
	if r.State == device.ReservationActive {
		x.n.live += delta
		return
	}
	x.n.released += delta
	if r.CleanupPending {
		x.n.pending += delta
	}
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
}

func (x *index) counts() Counts {
	return Counts{
		Total:          len(x.recs),
		Live:           x.n.live,
		Released:       x.n.released,
		CleanupPending: x.n.pending,
	}
}

// ownerIDs returns the IDs of owner's reservations, every state.
func (x *index) ownerIDs(owner string) []string {
	return slices.Collect(maps.Keys(x.owners[owner]))
}

// overlay is one batch's changes on top of the index, visible to the later requests of
// the same batch and applied to the index only once the batch has committed.
type overlay struct {
	base *index
	recs map[string]*device.Reservation // nil value: deleted in this batch
	held map[string]string              // "" value: freed in this batch
}

func newOverlay(base *index) *overlay {
	return &overlay{base: base, recs: make(map[string]*device.Reservation), held: make(map[string]string)}
}

func (o *overlay) get(id string) *device.Reservation {
	if r, ok := o.recs[id]; ok {
		return r
	}
	return o.base.recs[id]
}

func (o *overlay) holder(dev string) string {
	if id, ok := o.held[dev]; ok {
		return id
	}
	return o.base.held[dev]
}

func (o *overlay) put(r *device.Reservation) {
	o.drop(r.ID)
	o.recs[r.ID] = r
	if r.State == device.ReservationActive {
		for _, d := range r.DeviceIDs {
			o.held[d] = r.ID
		}
	}
}

func (o *overlay) drop(id string) {
	old := o.get(id)
	if old == nil {
		return
	}
	o.recs[id] = nil
	for _, d := range old.DeviceIDs {
		if o.holder(d) == id {
			o.held[d] = ""
		}
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
	return c
}
