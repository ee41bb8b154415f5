package ledger

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/manager/device"
)

// GC defaults, used for zero GCConfig fields.
const (
	DefaultGCMaxReservations = 1000
	DefaultGCInterval        = time.Minute
	DefaultGCParallel        = 2
	DefaultCleanupTimeout    = 10 * time.Second
	DefaultRetryMin          = time.Second
	DefaultRetryMax          = 5 * time.Minute
)

// GCEntry is a released reservation as the GC hands it to the cleanup func: everything
// the plugin cleanup needs, so no lookup is needed.
type GCEntry struct {
	ReservationID  string
	OwnerID        string
	Plugin         string
	Group          device.GroupKey
	DeviceIDs      []string // the caller's to keep
	ReleasedAt     time.Time
	CleanupPending bool // the plugin cleanup is still owed
	Attempt        int  // 1 for the first cleanup attempt, 2 for the first retry...
}

// GCConfig configures a GC. Zero fields take the defaults named; negative ones are an
// error.
type GCConfig struct {
	// Logger gets "marked for GC" (INFO, once per released reservation), the over-the-
	// limit skip (INFO, once per change of the count), failed cleanups (WARN, each
	// attempt) and each deletion (DEBUG). Nil means no logging.
	Logger hclog.Logger
	// Cleanup undoes a released reservation on the plugin side. It gets a context with
	// CleanupTimeout; an error leaves the cleanup pending, to be retried with backoff.
	// It must be idempotent: a cleanup whose success was not yet recorded when the
	// agent stopped runs again. It may be called from several goroutines at once (at
	// most Parallel). Nil means there is nothing to clean up: releases are recorded as
	// cleaned at once.
	Cleanup func(ctx context.Context, e GCEntry) error
	// MaxReservations: when the ledger holds more reservations than this (live and
	// released), the oldest released ones are destroyed until it does not. Zero means
	// DefaultGCMaxReservations.
	MaxReservations int
	// Interval: every Interval, the released reservations released at least Interval
	// ago are destroyed, so a released reservation stays listed between one and two
	// intervals when the limit is not reached. Zero means DefaultGCInterval.
	Interval time.Duration
	// Parallel bounds how many destroys (cleanup, then deletion) run at once, so that
	// releasing thousands at once causes no spike. Zero means DefaultGCParallel.
	Parallel int
	// CleanupTimeout bounds each Cleanup call. Zero means DefaultCleanupTimeout.
	CleanupTimeout time.Duration
	// RetryMin and RetryMax bound the backoff between attempts for one reservation:
	// RetryMin after the first failure, doubling up to RetryMax, with ±20% jitter.
	// Zero means DefaultRetryMin and DefaultRetryMax.
	RetryMin, RetryMax time.Duration
}

// GC cleans up after released reservations and garbage-collects them from a ledger.
//
// A released reservation is "marked for GC" when the GC first sees it. Its plugin
// cleanup is attempted as soon as it is marked; a failed cleanup stays pending in the
// ledger and is retried with exponential backoff, never dropped. A reservation is
// destroyed (cleanup if still pending, then deletion from the ledger) when the ledger
// holds more than MaxReservations reservations (oldest release first, only as many as
// needed) or on the Interval tick (those released at least Interval ago). At most
// Parallel cleanups and destroys run at once.
//
// The retry schedule (attempt count, next attempt time) is kept in memory: a pending
// cleanup is in the ledger, so after a restart every pending cleanup is tried again at
// once (still Parallel at a time), with its backoff starting over.
//
// Run does the work; RetryNow may be called from any goroutine.
type GC struct {
	l       *Ledger
	cfg     GCConfig
	log     hclog.Logger
	retry   chan struct{} // RetryNow's wake-up, coalesced
	running atomic.Bool

	// onPass, when set (by tests), is called by Run after each planning pass; tick says
	// whether the pass was due to the Interval tick.
	onPass func(tick bool)
}

// NewGC returns a GC for l; nothing runs until Run.
func NewGC(l *Ledger, cfg GCConfig) (*GC, error) {
	switch {
	case cfg.MaxReservations < 0:
		return nil, fmt.Errorf("gc: MaxReservations %d is negative", cfg.MaxReservations)
	case cfg.Interval < 0:
		return nil, fmt.Errorf("gc: Interval %s is negative", cfg.Interval)
	case cfg.Parallel < 0:
		return nil, fmt.Errorf("gc: Parallel %d is negative", cfg.Parallel)
	case cfg.CleanupTimeout < 0, cfg.RetryMin < 0, cfg.RetryMax < 0:
		return nil, errors.New("gc: CleanupTimeout, RetryMin and RetryMax must not be negative")
	}
	cfg.MaxReservations = cmp.Or(cfg.MaxReservations, DefaultGCMaxReservations)
	cfg.Interval = cmp.Or(cfg.Interval, DefaultGCInterval)
	cfg.Parallel = cmp.Or(cfg.Parallel, DefaultGCParallel)
	cfg.CleanupTimeout = cmp.Or(cfg.CleanupTimeout, DefaultCleanupTimeout)
	cfg.RetryMin = cmp.Or(cfg.RetryMin, DefaultRetryMin)
	cfg.RetryMax = max(cmp.Or(cfg.RetryMax, DefaultRetryMax), cfg.RetryMin)
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

// gcItem is what Run remembers about one marked reservation.
type gcItem struct {
	entry    GCEntry
	attempts int       // failed attempts in a row
	next     time.Time // no attempt before; zero: due now
}

type gcJob struct {
	entry  GCEntry
	delete bool   // destroy: delete the record once its cleanup is done
	epoch  uint64 // gcRun.retryEpoch when the job started
}

type gcResult struct {
	job gcJob
	err error
}

// gcRun is the state of one Run call, owned by its goroutine.
type gcRun struct {
	*GC
	items     map[string]*gcItem
	inflight  map[string]bool // reservation ID -> job deletes
	queue     []gcJob
	lastSkipN int // the count last logged as over the limit with nothing released; -1: none
	// retryEpoch counts RetryNow calls; a job started before the latest one that fails
	// is retried at once, since RetryNow came after it began.
	retryEpoch uint64
}

// Run works until ctx ends, then waits for the cleanups and destroys it started (they
// get ctx, so a cleanup func that honours it returns promptly) and returns nil. It
// wakes on every ledger commit that changes reservations, on the Interval tick, when a
// retry is due, and on RetryNow. Run must not be called twice at once, and should end
// before the ledger is closed.
func (g *GC) Run(ctx context.Context) error {
	if !g.running.CompareAndSwap(false, true) {
		return errors.New("gc: already running")
	}
	defer g.running.Store(false)

	changed, unsubscribe := g.l.subscribe()
	defer unsubscribe()
	ticker := time.NewTicker(g.cfg.Interval)
	defer ticker.Stop()
	retryTimer := time.NewTimer(time.Hour)
	retryTimer.Stop()
	defer retryTimer.Stop()

	r := &gcRun{GC: g, items: make(map[string]*gcItem), inflight: make(map[string]bool), lastSkipN: -1}
	done := make(chan gcResult, g.cfg.Parallel) // never more in flight, so workers never block
	var workers sync.WaitGroup
	defer workers.Wait()

	dirty, tick := true, false
	for ctx.Err() == nil { // select may take a finished job over ctx.Done: start nothing after
		if len(r.queue) == 0 && dirty {
			now, planTick := time.Now(), tick
			r.queue = r.plan(now, planTick)
			dirty, tick = false, false
			if next, ok := r.nextRetry(now); ok {
				retryTimer.Reset(next.Sub(now))
			}
			if g.onPass != nil {
				g.onPass(planTick)
			}
		}
		for len(r.inflight) < g.cfg.Parallel && len(r.queue) > 0 {
			job := r.queue[0]
			r.queue = r.queue[1:]
			job.entry.Attempt = r.items[job.entry.ReservationID].attempts + 1
			job.entry.DeviceIDs = slices.Clone(job.entry.DeviceIDs) // each call gets its own
			job.epoch = r.retryEpoch
			r.inflight[job.entry.ReservationID] = job.delete
			workers.Add(1)
			go func() {
				defer workers.Done()
				done <- gcResult{job: job, err: g.destroy(ctx, job)}
			}()
		}
		select {
		case <-ctx.Done():
			return nil // the deferred workers.Wait waits for the jobs in flight
		case <-changed:
			dirty = true
		case <-ticker.C:
			dirty, tick = true, true
		case <-retryTimer.C:
			dirty = true
		case <-g.retry:
			r.retryEpoch++
			for _, it := range r.items {
				it.next = time.Time{}
			}
			dirty = true
		case res := <-done:
			delete(r.inflight, res.job.entry.ReservationID)
			r.finish(res, time.Now())
			dirty = true
		}
	}
	return nil
}

// plan brings the marked set up to date with the ledger and returns the jobs now due,
// oldest release first.
func (r *gcRun) plan(now time.Time, tick bool) []gcJob {
	entries, c := r.l.gcEntries()
	seen := make(map[string]bool, len(entries))
	for _, e := range entries {
		seen[e.ReservationID] = true
		it := r.items[e.ReservationID]
		if it == nil {
			it = &gcItem{}
			r.items[e.ReservationID] = it
			r.log.Info("marked for GC", "reservation_id", e.ReservationID, "owner_id", e.OwnerID,
				"plugin", e.Plugin, "released_at", e.ReleasedAt)
		}
		it.entry = e
	}
	for id := range r.items {
		if !seen[id] && !r.inflightHas(id) {
			delete(r.items, id) // deleted by someone else
		}
	}

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
		excess = c.Total - r.cfg.MaxReservations
		for _, del := range r.inflight {
			if del {
				excess--
			}
		}
	default:
		r.lastSkipN = -1
	}

	var jobs []gcJob
	cutoff := now.Add(-r.cfg.Interval)
	for _, e := range entries {
		it := r.items[e.ReservationID]
		if r.inflightHas(e.ReservationID) || it.next.After(now) {
			continue
		}
		del := false
		if excess > 0 {
			del = true
			excess--
		}
		if tick && !e.ReleasedAt.After(cutoff) {
			del = true
		}
		if del || e.CleanupPending {
			jobs = append(jobs, gcJob{entry: e, delete: del})
		}
	}
	return jobs
}

func (r *gcRun) inflightHas(id string) bool {
	_, ok := r.inflight[id]
	return ok
}

// nextRetry returns the earliest future attempt time among the marked reservations.
func (r *gcRun) nextRetry(now time.Time) (time.Time, bool) {
	var next time.Time
	for id, it := range r.items {
		if it.next.After(now) && !r.inflightHas(id) && (next.IsZero() || it.next.Before(next)) {
			next = it.next
		}
	}
	return next, !next.IsZero()
}

// finish records a job's outcome: success resets the backoff (or forgets a destroyed
// reservation); failure schedules the next attempt.
func (r *gcRun) finish(res gcResult, now time.Time) {
	e := res.job.entry
	it := r.items[e.ReservationID]
	if res.err == nil {
		if res.job.delete {
			delete(r.items, e.ReservationID)
			r.log.Debug("garbage collected reservation", "reservation_id", e.ReservationID, "owner_id", e.OwnerID)
		} else if it != nil {
			it.attempts, it.next = 0, time.Time{}
		}
		return
	}
	if it == nil {
		return
	}
	it.attempts++
	wait := r.backoff(it.attempts)
	if res.job.epoch < r.retryEpoch {
		wait = 0
	}
	it.next = now.Add(wait)
	r.log.Warn("reservation cleanup failed; will retry", "reservation_id", e.ReservationID,
		"owner_id", e.OwnerID, "plugin", e.Plugin, "attempt", it.attempts, "retry_in", wait, "error", res.err)
}

// backoff is RetryMin doubled per failure after the first, capped at RetryMax, ±20%.
func (g *GC) backoff(failures int) time.Duration {
	d := g.cfg.RetryMin
	for i := 1; i < failures && d < g.cfg.RetryMax; i++ {
		d *= 2
	}
	d = min(d, g.cfg.RetryMax)
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// destroy runs one job: the plugin cleanup if it is still owed, recorded in the ledger,
// then the deletion if the job is a destroy.
func (g *GC) destroy(ctx context.Context, job gcJob) error {
	id := job.entry.ReservationID
	if job.entry.CleanupPending {
		if g.cfg.Cleanup != nil {
			cctx, cancel := context.WithTimeout(ctx, g.cfg.CleanupTimeout)
			err := g.cfg.Cleanup(cctx, job.entry)
			cancel()
			if err != nil {
				return fmt.Errorf("cleanup: %w", err)
			}
		}
		if err := g.l.CleanupDone(ctx, id); err != nil && !errors.Is(err, device.ErrNotFound) {
			return err
		}
	}
	if job.delete {
		return g.l.Delete(ctx, id)
	}
	return nil
}

// gcEntries returns the released reservations, oldest release first, and the counts, in
// one consistent read.
func (l *Ledger) gcEntries() ([]GCEntry, Counts) {
	l.mu.RLock()
	out := make([]GCEntry, 0, l.idx.n.released)
	for id := range l.idx.gone {
		r := l.idx.recs[id]
		out = append(out, GCEntry{
			ReservationID:  r.ID,
			OwnerID:        r.OwnerID,
			Plugin:         r.Plugin,
			Group:          r.Group,
			DeviceIDs:      slices.Clone(r.DeviceIDs),
			ReleasedAt:     r.ReleasedAt,
			CleanupPending: r.CleanupPending,
		})
	}
	c := l.idx.counts()
	l.mu.RUnlock()
	slices.SortFunc(out, func(a, b GCEntry) int {
		return cmp.Or(a.ReleasedAt.Compare(b.ReleasedAt), cmp.Compare(a.ReservationID, b.ReservationID))
	})
	return out, c
}
