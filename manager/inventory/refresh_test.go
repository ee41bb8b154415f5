package inventory

import (
	"context"
	"testing"

	"github.com/devicehost/devicehost/device"
)

// TestRefreshPublishesAfterTheReply: a Refresh made in a call's context shows in
// Snapshot at once, and reaches the watchers already subscribed once the call's reply
// is out (device.AfterReply); a watcher subscribing in between gets it once, not twice.
func TestRefreshPublishesAfterTheReply(t *testing.T) {
	holders := map[string]device.Holder{}
	r := New(Config{Holders: func() map[string]device.Holder { return holders }})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	early := r.Watch(ctx)
	first := (<-early).Seq

	holders["g0"] = device.Holder{ReservationID: "r1", OwnerID: "o"}
	call, run := device.WithAfterReply(context.Background())
	r.Refresh(call)
	seq := r.Snapshot().Seq
	if seq <= first {
		t.Fatalf("Snapshot's Seq is %d after Refresh, want past %d", seq, first)
	}
	select {
	case s := <-early:
		t.Fatalf("a watcher got snapshot %d before the call's reply", s.Seq)
	default:
	}
	late := r.Watch(ctx)
	if s := <-late; s.Seq != seq {
		t.Fatalf("a watcher subscribing after the Refresh starts at %d, want %d", s.Seq, seq)
	}
	run()
	if s := <-early; s.Seq != seq {
		t.Fatalf("after the reply the early watcher got %d, want %d", s.Seq, seq)
	}
	select {
	case s := <-late:
		t.Fatalf("the late watcher got snapshot %d a second time", s.Seq)
	default:
	}
}
