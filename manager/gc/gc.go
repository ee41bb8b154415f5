// Package gc is the garbage collector of the reservation ledger: it runs the plugin
// cleanup owed for each released reservation (the manager's cleanup, Config.Cleanup),
// retries it with backoff, and deletes released reservations past the ledger's bound or
// age, recording each step in the ledger as a deferred write. See docs/reservations.md.
package gc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/backoff"
	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger"
	"github.com/devicehost/devicehost/manager/ledger/store"
)

// GC defaults, used for zero Config fields.
const (
	DefaultMaxReservations = 1000
	DefaultInterval        = time.Minute
	DefaultParallel        = 2
	DefaultCleanupTimeout  = 10 * time.Second
	DefaultRetryMin        = time.Second
	DefaultRetryMax        = 5 * time.Minute
	DefaultCommitDelay     = 100 * time.Millisecond
)

// Entry is a released reservation as the GC hands it to the cleanup func: everything
// the plugin cleanup needs, so no lookup is needed.
type Entry struct {
	ReservationID  string
	OwnerID        string
	Plugin         string
	Group          device.GroupKey
	DeviceIDs      []string // the caller's to keep
	ReleasedAt     time.Time
	CleanupPending bool // the plugin cleanup is still owed
	Attempt        int  // 1 for the first cleanup attempt, 2 for the first retry...
}

// Config configures a GC. Zero fields take the defaults named; negative ones are an
// error.
type Config struct {
	// Logger gets "marked for GC" (INFO, once per released reservation), the over-the-
	// limit skip (INFO, once per change of the count), failed cleanups (WARN, each
	// attempt) and each deletion (DEBUG). Nil means no logging.
	Logger hclog.Logger
	// Cleanup undoes a released reservation on the plugin side. It gets a context with
	// CleanupTimeout; an error leaves the cleanup pending, to be retried with backoff.
	// It must be idempotent: its success is recorded in a later commit (see
	// CommitDelay), and a cleanup whose success was not yet recorded when the agent
	// stopped or crashed runs again. It may be called from several goroutines at once (at
	// most Parallel). Nil means there is nothing to clean up: releases are recorded as
	// cleaned at once.
	Cleanup func(ctx context.Context, e Entry) error
	// MaxReservations: when the ledger holds more reservations than this (live and
	// released), the oldest released ones are destroyed until it holds
	// MaxReservations less a sixteenth of it (rounded down; see gcLowWater). Zero means
	// DefaultMaxReservations.
	MaxReservations int
	// Interval: every Interval, the released reservations released at least Interval
	// ago are destroyed, so a released reservation stays listed between one and two
	// intervals when the limit is not reached. Zero means DefaultInterval.
	Interval time.Duration
	// Parallel bounds how many plugin cleanups run at once, so that releasing thousands
	// at once causes no spike. Zero means DefaultParallel.
	Parallel int
	// CleanupTimeout bounds each Cleanup call. Zero means DefaultCleanupTimeout.
	CleanupTimeout time.Duration
	// RetryMin and RetryMax bound the backoff between attempts for one reservation:
	// RetryMin after the first failure, doubling up to RetryMax, with ±20% jitter.
	// Zero means DefaultRetryMin and DefaultRetryMax.
	RetryMin, RetryMax time.Duration
	// CommitDelay is how long the GC's own ledger writes (a cleanup recorded done, a
	// released reservation deleted) wait, to share one commit with each other and with
	// other writes. Zero means DefaultCommitDelay.
	CommitDelay time.Duration
}

// GC cleans up after released reservations and garbage-collects them from a ledger.
//
// A released reservation is "marked for GC" when the GC first sees it. Its plugin
// cleanup is attempted as soon as it is marked; a failed cleanup stays pending in the
// ledger and is retried with exponential backoff, never dropped. A reservation is
// destroyed (cleanup if still pending, then deletion from the ledger) when the ledger
// holds more than MaxReservations reservations (oldest release first, down to its low
// water mark, gcLowWater) or on the Interval tick (those released at least Interval
// ago). At most Parallel plugin cleanups run at once.
//
// What the GC writes to the ledger (a cleanup done, a deletion) is deferred: after
// CommitDelay it rides on the next commit made for a Reserve or Release, or gets one of
// its own, all those due together, so a Reserve+Release cycle costs two commits, not
// three or four, and a Reserve waits for none of the GC's writes but once in a
// CommitDelay. A crash
// may lose such a write; nothing acknowledged is lost by it, since the cleanup is then
// still pending in the ledger and runs again (Cleanup must be idempotent), and the
// released reservation is still listed and is deleted again.
//
// The GC keeps what it needs incrementally: each ledger commit tells it which
// reservations changed, and it keeps the released ones in heaps by release time and by
// next retry, so its cost per change is O(log n) in the number of reservations.
//
// The retry schedule (attempt count, next attempt time) is kept in memory: a pending
// cleanup is in the ledger, so after a restart every pending cleanup is tried again at
// once (still Parallel at a time), with its backoff starting over.
//
// Run does the work; RetryNow may be called from any goroutine.
type GC struct {
	l       *ledger.Ledger
	cfg     Config
	log     hclog.Logger
	retry   chan struct{} // RetryNow's wake-up, coalesced
	running atomic.Bool

	// onPass, when set (by tests), is called by Run after each planning pass; tick says
	// whether the pass was due to the Interval tick.
	onPass func(tick bool)
}

// New returns a GC for l; nothing runs until Run.
func New(l *ledger.Ledger, cfg Config) (*GC, error) {
	switch {
	case cfg.MaxReservations < 0:
		return nil, fmt.Errorf("gc: MaxReservations %d is negative", cfg.MaxReservations)
	case cfg.Interval < 0:
		return nil, fmt.Errorf("gc: Interval %s is negative", cfg.Interval)
	case cfg.Parallel < 0:
		return nil, fmt.Errorf("gc: Parallel %d is negative", cfg.Parallel)
	case cfg.CleanupTimeout < 0, cfg.RetryMin < 0, cfg.RetryMax < 0:
		return nil, errors.New("gc: CleanupTimeout, RetryMin and RetryMax must not be negative")
	case cfg.CommitDelay < 0:
		return nil, fmt.Errorf("gc: CommitDelay %s is negative", cfg.CommitDelay)
	}
	cfg.MaxReservations = cmp.Or(cfg.MaxReservations, DefaultMaxReservations)
	cfg.Interval = cmp.Or(cfg.Interval, DefaultInterval)
	cfg.Parallel = cmp.Or(cfg.Parallel, DefaultParallel)
	cfg.CleanupTimeout = cmp.Or(cfg.CleanupTimeout, DefaultCleanupTimeout)
	cfg.RetryMin = cmp.Or(cfg.RetryMin, DefaultRetryMin)
	cfg.RetryMax = max(cmp.Or(cfg.RetryMax, DefaultRetryMax), cfg.RetryMin)
	cfg.CommitDelay = cmp.Or(cfg.CommitDelay, DefaultCommitDelay)
	log := cfg.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	return &GC{l: l, cfg: cfg, log: log, retry: make(chan struct{}, 1)}, nil
}

// RetryNow makes every pending cleanup due at once and wakes Run; the manager calls it
// when a plugin comes back, so cleanups owed to it need not wait out their backoff. It
// never blocks.
func (g *GC) RetryNow() {
	select {
	case g.retry <- struct{}{}:
	default:
	}
}

// maxCommitting bounds the GC's deferred writes waiting for a commit at once: a tick
// that destroys thousands writes them a batch at a time.
const maxCommitting = store.MaxBatch

// gcState is where a marked reservation is in the GC.
type gcState uint8

const (
	gcIdle       gcState = iota // in gcRun.clean or gcRun.pending: may get a job
	gcWaiting                   // in gcRun.waiting: its last attempt failed, backing off
	gcRunning                   // its plugin cleanup is running in a worker
	gcCommitting                // its deferred write (cleanup done, or deletion) awaits its commit
)

// gcItem is what Run remembers about one marked reservation: no more than it needs to
// order and schedule its jobs, since Run keeps one for every released reservation (the
// rest of the Entry a cleanup gets is read from the ledger when the job starts). Its
// one pointer comes first and the rest is scalars, so Go's garbage collector reads 8
// bytes of it.
type gcItem struct {
	id       string        // the reservation's ID (the ledger index's string)
	released int64         // its ReleasedAt, in Unix nanoseconds
	next     time.Duration // gcWaiting: no attempt before this long after gcRun.began
	epoch    uint64        // gcRun.retryEpoch when the job started
	pos      int           // its index in its heap
	attempts int32         // failed attempts in a row
	state    gcState
	heap     heapID // the heap it is in
	pending  bool   // its plugin cleanup is owed
	del      bool   // gcRunning, gcCommitting: the job deletes the reservation
	stale    bool   // the ledger changed it while its job ran: look again after
}

type gcResult struct {
	id    string
	err   error
	entry *Entry // the cleanup that ran (a worker's result); nil for a deferred write
	owner string // a deletion's owner, for its log line
}

// gcRun is the state of one Run call, owned by its goroutine except where noted.
type gcRun struct {
	*GC
	items   map[string]*gcItem // every marked reservation
	clean   itemHeap           // idle, cleanup done, oldest release first
	pending itemHeap           // idle, cleanup owed, oldest release first
	waiting itemHeap           // backing off, earliest next attempt first
	began   time.Time          // when Run began: gcItem.next counts from it

	running    int // items gcRunning (at most Parallel)
	committing int // items gcCommitting
	// deleting holds the items gcRunning or gcCommitting whose job deletes. A deletion
	// whose commit the index already shows, but whose result this goroutine has not
	// handled yet, is still in it: plan counts only those the index still holds.
	deleting  map[*gcItem]struct{}
	cutoff    time.Time // the last tick's: idle reservations released at or before it are destroyed
	lastSkipN int       // the count last logged as over the limit with nothing released; -1: none
	// retryEpoch counts RetryNow calls; a job started before the latest one that fails
	// is retried at once, since RetryNow came after it began.
	retryEpoch uint64

	spawn func(e Entry) // starts a worker running the plugin cleanup of e

	committedMu sync.Mutex    // guards committed; the goroutine committing deferred writes appends to it
	committed   []gcResult    // outcomes of deferred writes not yet handled
	commitWake  chan struct{} // buffered(1): committed grew
}

func newGCRun(g *GC) *gcRun {
	return &gcRun{
		GC:         g,
		items:      make(map[string]*gcItem),
		clean:      itemHeap{id: heapClean, less: releasedFirst},
		pending:    itemHeap{id: heapPending, less: releasedFirst},
		waiting:    itemHeap{id: heapWaiting, less: retryFirst},
		began:      time.Now(),
		lastSkipN:  -1,
		deleting:   make(map[*gcItem]struct{}),
		commitWake: make(chan struct{}, 1),
	}
}

func releasedFirst(a, b *gcItem) bool {
	return cmp.Or(cmp.Compare(a.released, b.released), cmp.Compare(a.id, b.id)) < 0
}

func retryFirst(a, b *gcItem) bool {
	if c := cmp.Compare(a.next, b.next); c != 0 {
		return c < 0
	}
	return releasedFirst(a, b)
}

// Run works until ctx ends, then waits for the cleanups it started (they get ctx, so a
// cleanup func that honours it returns promptly) and returns nil. It wakes on every
// ledger commit that changes released reservations or leaves more than MaxReservations,
// on the Interval tick, when a retry is due, when a cleanup ends or a deferred write
// commits, and on RetryNow. Run must not be called twice at once, and should end before
// the ledger is closed (deferred writes it queued are committed by then, or by Close).
func (g *GC) Run(ctx context.Context) error {
	if !g.running.CompareAndSwap(false, true) {
		return errors.New("gc: already running")
	}
	defer g.running.Store(false)

	changes, unsubscribe := g.l.Subscribe(g.cfg.MaxReservations)
	defer unsubscribe()
	ticker := time.NewTicker(g.cfg.Interval)
	defer ticker.Stop()
	retryTimer := time.NewTimer(time.Hour)
	retryTimer.Stop()
	defer retryTimer.Stop()

	r := newGCRun(g)
	results := make(chan gcResult, g.cfg.Parallel) // never more in flight, so workers never block
	var workers sync.WaitGroup
	defer workers.Wait()
	r.spawn = func(e Entry) {
		workers.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, g.cfg.CleanupTimeout)
			err := g.cfg.Cleanup(cctx, e)
			cancel()
			results <- gcResult{id: e.ReservationID, err: err, entry: &e}
		})
	}

	// Subscribed first, so a change made while the ledger is read here is seen again.
	r.sync(g.l.ReleasedIDs())
	dirty, tick := true, false
	for ctx.Err() == nil { // select may take a finished job over ctx.Done: start nothing after
		if dirty {
			now := time.Now()
			r.sync(changes.Drain())
			r.plan(now)
			if w := r.waiting.peek(); w != nil {
				retryTimer.Reset(w.next - now.Sub(r.began))
			} else {
				retryTimer.Stop()
			}
			if g.onPass != nil {
				g.onPass(tick)
			}
			dirty, tick = false, false
		}
		select {
		case <-ctx.Done():
			return nil // the deferred workers.Wait waits for the cleanups in flight
		case <-changes.Wake():
		case <-ticker.C:
			r.cutoff = time.Now().Add(-g.cfg.Interval)
			tick = true
		case <-retryTimer.C:
		case <-g.retry:
			r.retryEpoch++
			for w := r.waiting.peek(); w != nil; w = r.waiting.peek() {
				r.setIdle(w)
			}
		case res := <-results:
			r.cleaned(res, time.Now())
		case <-r.commitWake:
			r.committedMu.Lock()
			done := r.committed
			r.committed = nil
			r.committedMu.Unlock()
			now := time.Now()
			for _, res := range done {
				r.recorded(res, now)
			}
		}
		dirty = true
	}
	return nil
}

// sync brings the items named by ids up to date with the ledger, oldest release first
// (so "marked for GC" lines come in that order).
func (r *gcRun) sync(ids []string) {
	if len(ids) == 0 {
		return
	}
	type change struct {
		id  string
		rec *device.Reservation // nil: deleted
	}
	changes := make([]change, len(ids))
	for i, rec := range r.l.LookupAll(ids) {
		changes[i] = change{ids[i], rec}
	}
	slices.SortFunc(changes, func(a, b change) int {
		switch {
		case a.rec == nil && b.rec == nil:
			return cmp.Compare(a.id, b.id)
		case a.rec == nil: // the deleted first
			return -1
		case b.rec == nil:
			return 1
		}
		return cmp.Or(a.rec.ReleasedAt.Compare(b.rec.ReleasedAt), cmp.Compare(a.id, b.id))
	})
	for _, c := range changes {
		r.update(c.id, c.rec)
	}
}

// update brings item id up to date with rec, its record in the ledger (nil: none).
func (r *gcRun) update(id string, rec *device.Reservation) {
	it := r.items[id]
	if it != nil && (it.state == gcRunning || it.state == gcCommitting) {
		it.stale = true // its job decides on what it saw; looked at again when it ends
		return
	}
	switch {
	case rec == nil || rec.State != device.ReservationReleased:
		if it != nil { // deleted by someone else
			r.detach(it)
			delete(r.items, id)
		}
	case it == nil:
		it = &gcItem{id: rec.ID}
		it.set(rec)
		r.items[it.id] = it
		r.log.Info("marked for GC", "reservation_id", rec.ID, "owner_id", rec.OwnerID,
			"plugin", rec.Plugin, "released_at", rec.ReleasedAt)
		r.setIdle(it)
	default:
		st := it.state
		r.detach(it)
		it.set(rec)
		if st == gcWaiting {
			r.waiting.add(it)
		} else {
			r.setIdle(it)
		}
	}
}

// recheck updates it from the ledger if the ledger changed it while its job ran.
func (r *gcRun) recheck(it *gcItem) {
	if !it.stale {
		return
	}
	it.stale = false
	r.sync([]string{it.id})
}

// set takes what it keeps from rec, its reservation in the ledger.
func (it *gcItem) set(rec *device.Reservation) {
	it.released, it.pending = rec.ReleasedAt.UnixNano(), rec.CleanupPending
}

// entryOf is what the cleanup of rec gets.
func entryOf(rec *device.Reservation) Entry {
	return Entry{
		ReservationID:  rec.ID,
		OwnerID:        rec.OwnerID,
		Plugin:         rec.Plugin,
		Group:          rec.Group,
		DeviceIDs:      rec.DeviceIDs, // the ledger's get unpacked it afresh: the cleanup's
		ReleasedAt:     rec.ReleasedAt,
		CleanupPending: rec.CleanupPending,
	}
}

// setIdle makes it idle, in the heap its cleanup state says.
func (r *gcRun) setIdle(it *gcItem) {
	r.detach(it)
	it.state = gcIdle
	if it.pending {
		r.pending.add(it)
	} else {
		r.clean.add(it)
	}
}

func (r *gcRun) detach(it *gcItem) {
	switch it.heap {
	case heapClean:
		r.clean.remove(it)
	case heapPending:
		r.pending.remove(it)
	case heapWaiting:
		r.waiting.remove(it)
	}
}

// oldestIdle returns the idle item released first, or nil.
func (r *gcRun) oldestIdle() *gcItem {
	c, p := r.clean.peek(), r.pending.peek()
	switch {
	case c == nil:
		return p
	case p == nil || releasedFirst(c, p):
		return c
	}
	return p
}

// gcLowWater is what the GC brings a ledger over max reservations down to: max less a
// sixteenth of it. A busy host sits at its limit, where deleting only the one
// reservation over it made every Reserve wake the GC (a goroutine and a thread woken
// while the caller waited) and carry a deletion in its commit; with the margin the GC
// wakes, and deletes in one batch, once per max/16 new reservations (62 at the default
// 1000). Under 16 the margin is none: a small limit is kept exactly.
func gcLowWater(max int) int { return max - max/16 }

// plan makes due retries idle, then starts what is due, oldest release first: the
// destroys that bring the ledger down to gcLowWater, those of reservations released
// before the last tick's cutoff, then pending cleanups, as far as Parallel allows.
func (r *gcRun) plan(now time.Time) {
	for w := r.waiting.peek(); w != nil && w.next <= now.Sub(r.began); w = r.waiting.peek() {
		r.setIdle(w)
	}
	ids := make([]string, 0, len(r.deleting))
	for it := range r.deleting {
		ids = append(ids, it.id)
	}
	c, deleting := r.l.CountsHolding(ids) // deleting: deletions in flight that the counts still include
	excess := 0
	switch over := c.Total > r.cfg.MaxReservations; {
	case over && c.Released == 0:
		if c.Total != r.lastSkipN {
			r.log.Info(fmt.Sprintf("garbage collection due to number of reservations (%d) is over the limit (%d) "+
				"skipped because no released reservations", c.Total, r.cfg.MaxReservations))
			r.lastSkipN = c.Total
		}
	case over:
		r.lastSkipN = -1
		excess = c.Total - gcLowWater(r.cfg.MaxReservations) - deleting
	default:
		r.lastSkipN = -1
	}
	for {
		it := r.oldestIdle()
		if it == nil {
			return
		}
		if excess > 0 || (!r.cutoff.IsZero() && it.released <= r.cutoff.UnixNano()) {
			if !r.start(it, true) {
				return
			}
			excess--
			continue
		}
		if p := r.pending.peek(); p == nil || !r.start(p, false) {
			return
		}
	}
}

// start starts a job on it: a destroy (del) or a cleanup. A cleanup still owed runs in
// a worker (the plugin's); the ledger write that follows is deferred. It returns false,
// starting nothing, when the job must wait for a free worker or for deferred writes to
// commit.
func (r *gcRun) start(it *gcItem, del bool) bool {
	plugin := it.pending && r.cfg.Cleanup != nil
	if (plugin && r.running >= r.cfg.Parallel) || r.committing >= maxCommitting {
		return false
	}
	var e Entry
	if plugin {
		rec := r.l.Lookup(it.id)
		if rec == nil { // deleted since the last sync: forget it, as the next sync would
			r.update(it.id, nil)
			return true
		}
		e = entryOf(rec)
	}
	r.detach(it)
	it.del, it.epoch = del, r.retryEpoch
	if del {
		r.deleting[it] = struct{}{}
	}
	if !plugin {
		// Nothing to clean, or no Cleanup func: a release is recorded as cleaned at once.
		r.record(it, it.pending)
		return true
	}
	it.state = gcRunning
	r.running++
	e.Attempt = int(it.attempts) + 1
	r.spawn(e)
	return true
}

// cleaned handles the end of a plugin cleanup.
func (r *gcRun) cleaned(res gcResult, now time.Time) {
	it := r.items[res.id] // an item is never dropped while its job runs
	r.running--
	if res.err != nil {
		if it.del {
			delete(r.deleting, it)
		}
		r.fail(it, res.entry, "reservation cleanup failed; will retry", res.err, now)
		r.recheck(it)
		return
	}
	r.record(it, true)
}

// record queues the ledger write of the job on it as a deferred write: the deletion
// (it.del), else the cleanup done. cleaned says the job did the cleanup.
func (r *gcRun) record(it *gcItem, cleaned bool) {
	id := it.id
	it.state = gcCommitting
	r.committing++
	var owner string // for the deletion's log line
	if it.del && r.log.IsDebug() {
		if rec := r.l.Lookup(id); rec != nil {
			owner = rec.OwnerID
		}
	}
	done := func(err error) {
		r.committedMu.Lock()
		r.committed = append(r.committed, gcResult{id: id, err: err, owner: owner})
		r.committedMu.Unlock()
		select {
		case r.commitWake <- struct{}{}:
		default:
		}
	}
	if it.del {
		r.l.DeferDelete(r.cfg.CommitDelay, id, cleaned, "gc", done)
	} else {
		r.l.DeferCleanupDone(r.cfg.CommitDelay, id, done)
	}
}

// recorded handles the commit (or failure) of a deferred write.
func (r *gcRun) recorded(res gcResult, now time.Time) {
	it := r.items[res.id] // an item is never dropped while its write is queued
	r.committing--
	if it.del {
		delete(r.deleting, it)
	}
	if errors.Is(res.err, device.ErrNotFound) {
		res.err = nil // deleted by someone else: nothing left to do
	}
	switch {
	case res.err != nil:
		r.fail(it, nil, "recording garbage collection in the ledger failed; will retry", res.err, now)
		r.recheck(it)
	case it.del:
		delete(r.items, res.id)
		r.log.Debug("garbage collected reservation", "reservation_id", res.id, "owner_id", res.owner)
	default:
		it.pending = false
		it.attempts = 0
		r.setIdle(it)
		r.recheck(it)
	}
}

// fail schedules the next attempt on it after a failed one, and logs msg. e is the
// cleanup that failed, if that is what failed.
func (r *gcRun) fail(it *gcItem, e *Entry, msg string, err error, now time.Time) {
	it.attempts++
	wait := r.backoff(int(it.attempts))
	if it.epoch < r.retryEpoch {
		wait = 0
	}
	it.next = now.Sub(r.began) + wait
	it.state = gcWaiting
	r.waiting.add(it)
	if e == nil {
		e = &Entry{ReservationID: it.id}
		if rec := r.l.Lookup(it.id); rec != nil {
			*e = entryOf(rec)
		}
	}
	r.log.Warn(msg, "reservation_id", e.ReservationID, "owner_id", e.OwnerID, "plugin", e.Plugin,
		"attempt", it.attempts, "retry_in", wait, "error", err)
}

// backoff is RetryMin doubled per failure after the first, capped at RetryMax, ±20%.
func (g *GC) backoff(failures int) time.Duration {
	b := backoff.Backoff{Base: g.cfg.RetryMin, Max: g.cfg.RetryMax}
	return b.Delay(failures)
}
