package ledger

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// holdLeader submits a write that blocks inside its batch until the returned func is
// called, so that the writes submitted meanwhile queue behind it. It returns once the
// batch is running; the func waits for the held write's answer.
func holdLeader(t *testing.T, l *Ledger) (release func()) {
	t.Helper()
	entered, unblock := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := l.submit(context.Background(), func(*txn) (any, error) {
			close(entered)
			<-unblock
			return nil, nil
		})
		done <- err
	}()
	<-entered
	return func() {
		close(unblock)
		if err := <-done; err != nil {
			t.Errorf("the held write: %v", err)
		}
	}
}

// queued waits until n requests are queued behind the leader.
func queued(l *Ledger, n int) {
	for {
		l.wmu.Lock()
		q := len(l.queue)
		l.wmu.Unlock()
		if q >= n {
			return
		}
		time.Sleep(50 * time.Microsecond) // polling a condition that will hold, not a timing

	}
}

// TestQueuedWriteWithdrawnWhenItsContextEnds: a write queued behind a commit that does
// not end (a disk that hangs) returns its context's error when that ends and is never
// applied; the writes queued beside it are not disturbed.
func TestQueuedWriteWithdrawnWhenItsContextEnds(t *testing.T) {
	l := newLedger(t)
	release := holdLeader(t, l)

	var applied atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	withdrawn := make(chan error, 1)
	go func() {
		_, err := l.submit(ctx, func(*txn) (any, error) {
			applied.Add(1)
			return nil, nil
		})
		withdrawn <- err
	}()
	queued(l, 1)
	var wg sync.WaitGroup
	var kept atomic.Int32
	wg.Add(1)
	go func() {
		defer wg.Done()
		if _, err := l.submit(context.Background(), func(*txn) (any, error) {
			kept.Add(1)
			return nil, nil
		}); err != nil {
			t.Errorf("the write queued beside it: %v", err)
		}
	}()
	queued(l, 2)

	cancel()
	if err := <-withdrawn; !errors.Is(err, context.Canceled) {
		t.Fatalf("withdrawn write returned %v, want context.Canceled", err)
	}
	release()
	wg.Wait()
	if applied.Load() != 0 {
		t.Errorf("the withdrawn write was applied %d times", applied.Load())
	}
	if kept.Load() != 1 {
		t.Errorf("the write queued beside it was applied %d times, want once", kept.Load())
	}
	if len(l.slots) != 0 {
		t.Errorf("%d queue slots still taken with nothing queued", len(l.slots))
	}
}

// TestGroupCommitHandsTheLeadOn: many writers at once, each answered exactly once with
// its own result, none left waiting, and no one leading afterwards (an idle ledger
// runs no goroutine of its own).
func TestGroupCommitHandsTheLeadOn(t *testing.T) {
	l := newLedger(t)
	release := holdLeader(t, l)
	const n = 300 // more than one batch (maxBatch) queues behind the held one
	var wg sync.WaitGroup
	results := make([]any, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			v, err := l.submit(context.Background(), func(*txn) (any, error) { return i, nil })
			if err != nil {
				t.Errorf("write %d: %v", i, err)
			}
			results[i] = v
		}()
	}
	queued(l, n)
	release()
	wg.Wait()
	for i, v := range results {
		if v != i {
			t.Fatalf("write %d answered %v", i, v)
		}
	}
	l.wmu.Lock()
	leading, q := l.leading, len(l.queue)
	l.wmu.Unlock()
	if leading || q != 0 || len(l.slots) != 0 {
		t.Errorf("after every answer: leading %v, %d queued, %d slots taken; want none", leading, q, len(l.slots))
	}
}

// TestCloseAnswersQueuedWrites: Close while writes are queued behind a running commit
// commits them all before closing the file; a write after Close gets ErrClosed.
func TestCloseAnswersQueuedWrites(t *testing.T) {
	l := newLedger(t)
	release := holdLeader(t, l)
	var wg sync.WaitGroup
	for i := range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := l.submit(context.Background(), func(*txn) (any, error) { return i, nil }); err != nil {
				t.Errorf("write %d queued before Close: %v", i, err)
			}
		}()
	}
	queued(l, 5)
	closed := make(chan error, 1)
	go func() { closed <- l.Close() }()
	release()
	wg.Wait()
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if _, err := l.submit(context.Background(), func(*txn) (any, error) { return nil, nil }); !errors.Is(err, ErrClosed) {
		t.Errorf("write after Close: %v, want ErrClosed", err)
	}
}

// TestLeaderKickedByDueDeferredWritesLetsGo: deferred writes falling due while a caller
// leads are committed, and the caller gets its answer and stops leading: it does not go
// on committing for others once its own write is done.
func TestLeaderKickedByDueDeferredWritesLetsGo(t *testing.T) {
	l := newLedger(t)
	r := release(t, l, reserve(t, l, "a", "GPU-1").ID, t0)
	release := holdLeader(t, l) // the held batch took the deferred writes waiting: none
	notify, done := deferredDone()
	l.submitDeferred(0, cleanupDoneRun(r.ID), notify) // due at once: the timer kicks the leader
	for {
		l.wmu.Lock()
		kicked := l.kicked
		l.wmu.Unlock()
		if kicked {
			break
		}
		time.Sleep(50 * time.Microsecond) // polling a condition that will hold
	}
	answered := make(chan struct{})
	go func() { release(); close(answered) }()
	select {
	case <-answered:
	case <-time.After(time.Minute): // a failsafe, not a measurement: it takes microseconds
		t.Fatal("the leader did not answer its own write after a kick")
	}
	if err := <-done; err != nil {
		t.Fatalf("the deferred write: %v", err)
	}
	if got, _ := l.Get(r.ID); got.CleanupPending {
		t.Errorf("after the deferred write: %+v, want the cleanup recorded done", got)
	}
	for { // the timer's goroutine may still be stopping its lead
		l.wmu.Lock()
		leading := l.leading
		l.wmu.Unlock()
		if !leading {
			break
		}
		time.Sleep(50 * time.Microsecond)
	}
}
