package ledger

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
)

// The change feed (the GC's) is told of what released reservations need: a Release, a
// take-over, a deletion. A new live reservation, or a live one reowned, does not wake
// it, so a Reserve does not make the GC run a pass for nothing.
func TestFeedToldOfReleasedChangesOnly(t *testing.T) {
	l := newLedger(t)
	f, stop := l.Subscribe(0)
	defer stop()
	told := func() []string {
		t.Helper()
		select {
		case <-f.Wake():
		default:
			return nil
		}
		ids := f.Drain()
		slices.Sort(ids)
		return ids
	}

	a := reserve(t, l, "alloc-a", "GPU-0")
	if got := told(); got != nil {
		t.Fatalf("after a Reserve the feed was told %v, want nothing", got)
	}
	if _, err := l.Reown(context.Background(), device.ReownRequest{ReservationID: a.ID, OwnerID: "alloc-a", NewOwnerID: "alloc-b"}); err != nil {
		t.Fatal(err)
	}
	if got := told(); got != nil {
		t.Fatalf("after a Reown of a live reservation the feed was told %v, want nothing", got)
	}
	release(t, l, a.ID, time.Now())
	if got := told(); !slices.Equal(got, []string{a.ID}) {
		t.Fatalf("after a Release the feed was told %v, want [%s]", got, a.ID)
	}

	// A take-over: the new reservation is not told, the one taken over is.
	old := reserve(t, l, "kubelet/x", "GPU-1")
	r := res("k8s/pod", "GPU-1")
	got, _, err := l.Reserve(context.Background(), r, []string{"kubelet/"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.TakenOver) != 1 {
		t.Fatalf("took over %v, want [%s]", got.TakenOver, old.ID)
	}
	if ids := told(); !slices.Equal(ids, []string{old.ID}) {
		t.Fatalf("after a take-over the feed was told %v, want only the reservation taken over [%s]", ids, old.ID)
	}
}

// A feed with a limit is woken, with nothing to drain, by every commit that leaves more
// reservations than the limit, live ones included: the GC checks MaxReservations then.
func TestFeedWokenOverItsLimit(t *testing.T) {
	l := newLedger(t)
	f, stop := l.Subscribe(2)
	defer stop()
	woken := func() bool {
		select {
		case <-f.Wake():
			return true
		default:
			return false
		}
	}
	reserve(t, l, "alloc-a", "GPU-0")
	reserve(t, l, "alloc-b", "GPU-1")
	if woken() {
		t.Fatal("woken by a Reserve that leaves 2 reservations, the limit")
	}
	reserve(t, l, "alloc-c", "GPU-2")
	if !woken() {
		t.Fatal("not woken by a Reserve that leaves 3 reservations, over the limit of 2")
	}
	if ids := f.Drain(); len(ids) != 0 {
		t.Fatalf("drained %v after live reservations only, want nothing", ids)
	}
}

// The GC's own deferred writes (a cleanup recorded done, a deletion) do not wake the
// feed: it learns their outcome from their notify, and they ride on callers' commits,
// which would each wake it on their account. The same changes made by a caller do.
func TestFeedNotToldOfDeferredWrites(t *testing.T) {
	l := newLedger(t)
	a := release(t, l, reserve(t, l, "alloc-a", "GPU-0").ID, t0)
	b := release(t, l, reserve(t, l, "alloc-b", "GPU-1").ID, t0)
	f, stop := l.Subscribe(0)
	defer stop()

	notify, done := deferredDone()
	l.submitDeferred(0, cleanupDoneRun(a.ID), notify)
	notify2, done2 := deferredDone()
	l.submitDeferred(0, deleteRun([]string{b.ID}, true, "gc"), notify2)
	for _, d := range []<-chan error{done, done2} {
		if err := <-d; err != nil {
			t.Fatalf("deferred write: %v", err)
		}
	}
	c := reserve(t, l, "alloc-c", "GPU-2")
	select {
	case <-f.Wake():
		t.Fatalf("woken by two deferred writes and a Reserve; drained %v", f.Drain())
	default:
	}

	if err := l.CleanupDone(context.Background(), release(t, l, c.ID, t0).ID); err != nil {
		t.Fatal(err)
	}
	<-f.Wake()
	if ids := f.Drain(); !slices.Equal(ids, []string{c.ID}) {
		t.Fatalf("after a caller's Release and CleanupDone the feed was told %v, want [%s]", ids, c.ID)
	}
}

// A Release made in a call that defers work past its reply (device.AfterReply) leaves
// its ID in the feed at once, but wakes the feed's reader (the GC) only once the reply
// is out.
func TestFeedWokenAfterTheReply(t *testing.T) {
	l := newLedger(t)
	a := reserve(t, l, "alloc-a", "GPU-0")
	f, stop := l.Subscribe(0)
	defer stop()
	ctx, run := device.WithAfterReply(context.Background())
	if _, _, err := l.Release(ctx, device.ReleaseRequest{ReservationID: a.ID}, t0); err != nil {
		t.Fatal(err)
	}
	select {
	case <-f.Wake():
		t.Fatal("the feed was woken before the Release's reply")
	default:
	}
	run()
	select {
	case <-f.Wake():
	default:
		t.Fatal("the feed was not woken after the Release's reply")
	}
	if ids := f.Drain(); !slices.Equal(ids, []string{a.ID}) {
		t.Fatalf("the feed was told %v, want [%s]", ids, a.ID)
	}
}

// deferredDone returns a notify func for submitDeferred and the channel it reports on.
func deferredDone() (func(error), <-chan error) {
	ch := make(chan error, 1)
	return func(err error) { ch <- err }, ch
}
