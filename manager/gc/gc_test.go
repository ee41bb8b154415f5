package gc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger"
	"github.com/devicehost/devicehost/manager/ledger/store"
)

// gcHarness runs a GC for a test and lets the test wait on its passes.
type gcHarness struct {
	g      *GC
	passes atomic.Int64
	ticks  atomic.Int64  // passes due to the Interval tick
	wake   chan struct{} // coalesced: a pass happened
	stop   func()        // cancels Run and waits for it; idempotent
}

// startGC runs a GC on l until the test ends (before l is closed).
func startGC(t *testing.T, l *ledger.Ledger, cfg Config) *gcHarness {
	t.Helper()
	g, err := New(l, cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := &gcHarness{g: g, wake: make(chan struct{}, 1)}
	g.onPass = func(tick bool) {
		h.passes.Add(1)
		if tick {
			h.ticks.Add(1)
		}
		select {
		case h.wake <- struct{}{}:
		default:
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	var once sync.Once
	h.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("GC.Run: %v", err)
			}
		})
	}
	t.Cleanup(h.stop)
	return h
}

// waitUntil waits, pass by pass, until cond holds, for a minute at most: in a synctest
// bubble that is a minute of the bubble's clock, longer than any wait of the GC's that
// a test sets up (and it passes at once when nothing is left to happen).
func (h *gcHarness) waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(time.Minute)
	defer deadline.Stop()
	for !cond() {
		select {
		case <-h.wake:
		case <-deadline.C:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// waitTicks waits for n more passes due to the Interval tick.
func (h *gcHarness) waitTicks(t *testing.T, n int64) {
	t.Helper()
	want := h.ticks.Load() + n
	h.waitUntil(t, fmt.Sprintf("%d interval passes", n), func() bool { return h.ticks.Load() >= want })
}

// releasedN makes n released reservations, released at t0, t0+1s..., and returns them.
func releasedN(t *testing.T, l *ledger.Ledger, n int) []device.Reservation {
	t.Helper()
	out := make([]device.Reservation, n)
	for i := range n {
		r := reserve(t, l, fmt.Sprint("owner-", i), fmt.Sprint("GPU-", i))
		out[i] = release(t, l, r.ID, t0.Add(time.Duration(i)*time.Second))
	}
	return out
}

// TestGCParallelBound: no more than Parallel cleanups and destroys run at once, however
// many are due.
func TestGCParallelBound(t *testing.T) {
	l := newLedger(t)
	const n, parallel = 12, 2
	releasedN(t, l, n)
	var inflight, most atomic.Int32
	started := make(chan Entry, n)
	gate := make(chan struct{})
	cleanup := func(ctx context.Context, e Entry) error {
		cur := inflight.Add(1)
		defer inflight.Add(-1)
		for m := most.Load(); cur > m && !most.CompareAndSwap(m, cur); m = most.Load() {
		}
		started <- e
		select {
		case <-gate:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	// MaxReservations 1: eleven are destroyed (cleanup, then deletion), the newest is
	// only cleaned up.
	h := startGC(t, l, Config{Cleanup: cleanup, Parallel: parallel, MaxReservations: 1})

	timeout := time.After(10 * time.Second)
	next := func() Entry {
		t.Helper()
		select {
		case e := <-started:
			return e
		case <-timeout:
			t.Fatalf("timed out waiting for a cleanup to start")
			return Entry{}
		}
	}
	var seen []string
	for range parallel {
		seen = append(seen, next().ReservationID)
	}
	for range n - parallel {
		gate <- struct{}{} // one finishes...
		e := next()        // ...and the next starts
		if e.OwnerID == "" || len(e.DeviceIDs) != 1 || e.Plugin != "nvidia-example" || !e.CleanupPending {
			t.Errorf("cleanup entry %+v lacks what the cleanup needs", e)
		}
		seen = append(seen, e.ReservationID)
	}
	for range parallel {
		gate <- struct{}{}
	}
	h.waitUntil(t, "every cleanup and destroy", func() bool {
		c := l.Counts()
		return c.Total == 1 && c.CleanupPending == 0
	})
	if got := most.Load(); got != parallel {
		t.Errorf("at most %d cleanups ran at once, want %d", got, parallel)
	}
	slices.Sort(seen)
	if len(slices.Compact(seen)) != n {
		t.Errorf("cleanups ran for %d distinct reservations, want %d (each once)", len(seen), n)
	}
}

func TestGCOverLimitDestroysOldestReleasedFirst(t *testing.T) {
	l := newLedger(t)
	live := []device.Reservation{reserve(t, l, "live-1", "GPU-L1"), reserve(t, l, "live-2", "GPU-L2")}
	released := releasedN(t, l, 6)
	h := startGC(t, l, Config{MaxReservations: 5})
	h.waitUntil(t, "the ledger down to the limit, cleanups done", func() bool {
		c := l.Counts()
		return c.Total <= 5 && c.CleanupPending == 0
	})
	// One more pass, to see it destroys no more.
	before := h.passes.Load()
	h.g.RetryNow()
	h.waitUntil(t, "one more pass", func() bool { return h.passes.Load() > before })

	want := append(slices.Clone(live), released[3:]...)
	got := listAll(t, l)
	if !reflect.DeepEqual(ids(got), ids(want)) {
		t.Errorf("after GC the ledger lists %v, want the live ones and the three newest released %v", ids(got), ids(want))
	}
}

// TestGCOverLimitDeletesDownToLowWater: past MaxReservations the GC deletes the oldest
// releases down to the limit less a sixteenth (32 -> 30), then lets the ledger fill to
// the limit again without deleting, so a host at its limit does not make every Reserve
// carry a deletion.
func TestGCOverLimitDeletesDownToLowWater(t *testing.T) {
	l := newLedger(t)
	released := releasedN(t, l, 33)
	h := startGC(t, l, Config{MaxReservations: 32})
	h.waitUntil(t, "the ledger down to 30", func() bool { return l.Counts().Total == 30 })
	if got, want := ids(listAll(t, l)), ids(released[3:]); !reflect.DeepEqual(got, want) {
		t.Fatalf("after GC the ledger lists %v, want the 30 newest releases %v", got, want)
	}
	// Up to the limit again: nothing deleted, pass after pass.
	later := []device.Reservation{release(t, l, reserve(t, l, "later-0", "GPU-L0").ID, t0.Add(time.Hour))}
	later = append(later, release(t, l, reserve(t, l, "later-1", "GPU-L1").ID, t0.Add(time.Hour+time.Second)))
	before := h.passes.Load()
	h.g.RetryNow()
	h.waitUntil(t, "one more pass", func() bool { return h.passes.Load() > before })
	if c := l.Counts(); c.Total != 32 {
		t.Fatalf("at the limit the ledger holds %d, want all 32: the GC deleted under its limit", c.Total)
	}
	// One over: the three oldest go.
	later = append(later, release(t, l, reserve(t, l, "later-2", "GPU-L2").ID, t0.Add(time.Hour+2*time.Second)))
	h.waitUntil(t, "the ledger down to 30 again", func() bool { return l.Counts().Total == 30 })
	if got, want := ids(listAll(t, l)), ids(append(slices.Clone(released[6:]), later...)); !reflect.DeepEqual(got, want) {
		t.Errorf("after the second GC the ledger lists %v, want %v", got, want)
	}
}

// TestGCIntervalDestroysOldReleases: on each Interval tick, the releases at least an
// Interval old are destroyed, so a release stays listed between one and two intervals.
// On synctest's clock: the ticks are the GC's own and take no time.
func TestGCIntervalDestroysOldReleases(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const interval = 10 * time.Second
		l := newLedger(t)
		live := reserve(t, l, "live", "GPU-L")
		old := release(t, l, reserve(t, l, "old", "GPU-O").ID, time.Now().Add(-time.Hour))
		fresh := release(t, l, reserve(t, l, "fresh", "GPU-F").ID, time.Now().Add(time.Hour))
		later := reserve(t, l, "later", "GPU-R")
		start := time.Now()
		h := startGC(t, l, Config{Interval: interval})
		time.Sleep(time.Second)
		later = release(t, l, later.ID, time.Now()) // 1s after the GC started
		gone := func(id string) func() bool {
			return func() bool { _, err := l.Get(id); return errors.Is(err, device.ErrNotFound) }
		}

		// The first tick destroys the hour-old release (its deletion is a deferred
		// write, committed within CommitDelay), not the one 9s old.
		h.waitUntil(t, "the old release destroyed", gone(old.ID))
		if took := time.Since(start); took < interval || took > interval+DefaultCommitDelay {
			t.Errorf("the old release was destroyed %v after the GC started, want at its first tick (%v) + CommitDelay", took, interval)
		}
		if got := ids(listAll(t, l)); !reflect.DeepEqual(got, []string{live.ID, fresh.ID, later.ID}) {
			t.Errorf("after the first tick the ledger lists %v, want all but the hour-old release %s", got, old.ID)
		}
		// The second destroys the one released between them.
		h.waitUntil(t, "the later release destroyed", gone(later.ID))
		if listed := time.Since(later.ReleasedAt); listed < interval || listed > 2*interval+DefaultCommitDelay {
			t.Errorf("a release was listed for %v, want between one and two intervals (%v)", listed, interval)
		}
		h.waitTicks(t, 3)
		if got := ids(listAll(t, l)); !reflect.DeepEqual(got, []string{live.ID, fresh.ID}) {
			t.Errorf("after interval passes the ledger lists %v, want the live %s and the recent release %s", got, live.ID, fresh.ID)
		}
		if p := l.PendingCleanups(); len(p) != 0 {
			t.Errorf("pending cleanups %v, want none: a nil Cleanup records each release cleaned", ids(p))
		}
	})
}

func TestGCSkipLoggedOncePerCount(t *testing.T) {
	synctest.Test(t, testGCSkipLoggedOncePerCount)
}

// testGCSkipLoggedOncePerCount runs in a synctest bubble: its ticks take no time.
func testGCSkipLoggedOncePerCount(t *testing.T) {
	logs, logger := newLogCapture()
	l := newLedger(t)
	for i := range 3 {
		reserve(t, l, fmt.Sprint("o", i), fmt.Sprint("GPU-", i))
	}
	h := startGC(t, l, Config{Logger: logger, MaxReservations: 2, Interval: 10 * time.Second})
	const msg = "garbage collection due to number of reservations"
	want := func(n int) string {
		return fmt.Sprintf("%s (%d) is over the limit (2) skipped because no released reservations", msg, n)
	}

	h.waitTicks(t, 5)
	lines := logged(t, logs, msg, true)
	if len(lines) != 1 || lines[0]["@message"] != want(3) || lines[0]["@level"] != "info" {
		t.Fatalf("after 5 passes over the limit, skip lines = %v; want one at info: %q", lines, want(3))
	}

	reserve(t, l, "o3", "GPU-3")
	h.waitTicks(t, 5)
	lines = logged(t, logs, msg, true)
	if len(lines) != 2 || lines[1]["@message"] != want(4) {
		t.Errorf("after the count changed to 4, skip lines = %v; want a second one: %q", lines, want(4))
	}
}

func TestGCMarksOncePerReservation(t *testing.T) {
	synctest.Test(t, testGCMarksOncePerReservation)
}

// testGCMarksOncePerReservation runs in a synctest bubble: its retries take no time.
func testGCMarksOncePerReservation(t *testing.T) {
	logs, logger := newLogCapture()
	l := newLedger(t)
	released := releasedN(t, l, 3)
	var calls sync.Map // reservation ID -> *atomic.Int32
	cleanup := func(_ context.Context, e Entry) error {
		n, _ := calls.LoadOrStore(e.ReservationID, new(atomic.Int32))
		if n.(*atomic.Int32).Add(1) <= 2 {
			return errors.New("plugin down")
		}
		return nil
	}
	h := startGC(t, l, Config{Logger: logger, Cleanup: cleanup, RetryMin: time.Second, RetryMax: 2 * time.Second})
	h.waitUntil(t, "every cleanup done", func() bool { return l.Counts().CleanupPending == 0 })

	marked := map[string]int{}
	for _, line := range logged(t, logs, "marked for GC", false) {
		if line["@level"] != "info" {
			t.Errorf("marked for GC logged at %v, want info", line["@level"])
		}
		marked[line["reservation_id"].(string)]++
	}
	want := map[string]int{}
	for _, r := range released {
		want[r.ID] = 1
	}
	if !reflect.DeepEqual(marked, want) {
		t.Errorf("marked for GC lines per reservation = %v, want one each %v", marked, want)
	}
	if warns := logged(t, logs, "reservation cleanup failed; will retry", false); len(warns) != 6 {
		t.Errorf("%d failed-cleanup lines, want 6 (two per reservation)", len(warns))
	}
}

// TestGCRetriesFailedCleanupWithBackoff: a failed cleanup stays pending and is retried
// after RetryMin, then twice that, up to RetryMax (±20% jitter), until it succeeds. On
// synctest's clock, so the waits are the GC's own, to the nanosecond, and take no time.
func TestGCRetriesFailedCleanupWithBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := newLedger(t)
		r := releasedN(t, l, 1)[0]
		var mu sync.Mutex
		var attempts []int
		var at []time.Time
		cleanup := func(_ context.Context, e Entry) error {
			mu.Lock()
			defer mu.Unlock()
			attempts = append(attempts, e.Attempt)
			at = append(at, time.Now())
			if len(attempts) <= 4 {
				if p := l.PendingCleanups(); len(p) != 1 || p[0].ID != r.ID {
					t.Errorf("during attempt %d, pending cleanups = %v, want [%s]", e.Attempt, ids(p), r.ID)
				}
				return fmt.Errorf("attempt %d: %w", e.Attempt, device.ErrPluginUnavailable)
			}
			return nil
		}
		h := startGC(t, l, Config{Cleanup: cleanup, RetryMin: time.Second, RetryMax: 4 * time.Second})
		h.waitUntil(t, "the cleanup to succeed", func() bool { return l.Counts().CleanupPending == 0 })
		mu.Lock()
		defer mu.Unlock()
		if want := []int{1, 2, 3, 4, 5}; !reflect.DeepEqual(attempts, want) {
			t.Fatalf("cleanup attempts %v, want %v", attempts, want)
		}
		for i, base := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 4 * time.Second} {
			lo, hi := base*8/10, base*12/10
			if gap := at[i+1].Sub(at[i]); gap < lo || gap > hi {
				t.Errorf("attempt %d came %v after attempt %d, want the backoff %v ±20%%", i+2, gap, i+1, base)
			}
		}
		if got, err := l.Get(r.ID); err != nil || got.CleanupPending {
			t.Errorf("after the cleanup succeeded: %+v, %v; want it recorded done", got, err)
		}
	})
}

// TestGCPendingCleanupSurvivesRestart: a cleanup that keeps failing is still owed after
// the GC stops and the ledger is reopened, and the next GC does it.
func TestGCPendingCleanupSurvivesRestart(t *testing.T) {
	path := statePath(t)
	l, err := ledger.Open(path, ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := releasedN(t, l, 1)[0]
	failed := make(chan struct{}, 1)
	h := startGC(t, l, Config{
		Cleanup: func(context.Context, Entry) error {
			select {
			case failed <- struct{}{}:
			default:
			}
			return device.ErrPluginUnavailable
		},
		RetryMin: time.Hour,
	})
	select {
	case <-failed:
	case <-time.After(10 * time.Second):
		t.Fatal("timed out waiting for the cleanup attempt")
	}
	h.stop()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	l = openLedger(t, path)
	if p := l.PendingCleanups(); len(p) != 1 || p[0].ID != r.ID {
		t.Fatalf("after a restart pending cleanups = %v, want [%s]", ids(p), r.ID)
	}
	done := make(chan Entry, 1)
	h = startGC(t, l, Config{Cleanup: func(_ context.Context, e Entry) error { done <- e; return nil }})
	h.waitUntil(t, "the cleanup after the restart", func() bool { return l.Counts().CleanupPending == 0 })
	if e := <-done; e.ReservationID != r.ID || e.OwnerID != r.OwnerID {
		t.Errorf("cleanup after the restart got %+v, want reservation %s of %s", e, r.ID, r.OwnerID)
	}
}

func TestGCRetryNowSkipsBackoff(t *testing.T) {
	l := newLedger(t)
	releasedN(t, l, 1)
	var calls atomic.Int32
	h := startGC(t, l, Config{
		Cleanup: func(context.Context, Entry) error {
			if calls.Add(1) == 1 {
				return device.ErrPluginUnavailable
			}
			return nil
		},
		RetryMin: time.Hour,
	})
	h.waitUntil(t, "the first attempt", func() bool { return calls.Load() == 1 })
	h.g.RetryNow()
	h.waitUntil(t, "the retry RetryNow asked for", func() bool { return l.Counts().CleanupPending == 0 })
}

func TestGCStopsOnCancel(t *testing.T) {
	l := newLedger(t)
	releasedN(t, l, 3)
	started := make(chan struct{}, 3)
	var canceled atomic.Int32
	h := startGC(t, l, Config{Cleanup: func(ctx context.Context, _ Entry) error {
		started <- struct{}{}
		<-ctx.Done()
		canceled.Add(1)
		return ctx.Err()
	}})
	for range 2 {
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			t.Fatal("timed out waiting for cleanups to start")
		}
	}
	h.stop() // returns only once Run and its workers are done; goleak checks the rest
	if got := canceled.Load(); got != 2 {
		t.Errorf("%d cleanups saw the cancel, want the 2 in flight", got)
	}
	if got := l.Counts().CleanupPending; got != 3 {
		t.Errorf("%d cleanups pending after the stop, want all 3 still owed", got)
	}
}

func TestGCRunTwice(t *testing.T) {
	l := newLedger(t)
	h := startGC(t, l, Config{})
	h.waitUntil(t, "the first pass", func() bool { return h.passes.Load() > 0 })
	if err := h.g.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "already running") {
		t.Errorf("second Run: err = %v, want already running", err)
	}
}

func TestNewRefusesNegativeConfig(t *testing.T) {
	l := newLedger(t)
	for _, cfg := range []Config{
		{MaxReservations: -1}, {Interval: -time.Second}, {Parallel: -1},
		{CleanupTimeout: -1}, {RetryMin: -1}, {RetryMax: -1}, {CommitDelay: -1},
	} {
		if _, err := New(l, cfg); err == nil {
			t.Errorf("New(%+v) succeeded, want an error", cfg)
		}
	}
}

func TestGCBackoff(t *testing.T) {
	g, err := New(nil, Config{RetryMin: time.Second, RetryMax: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		failures int
		base     time.Duration
	}{{1, time.Second}, {2, 2 * time.Second}, {3, 4 * time.Second}, {4, 8 * time.Second}, {5, 10 * time.Second}, {40, 10 * time.Second}} {
		lo, hi := time.Duration(float64(tt.base)*0.8), time.Duration(float64(tt.base)*1.2)
		if got := g.backoff(tt.failures); got < lo || got > hi {
			t.Errorf("backoff(%d) = %s, want within [%s, %s]", tt.failures, got, lo, hi)
		}
	}
}

// TestGCDestroysManyInFewCommits: destroying hundreds of released reservations at once
// (more than one batch) shares commits instead of paying one per reservation, and still
// destroys the oldest first.
func TestGCDestroysManyInFewCommits(t *testing.T) {
	l := newLedger(t)
	const n = store.MaxBatch + 44
	var wg sync.WaitGroup
	for w := range 16 { // concurrent, so that filling the ledger shares commits too
		wg.Go(func() {
			for i := w; i < n; i += 16 {
				r, _, err := l.Reserve(context.Background(), res(fmt.Sprint("o", i), fmt.Sprint("GPU-", i)), nil, nil)
				if err == nil {
					_, _, err = l.Release(context.Background(), device.ReleaseRequest{ReservationID: r.ID}, t0.Add(time.Duration(i)*time.Second))
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	newest := listAll(t, l)
	slices.SortFunc(newest, func(a, b device.Reservation) int { return a.ReleasedAt.Compare(b.ReleasedAt) })
	newest = newest[n-1:]

	commits := l.Commits()
	h := startGC(t, l, Config{MaxReservations: 1, CommitDelay: 50 * time.Millisecond})
	h.waitUntil(t, "the ledger down to the limit, cleanups done", func() bool {
		c := l.Counts()
		return c.Total == 1 && c.CleanupPending == 0
	})
	if got := ids(listAll(t, l)); !reflect.DeepEqual(got, ids(newest)) {
		t.Errorf("after GC the ledger lists %v, want the newest release %v", got, ids(newest))
	}
	// One commit per batch of store.MaxBatch, give or take those the CommitDelay split off.
	if got := l.Commits() - commits; got > 10 {
		t.Errorf("destroying %d reservations took %d commits, want them to share a few", n-1, got)
	}
}

// TestGCForgetsAReservationDeletedWhileItsCleanupRuns: a reservation whose cleanup is
// recorded and which is deleted by someone else while the GC's own cleanup of it runs is
// forgotten once that cleanup ends, with no error, and the GC goes on working.
func TestGCForgetsAReservationDeletedWhileItsCleanupRuns(t *testing.T) {
	logs, logger := newLogCapture()
	l := newLedger(t)
	r := releasedN(t, l, 1)[0]
	entered, gate := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	h := startGC(t, l, Config{Logger: logger, Cleanup: func(context.Context, Entry) error {
		if calls.Add(1) == 1 {
			close(entered)
			<-gate
		}
		return nil
	}})
	<-entered
	ctx := context.Background()
	if err := l.CleanupDone(ctx, r.ID); err != nil {
		t.Fatal(err)
	}
	if err := l.Delete(ctx, r.ID); err != nil {
		t.Fatal(err)
	}
	close(gate)

	next := reserve(t, l, "next", "GPU-next")
	release(t, l, next.ID, time.Time{})
	h.waitUntil(t, "the next reservation's cleanup", func() bool { return l.Counts().CleanupPending == 0 })
	if got := calls.Load(); got != 2 {
		t.Errorf("%d cleanups, want 2: the deleted reservation's once, the next one's", got)
	}
	if warns := logged(t, logs, "recording garbage collection in the ledger failed; will retry", false); len(warns) != 0 {
		t.Errorf("warnings %v, want none", warns)
	}
	if got := ids(listAll(t, l)); !reflect.DeepEqual(got, []string{next.ID}) {
		t.Errorf("ledger lists %v, want [%s]", got, next.ID)
	}
}

// TestGCReserveReleaseCycleCommitsTwice: with a GC running, each Reserve+Release cycle
// at one caller costs two commits: the GC's cleanup-done records make none of their own
// (here they wait an hour to ride on one). They are all durable once the ledger is
// closed.
func TestGCReserveReleaseCycleCommitsTwice(t *testing.T) {
	path := statePath(t)
	l, err := ledger.Open(path, ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	cleaned := make(chan string, 1)
	h := startGC(t, l, Config{
		Cleanup:     func(_ context.Context, e Entry) error { cleaned <- e.ReservationID; return nil },
		CommitDelay: time.Hour, // no commit of their own: they can only ride
	})
	const cycles = 20
	commits := l.Commits()
	for i := range cycles {
		r := reserve(t, l, fmt.Sprint("o", i), "GPU-1")
		release(t, l, r.ID, time.Time{})
		select {
		case id := <-cleaned:
			if id != r.ID {
				t.Fatalf("cleanup of %s, want %s", id, r.ID)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("cycle %d: no cleanup of %s", i, r.ID)
		}
	}
	if got := l.Commits() - commits; got != 2*cycles {
		t.Errorf("%d Reserve+Release cycles took %d commits, want %d", cycles, got, 2*cycles)
	}
	// The last cleanups' done marks have no commit left to ride on: once the GC has
	// queued them, Close commits them.
	h.waitUntil(t, "every done mark committed or queued", func() bool { return l.Counts().CleanupPending == l.DeferredWaiting() })
	h.stop()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l = openLedger(t, path)
	if c := l.Counts(); c.Released != cycles || c.CleanupPending != 0 {
		t.Errorf("after reopening: %+v, want %d released, every cleanup recorded done", c, cycles)
	}
}

// The GC sees a taken-over reservation like any released one: its plugin cleanup is
// owed and done, then recorded.
func TestTakeOverOwesCleanup(t *testing.T) {
	l := newLedger(t)
	a := reserve(t, l, "nomad/a", "GPU-1", "GPU-2")
	cleaned := make(chan Entry, 1)
	h := startGC(t, l, Config{CommitDelay: time.Millisecond, Cleanup: func(_ context.Context, e Entry) error {
		cleaned <- e
		return nil
	}})
	if _, _, err := l.Reserve(context.Background(), res("nomad/b", "GPU-2"), []string{"nomad/"}, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-cleaned:
		if e.ReservationID != a.ID || !slices.Equal(e.DeviceIDs, a.DeviceIDs) || e.Plugin != a.Plugin {
			t.Errorf("cleanup of %+v, want the taken-over %s on %v", e, a.ID, a.DeviceIDs)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no cleanup for the taken-over reservation")
	}
	h.waitUntil(t, "the cleanup recorded", func() bool { return l.Counts().CleanupPending == 0 })
}

// TestCrashRedoesCleanupWhoseMarkWasDeferred: the GC records a cleanup as done in a
// later commit. A crash before that commit (the state file as it is on disk, copied
// while the done marks wait for a commit) loses nothing acknowledged: every reservation
// and release is there, and a cleanup whose done mark was lost is still pending and is
// done again by the next GC, once; the others are not redone.
func TestCrashRedoesCleanupWhoseMarkWasDeferred(t *testing.T) {
	const cycles = 5
	path := statePath(t)
	l := openLedger(t, path)
	cleaned := make(chan string)
	h := startGC(t, l, Config{
		CommitDelay: time.Hour, // the done marks can only ride on other commits
		Cleanup:     func(_ context.Context, e Entry) error { cleaned <- e.ReservationID; return nil },
	})
	var made []string
	for i := range cycles {
		r := reserve(t, l, fmt.Sprint("owner-", i), "GPU-0")
		release(t, l, r.ID, time.Time{})
		if id := <-cleaned; id != r.ID {
			t.Fatalf("cleanup of %s, want %s", id, r.ID)
		}
		made = append(made, r.ID)
	}
	h.waitUntil(t, "every done mark queued", func() bool { return l.DeferredWaiting() == cycles }) // due in an hour: none rode
	image := filepath.Join(t.TempDir(), ledger.DefaultFileName)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(image, b, 0o600); err != nil {
		t.Fatal(err)
	}
	h.stop()

	after := openLedger(t, image)
	var pending []string
	for _, id := range made {
		r, err := after.Get(id)
		switch {
		case err != nil:
			t.Errorf("acknowledged reservation %s lost: %v", id, err)
		case r.State != device.ReservationReleased:
			t.Errorf("acknowledged release of %s lost: %+v", id, r)
		case r.CleanupPending:
			pending = append(pending, id)
		}
	}
	if !slices.Contains(pending, made[cycles-1]) {
		t.Fatalf("pending cleanups after the crash %v, want the last one %s among them: its done mark had no commit to ride on", pending, made[cycles-1])
	}
	redone := make(chan string, cycles)
	h = startGC(t, after, Config{Cleanup: func(_ context.Context, e Entry) error { redone <- e.ReservationID; return nil }})
	h.waitUntil(t, "the lost cleanups redone and recorded", func() bool { return after.Counts().CleanupPending == 0 })
	h.stop()
	close(redone)
	var got []string
	for id := range redone {
		got = append(got, id)
	}
	slices.Sort(got)
	slices.Sort(pending)
	if !slices.Equal(got, pending) {
		t.Errorf("cleanups redone after the crash: %v, want exactly those still pending, once each: %v", got, pending)
	}
}
