package ledger

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/devicehost/devicehost/device"
)

// Release ends the live reservations req names, durably before it returns: each is
// marked released at now (the ledger's clock when now is zero) with its plugin cleanup
// pending, and its devices are free for others at once. It returns, in their state after
// the call and oldest first, the reservations this call released and, apart, those req
// named that were released before: those keep their first release time and are not
// released twice.
//
// req names either one reservation (an unknown ID wraps device.ErrNotFound) or every
// reservation of one owner (an owner with none is not an error: both results are empty).
// req is one the host API's server has validated (validate.ReleaseRequest); setting both
// fields or neither is an "internal:" error. With req.OwnerPrefixes, a reservation of an
// owner under none of them fails the call with a *device.PermissionError, and nothing
// is released.
func (l *Ledger) Release(ctx context.Context, req device.ReleaseRequest, now time.Time) (released, already []device.Reservation, err error) {
	if (req.ReservationID == "") == (req.OwnerID == "") {
		return nil, nil, fmt.Errorf("release: %w: the request must name exactly one of a reservation and an owner", errInternal)
	}
	if now.IsZero() {
		now = l.now()
	}
	now = normTime(now)
	type result struct{ released, already []*device.Reservation }
	by := device.CallerOf(ctx)
	val, err := l.submit(ctx, func(w *txn) (any, error) {
		var ids []string
		if req.ReservationID != "" {
			if w.get(req.ReservationID) == nil {
				return nil, fmt.Errorf("reservation %q: %w", req.ReservationID, device.ErrNotFound)
			}
			ids = []string{req.ReservationID}
		} else {
			ids = w.ov.ownerIDs(req.OwnerID)
		}
		var out result
		for _, id := range ids {
			r := w.get(id)
			if !device.OwnerUnder(r.OwnerID, req.OwnerPrefixes) {
				return nil, &device.PermissionError{
					Call:  fmt.Sprintf("release reservation %q of owner %q", r.ID, r.OwnerID),
					Lacks: "reserve:" + r.OwnerID,
				}
			}
			if r.State != device.ReservationActive {
				out.already = append(out.already, r)
				continue
			}
			nr := *r // shares r's immutable slices and maps
			nr.State, nr.ReleasedAt, nr.CleanupPending = device.ReservationReleased, now, true
			if err := w.putReservation(&nr); err != nil {
				return nil, err
			}
			out.released = append(out.released, &nr)
		}
		if len(out.released) > 0 {
			e := device.Event{Kind: device.EventRelease, By: by, Owner: req.OwnerID}
			for _, r := range out.released {
				e.Owner = cmp.Or(req.OwnerID, r.OwnerID)
				e.Reservations = append(e.Reservations, r.ID)
				e.Devices = append(e.Devices, r.DeviceIDs...)
			}
			if err := w.event(e); err != nil {
				return nil, err
			}
		}
		return out, nil
	})
	if err != nil {
		l.Refused(ctx, "release", device.Event{Owner: req.OwnerID, Reservations: nonEmpty(req.ReservationID)}, err)
		return nil, nil, fmt.Errorf("release: %w", err)
	}
	res := val.(result)
	return cloneAll(res.released), cloneAll(res.already), nil
}

// cloneAll deep-copies rs for a caller; nil stays nil.
func cloneAll(rs []*device.Reservation) []device.Reservation {
	if rs == nil {
		return nil
	}
	out := make([]device.Reservation, len(rs))
	for i, r := range rs {
		out[i] = clone(r)
	}
	return out
}

// CleanupDone records, durably, that the plugin has cleaned up after the released
// reservation id. Recording it twice is not an error. An unknown id wraps
// device.ErrNotFound; a live one wraps ErrNotReleased.
func (l *Ledger) CleanupDone(ctx context.Context, id string) error {
	if _, err := l.submit(ctx, cleanupDoneRun(id)); err != nil {
		return fmt.Errorf("record cleanup done: %w", err)
	}
	return nil
}

// cleanupDoneRun is the write of CleanupDone.
func cleanupDoneRun(id string) func(w *txn) (any, error) {
	return func(w *txn) (any, error) {
		r := w.get(id)
		switch {
		case r == nil:
			return nil, fmt.Errorf("reservation %q: %w", id, device.ErrNotFound)
		case r.State == device.ReservationActive:
			return nil, fmt.Errorf("reservation %q: %w", id, ErrNotReleased)
		case !r.CleanupPending:
			return nil, nil
		}
		nr := *r
		nr.CleanupPending = false
		return nil, w.putReservation(&nr)
	}
}

// Delete removes released reservations whose cleanup is done, all or none, durably.
// IDs the ledger does not have are skipped (already deleted). A live reservation wraps
// ErrNotReleased and one whose cleanup is pending wraps ErrCleanupPending; then nothing
// is deleted.
func (l *Ledger) Delete(ctx context.Context, ids ...string) error {
	if len(ids) == 0 {
		return nil
	}
	if _, err := l.submit(ctx, deleteRun(ids, false, device.CallerOf(ctx))); err != nil {
		return fmt.Errorf("delete reservations: %w", err)
	}
	return nil
}

// deleteRun is the write of Delete; cleaned deletes reservations whose cleanup is still
// recorded as pending too (the caller has just done it).
func deleteRun(ids []string, cleaned bool, by string) func(w *txn) (any, error) {
	return func(w *txn) (any, error) {
		for _, id := range ids {
			switch r := w.get(id); {
			case r == nil:
			case r.State == device.ReservationActive:
				return nil, fmt.Errorf("reservation %q: %w", id, ErrNotReleased)
			case r.CleanupPending && !cleaned:
				return nil, fmt.Errorf("reservation %q: %w", id, ErrCleanupPending)
			}
		}
		e := device.Event{Kind: device.EventDelete, By: by}
		for _, id := range ids {
			if r := w.get(id); r != nil {
				if err := w.deleteReservation(id); err != nil {
					return nil, err
				}
				e.Owner = r.OwnerID
				e.Reservations = append(e.Reservations, id)
				e.Devices = append(e.Devices, r.DeviceIDs...)
			}
		}
		if len(e.Reservations) > 1 {
			e.Owner = "" // several owners, perhaps: the reservations say
		}
		if len(e.Reservations) > 0 {
			return nil, w.event(e)
		}
		return nil, nil
	}
}

// PendingCleanups returns the released reservations whose plugin cleanup is not yet
// recorded as done, oldest release first.
func (l *Ledger) PendingCleanups() []device.Reservation {
	l.mu.RLock()
	var rs []*device.Reservation
	for _, rr := range l.idx.released {
		if rr.p.cleanupPending() {
			rs = append(rs, rr.p.unpack(rr.id)) // unpacked afresh: the caller's
		}
	}
	l.mu.RUnlock()
	slices.SortFunc(rs, func(a, b *device.Reservation) int {
		return cmp.Or(a.ReleasedAt.Compare(b.ReleasedAt), cmp.Compare(a.ID, b.ID))
	})
	out := make([]device.Reservation, len(rs))
	for i, r := range rs {
		out[i] = *r
	}
	return out
}
