package ledger

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
)

// commitLog records what Options.OnCommit is told. Safe for concurrent use.
type commitLog struct {
	mu     sync.Mutex
	writes []int
	took   []time.Duration
}

func (c *commitLog) observe(took time.Duration, writes int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.writes = append(c.writes, writes)
	c.took = append(c.took, took)
}

func (c *commitLog) get() ([]int, []time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]int(nil), c.writes...), append([]time.Duration(nil), c.took...)
}

func openObserved(t *testing.T) (*Ledger, *commitLog) {
	t.Helper()
	var log commitLog
	// No audit trail: a refused call's event is a write of its own, riding on a later
	// commit (events_test.go), and these tests count the calls' writes.
	l, err := Open(statePath(t), Options{Now: tickingClock(), OnCommit: log.observe, MaxEvents: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, &log
}

// OnCommit hears of every committed transaction once, with its duration and the writes
// it carried, and of nothing that was not committed.
func TestOnCommitSeesEveryCommitAndItsWrites(t *testing.T) {
	l, log := openObserved(t)

	r := reserve(t, l, "job-1", "GPU-1")
	release(t, l, r.ID, t0.Add(time.Hour))
	// Refused requests write nothing: no commit, nothing observed.
	if _, _, err := l.Reserve(context.Background(), res("job-2", "GPU-2", "GPU-2"), nil, nil); err == nil {
		t.Fatal("a Reserve naming a device twice was accepted")
	}
	if _, _, err := l.Release(context.Background(), device.ReleaseRequest{ReservationID: "res-nope"}, t0); err == nil {
		t.Fatal("Release of an unknown reservation succeeded")
	}
	writes, took := log.get()
	if fmt.Sprint(writes) != "[1 1]" {
		t.Fatalf("OnCommit writes = %v, want [1 1] (the Reserve, the Release; nothing for the refused calls)", writes)
	}
	if got := l.Commits(); got != int64(len(writes)) {
		t.Errorf("OnCommit called %d times for %d commits", len(writes), got)
	}
	for i, d := range took {
		if d <= 0 {
			t.Errorf("commit %d took %v, want > 0", i, d)
		}
	}

	// Concurrent writers share commits: every write is counted in exactly one of them.
	const n = 64
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { reserve(t, l, fmt.Sprintf("par-%d", i), fmt.Sprintf("D-%d", i)) })
	}
	wg.Wait()
	writes, _ = log.get()
	sum := 0
	for _, w := range writes[2:] {
		sum += w
	}
	if sum != n || len(writes)-2 > n {
		t.Errorf("%d concurrent reserves: OnCommit saw %d writes in %d commits, want %d in at most %d", n, sum, len(writes)-2, n, n)
	}
	if got := l.Commits(); got != int64(len(writes)) {
		t.Errorf("OnCommit called %d times for %d commits", len(writes), got)
	}
}
