package ledger

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/devicehost/devicehost/device"
)

// Intents: a Reserve recorded in two writes, so that its commit and its plugin call run
// side by side instead of one after the other.
//
// The manager records the reservation as an intent (Intend) while it asks the plugin:
// an intent holds its devices and counters as a reservation does, under the same
// conflict, capacity and cordon rules, durably before Intend returns. When the plugin
// has answered, Finalize hands the answer over: readers see the reservation whole at
// once, and its record, with the answer, rides on the next commit (submitRider; within
// Options.AnswerDelay when no other commit comes sooner), in one write with the intent's
// deletion and the trail's reserve event. A Reserve so waits for the longer of its
// plugin call and its commit, not their sum, and still answers only once its devices
// are durably held.
//
// A stop between the reply and that write (a crash, a kill) leaves an intent in the file
// without its answer. Its devices stay held; the manager asks the plugin again when the
// plugin is next up (the plugin protocol's Reserve answers a repeated request for
// devices it prepared as it did the first time) and records the answer (FinalizeNow), or
// withdraws the intent when the plugin refuses (Withdraw). Until then the intent is
// shown by Holders and Intents only: Get and List skip it, a retried Reserve's Check
// answers *UnansweredError, and Reown refuses it.

// bucketIntents holds the intents: intents/<ID>, a record envelope around the same
// JSON recordV1 as a reservation's, without its container. Created by the first intent.
var bucketIntents = []byte("intents")

// DefaultAnswerDelay is how long an answered intent's record waits for another commit to
// ride on before it is committed on its own (Options.AnswerDelay).
const DefaultAnswerDelay = 2 * time.Millisecond

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
			l.refused(ctx, "reserve", device.Event{Owner: rec.OwnerID, Devices: rec.DeviceIDs}, err)
		}
		return device.Reservation{}, false, fmt.Errorf("reserve: %w", err)
	}
	return l.answered(val.(reserveResult))
}

// intendRun is the write of Intend for rec (checked, stamped, owned by the run).
func intendRun(rec device.Reservation, takeOver []string, caps device.Capacity) func(w *txn) (any, error) {
	return func(w *txn) (any, error) {
		prior, victims, err := decide(w, rec.OwnerID, rec.DeviceIDs, takeOver, rec.Consumes, caps)
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

// Finalize hands intent id its plugin's answer c: readers see the reservation with it,
// and the trail its reserve event, at once; its record is written on the next commit
// (see the top of this file). A reservation released or taken over meanwhile keeps its
// release. by is the caller the trail's reserve event names.
func (l *Ledger) Finalize(id string, c device.ContainerReservation, by string) {
	c = cloneContainer(c)
	l.mu.Lock()
	r := l.idx.live[id]
	if r == nil || !l.idx.isIntent(id) { // released or taken over meanwhile
		l.mu.Unlock()
		return
	}
	l.answers[id] = c
	e := device.Event{Kind: device.EventReserve, By: by, Owner: r.OwnerID, Devices: r.DeviceIDs, Reservations: []string{id}}
	l.mu.Unlock()
	// The trail's reserve event now, as a Reserve's comes at its commit: the
	// reservation is durable already (its intent), and the trail writes its events
	// later anyway (eventFlushEvery).
	if l.ev != nil && l.ev.max > 0 {
		l.addEvents(e)
	}
	l.submitRider(l.answerDelay, answerRun(id, c, by, "", true), func(err error) {
		l.mu.Lock()
		if !l.idx.isIntent(id) {
			delete(l.answers, id) // written, or no longer an intent
		}
		l.mu.Unlock()
		if err != nil {
			l.log.Warn("a reservation's answer is not in the state file yet: its devices stay held, and the plugin is asked again at its next start",
				"reservation_id", id, "error", err.Error())
		}
	})
}

// FinalizeNow records intent id's answer c durably before it returns (an intent left
// by a stop, answered again), with detail in the trail's reserve event. An id that is
// not an intent (any more) wraps device.ErrNotFound.
func (l *Ledger) FinalizeNow(ctx context.Context, id string, c device.ContainerReservation, detail string) (device.Reservation, error) {
	val, err := l.submit(ctx, answerRun(id, cloneContainer(c), device.CallerOf(ctx), detail, false))
	if err != nil {
		if errors.Is(err, errNotIntent) {
			err = fmt.Errorf("intent %q: %w", id, device.ErrNotFound)
		}
		return device.Reservation{}, fmt.Errorf("record reservation answer: %w", err)
	}
	return clone(val.(*device.Reservation)), nil
}

// answerRun writes intent id's record with its answer c, and the reserve event. quiet
// (a rider's, whose event Finalize made): no event, and an id that is no longer an
// intent is no error.
func answerRun(id string, c device.ContainerReservation, by, detail string, quiet bool) func(w *txn) (any, error) {
	return func(w *txn) (any, error) {
		r := w.get(id)
		if r == nil || r.State != device.ReservationActive || !w.ov.isIntent(id) {
			if quiet {
				return nil, nil
			}
			return nil, errNotIntent
		}
		nr := *r // shares r's immutable slices and maps
		nr.Container = c
		if err := w.putReservation(&nr); err != nil {
			return nil, err
		}
		if quiet {
			return &nr, nil
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

// Intents returns the live intents, answered (in memory) or not, oldest first, each
// with the answer it has; unanswered says which have none.
func (l *Ledger) Intents() (all []device.Reservation, unanswered map[string]bool) {
	l.mu.RLock()
	var rs []*device.Reservation
	unanswered = make(map[string]bool)
	for id := range l.idx.intent {
		c := clone(l.idx.live[id])
		if a, ok := l.answers[id]; ok {
			c.Container = cloneContainer(a)
		} else {
			unanswered[id] = true
		}
		rs = append(rs, &c)
	}
	l.mu.RUnlock()
	sortReservations(rs)
	for _, r := range rs {
		all = append(all, *r)
	}
	return all, unanswered
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

// seen is what a reader is shown of reservation r (the index's, or a batch's): a copy,
// with its answer when it is an intent answered in memory; an *UnansweredError for an
// intent without one. Takes mu.
func (l *Ledger) seen(r *device.Reservation) (device.Reservation, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	c, ok := l.shown(r)
	if !ok {
		return device.Reservation{}, &UnansweredError{Reservation: clone(r)}
	}
	return *c, nil
}

// shown is seen under mu: nil, false for an unanswered intent.
func (l *Ledger) shown(r *device.Reservation) (*device.Reservation, bool) {
	c := clone(r)
	if r.State == device.ReservationActive && l.idx.isIntent(r.ID) {
		a, ok := l.answers[r.ID]
		if !ok {
			return nil, false
		}
		c.Container = cloneContainer(a)
	}
	return &c, true
}

// putIntent stores intent r (never modified afterwards) in the file and the batch view.
func (w *txn) putIntent(r *device.Reservation) error {
	v, err := encodeReservation(r)
	if err != nil {
		return &storageError{err}
	}
	if err := w.put(bucketIntents, []byte(r.ID), v); err != nil {
		return &storageError{fmt.Errorf("store intent %q: %w", r.ID, err)}
	}
	w.ov.put(r)
	w.ov.setIntent(r.ID, true)
	return nil
}

// deleteIntentKey deletes intent id's key from the file and marks it no longer an
// intent in the batch view; its record in the view is the caller's to change.
func (w *txn) deleteIntentKey(id string) error {
	if err := w.del(bucketIntents, []byte(id)); err != nil {
		return &storageError{fmt.Errorf("delete intent %q: %w", id, err)}
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
