package store

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	bolt "go.etcd.io/bbolt"
)

var (
	errClosed  = errors.New("closed")
	testBucket = []byte("b")
)

// testBatch is a batch's state in these tests: its transaction and whether it wrote.
type testBatch struct {
	tx    *bolt.Tx
	wrote bool
}

// put is a write of the batch: key set to val.
func put(key, val string) func(b *testBatch) (any, error) {
	return func(b *testBatch) (any, error) {
		bk, err := b.tx.CreateBucketIfNotExists(testBucket)
		if err == nil {
			err = bk.Put([]byte(key), []byte(val))
		}
		if err != nil {
			return nil, &StorageError{Err: err}
		}
		b.wrote = true
		return key, nil
	}
}

// replies holds the work deferred until a reply, by context, for AfterReply.
type replies struct {
	mu      sync.Mutex
	pending map[context.Context][]func()
}

type replyKey struct{}

// withReply returns a context whose AfterReply work waits until run is called.
func (r *replies) withReply() (ctx context.Context, run func()) {
	ctx = context.WithValue(context.Background(), replyKey{}, new(int))
	return ctx, func() {
		r.mu.Lock()
		fns := r.pending[ctx]
		delete(r.pending, ctx)
		r.mu.Unlock()
		for _, fn := range fns {
			fn()
		}
	}
}

func (r *replies) afterReply(ctx context.Context, fn func()) {
	if ctx.Value(replyKey{}) == nil {
		fn()
		return
	}
	r.mu.Lock()
	r.pending[ctx] = append(r.pending[ctx], fn)
	r.mu.Unlock()
}

// newCommitter opens a bbolt file in a temporary dir and returns a Committer on it and
// the replies its AfterReply defers to; cleanup closes both.
func newCommitter(t *testing.T) (*Committer[*testBatch], *bolt.DB, *replies) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "state.db")
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := &replies{pending: map[context.Context][]func(){}}
	c := NewCommitter(db, path, CommitConfig[*testBatch]{
		Begin:      func(tx *bolt.Tx) *testBatch { return &testBatch{tx: tx} },
		End:        func(b *testBatch) (bool, error) { return b.wrote, nil },
		AfterReply: r.afterReply,
		Closed:     errClosed,
	})
	t.Cleanup(func() {
		c.Close()
		db.Close()
	})
	return c, db, r
}

// get reads key from db.
func get(t *testing.T, db *bolt.DB, key string) string {
	t.Helper()
	var v string
	if err := db.View(func(tx *bolt.Tx) error {
		if b := tx.Bucket(testBucket); b != nil {
			v = string(b.Get([]byte(key)))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return v
}

// holdLeader submits a write that blocks inside its batch until the returned func is
// called, so that the writes submitted meanwhile queue behind it. It returns once the
// batch is running; the func waits for the held write's answer.
func holdLeader(t *testing.T, c *Committer[*testBatch]) (release func()) {
	t.Helper()
	entered, unblock := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := c.Submit(context.Background(), func(*testBatch) (any, error) {
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
func queued(c *Committer[*testBatch], n int) {
	for {
		c.wmu.Lock()
		q := len(c.queue)
		c.wmu.Unlock()
		if q >= n {
			return
		}
		time.Sleep(50 * time.Microsecond) // polling a condition that will hold, not a timing
	}
}

// deferredDone returns a notify func for SubmitDeferred and the channel it reports on.
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
func makeDue(c *Committer[*testBatch]) {
	c.deferMu.Lock()
	c.deferDue = time.Now().Add(-time.Nanosecond)
	c.deferMu.Unlock()
}

// TestQueuedWriteWithdrawnWhenItsContextEnds: a write queued behind a commit that does
// not end (a disk that hangs) returns its context's error when that ends and is never
// applied; the writes queued beside it are not disturbed.
func TestQueuedWriteWithdrawnWhenItsContextEnds(t *testing.T) {
	c, _, _ := newCommitter(t)
	release := holdLeader(t, c)

	var applied atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	withdrawn := make(chan error, 1)
	go func() {
		_, err := c.Submit(ctx, func(*testBatch) (any, error) {
			applied.Add(1)
			return nil, nil
		})
		withdrawn <- err
	}()
	queued(c, 1)
	var wg sync.WaitGroup
	var kept atomic.Int32
	wg.Go(func() {
		if _, err := c.Submit(context.Background(), func(*testBatch) (any, error) {
			kept.Add(1)
			return nil, nil
		}); err != nil {
			t.Errorf("the write queued beside it: %v", err)
		}
	})
	queued(c, 2)

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
	if len(c.slots) != 0 {
		t.Errorf("%d queue slots still taken with nothing queued", len(c.slots))
	}
}

// TestGroupCommitHandsTheLeadOn: many writers at once, each answered exactly once with
// its own result, in few commits, none left waiting, and no one leading afterwards (an
// idle Committer runs no goroutine of its own).
func TestGroupCommitHandsTheLeadOn(t *testing.T) {
	c, db, _ := newCommitter(t)
	release := holdLeader(t, c)
	const n = 300 // more than one batch (MaxBatch) queues behind the held one
	var wg sync.WaitGroup
	results := make([]any, n)
	for i := range n {
		wg.Go(func() {
			v, err := c.Submit(context.Background(), put(fmt.Sprint(i), "v"))
			if err != nil {
				t.Errorf("write %d: %v", i, err)
			}
			results[i] = v
		})
	}
	queued(c, n)
	release()
	wg.Wait()
	for i, v := range results {
		if v != fmt.Sprint(i) || get(t, db, fmt.Sprint(i)) != "v" {
			t.Fatalf("write %d answered %v", i, v)
		}
	}
	if got := c.Commits(); got != 2 {
		t.Errorf("%d writes queued behind one commit took %d commits, want 2 (batches of %d)", n, got, MaxBatch)
	}
	c.wmu.Lock()
	leading, q := c.leading, len(c.queue)
	c.wmu.Unlock()
	if leading || q != 0 || len(c.slots) != 0 {
		t.Errorf("after every answer: leading %v, %d queued, %d slots taken; want none", leading, q, len(c.slots))
	}
}

// TestStorageFailureFailsOnlyItsWrite: a write whose storage fails in a batch makes the
// batch be retried one write at a time, so that only it fails.
func TestStorageFailureFailsOnlyItsWrite(t *testing.T) {
	c, db, _ := newCommitter(t)
	release := holdLeader(t, c)
	errDisk := errors.New("disk on fire")
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range 3 {
		wg.Go(func() {
			run := put(fmt.Sprint(i), "v")
			if i == 1 {
				run = func(*testBatch) (any, error) { return nil, &StorageError{Err: errDisk} }
			}
			_, errs[i] = c.Submit(context.Background(), run)
		})
		queued(c, i+1)
	}
	release()
	wg.Wait()
	if errs[0] != nil || errs[2] != nil || !errors.Is(errs[1], errDisk) {
		t.Fatalf("errors %v, want only the second write's storage failure", errs)
	}
	if get(t, db, "0") != "v" || get(t, db, "2") != "v" {
		t.Error("the writes beside the failed one are not in the file")
	}
}

// TestCloseAnswersQueuedWrites: Close while writes are queued behind a running commit
// commits them all; a write after Close gets Config.Closed.
func TestCloseAnswersQueuedWrites(t *testing.T) {
	c, _, _ := newCommitter(t)
	release := holdLeader(t, c)
	var wg sync.WaitGroup
	for i := range 5 {
		wg.Go(func() {
			if _, err := c.Submit(context.Background(), put(fmt.Sprint(i), "v")); err != nil {
				t.Errorf("write %d queued before Close: %v", i, err)
			}
		})
	}
	queued(c, 5)
	closed := make(chan struct{})
	go func() { c.Close(); close(closed) }()
	release()
	wg.Wait()
	<-closed
	if _, err := c.Submit(context.Background(), put("late", "v")); !errors.Is(err, errClosed) {
		t.Errorf("write after Close: %v, want the Closed error", err)
	}
}

// TestLeaderKickedByDueDeferredWritesLetsGo: deferred writes falling due while a caller
// leads are committed, and the caller gets its answer and stops leading: it does not go
// on committing for others once its own write is done.
func TestLeaderKickedByDueDeferredWritesLetsGo(t *testing.T) {
	c, db, _ := newCommitter(t)
	release := holdLeader(t, c)
	notify, done := deferredDone()
	c.SubmitDeferred(0, put("d", "v"), notify) // due at once: the timer kicks the leader
	for {
		c.wmu.Lock()
		kicked := c.kicked
		c.wmu.Unlock()
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
	if get(t, db, "d") != "v" {
		t.Error("the deferred write is not in the file")
	}
	for { // the timer's goroutine may still be stopping its lead
		c.wmu.Lock()
		leading := c.leading
		c.wmu.Unlock()
		if !leading {
			break
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// TestDeferredWriteRidesOnTheNextCommitOnceDue: a deferred write waits, uncommitted,
// until it is due: a commit made before that does not carry it; the first commit after
// it does, in the same commit.
func TestDeferredWriteRidesOnTheNextCommitOnceDue(t *testing.T) {
	c, db, _ := newCommitter(t)
	notify, done := deferredDone()
	c.SubmitDeferred(time.Hour, put("d", "v"), notify)
	if _, err := c.Submit(context.Background(), put("a", "v")); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		t.Fatalf("deferred write committed (err %v) before it was due", err)
	default:
	}
	if get(t, db, "d") != "" {
		t.Error("the deferred write is in the file before it was due")
	}
	makeDue(c)
	commits := c.Commits()
	if _, err := c.Submit(context.Background(), put("b", "v")); err != nil {
		t.Fatal(err)
	}
	select { // answered before the write it rode with
	case err := <-done:
		if err != nil {
			t.Fatalf("deferred write: %v", err)
		}
	default:
		t.Fatal("the write committed without the deferred write waiting before it")
	}
	if got := c.Commits() - commits; got != 1 || get(t, db, "d") != "v" {
		t.Errorf("the write and the deferred write took %d commits, want 1", got)
	}
}

// TestDeferredWriteCommitsWhenDue: with no other write coming, a deferred write gets a
// commit of its own once it is due, not before. On synctest's clock, so "once it is
// due" is to the nanosecond.
func TestDeferredWriteCommitsWhenDue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const delay = time.Second
		c, db, _ := newCommitter(t)
		notify, done := deferredDone()
		c.SubmitDeferred(delay, put("d", "v"), notify)
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
		if got := c.Commits(); got != 1 || get(t, db, "d") != "v" {
			t.Errorf("%d commits, want 1 with the write", got)
		}
	})
}

// TestDeferredWritesOfAFullBatchDoNotWait: once a batch's worth of deferred writes is
// waiting, they are committed at once, together.
func TestDeferredWritesOfAFullBatchDoNotWait(t *testing.T) {
	c, _, _ := newCommitter(t)
	outcomes := make(chan error, MaxBatch)
	for i := range MaxBatch {
		c.SubmitDeferred(time.Hour, put(fmt.Sprint(i), "v"), func(err error) { outcomes <- err })
	}
	for range MaxBatch {
		if err := waitDeferred(t, outcomes); err != nil {
			t.Fatalf("deferred write: %v", err)
		}
	}
	if got := c.Commits(); got != 1 {
		t.Errorf("%d deferred writes took %d commits, want 1", MaxBatch, got)
	}
}

// TestCloseCommitsDeferredWrites: Close commits the deferred writes still waiting, and
// a deferred write after Close is refused with Config.Closed at once.
func TestCloseCommitsDeferredWrites(t *testing.T) {
	c, db, _ := newCommitter(t)
	notify, done := deferredDone()
	c.SubmitDeferred(time.Hour, put("d", "v"), notify)
	if got := c.Waiting(); got != 1 {
		t.Errorf("Waiting = %d, want 1", got)
	}
	c.Close()
	if err := waitDeferred(t, done); err != nil {
		t.Fatalf("deferred write at Close: %v", err)
	}
	if get(t, db, "d") != "v" {
		t.Error("the deferred write is not in the file after Close")
	}
	notify, done = deferredDone()
	c.SubmitDeferred(time.Hour, put("e", "v"), notify)
	if err := waitDeferred(t, done); !errors.Is(err, errClosed) {
		t.Errorf("deferred write after Close: err = %v, want the Closed error", err)
	}
}

// TestDeferredWritesNotifyAfterTheReply: a deferred write that rides on a caller's
// commit is durable when the caller's write is, but its notify (which wakes its writer)
// waits until the caller's reply is out (Config.AfterReply), so the caller does not
// wait for that wake-up.
func TestDeferredWritesNotifyAfterTheReply(t *testing.T) {
	c, db, r := newCommitter(t)
	notify, done := deferredDone()
	c.SubmitDeferred(time.Hour, put("d", "v"), notify)
	makeDue(c)
	ctx, run := r.withReply()
	if _, err := c.Submit(ctx, put("a", "v")); err != nil {
		t.Fatal(err)
	}
	if get(t, db, "d") != "v" {
		t.Fatal("the deferred write did not ride on the caller's commit")
	}
	select {
	case err := <-done:
		t.Fatalf("notified (err %v) before the caller's reply", err)
	default:
	}
	run()
	if err := waitDeferred(t, done); err != nil {
		t.Fatalf("deferred write: %v", err)
	}
}
