package ledger

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/internal/steps"
)

// maxBatch caps how many requests, and how many deferred writes, share one
// transaction, bounding its size.
const maxBatch = 256

// request is one write, queued for the leader to commit (see submit).
type request struct {
	ctx  context.Context
	run  func(w *txn) (any, error) // decides first, then writes; see txn
	done chan response             // buffered(1): the leader never blocks on it
	// leadGiven (under Ledger.wmu) says the lead was handed to this request's caller,
	// which then may not withdraw it.
	leadGiven bool
	// notify, set for a deferred write instead of done, gets the outcome: nil once the
	// write is durable. Called on the committing goroutine; it must not block.
	notify func(error)
}

// answer hands resp to whoever waits for req.
func (req *request) answer(resp response) {
	if req.notify != nil {
		req.notify(resp.err)
		return
	}
	req.done <- resp
}

type response struct {
	val any
	err error
	// lead, instead of an answer, hands the lead to the request's caller (see submit).
	lead bool
}

// storageError marks an error from bbolt itself inside a batch: it aborts the whole
// transaction, while any other error a request returns refuses only that request.
type storageError struct{ err error }

func (e *storageError) Error() string { return e.err.Error() }
func (e *storageError) Unwrap() error { return e.err }

// txn is what a request's run func sees: the batch's view of the reservations (the
// index plus the batch's earlier changes) and the bbolt transaction. A run func must
// make every decision before its first write, so a refused request leaves nothing
// behind; errors from the write helpers are storageErrors, which abort the batch.
type txn struct {
	tx *bolt.Tx
	ov *overlay
	ev *eventLog // the trail events are written to (event)
	// deferred says the request running is a deferred write, whose changes the change
	// feeds are not told of (overlay.feedChanges).
	deferred bool
	// dirty says the batch wrote something: a batch that did not is rolled back, no
	// commit (and no fsync) made for it.
	dirty bool
}

// put sets key of bucket (made when missing) to val in the transaction. put keeps key
// and val until the commit: the caller must not change them.
func (w *txn) put(bucket, key, val []byte) error {
	b, err := w.tx.CreateBucketIfNotExists(bucket)
	if err == nil {
		err = b.Put(key, val)
	}
	if err != nil {
		return err
	}
	w.dirty = true
	return nil
}

// del deletes key of bucket in the transaction; a bucket not there has nothing to
// delete. del keeps key until the commit.
func (w *txn) del(bucket, key []byte) error {
	b := w.tx.Bucket(bucket)
	if b == nil {
		return nil
	}
	if err := b.Delete(key); err != nil {
		return err
	}
	w.dirty = true
	return nil
}

// changed notes id as changed by the request running, for the change feeds.
func (w *txn) changed(id string) {
	if !w.deferred {
		w.ov.told[id] = struct{}{}
	}
}

func (w *txn) get(id string) *device.Reservation { return w.ov.get(id) }
func (w *txn) holder(dev string) string          { return w.ov.holder(dev) }
func (w *txn) usedOf(k counterKey) int64         { return w.ov.usedOf(k) }
func (w *txn) usersOf(k counterKey) []string     { return w.ov.usersOf(k) }

// putReservation stores r (never modified afterwards) in the file and the batch view.
func (w *txn) putReservation(r *device.Reservation) error {
	v, err := encodeReservation(r)
	if err != nil {
		return &storageError{err}
	}
	if err := w.put(bucketReservations, []byte(r.ID), v); err != nil {
		return &storageError{fmt.Errorf("store reservation %q: %w", r.ID, err)}
	}
	// The reservation's record supersedes its intent, whatever the write (its answer,
	// its release, a take-over): both go in the same commit.
	if w.ov.isIntent(r.ID) {
		if err := w.deleteIntentKey(r.ID); err != nil {
			return err
		}
	}
	w.ov.put(r)
	w.changed(r.ID)
	return nil
}

func (w *txn) deleteReservation(id string) error {
	if w.ov.isIntent(id) {
		if err := w.deleteIntentKey(id); err != nil {
			return err
		}
	}
	if err := w.del(bucketReservations, []byte(id)); err != nil {
		return &storageError{fmt.Errorf("delete reservation %q: %w", id, err)}
	}
	w.ov.drop(id)
	w.changed(id)
	return nil
}

func (w *txn) putReattach(plugin string, data []byte) error {
	if err := w.put(bucketReattach, []byte(plugin), seal(data)); err != nil {
		return &storageError{fmt.Errorf("store reattach data of plugin %q: %w", plugin, err)}
	}
	return nil
}

func (w *txn) deleteReattach(plugin string) error {
	if err := w.del(bucketReattach, []byte(plugin)); err != nil {
		return &storageError{fmt.Errorf("delete reattach data of plugin %q: %w", plugin, err)}
	}
	return nil
}

// read runs fn in a read-only transaction of the state file: the state of the last
// commit, which holds every write acknowledged (a write is answered only once its
// commit is durable). It waits for no writer. fn must not write.
func (l *Ledger) read(fn func(tx *bolt.Tx) error) error {
	err := l.db.View(fn)
	if errors.Is(err, berrors.ErrDatabaseNotOpen) {
		return ErrClosed
	}
	return err
}

// maxQueued bounds the requests accepted and not yet taken into a batch: a caller past
// it waits (bounded by its context) for room.
const maxQueued = 4 * maxBatch

// submit queues run and waits for its durable result. ctx bounds only the wait to be
// accepted and, once queued, the wait for a batch to take it: a request withdrawn
// when ctx ends was never applied; one taken into a batch is answered when its commit
// is durable or has failed (see Ledger).
//
// Group commit without a writer goroutine: the first caller to find no commit running
// leads. It commits the queue (its own request and whatever queued meanwhile, up to
// maxBatch, with the deferred writes waiting) on its own goroutine, and again while more
// queue up, until its own request is answered; it then hands the lead to the oldest
// request still queued, or stops leading when none is. A lone Reserve so makes its
// commit itself: no hand-off to a writer and back, two goroutine switches (and the
// thread wake-ups behind them) saved on every write.
func (l *Ledger) submit(ctx context.Context, run func(w *txn) (any, error)) (any, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	select {
	case l.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-l.quit:
		return nil, ErrClosed
	}
	req := &request{ctx: ctx, run: run, done: make(chan response, 1)}
	l.wmu.Lock()
	if l.closed {
		l.wmu.Unlock()
		<-l.slots
		return nil, ErrClosed
	}
	l.queue = append(l.queue, req)
	lead := !l.leading
	l.leading = true
	l.wmu.Unlock()
	if lead {
		l.lead(req)
	}
	wait := ctx.Done()
	for {
		select {
		case resp := <-req.done:
			if resp.lead { // handed the lead while still queued
				l.lead(req)
				continue
			}
			return resp.val, resp.err
		case <-wait:
			// Still queued (not in a batch, not handed the lead): withdrawn, never applied.
			l.wmu.Lock()
			if i := slices.Index(l.queue, req); i >= 0 && !req.leadGiven {
				l.queue = slices.Delete(l.queue, i, i+1)
				l.wmu.Unlock()
				<-l.slots
				return nil, ctx.Err()
			}
			l.wmu.Unlock()
			wait = nil // taken: its answer comes
		}
	}
}

// lead commits batches while this goroutine holds the lead (l.leading, set by whoever
// gave it): until own is answered (nil: one round, for due deferred writes), then hands
// the lead on (see submit). Only the leader touches the file and the index.
func (l *Ledger) lead(own *request) {
	batch := make([]*request, 0, maxBatch)
	answered := own == nil
	for {
		l.wmu.Lock()
		n := min(len(l.queue), maxBatch)
		batch = append(batch[:0], l.queue[:n]...)
		clear(l.queue[:n])
		l.queue = l.queue[n:]
		if len(l.queue) == 0 {
			l.queue = l.queueBuf // reuse the array from its start
		}
		l.kicked = false
		l.wmu.Unlock()
		for range n {
			<-l.slots
		}
		answered = answered || slices.Contains(batch, own)
		if d := l.takeDueDeferred(); len(d) > 0 {
			batch = append(d, batch...)
		}
		if len(batch) > 0 {
			l.commit(batch, own)
		}
		clear(batch) // drop references to answered requests
		l.armDeferred()
		l.wmu.Lock()
		switch {
		case !answered:
			l.wmu.Unlock()
			continue
		case len(l.queue) > 0:
			// Under wmu, so that next's caller cannot withdraw it meanwhile; the send
			// never blocks: next is queued, so unanswered, and done is buffered.
			next := l.queue[0]
			next.leadGiven = true
			next.done <- response{lead: true}
			l.wmu.Unlock()
			return
		default:
			// Deferred writes fell due meanwhile: the timer's goroutine commits them, not
			// this caller, whose own write is done.
			kicked := l.kicked
			l.kicked = false
			l.leading = false
			l.idle.Broadcast()
			l.wmu.Unlock()
			if kicked {
				l.deferTimer.Reset(0)
			}
			return
		}
	}
}

// submitDeferred queues run as a deferred write: once it is due, within after it was
// queued (at once while maxBatch or more are waiting), it is applied, in the order
// deferred writes were queued and ahead of the other requests, in the next batch a
// leader commits, or committed on its own when no leader is committing then. It never
// blocks. notify gets the outcome on the committing goroutine (nil once durable), or
// ErrClosed at once, on the caller's goroutine, when the ledger is closed; it must not
// block.
//
// Deferred writes are for bookkeeping whose loss in a crash is harmless because it is
// redone (the GC's cleanup-done marks and deletions): they save commits, and their
// fsyncs, by riding together on a commit made for other writes. They wait until due
// rather than ride on the next commit, so that a busy host's Reserves do not each
// carry the previous Release's bookkeeping: one commit in CommitDelay carries it all.
func (l *Ledger) submitDeferred(within time.Duration, run func(w *txn) (any, error), notify func(error)) {
	req := &request{ctx: context.Background(), run: run, notify: notify}
	at := time.Now().Add(within)
	l.deferMu.Lock()
	if l.deferClosed {
		l.deferMu.Unlock()
		notify(ErrClosed)
		return
	}
	if len(l.deferred) == 0 || at.Before(l.deferDue) {
		l.deferDue = at
	}
	l.deferred = append(l.deferred, req)
	if len(l.deferred) >= maxBatch {
		l.deferDue = time.Time{} // a full batch waits no longer
	}
	l.armLocked()
	l.deferMu.Unlock()
}

// takeDueDeferred is takeDeferred once the oldest deferred write is due (or a full
// batch waits): until then they wait, so that a caller's commit carries none of them.
func (l *Ledger) takeDueDeferred() []*request {
	l.deferMu.Lock()
	due := len(l.deferred) > 0 && !time.Now().Before(l.deferDue)
	l.deferMu.Unlock()
	if !due {
		return nil
	}
	return l.takeDeferred()
}

// takeDeferred removes and returns up to maxBatch deferred writes, oldest first; those
// left over (a full batch waiting) are due at once.
func (l *Ledger) takeDeferred() []*request {
	l.deferMu.Lock()
	defer l.deferMu.Unlock()
	n := min(len(l.deferred), maxBatch)
	if n == 0 {
		return nil
	}
	out := slices.Clone(l.deferred[:n])
	l.deferred = slices.Delete(l.deferred, 0, n)
	if len(l.deferred) > 0 {
		l.deferDue = time.Time{}
	}
	return out
}

// armDeferred sets the timer to fire when the oldest deferred write is due, or stops it
// when none is waiting.
func (l *Ledger) armDeferred() {
	l.deferMu.Lock()
	defer l.deferMu.Unlock()
	l.armLocked()
}

// armLocked is armDeferred under deferMu.
func (l *Ledger) armLocked() {
	if len(l.deferred) == 0 {
		l.deferTimer.Stop()
		return
	}
	l.deferTimer.Reset(max(time.Until(l.deferDue), 0))
}

// deferredDue runs when the oldest deferred write is due (the timer's goroutine): it
// commits the deferred writes, leading itself when no one leads, or tells the leader
// to make one more round.
func (l *Ledger) deferredDue() {
	l.wmu.Lock()
	if l.closed {
		l.wmu.Unlock()
		return
	}
	if l.leading {
		l.kicked = true
		l.wmu.Unlock()
		return
	}
	l.leading = true
	l.wmu.Unlock()
	l.lead(nil)
}

// stopWrites refuses new requests, waits for the leader to answer those accepted,
// then commits the deferred writes still waiting (see Close).
func (l *Ledger) stopWrites() {
	l.wmu.Lock()
	l.closed = true
	for l.leading {
		l.idle.Wait()
	}
	l.wmu.Unlock()
	l.deferMu.Lock()
	l.deferClosed = true
	l.deferTimer.Stop()
	l.deferMu.Unlock()
	for d := l.takeDeferred(); len(d) > 0; d = l.takeDeferred() {
		l.commit(d, nil)
	}
}

// commit runs batch in one transaction and answers every request. When the transaction
// fails, each request is retried in a transaction of its own, so one request's storage
// failure does not fail the others.
//
// The deferred writes' notify funcs, which wake their writer (the GC) and which no
// caller waits for, run after the reply of leader's call (device.AfterReply; leader is
// the request whose caller leads the commit, nil for the deferred writes' timer).
func (l *Ledger) commit(batch []*request, leader *request) {
	start := time.Now()
	resps, ov, wrote, err := l.runBatch(batch)
	took := time.Since(start)
	if err != nil && len(batch) > 1 {
		for _, req := range batch {
			l.commit([]*request{req}, leader)
		}
		return
	}
	if err != nil {
		batch[0].answer(response{err: fmt.Errorf("state file %s: commit: %w", l.path, err)})
		return
	}
	l.applyEvents(ov.ev)
	if wrote {
		l.commits.Add(1)
		if l.onCommit != nil {
			l.onCommit(took, len(batch))
		}
	}
	// Where the work no caller waits for goes: after the reply of the leader's call
	// (device.AfterReply), or at once for the deferred writes' timer.
	ctx := context.Background()
	if leader != nil {
		ctx = leader.ctx
	}
	if len(ov.recs) > 0 {
		region := steps.Start(traceContext(batch), "ledger: index")
		told := ov.feedChanges()
		l.mu.Lock()
		l.idx.apply(ov)
		total := l.idx.counts().Total
		l.mu.Unlock()
		l.notify(ctx, told, total)
		region.End()
	}
	var notify []func()
	for i, req := range batch {
		if req.notify != nil {
			n, err := req.notify, resps[i].err
			notify = append(notify, func() { n(err) })
			continue
		}
		req.answer(resps[i])
	}
	if len(notify) > 0 {
		device.AfterReply(ctx, func() {
			for _, n := range notify {
				n()
			}
		})
	}
}

// runBatch runs batch in one bbolt transaction and commits it; wrote says whether it
// wrote anything (a batch whose requests were all refused, or wrote nothing, is rolled
// back: no commit, no fsync).
//
// Its steps are runtime/trace regions in the task of the batch's first caller (deferred
// writes have none): "ledger: begin" (bbolt's Begin: the file's write lock), "ledger:
// apply" (the requests' decisions and writes) and "ledger: bolt commit" (bbolt's Commit, its
// fdatasyncs included); commit marks "ledger: index".
func (l *Ledger) runBatch(batch []*request) (resps []response, ov *overlay, wrote bool, err error) {
	resps = make([]response, len(batch))
	ov = newOverlay(l.idx) // only the leader writes l.idx, so reading it unlocked is safe
	ctx := traceContext(batch)
	region := steps.Start(ctx, "ledger: begin")
	tx, err := l.db.Begin(true)
	region.End()
	if err != nil {
		return nil, nil, false, err
	}
	region = steps.Start(ctx, "ledger: apply")
	w := &txn{tx: tx, ov: ov, ev: l.ev}
	for i, req := range batch {
		if err := req.ctx.Err(); err != nil {
			resps[i].err = err
			continue
		}
		w.deferred = req.notify != nil
		val, err := req.run(w)
		if se := (*storageError)(nil); errors.As(err, &se) {
			region.End()
			_ = tx.Rollback()
			return nil, nil, false, se.err
		}
		resps[i] = response{val: val, err: err}
	}
	if err := w.pruneEvents(); err != nil {
		region.End()
		_ = tx.Rollback()
		return nil, nil, false, err
	}
	region.End()
	if !w.dirty {
		_ = tx.Rollback()
		return resps, ov, false, nil
	}
	region = steps.Start(ctx, "ledger: bolt commit")
	err = tx.Commit() // bbolt rolls back a commit that fails
	region.End()
	if err != nil {
		return nil, nil, false, err
	}
	return resps, ov, true, nil
}

// traceContext is the context of batch's first caller, whose trace task the batch's
// regions go into; Background when the batch holds only deferred writes.
func traceContext(batch []*request) context.Context {
	for _, req := range batch {
		if req.notify == nil {
			return req.ctx
		}
	}
	return context.Background()
}
