package ledger

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"

	"github.com/devicehost/devicehost/device"
)

// The audit trail: an event for every change to the reservations and the cordons.
// A change's events are collected in its transaction and take their positions (Seq) in
// commit order once it is durable; watchers see them at once, from memory. They are
// written to the file in batches, as a deferred write riding on a later commit, at
// most eventFlushEvery after they were made (at once past eventFlushAt waiting), so a
// Reserve pays for no event write of its own: on a 2-core machine with its disk, an
// event in the Reserve's own transaction cost 15 to 25% of the Reserve (two more pages
// written before its fsync). What a crash can lose is the events of the last
// eventFlushEvery, never a change: the reservations and cordons are durable as before.
//
//	events/<seq, 8 bytes big-endian>    record envelope around eventRecord's JSON
//
// The file keeps the newest Options.MaxEvents, and none older than Options.MaxEventAge
// (both checked as events are written). The bucket is created by the first event, so a
// file without it (same schema version) has none, and an older devicehost ignores it.
var bucketEvents = []byte("events")

// Defaults of the trail's bounds.
const (
	DefaultMaxEvents   = 10000
	DefaultMaxEventAge = 7 * 24 * time.Hour
)

// How events are written: at most eventFlushEvery after they are made, at once when
// eventFlushAt wait; ageDropMax bounds the old events one write drops.
const (
	eventFlushEvery = 200 * time.Millisecond
	eventFlushAt    = 512
	ageDropMax      = 1024
)

// eventRecord is an event as stored.
type eventRecord struct {
	Time         time.Time `json:"time"`
	Kind         string    `json:"kind"`
	By           string    `json:"by,omitempty"`
	Call         string    `json:"call,omitempty"`
	Owner        string    `json:"owner,omitempty"`
	NewOwner     string    `json:"new_owner,omitempty"`
	Devices      []string  `json:"devices,omitempty"`
	Reservations []string  `json:"reservations,omitempty"`
	Detail       string    `json:"detail,omitempty"`
}

// eventLog is the trail's state, under mu.
type eventLog struct {
	max    int // 0 or less: no events
	maxAge time.Duration
	now    func() time.Time

	mu       sync.Mutex
	next     uint64         // the Seq of the next event
	count    int            // events in the file
	pending  []device.Event // made, not yet in the file, in Seq order
	flushing bool           // a write of pending is queued
	timer    *time.Timer    // the next flush, while pending waits
	wake     chan struct{}  // closed when an event is made
}

// eventDelta is what a batch's transaction made of events, given their Seq once the
// batch is durable.
type eventDelta struct {
	events []device.Event
}

func seqKey(seq uint64) []byte {
	var k [8]byte
	binary.BigEndian.PutUint64(k[:], seq)
	return k[:]
}

// loadEventLog reads the trail's position and size from db.
func loadEventLog(db *bolt.DB, max int, maxAge time.Duration, now func() time.Time) (*eventLog, error) {
	ev := &eventLog{max: max, maxAge: maxAge, now: now, next: 1, wake: make(chan struct{})}
	err := db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketEvents)
		if b == nil {
			return nil
		}
		if k, _ := b.Cursor().Last(); len(k) == 8 {
			ev.next = binary.BigEndian.Uint64(k) + 1
		}
		ev.count = b.Stats().KeyN
		return nil
	})
	if err != nil {
		return nil, err
	}
	return ev, nil
}

// event collects e as one of the batch's events; it gets its time and Seq when the
// batch is durable (applyEvents). It writes nothing and never fails (the error is for
// the runs' convenience).
func (w *txn) event(e device.Event) error {
	if w.ev == nil || w.ev.max <= 0 {
		return nil
	}
	w.ov.ev.events = append(w.ov.ev.events, e)
	return nil
}

// applyEvents makes a durable batch's events the trail's.
func (l *Ledger) applyEvents(d eventDelta) {
	if len(d.events) > 0 {
		l.addEvents(d.events...)
	}
}

// addEvents gives events their time and Seq, in order, keeps them for the file's next
// write, and wakes the watchers.
func (l *Ledger) addEvents(events ...device.Event) {
	ev := l.ev
	now := normTime(ev.now())
	ev.mu.Lock()
	for _, e := range events {
		e.Seq, e.Time = ev.next, now
		ev.next++
		ev.pending = append(ev.pending, e)
	}
	close(ev.wake)
	ev.wake = make(chan struct{})
	flushNow := false
	switch {
	case ev.flushing:
	case len(ev.pending) >= eventFlushAt:
		flushNow = true
	case ev.timer == nil:
		ev.timer = time.AfterFunc(eventFlushEvery, l.flushEvents)
	}
	ev.mu.Unlock()
	if flushNow {
		l.flushEvents()
	}
}

// flushEvents queues, as a deferred write due at once, the write of the events pending
// now, which also drops the oldest past the bounds; they leave pending once durable. A
// write that fails leaves them pending for the next.
func (l *Ledger) flushEvents() {
	ev := l.ev
	ev.mu.Lock()
	if ev.timer != nil {
		ev.timer.Stop()
		ev.timer = nil
	}
	if ev.flushing || len(ev.pending) == 0 {
		ev.mu.Unlock()
		return
	}
	ev.flushing = true
	batch := slices.Clone(ev.pending)
	count := ev.count
	ev.mu.Unlock()
	var dropped int
	l.submitDeferred(0, func(w *txn) (any, error) {
		n, err := writeEvents(w, batch, count, ev.max, ev.maxAge, ev.now())
		dropped = n
		return nil, err
	}, func(err error) {
		ev.mu.Lock()
		defer ev.mu.Unlock()
		ev.flushing = false
		if err == nil {
			ev.pending = ev.pending[len(batch):]
			ev.count += len(batch) - dropped
		}
		if len(ev.pending) > 0 && !errors.Is(err, ErrClosed) && ev.timer == nil {
			ev.timer = time.AfterFunc(eventFlushEvery, l.flushEvents)
		}
	})
}

// writeEvents stores events in the file, which holds count, and drops the oldest past
// max and those older than maxAge; it returns how many it dropped.
func writeEvents(w *txn, events []device.Event, count, max int, maxAge time.Duration, now time.Time) (int, error) {
	b, err := w.tx.CreateBucketIfNotExists(bucketEvents)
	if err != nil {
		return 0, &storageError{fmt.Errorf("events bucket: %w", err)}
	}
	b.FillPercent = 1 // appended in key order: full pages
	for _, e := range events {
		payload, err := json.Marshal(eventRecord{Time: e.Time, Kind: string(e.Kind), By: e.By, Call: e.Call, Owner: e.Owner,
			NewOwner: e.NewOwner, Devices: e.Devices, Reservations: e.Reservations, Detail: e.Detail})
		if err != nil {
			return 0, &storageError{err}
		}
		if err := w.put(bucketEvents, seqKey(e.Seq), seal(payload)); err != nil {
			return 0, &storageError{fmt.Errorf("store event %d: %w", e.Seq, err)}
		}
	}
	dropped := 0
	c := b.Cursor()
	for count+len(events)-dropped > max {
		k, _ := c.First()
		if k == nil {
			break
		}
		if err := w.del(bucketEvents, slices.Clone(k)); err != nil {
			return 0, &storageError{fmt.Errorf("drop the oldest event: %w", err)}
		}
		dropped++
	}
	cutoff := now.Add(-maxAge)
	for i := 0; i < ageDropMax; i++ {
		k, v := c.First()
		if k == nil {
			break
		}
		var rec eventRecord
		if payload, err := unseal(v); err == nil && json.Unmarshal(payload, &rec) == nil && !rec.Time.Before(cutoff) {
			break // the oldest is young enough (an unreadable one goes)
		}
		if err := w.del(bucketEvents, slices.Clone(k)); err != nil {
			return 0, &storageError{fmt.Errorf("drop an old event: %w", err)}
		}
		dropped++
	}
	return dropped, nil
}

// EventsAfter returns a channel closed once the trail holds an event after seq (at once
// when it does already). See device.Manager.
func (l *Ledger) EventsAfter(seq uint64) <-chan struct{} {
	ev := l.ev
	ev.mu.Lock()
	defer ev.mu.Unlock()
	if ev.next-1 > seq {
		done := make(chan struct{})
		close(done)
		return done
	}
	return ev.wake
}

// scanMax bounds the records one Events call reads, matching or not.
const scanMax = 4 * device.MaxEventsPerCall

// Events returns the trail's events after f.After that match f, oldest first: at most
// f.Limit (device.MaxEventsPerCall), reading at most scanMax events. Those not yet
// written to the file come from memory. A record that cannot be read is returned as an
// event of kind "unreadable" saying so, so that a consumer sees why a position is not
// what it expected.
func (l *Ledger) Events(ctx context.Context, f device.EventFilter) (device.EventsResult, error) {
	limit := f.Limit
	if limit <= 0 || limit > device.MaxEventsPerCall {
		limit = device.MaxEventsPerCall
	}
	// Pending first: a write that lands in between moves events from pending to the
	// file, where the read below does not look past the first of them.
	ev := l.ev
	ev.mu.Lock()
	pending := slices.Clone(ev.pending)
	fileEnd := ev.next // the file holds positions below this, and below pending's first
	// The trail's bounds hold for what is read whether or not its write has dropped the
	// events past them yet.
	low := uint64(1)
	if ev.next > uint64(ev.max) {
		low = ev.next - uint64(ev.max)
	}
	ev.mu.Unlock()
	cutoff := ev.now().Add(-ev.maxAge)
	if len(pending) > 0 {
		fileEnd = pending[0].Seq
	}
	out := device.EventsResult{Through: f.After}
	scanned := 0
	take := func(e device.Event) bool {
		if len(out.Events) >= limit || scanned >= scanMax {
			return false
		}
		scanned++
		out.Through = e.Seq
		if e.Seq >= low && (!e.Time.Before(cutoff) || e.Kind == "unreadable") && matchEvent(e, f) {
			out.Events = append(out.Events, e)
		}
		return true
	}
	err := l.read(ctx, func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketEvents)
		if b == nil {
			return nil
		}
		c := b.Cursor()
		if k, _ := c.First(); len(k) == 8 {
			out.Oldest = binary.BigEndian.Uint64(k)
		}
		for k, v := c.Seek(seqKey(f.After + 1)); k != nil; k, v = c.Next() {
			seq := binary.BigEndian.Uint64(k)
			if seq >= fileEnd || !take(decodeEvent(seq, v)) {
				break
			}
		}
		return nil
	})
	if errors.Is(err, berrors.ErrDatabaseNotOpen) {
		err = ErrClosed
	}
	if err != nil {
		return device.EventsResult{}, fmt.Errorf("read events from %s: %w", l.path, err)
	}
	if out.Oldest == 0 && len(pending) > 0 {
		out.Oldest = pending[0].Seq
	}
	if out.Oldest != 0 {
		out.Oldest = max(out.Oldest, low)
	}
	for _, e := range pending {
		if e.Seq > out.Through && !take(e) {
			break
		}
	}
	return out, nil
}

// decodeEvent reads the event stored as v at seq.
func decodeEvent(seq uint64, v []byte) device.Event {
	var rec eventRecord
	payload, err := unseal(v)
	if err == nil {
		err = json.Unmarshal(payload, &rec)
	}
	if err != nil {
		return device.Event{Seq: seq, Kind: "unreadable", Detail: fmt.Sprintf("the event's record in the state file is damaged: %v", err)}
	}
	return device.Event{Seq: seq, Time: rec.Time, Kind: device.EventKind(rec.Kind), By: rec.By, Call: rec.Call, Owner: rec.Owner,
		NewOwner: rec.NewOwner, Devices: rec.Devices, Reservations: rec.Reservations, Detail: rec.Detail}
}

// matchEvent reports whether e matches f's owner and device.
func matchEvent(e device.Event, f device.EventFilter) bool {
	if f.Owner != "" {
		if !device.OwnerMatches(f.Owner, e.Owner) && !device.OwnerMatches(f.Owner, e.NewOwner) {
			return false
		}
	}
	if f.Device != "" {
		found := false
		for _, d := range e.Devices {
			if d == f.Device {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// refused records that the ledger refused a call of ctx's caller.
func (l *Ledger) refused(ctx context.Context, call string, e device.Event, err error) {
	if l.ev.max <= 0 || err == nil || errors.Is(err, ErrClosed) || errors.Is(err, errInternal) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return
	}
	var se *storageError
	if errors.As(err, &se) {
		return
	}
	// A flood of refusals (a careless or hostile caller) must not push the changes out
	// of the bounded trail: at most refusedPerSecond are recorded each second, and the
	// next one recorded says how many were not.
	now := l.now()
	l.refusedMu.Lock()
	if now.Sub(l.refusedWindow) >= time.Second {
		l.refusedWindow, l.refusedIn = now, 0
	}
	if l.refusedIn >= refusedPerSecond {
		l.refusedLost++
		l.refusedMu.Unlock()
		return
	}
	l.refusedIn++
	lost := l.refusedLost
	l.refusedLost = 0
	l.refusedMu.Unlock()
	e.Kind, e.Call, e.By, e.Detail = device.EventRefused, call, device.CallerOf(ctx), err.Error()
	if lost > 0 {
		e.Detail += fmt.Sprintf(" (and %d refusals before it not recorded: more than %d a second)", lost, refusedPerSecond)
	}
	l.addEvents(e)
}

// refusedPerSecond bounds the refusals the trail records each second.
const refusedPerSecond = 20

// nonEmpty is []string{s}, or nil for "".
func nonEmpty(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}
