package ledger

import (
	"sync"
	"time"

	"github.com/devicehost/devicehost/device"
)

// What the garbage collector (manager/gc) asks of the ledger: a feed of the released
// reservations that change, the records as the ledger holds them, and its bookkeeping
// (a cleanup recorded done, a deletion) as deferred writes.

// Feed is one subscriber's view of the commits: the IDs of the reservations that
// changed since it last drained them, and a coalesced wake-up. It never blocks a
// commit.
type Feed struct {
	wake chan struct{} // buffered(1)
	over int           // also woken after a commit that leaves more reservations than this (0: never)
	mu   sync.Mutex
	ids  map[string]struct{}
}

// Wake is told (a coalesced wake-up) after each commit the feed is told of.
func (f *Feed) Wake() <-chan struct{} { return f.wake }

// Drain returns the IDs changed since the last Drain, in no order.
func (f *Feed) Drain() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]string, 0, len(f.ids))
	for id := range f.ids {
		out = append(out, id)
	}
	clear(f.ids)
	return out
}

// Subscribe returns a feed told, after every commit that changed released reservations,
// which ones changed (once the index shows the change), and a func that ends the
// subscription. A change is a reservation released, deleted or changed while released;
// a live reservation's making or changing is not told (overlay.feedChanges), but when
// over > 0 the feed is also woken, with nothing to drain, after every commit that leaves
// more than over reservations in the ledger (the GC's MaxReservations).
func (l *Ledger) Subscribe(over int) (*Feed, func()) {
	f := &Feed{wake: make(chan struct{}, 1), over: over, ids: make(map[string]struct{})}
	l.subMu.Lock()
	l.subs[f] = struct{}{}
	l.subMu.Unlock()
	return f, func() {
		l.subMu.Lock()
		delete(l.subs, f)
		l.subMu.Unlock()
	}
}

// ReleasedIDs returns the IDs of every released reservation.
func (l *Ledger) ReleasedIDs() []string {
	l.mu.RLock()
	defer l.mu.RUnlock()
	out := make([]string, 0, len(l.idx.released))
	for _, rr := range l.idx.released {
		out = append(out, rr.id)
	}
	return out
}

// Lookup returns reservation id as the ledger holds it now (intents included), nil when
// it has none. A live one is the index's own record, shared: the caller must not
// modify it; a released one is unpacked afresh.
func (l *Ledger) Lookup(id string) *device.Reservation {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.idx.get(id)
}

// LookupAll is Lookup of each of ids, read at one instant.
func (l *Ledger) LookupAll(ids []string) []*device.Reservation {
	out := make([]*device.Reservation, len(ids))
	l.mu.RLock()
	defer l.mu.RUnlock()
	for i, id := range ids {
		out[i] = l.idx.get(id)
	}
	return out
}

// CountsHolding returns Counts and how many of ids the ledger holds, read at one
// instant.
func (l *Ledger) CountsHolding(ids []string) (Counts, int) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	n := 0
	for _, id := range ids {
		if l.idx.has(id) {
			n++
		}
	}
	return l.idx.counts(), n
}

// DeferCleanupDone records the plugin cleanup of released reservation id as done, as a
// deferred write (committed within after, riding with others; see writer.go): for
// bookkeeping whose loss in a crash only makes the cleanup run again. notify gets the
// outcome, after the reply of the call whose commit carried it; it must not block.
func (l *Ledger) DeferCleanupDone(within time.Duration, id string, notify func(error)) {
	l.submitDeferred(within, cleanupDoneRun(id), notify)
}

// DeferDelete deletes released reservation id (its cleanup done, or done by this
// write when cleaned), by by, as a deferred write (see DeferCleanupDone).
func (l *Ledger) DeferDelete(within time.Duration, id string, cleaned bool, by string, notify func(error)) {
	l.submitDeferred(within, deleteRun([]string{id}, cleaned, by), notify)
}

// DeferredWaiting returns how many deferred writes wait for a commit.
func (l *Ledger) DeferredWaiting() int { return l.cm.Waiting() }
