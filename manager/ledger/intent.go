package ledger

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/devicehost/devicehost/device"
)

// Intents: a reservation recorded before its plugin's answer. Devicehost 189008b to
// c9e8f1f recorded every Reserve so (Intend) while it asked the plugin, and wrote the
// answer later; a stop in between left an intent in the file without its answer. This
// version records a Reserve whole, after its plugin answered, in one commit; it still
// reads the intents such a file holds, and Intend remains for a caller that must hold
// devices durably before it can ask for them.
//
// An intent holds its devices and counters as a reservation does, under the same
// conflict, capacity and cordon rules. Its devices stay held until the manager asks the
// plugin again when the plugin is next up (the plugin protocol's Reserve answers a
// repeated request for devices it prepared as it did the first time) and records the
// answer (FinalizeNow), or withdraws the intent when the plugin refuses (Withdraw).
// Until then the intent is shown by Holders and Intents only: Get and List skip it, a
// retried Reserve's Check answers *UnansweredError, and Reown refuses it.

// bucketIntents holds the intents: intents/<ID>, a record envelope around the same
// JSON recordV1 as a reservation's, without its container. Created by the first intent.
var bucketIntents = []byte("intents")

// ErrNeedsTakeOver is Intend's refusal of a request that would take devices over from
// their holders (see Reserve): such a request is recorded whole, by Reserve.
var ErrNeedsTakeOver = errors.New("the devices are held by reservations to take over: record the reservation whole")

// errNotIntent is an answer's refusal when its reservation is no longer an intent
// (released, taken over or withdrawn meanwhile).
var errNotIntent = errors.New("not an intent")

// UnansweredError is what Check (and Reserve) answer for a request its owner's live
// reservation already covers when that reservation is an intent without its plugin's
// answer: the caller asks the plugin and records the answer (FinalizeNow).
type UnansweredError struct {
	Reservation device.Reservation // the intent, without a container
}

func (e *UnansweredError) Error() string {
	return fmt.Sprintf("reservation %s is recorded without its plugin's answer (the host stopped before writing it)", e.Reservation.ID)
}

// Intend records r as an intent, fsynced before it returns, after the conflict,
// capacity and cordon rules of Reserve (see there; r.ID must be set). A request that
// would take devices over is refused with ErrNeedsTakeOver and nothing written; one
// its owner's live reservation already covers returns that reservation with existing
// true (an *UnansweredError when it is an unanswered intent).
func (l *Ledger) Intend(ctx context.Context, r device.Reservation, takeOver []string, caps device.Capacity) (res device.Reservation, existing bool, err error) {
	if r.ID == "" {
		return device.Reservation{}, false, fmt.Errorf("intend: %w: no reservation ID", errInternal)
	}
	rec, err := l.newRecord("intend", r)
	if err != nil {
		return device.Reservation{}, false, err
	}
	rec.Container = device.ContainerReservation{}
	val, err := l.submit(ctx, intendRun(rec, slices.Clone(takeOver), caps))
	if err != nil {
		if !errors.Is(err, ErrNeedsTakeOver) {
			l.Refused(ctx, "reserve", device.Event{Owner: rec.OwnerID, Devices: rec.DeviceIDs}, err)
		}
		return device.Reservation{}, false, fmt.Errorf("reserve: %w", err)
	}
	return l.answered(val.(reserveResult))
}

// intendRun is the write of Intend for rec (checked, stamped, owned by the run).
func intendRun(rec device.Reservation, takeOver []string, caps device.Capacity) func(w *txn) (any, error) {
	return func(w *txn) (any, error) {
		prior, victims, err := decide(w, rec.OwnerID, rec.DeviceIDs, takeOver, rec.PluginOptions, rec.Consumes, caps)
		switch {
		case err != nil:
			return nil, err
		case prior != nil:
			return reserveResult{r: prior, existing: true}, nil
		case len(victims) > 0:
			return nil, ErrNeedsTakeOver
		}
		if err := checkCordons(w, rec.DeviceIDs); err != nil {
			return nil, err
		}
		if w.get(rec.ID) != nil {
			return nil, &device.FieldError{Field: "reservation_id",
				Rule: fmt.Sprintf("%q is already used by another reservation", rec.ID)}
		}
		nr := rec // a fresh copy per run: the batch may be retried
		if err := w.putIntent(&nr); err != nil {
			return nil, err
		}
		return reserveResult{r: &nr}, nil
	}
}

// FinalizeNow records intent id's answer c durably before it returns (an intent left
// by a stop, answered again), with detail in the trail's reserve event. An id that is
// not an intent (any more) wraps device.ErrNotFound.
func (l *Ledger) FinalizeNow(ctx context.Context, id string, c device.ContainerReservation, detail string) (device.Reservation, error) {
	val, err := l.submit(ctx, answerRun(id, cloneContainer(c), device.CallerOf(ctx), detail))
	if err != nil {
		if errors.Is(err, errNotIntent) {
			err = fmt.Errorf("intent %q: %w", id, device.ErrNotFound)
		}
		return device.Reservation{}, fmt.Errorf("record reservation answer: %w", err)
	}
	return clone(val.(*device.Reservation)), nil
}

// answerRun writes intent id's record with its answer c, and the reserve event.
func answerRun(id string, c device.ContainerReservation, by, detail string) func(w *txn) (any, error) {
	return func(w *txn) (any, error) {
		r := w.get(id)
		if r == nil || r.State != device.ReservationActive || !w.ov.isIntent(id) {
			return nil, errNotIntent
		}
		nr := *r // shares r's immutable slices and maps
		nr.Container = c
		if err := w.putReservation(&nr); err != nil {
			return nil, err
		}
		if err := w.event(device.Event{Kind: device.EventReserve, By: by, Owner: nr.OwnerID, Devices: nr.DeviceIDs,
			Reservations: []string{nr.ID}, Detail: detail}); err != nil {
			return nil, err
		}
		return &nr, nil
	}
}

// Withdraw deletes intent id, durably, freeing its devices: its plugin refused, or the
// Reserve failed after the intent was written. An id that is not an intent (any more)
// is left as it is. Nothing goes into the trail: no reservation was made.
func (l *Ledger) Withdraw(ctx context.Context, id string) error {
	_, err := l.submit(ctx, func(w *txn) (any, error) {
		if r := w.get(id); r == nil || r.State != device.ReservationActive || !w.ov.isIntent(id) {
			return nil, nil
		}
		if err := w.deleteIntentKey(id); err != nil {
			return nil, err
		}
		w.ov.drop(id)
		return nil, nil
	})
	if err != nil {
		return fmt.Errorf("withdraw reservation %s: %w", id, err)
	}
	return nil
}

// Intents returns the live intents (reservations recorded without their plugin's
// answer), oldest first.
func (l *Ledger) Intents() []device.Reservation {
	l.mu.RLock()
	var rs []*device.Reservation
	for id := range l.idx.intent {
		c := clone(l.idx.live[id])
		rs = append(rs, &c)
	}
	l.mu.RUnlock()
	sortReservations(rs)
	all := make([]device.Reservation, len(rs))
	for i, r := range rs {
		all[i] = *r
	}
	return all
}

// Live returns every live reservation, intents included (answered or not: their devices
// are held), read at one instant, oldest first; for a plugin's Reconcile.
func (l *Ledger) Live() []device.Reservation {
	l.mu.RLock()
	rs := make([]*device.Reservation, 0, len(l.idx.live))
	for _, r := range l.idx.live {
		c := clone(r)
		rs = append(rs, &c)
	}
	l.mu.RUnlock()
	sortReservations(rs)
	out := make([]device.Reservation, len(rs))
	for i, r := range rs {
		out[i] = *r
	}
	return out
}

// seen is what a reader is shown of reservation r (the index's, or a batch's): a copy;
// an *UnansweredError for an intent. Takes mu.
func (l *Ledger) seen(r *device.Reservation) (device.Reservation, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	c, ok := l.shown(r)
	if !ok {
		return device.Reservation{}, &UnansweredError{Reservation: clone(r)}
	}
	return *c, nil
}

// shown is seen under mu: nil, false for an intent.
func (l *Ledger) shown(r *device.Reservation) (*device.Reservation, bool) {
	if r.State == device.ReservationActive && l.idx.isIntent(r.ID) {
		return nil, false
	}
	c := clone(r)
	return &c, true
}

// putIntent stores intent r (never modified afterwards) in the file and the batch view.
func (w *txn) putIntent(r *device.Reservation) error {
	v, err := encodeReservation(r)
	if err != nil {
		return &storageError{Err: err}
	}
	if err := w.put(bucketIntents, []byte(r.ID), v); err != nil {
		return &storageError{Err: fmt.Errorf("store intent %q: %w", r.ID, err)}
	}
	w.ov.put(r)
	w.ov.setIntent(r.ID, true)
	return nil
}

// deleteIntentKey deletes intent id's key from the file and marks it no longer an
// intent in the batch view; its record in the view is the caller's to change.
func (w *txn) deleteIntentKey(id string) error {
	if err := w.del(bucketIntents, []byte(id)); err != nil {
		return &storageError{Err: fmt.Errorf("delete intent %q: %w", id, err)}
	}
	w.ov.setIntent(id, false)
	return nil
}

// cloneContainer deep-copies c.
func cloneContainer(c device.ContainerReservation) device.ContainerReservation {
	return device.ContainerReservation{
		Envs:       maps.Clone(c.Envs),
		Mounts:     slices.Clone(c.Mounts),
		Devices:    slices.Clone(c.Devices),
		CDIDevices: slices.Clone(c.CDIDevices),
	}
}
