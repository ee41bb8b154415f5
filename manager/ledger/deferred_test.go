package ledger

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/devicehost/devicehost/device"
)

// deferredDone returns a notify func for submitDeferred and the channel it reports on.
func deferredDone() (func(error), <-chan error) {
	ch := make(chan error, 1)
	return func(err error) { ch <- err }, ch
}

// waitDeferred waits for a deferred write's outcome.
func waitDeferred(t *testing.T, ch <-chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("timed out waiting for a deferred write to be committed")
		return nil
	}
}

// makeDue makes the deferred writes waiting due now, as if their delay had passed,
// without their timer firing (it is set for their real due time).
func makeDue(l *Ledger) {
	l.deferMu.Lock()
	l.deferDue = time.Now().Add(-time.Nanosecond)
	l.deferMu.Unlock()
}

// TestDeferredWriteRidesOnTheNextCommitOnceDue: a deferred write waits, uncommitted and
// unseen, until it is due: a commit made before that does not carry it; the first
// commit after it does, in the same commit.
func TestDeferredWriteRidesOnTheNextCommitOnceDue(t *testing.T) {
	l := newLedger(t)
	r := release(t, l, reserve(t, l, "a", "GPU-1").ID, t0)

	notify, done := deferredDone()
	l.submitDeferred(time.Hour, cleanupDoneRun(r.ID), notify)
	reserve(t, l, "c", "GPU-3")
	select {
	case err := <-done:
		t.Fatalf("deferred write committed (err %v) before it was due", err)
	default:
	}
	if got, _ := l.Get(r.ID); !got.CleanupPending {
		t.Errorf("before it was due the deferred cleanup-done shows: %+v", got)
	}

	makeDue(l)
	commits := l.Commits()
	reserve(t, l, "b", "GPU-2")
	select { // answered before the Reserve it rode with
	case err := <-done:
		if err != nil {
			t.Fatalf("deferred write: %v", err)
		}
	default:
		t.Fatal("the Reserve committed without the deferred write waiting before it")
	}
	if got := l.Commits() - commits; got != 1 {
		t.Errorf("the Reserve and the deferred write took %d commits, want 1", got)
	}
	if got, _ := l.Get(r.ID); got.CleanupPending {
		t.Errorf("after the commit: %+v, want the cleanup recorded done", got)
	}
}

// TestDeferredWriteCommitsWhenDue: with no other write coming, a deferred write gets a
// commit of its own once it is due, not before. On synctest's clock, so "once it is
// due" is to the nanosecond.
func TestDeferredWriteCommitsWhenDue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const delay = time.Second
		l := newLedger(t)
		r := release(t, l, reserve(t, l, "a", "GPU-1").ID, t0)
		commits := l.Commits()
		notify, done := deferredDone()
		l.submitDeferred(delay, cleanupDoneRun(r.ID), notify)
		time.Sleep(delay - time.Nanosecond)
		synctest.Wait()
		select {
		case err := <-done:
			t.Fatalf("deferred write committed (err %v) before it was due", err)
		default:
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait() // the commit, fsync included, is done or blocked
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("deferred write: %v", err)
			}
		default:
			t.Fatal("deferred write not committed once it was due")
		}
		if got := l.Commits() - commits; got != 1 {
			t.Errorf("%d commits, want 1", got)
		}
		if got, _ := l.Get(r.ID); got.CleanupPending {
			t.Errorf("after the commit: %+v, want the cleanup recorded done", got)
		}
	})
}

// TestDeferredWritesOfAFullBatchDoNotWait: once a batch's worth of deferred writes is
// waiting, they are committed at once, together.
func TestDeferredWritesOfAFullBatchDoNotWait(t *testing.T) {
	l := newLedger(t)
	commits := l.Commits()
	outcomes := make(chan error, maxBatch)
	for i := range maxBatch {
		r := res(fmt.Sprint("o", i), fmt.Sprint("GPU-", i))
		r.ID, r.State, r.CreatedAt = fmt.Sprintf("res-%04d", i), device.ReservationActive, t0
		run := func(w *txn) (any, error) { return nil, w.putReservation(&r) }
		l.submitDeferred(time.Hour, run, func(err error) { outcomes <- err })
	}
	for range maxBatch {
		if err := waitDeferred(t, outcomes); err != nil {
			t.Fatalf("deferred write: %v", err)
		}
	}
	if got := l.Commits() - commits; got != 1 {
		t.Errorf("%d deferred writes took %d commits, want 1", maxBatch, got)
	}
	if got := l.Counts().Live; got != maxBatch {
		t.Errorf("%d live reservations, want %d", got, maxBatch)
	}
}

// TestCloseCommitsDeferredWrites: Close commits the deferred writes still waiting, and
// a deferred write after Close is refused with ErrClosed.
func TestCloseCommitsDeferredWrites(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := release(t, l, reserve(t, l, "a", "GPU-1").ID, t0)
	notify, done := deferredDone()
	l.submitDeferred(time.Hour, cleanupDoneRun(r.ID), notify)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := waitDeferred(t, done); err != nil {
		t.Fatalf("deferred write at Close: %v", err)
	}
	notify, done = deferredDone()
	l.submitDeferred(time.Hour, cleanupDoneRun(r.ID), notify)
	if err := waitDeferred(t, done); !errors.Is(err, ErrClosed) {
		t.Errorf("deferred write after Close: err = %v, want ErrClosed", err)
	}

	l = openLedger(t, path)
	if got, err := l.Get(r.ID); err != nil || got.CleanupPending {
		t.Errorf("after reopening: %+v, %v; want the cleanup recorded done", got, err)
	}
}

// TestGCReserveReleaseCycleCommitsTwice: with a GC running, each Reserve+Release cycle
// at one caller costs two commits: the GC's cleanup-done records make none of their own
// (here they wait an hour to ride on one). They are all durable once the ledger is
// closed.
func TestGCReserveReleaseCycleCommitsTwice(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	cleaned := make(chan string, 1)
	h := startGC(t, l, GCConfig{
		Cleanup:     func(_ context.Context, e GCEntry) error { cleaned <- e.ReservationID; return nil },
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
	queued := func() int {
		l.deferMu.Lock()
		defer l.deferMu.Unlock()
		return len(l.deferred)
	}
	h.waitUntil(t, "every done mark committed or queued", func() bool { return l.Counts().CleanupPending == queued() })
	h.stop()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l = openLedger(t, path)
	if c := l.Counts(); c.Released != cycles || c.CleanupPending != 0 {
		t.Errorf("after reopening: %+v, want %d released, every cleanup recorded done", c, cycles)
	}
}

// TestDeferredWritesNotifyAfterTheReply: a deferred write that rides on a caller's
// commit is durable when the caller's write is, but its notify (which wakes the GC)
// waits until the caller's reply is out (device.AfterReply), so the caller does not
// wait for that wake-up.
func TestDeferredWritesNotifyAfterTheReply(t *testing.T) {
	l := newLedger(t)
	r := release(t, l, reserve(t, l, "a", "GPU-1").ID, t0)
	notify, done := deferredDone()
	l.submitDeferred(time.Hour, cleanupDoneRun(r.ID), notify)
	makeDue(l)

	ctx, run := device.WithAfterReply(context.Background())
	if _, _, err := l.Reserve(ctx, res("b", "GPU-2"), nil, nil); err != nil {
		t.Fatal(err)
	}
	if got, _ := l.Get(r.ID); got.CleanupPending {
		t.Fatal("the deferred write did not ride on the Reserve's commit")
	}
	select {
	case err := <-done:
		t.Fatalf("notified (err %v) before the Reserve's reply", err)
	default:
	}
	run()
	if err := waitDeferred(t, done); err != nil {
		t.Fatalf("deferred write: %v", err)
	}
}
