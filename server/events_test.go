package server_test

import (
	"context"
	"io"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// trail is a fake audit trail: events appended by the test, pages of at most 2.
type trail struct {
	mu     sync.Mutex
	events []device.Event
	wake   chan struct{}
}

func (tr *trail) add(e device.Event) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	e.Seq = uint64(len(tr.events) + 1)
	tr.events = append(tr.events, e)
	close(tr.wake)
	tr.wake = make(chan struct{})
}

func (tr *trail) page(_ context.Context, f device.EventFilter) (device.EventsResult, error) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	out := device.EventsResult{Through: f.After, Oldest: 1}
	for _, e := range tr.events {
		if e.Seq > f.After && len(out.Events) < 2 {
			if f.Owner == "" || e.Owner == f.Owner {
				out.Events = append(out.Events, e)
			}
			out.Through = e.Seq
		}
	}
	return out, nil
}

func (tr *trail) after(seq uint64) <-chan struct{} {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if uint64(len(tr.events)) > seq {
		done := make(chan struct{})
		close(done)
		return done
	}
	return tr.wake
}

// WatchEvents reads the whole trail page by page and ends, or with follow goes on
// with each new event; a bad filter is refused.
func TestWatchEvents(t *testing.T) {
	tr := &trail{wake: make(chan struct{})}
	for _, o := range []string{"a", "b", "a", "c", "a"} {
		tr.add(device.Event{Kind: device.EventReserve, Owner: o})
	}
	h := startHost(t, &devicetest.Fake{EventsFunc: tr.page, EventsAfterFunc: tr.after})
	ctx := testContext(t)
	read := func(s pb.DeviceHost_WatchEventsClient, n int) []uint64 {
		t.Helper()
		var seqs []uint64
		for len(seqs) < n {
			resp, err := s.Recv()
			if err != nil {
				t.Fatalf("after %v: %v", seqs, err)
			}
			for _, e := range resp.GetEvents() {
				seqs = append(seqs, e.GetSeq())
			}
		}
		return seqs
	}
	s, err := h.client.WatchEvents(ctx, &pb.WatchEventsRequest{OwnerId: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if got := read(s, 3); len(got) != 3 || got[0] != 1 || got[1] != 3 || got[2] != 5 {
		t.Errorf("events of a: %v, want 1, 3, 5", got)
	}
	if _, err := s.Recv(); err != io.EOF {
		t.Errorf("end of the trail without follow: %v, want the stream to end", err)
	}

	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	f, err := h.client.WatchEvents(fctx, &pb.WatchEventsRequest{AfterSeq: 4, Follow: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := read(f, 1); got[0] != 5 {
		t.Fatalf("follow after 4: %v", got)
	}
	tr.add(device.Event{Kind: device.EventRelease, Owner: "a"})
	if got := read(f, 1); got[0] != 6 {
		t.Errorf("the new event: %v, want 6", got)
	}

	bad, err := h.client.WatchEvents(ctx, &pb.WatchEventsRequest{OwnerId: "a\nb"})
	if err == nil {
		_, err = bad.Recv()
	}
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("a filter that is not printable: %v", err)
	}
}
