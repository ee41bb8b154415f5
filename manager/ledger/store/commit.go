package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/internal/steps"
)

// CommitConfig configures a Committer. B is the state one batch's requests share (the
// ledger's view of its reservations over the batch's transaction).
type CommitConfig[B any] struct {
	// Begin makes a batch's state over its write transaction.
	Begin func(tx *bolt.Tx) B
	// End runs after the batch's requests, before the commit: whether the batch wrote
	// anything (one that did not is rolled back), or a *StorageError that fails it.
	End func(b B) (wrote bool, err error)
	// Committed, when set, runs once a batch is durable, before its requests are
	// answered, on the committing goroutine: ctx is the leading caller's (for work to
	// run after its reply), trace the task the batch's regions go into.
	Committed func(ctx, trace context.Context, b B)
	// OnCommit, when set, is called after every batch that wrote, with how long it took,
	// fsyncs included, and how many writes shared it. It must be quick: every write
	// waits for it.
	OnCommit func(took time.Duration, writes int)
	// AfterReply, when set, runs fn once the reply of ctx's call is sent (or at once),
	// for the deferred writes' notify funcs. Nil runs them at once.
	AfterReply func(ctx context.Context, fn func())
	// Closed is the error of a write submitted after Close.
	Closed error
}

// Committer group-commits writes into the bbolt file db: each batch of requests is one
// transaction, committed (fsynced) before any request in it is answered. Its methods are
// safe for concurrent use. No goroutine runs while it is idle: the callers lead the
// commits (see Submit), and a timer the deferred writes (see SubmitDeferred).
type Committer[B any] struct {
	db   *bolt.DB
	path string
	cfg  CommitConfig[B]

	quit      chan struct{} // closed by Close
	closeOnce sync.Once
	commits   atomic.Int64 // batches that wrote

	// wmu guards the queue and the lead.
	wmu      sync.Mutex
	queue    []*request[B] // accepted, not yet taken into a batch; oldest first
	queueBuf []*request[B] // the queue's array, reused whenever it empties
	leading  bool          // a goroutine leads: commits the queue; it alone writes the file
	kicked   bool          // deferred writes are due: the leader makes one more round
	closed   bool          // Close has begun: no more requests
	idle     *sync.Cond    // on wmu: broadcast when leading ends
	slots    chan struct{} // one per accepted request until a batch takes it: at most maxQueued

	deferMu     sync.Mutex
	deferred    []*request[B] // deferred writes, oldest first (see SubmitDeferred)
	deferDue    time.Time     // when the oldest must be committed; zero: at once
	deferClosed bool          // Close has stopped taking deferred writes
	deferTimer  *time.Timer   // fires (deferredDue) when the oldest deferred write is due
}

// NewCommitter returns a Committer of the open file db at path.
func NewCommitter[B any](db *bolt.DB, path string, cfg CommitConfig[B]) *Committer[B] {
	l := &Committer[B]{
		db: db, path: path, cfg: cfg,
		quit:     make(chan struct{}),
		queueBuf: make([]*request[B], 0, maxQueued),
		slots:    make(chan struct{}, maxQueued),
	}
	l.queue = l.queueBuf
	l.idle = sync.NewCond(&l.wmu)
	l.deferTimer = time.AfterFunc(time.Hour, l.deferredDue)
	l.deferTimer.Stop()
	return l
}

// Queued returns how many requests wait for a batch to take them.
func (l *Committer[B]) Queued() int {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	return len(l.queue)
}

// Waiting returns how many deferred writes wait for a commit.
func (l *Committer[B]) Waiting() int {
	l.deferMu.Lock()
	defer l.deferMu.Unlock()
	return len(l.deferred)
}

// Commits returns how many batches that wrote were committed.
func (l *Committer[B]) Commits() int64 { return l.commits.Load() }

// Close refuses later writes with Config.Closed, waits until the requests accepted are
// answered, and commits the deferred writes waiting. It does not close the file. It is
// idempotent.
func (l *Committer[B]) Close() {
	l.closeOnce.Do(func() {
		close(l.quit)
		l.stopWrites()
	})
}

// MaxBatch caps how many requests, and how many deferred writes, share one
// transaction, bounding its size.
const MaxBatch = 256

// request is one write, queued for the leader to commit (see Submit).
type request[B any] struct {
	ctx  context.Context
	run  func(b B) (any, error) // decides first, then writes
	done chan response          // buffered(1): the leader never blocks on it
	// leadGiven (under Committer.wmu) says the lead was handed to this request's caller,
	// which then may not withdraw it.
	leadGiven bool
	// notify, set for a deferred write instead of done, gets the outcome: nil once the
	// write is durable. Called on the committing goroutine; it must not block.
	notify func(error)
}

// answer hands resp to whoever waits for req.
func (req *request[B]) answer(resp response) {
	if req.notify != nil {
		req.notify(resp.err)
		return
	}
	req.done <- resp
}

type response struct {
	val any
	err error
	// lead, instead of an answer, hands the lead to the request's caller (see Submit).
	lead bool
}

// StorageError marks an error from bbolt itself inside a batch: it aborts the whole
// transaction, while any other error a request returns refuses only that request.
type StorageError struct{ Err error }

func (e *StorageError) Error() string { return e.Err.Error() }
func (e *StorageError) Unwrap() error { return e.Err }

// maxQueued bounds the requests accepted and not yet taken into a batch: a caller past
// it waits (bounded by its context) for room.
const maxQueued = 4 * MaxBatch

// Submit queues run and waits for its durable result. ctx bounds only the wait to be
// accepted and, once queued, the wait for a batch to take it: a request withdrawn
// when ctx ends was never applied; one taken into a batch is answered when its commit
// is durable or has failed.
//
// Group commit without a writer goroutine: the first caller to find no commit running
// leads. It commits the queue (its own request and whatever queued meanwhile, up to
// MaxBatch, with the deferred writes waiting) on its own goroutine, and again while more
// queue up, until its own request is answered; it then hands the lead to the oldest
// request still queued, or stops leading when none is. A lone Reserve so makes its
// commit itself: no hand-off to a writer and back, two goroutine switches (and the
// thread wake-ups behind them) saved on every write.
func (l *Committer[B]) Submit(ctx context.Context, run func(b B) (any, error)) (any, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	select {
	case l.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-l.quit:
		return nil, l.cfg.Closed
	}
	req := &request[B]{ctx: ctx, run: run, done: make(chan response, 1)}
	l.wmu.Lock()
	if l.closed {
		l.wmu.Unlock()
		<-l.slots
		return nil, l.cfg.Closed
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
// the lead on (see Submit). Only the leader writes the file.
func (l *Committer[B]) lead(own *request[B]) {
	batch := make([]*request[B], 0, MaxBatch)
	answered := own == nil
	for {
		l.wmu.Lock()
		n := min(len(l.queue), MaxBatch)
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
// queued (at once while MaxBatch or more are waiting), it is applied, in the order
// deferred writes were queued and ahead of the other requests, in the next batch a
// leader commits, or committed on its own when no leader is committing then. It never
// blocks. notify gets the outcome on the committing goroutine (nil once durable), or
// l.cfg.Closed at once, on the caller's goroutine, when the ledger is closed; it must not
// block.
//
// Deferred writes are for bookkeeping whose loss in a crash is harmless because it is
// redone (the GC's cleanup-done marks and deletions): they save commits, and their
// fsyncs, by riding together on a commit made for other writes. They wait until due
// rather than ride on the next commit, so that a busy host's Reserves do not each
// carry the previous Release's bookkeeping: one commit in CommitDelay carries it all.
func (l *Committer[B]) SubmitDeferred(within time.Duration, run func(b B) (any, error), notify func(error)) {
	req := &request[B]{ctx: context.Background(), run: run, notify: notify}
	at := time.Now().Add(within)
	l.deferMu.Lock()
	if l.deferClosed {
		l.deferMu.Unlock()
		notify(l.cfg.Closed)
		return
	}
	if len(l.deferred) == 0 || at.Before(l.deferDue) {
		l.deferDue = at
	}
	l.deferred = append(l.deferred, req)
	if len(l.deferred) >= MaxBatch {
		l.deferDue = time.Time{} // a full batch waits no longer
	}
	l.armLocked()
	l.deferMu.Unlock()
}

// takeDueDeferred is takeDeferred once the oldest deferred write is due (or a full
// batch waits): until then they wait, so that a caller's commit carries none of them.
func (l *Committer[B]) takeDueDeferred() []*request[B] {
	l.deferMu.Lock()
	due := len(l.deferred) > 0 && !time.Now().Before(l.deferDue)
	l.deferMu.Unlock()
	if !due {
		return nil
	}
	return l.takeDeferred()
}

// takeDeferred removes and returns up to MaxBatch deferred writes, oldest first; those
// left over (a full batch waiting) are due at once.
func (l *Committer[B]) takeDeferred() []*request[B] {
	l.deferMu.Lock()
	defer l.deferMu.Unlock()
	n := min(len(l.deferred), MaxBatch)
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
func (l *Committer[B]) armDeferred() {
	l.deferMu.Lock()
	defer l.deferMu.Unlock()
	l.armLocked()
}

// armLocked is armDeferred under deferMu.
func (l *Committer[B]) armLocked() {
	if len(l.deferred) == 0 {
		l.deferTimer.Stop()
		return
	}
	l.deferTimer.Reset(max(time.Until(l.deferDue), 0))
}

// deferredDue runs when the oldest deferred write is due (the timer's goroutine): it
// commits the deferred writes, leading itself when no one leads, or tells the leader
// to make one more round.
func (l *Committer[B]) deferredDue() {
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
func (l *Committer[B]) stopWrites() {
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
// The deferred writes' notify funcs, which wake their writer and which no caller waits
// for, run after the reply of leader's call (Config.AfterReply; leader is the request
// whose caller leads the commit, nil for the deferred writes' timer).
func (l *Committer[B]) commit(batch []*request[B], leader *request[B]) {
	start := time.Now()
	resps, b, wrote, err := l.runBatch(batch)
	took := time.Since(start)
	if err != nil && len(batch) > 1 {
		for _, req := range batch {
			l.commit([]*request[B]{req}, leader)
		}
		return
	}
	if err != nil {
		batch[0].answer(response{err: fmt.Errorf("state file %s: commit: %w", l.path, err)})
		return
	}
	if wrote {
		l.commits.Add(1)
		if l.cfg.OnCommit != nil {
			l.cfg.OnCommit(took, len(batch))
		}
	}
	// Where the work no caller waits for goes: after the reply of the leader's call, or
	// at once for the deferred writes' timer.
	ctx := context.Background()
	if leader != nil {
		ctx = leader.ctx
	}
	if l.cfg.Committed != nil {
		l.cfg.Committed(ctx, traceContext(batch), b)
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
		l.afterReply(ctx, func() {
			for _, n := range notify {
				n()
			}
		})
	}
}

// afterReply runs fn after the reply of ctx's call (Config.AfterReply), or at once.
func (l *Committer[B]) afterReply(ctx context.Context, fn func()) {
	if l.cfg.AfterReply == nil {
		fn()
		return
	}
	l.cfg.AfterReply(ctx, fn)
}

// runBatch runs batch in one bbolt transaction and commits it; wrote says whether it
// wrote anything (a batch whose requests were all refused, or wrote nothing, is rolled
// back: no commit, no fsync).
//
// Its steps are runtime/trace regions in the task of the batch's first caller (deferred
// writes have none): "ledger: begin" (bbolt's Begin: the file's write lock), "ledger:
// apply" (the requests' decisions and writes, and Config.End) and "ledger: bolt commit"
// (bbolt's Commit, its fdatasyncs included).
func (l *Committer[B]) runBatch(batch []*request[B]) (resps []response, b B, wrote bool, err error) {
	resps = make([]response, len(batch))
	ctx := traceContext(batch)
	region := steps.Start(ctx, "ledger: begin")
	tx, err := l.db.Begin(true)
	region.End()
	if err != nil {
		return nil, b, false, err
	}
	region = steps.Start(ctx, "ledger: apply")
	b = l.cfg.Begin(tx)
	for i, req := range batch {
		if err := req.ctx.Err(); err != nil {
			resps[i].err = err
			continue
		}
		val, err := req.run(b)
		if se := (*StorageError)(nil); errors.As(err, &se) {
			region.End()
			_ = tx.Rollback()
			return nil, b, false, se.Err
		}
		resps[i] = response{val: val, err: err}
	}
	wrote, err = l.cfg.End(b)
	region.End()
	if err != nil || !wrote {
		_ = tx.Rollback()
		if se := (*StorageError)(nil); errors.As(err, &se) {
			err = se.Err
		}
		return resps, b, false, err
	}
	region = steps.Start(ctx, "ledger: bolt commit")
	err = tx.Commit() // bbolt rolls back a commit that fails
	region.End()
	if err != nil {
		return nil, b, false, err
	}
	return resps, b, true, nil
}

// traceContext is the context of batch's first caller, whose trace task the batch's
// regions go into; Background when the batch holds only deferred writes.
func traceContext[B any](batch []*request[B]) context.Context {
	for _, req := range batch {
		if req.notify == nil {
			return req.ctx
		}
	}
	return context.Background()
}
