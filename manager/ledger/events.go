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

	"github.com/devicehost/devicehost/device"
)

// The audit trail: an event for every change to the reservations, the cordons and the
// admin accesses, and for the calls the ledger refused. A change's events are written in
// the change's own transaction, their positions (Seq) taken in commit order; watchers
// see them once the commit is durable, so an event a watcher saw survives any crash and
// its Seq is never given to another.
//
//	events/<seq, 8 bytes big-endian>    record envelope around eventRecord's JSON
//
// The file keeps the newest Options.MaxEvents, and none older than Options.MaxEventAge
// (both checked in each transaction that writes events). The bucket is created by the
// first event, so a file without it (same schema version) has none, and an older
// devicehost ignores it.
var bucketEvents = []byte("events")

// Defaults of the trail's bounds.
const (
	DefaultMaxEvents   = 10000
	DefaultMaxEventAge = 7 * 24 * time.Hour
)

// ageDropMax bounds the old events one transaction drops.
const ageDropMax = 1024

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

// eventLog is the trail's state. next and count change only after a commit, by the
// leader (commit); mu guards them for the readers.
type eventLog struct {
	max    int // 0 or less: no events
	maxAge time.Duration
	now    func() time.Time

	mu         sync.Mutex
	next       uint64        // the Seq of the next event
	count      int           // events in the file
	ageChecked time.Time     // when a commit last looked for events past their age
	wake       chan struct{} // closed when an event is committed
}

// eventDelta is what a batch's transaction made of events: those it wrote, and how
// many old ones it dropped.
type eventDelta struct {
	events     []device.Event
	dropped    int
	ageChecked time.Time // when the batch looked for events past their age; zero: it did not
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

// event writes e in the batch's transaction, with the next Seq and the time now; it is
// the trail's once the batch is durable (applyEvents). Its errors are storageErrors.
func (w *txn) event(e device.Event) error {
	ev := w.ev
	if ev == nil || ev.max <= 0 {
		return nil
	}
	ev.mu.Lock()
	next := ev.next
	ev.mu.Unlock()
	e.Seq = next + uint64(len(w.ov.ev.events))
	e.Time = normTime(ev.now())
	payload, err := json.Marshal(eventRecord{Time: e.Time, Kind: string(e.Kind), By: e.By, Call: e.Call, Owner: e.Owner,
		NewOwner: e.NewOwner, Devices: e.Devices, Reservations: e.Reservations, Detail: e.Detail})
	if err != nil {
		return &storageError{Err: err}
	}
	b, err := w.tx.CreateBucketIfNotExists(bucketEvents)
	if err != nil {
		return &storageError{Err: fmt.Errorf("events bucket: %w", err)}
	}
	b.FillPercent = 1 // appended in key order: full pages
	if err := w.put(bucketEvents, seqKey(e.Seq), seal(payload)); err != nil {
		return &storageError{Err: fmt.Errorf("store event %d: %w", e.Seq, err)}
	}
	w.ov.ev.events = append(w.ov.ev.events, e)
	return nil
}

// applyEvents makes a durable batch's events the trail's and wakes the watchers.
func (l *Ledger) applyEvents(d eventDelta) {
	if len(d.events) == 0 {
		return
	}
	ev := l.ev
	ev.mu.Lock()
	ev.next += uint64(len(d.events))
	ev.count += len(d.events) - d.dropped
	if !d.ageChecked.IsZero() {
		ev.ageChecked = d.ageChecked
	}
	close(ev.wake)
	ev.wake = make(chan struct{})
	ev.mu.Unlock()
}

// pruneEvents drops, in the batch's transaction, the oldest events past the trail's
// bounds once the batch's own are counted; a batch that wrote no event drops none. So
// that most commits touch only the trail's newest page, the file may hold a sixteenth
// more than max (readers are shown the newest max, see Events) and is brought back to
// max when it holds more; the events past maxAge are looked for at most once in
// ageCheckEvery (readers are not shown them either).
func (w *txn) pruneEvents() error {
	if len(w.ov.ev.events) == 0 {
		return nil
	}
	ev := w.ev
	ev.mu.Lock()
	count, checked := ev.count, ev.ageChecked
	ev.mu.Unlock()
	count += len(w.ov.ev.events)
	now := ev.now()
	byAge := now.Sub(checked) >= ageCheckEvery
	if count <= ev.max+ev.max/16 && !byAge {
		return nil
	}
	n, err := dropEvents(w, count, ev.max, ev.maxAge, now, byAge)
	w.ov.ev.dropped = n
	if byAge {
		w.ov.ev.ageChecked = now
	}
	return err
}

// ageCheckEvery is how often the trail's writes look for events past their age.
const ageCheckEvery = time.Minute

// dropEvents drops from the file, which holds count events, the oldest past max and,
// when byAge, those older than maxAge; it returns how many it dropped.
func dropEvents(w *txn, count, max int, maxAge time.Duration, now time.Time, byAge bool) (int, error) {
	b := w.tx.Bucket(bucketEvents)
	if b == nil {
		return 0, nil
	}
	dropped := 0
	c := b.Cursor()
	for count-dropped > max {
		k, _ := c.First()
		if k == nil {
			break
		}
		if err := w.del(bucketEvents, slices.Clone(k)); err != nil {
			return 0, &storageError{Err: fmt.Errorf("drop the oldest event: %w", err)}
		}
		dropped++
	}
	if !byAge {
		return dropped, nil
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
			return 0, &storageError{Err: fmt.Errorf("drop an old event: %w", err)}
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
// f.Limit (device.MaxEventsPerCall), reading at most scanMax events, all from the file
// (every event shown is durable). A record that cannot be read is returned as an event
// of kind "unreadable" saying so, so that a consumer sees why a position is not what it
// expected. ctx is not waited on: a read waits for no writer.
func (l *Ledger) Events(_ context.Context, f device.EventFilter) (device.EventsResult, error) {
	limit := f.Limit
	if limit <= 0 || limit > device.MaxEventsPerCall {
		limit = device.MaxEventsPerCall
	}
	ev := l.ev
	cutoff := ev.now().Add(-ev.maxAge)
	// The trail's bounds hold for what is shown whether or not a write has dropped the
	// events past them yet (pruneEvents).
	// And only committed events: a commit whose fsync failed may have left its pages,
	// meta page included, where a read transaction finds them; its events were never
	// given their positions (applyEvents), and a later commit takes them.
	ev.mu.Lock()
	next := ev.next
	low := uint64(1)
	if next > uint64(ev.max) {
		low = next - uint64(ev.max)
	}
	ev.mu.Unlock()
	out := device.EventsResult{Through: f.After}
	scanned := 0
	err := l.read(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketEvents)
		if b == nil {
			return nil
		}
		c := b.Cursor()
		if k, _ := c.First(); len(k) == 8 {
			out.Oldest = max(binary.BigEndian.Uint64(k), low)
		}
		for k, v := c.Seek(seqKey(max(f.After+1, low))); k != nil; k, v = c.Next() {
			if len(out.Events) >= limit || scanned >= scanMax || binary.BigEndian.Uint64(k) >= next {
				break
			}
			scanned++
			e := decodeEvent(binary.BigEndian.Uint64(k), v)
			out.Through = e.Seq
			if (!e.Time.Before(cutoff) || e.Kind == "unreadable") && matchEvent(e, f) {
				out.Events = append(out.Events, e)
			}
		}
		return nil
	})
	if err != nil {
		return device.EventsResult{}, fmt.Errorf("read events from %s: %w", l.path, err)
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

// Refused records in the trail that the host refused a call of ctx's caller (call:
// "reserve", "release" or "reown") for err, e naming what it asked for, durably before
// it returns. Errors of the caller's own making (its context ended) and of the host's
// (internal, storage, closed) are not refusals and are not recorded; a flood is bounded
// (refusedPerSecond).
func (l *Ledger) Refused(ctx context.Context, call string, e device.Event, err error) {
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
	// Written before the refusal is answered, as a change's event is: bounded by the
	// caller's wait, not by whether it gave up meanwhile.
	_, werr := l.submit(context.WithoutCancel(ctx), func(w *txn) (any, error) { return nil, w.event(e) })
	if werr != nil && !errors.Is(werr, ErrClosed) {
		l.log.Warn("a refusal could not be written to the audit trail", "call", call, "error", werr.Error())
	}
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
