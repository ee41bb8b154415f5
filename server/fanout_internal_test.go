package server

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// testFeeds is a feeds[int] on a manager channel the test writes.
type testFeeds struct {
	fs   *feeds[int]
	ch   chan int
	quit chan struct{}
}

func newTestFeeds(t *testing.T) *testFeeds {
	t.Helper()
	tf := &testFeeds{ch: make(chan int), quit: make(chan struct{})}
	tf.fs = newFeeds[int](tf.quit)
	t.Cleanup(func() {
		close(tf.quit)
		tf.fs.close()
	})
	return tf
}

func (tf *testFeeds) subscribe(context.Context) <-chan int { return tf.ch }

// send hands v to the feed, as the Manager would.
func (tf *testFeeds) send(t *testing.T, ctx context.Context, v int) {
	t.Helper()
	select {
	case tf.ch <- v:
	case <-ctx.Done():
		t.Fatalf("the feed did not take value %d", v)
	}
}

// countingEncoder encodes an int as one byte and counts its calls.
type countingEncoder struct{ calls atomic.Int32 }

func (e *countingEncoder) encode(v int) *frame {
	e.calls.Add(1)
	return &frame{data: []byte{byte(v)}}
}

// reader plays a stream: on each wake it takes its group's frame and answers the round;
// the values it saw arrive on got.
type reader struct {
	f   *feed[int]
	sub *sub
	got chan int
}

func (tf *testFeeds) join(t *testing.T, ctx context.Context, wg *sync.WaitGroup, filter string, enc *countingEncoder) *reader {
	t.Helper()
	f, s, _, _, ok := tf.fs.join("", tf.subscribe, 0, filter, enc.encode)
	if !ok {
		t.Fatal("join refused")
	}
	r := &reader{f: f, sub: s, got: make(chan int, 100)}
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer f.leave(s)
		var last *frame
		for {
			select {
			case <-ctx.Done():
				return
			case b := <-s.wake:
				if fr := s.cur.Load(); fr != last {
					last = fr
					r.got <- int(fr.data[0])
				}
				b.done()
			}
		}
	}()
	return r
}

func (r *reader) want(t *testing.T, ctx context.Context, v int) {
	t.Helper()
	select {
	case got := <-r.got:
		if got != v {
			t.Errorf("stream got %d, want %d", got, v)
		}
	case <-ctx.Done():
		t.Fatalf("stream did not get %d", v)
	}
}

func TestFeedEncodesOncePerFilterAndChange(t *testing.T) {
	tf := newTestFeeds(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()

	var encA, encB countingEncoder
	var readers []*reader
	for range 3 {
		readers = append(readers, tf.join(t, ctx, &wg, "a", &encA))
	}
	for range 2 {
		readers = append(readers, tf.join(t, ctx, &wg, "b", &encB))
	}
	for v := 1; v <= 3; v++ {
		tf.send(t, ctx, v)
		for _, r := range readers {
			r.want(t, ctx, v)
		}
	}
	if got := encA.calls.Load(); got != 3 {
		t.Errorf("filter a (3 streams): %d encodings for 3 changes, want 3", got)
	}
	if got := encB.calls.Load(); got != 3 {
		t.Errorf("filter b (2 streams): %d encodings for 3 changes, want 3", got)
	}
	// A new stream with a known filter takes the frame made already; one with a new
	// filter encodes the latest value once.
	var encC countingEncoder
	_, _, curA, _, _ := tf.fs.join("", tf.subscribe, 0, "a", encA.encode)
	_, _, curC, hadValue, _ := tf.fs.join("", tf.subscribe, 0, "c", encC.encode)
	if !hadValue || curA == nil || curA.data[0] != 3 || curC == nil || curC.data[0] != 3 {
		t.Errorf("joining a feed with a value: hadValue %v, frames %v %v, want the latest (3)", hadValue, curA, curC)
	}
	if encA.calls.Load() != 3 || encC.calls.Load() != 1 {
		t.Errorf("joining: %d more encodings for a known filter (want 0), %d for a new one (want 1)", encA.calls.Load()-3, encC.calls.Load())
	}
}

func TestFeedSkipsStuckAndBusyStreams(t *testing.T) {
	tf := newTestFeeds(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()

	var enc countingEncoder
	// Streams that never take a wake (their goroutine is stuck), more than the round's
	// senders, and one that is busy sending all along.
	for range fanoutSenders + 2 {
		f, s, _, _, _ := tf.fs.join("", tf.subscribe, 0, "", enc.encode)
		defer f.leave(s)
	}
	f, busy, _, _, _ := tf.fs.join("", tf.subscribe, 0, "", enc.encode)
	defer f.leave(busy)
	busy.busy.Store(true)
	r := tf.join(t, ctx, &wg, "", &enc)

	for v := 1; v <= 20; v++ {
		tf.send(t, ctx, v)
		r.want(t, ctx, v)
	}
	// The busy stream is woken without being waited for, and when it is done it finds
	// the newest frame, not a backlog.
	busy.busy.Store(false)
	select {
	case b := <-busy.wake:
		if b != nil {
			t.Error("a busy stream's wake carries a round to answer")
		}
	default:
		t.Fatal("the busy stream was not woken")
	}
	if got := busy.cur.Load().data[0]; got != 20 {
		t.Errorf("busy stream's frame is %d, want the newest, 20", got)
	}
	if len(busy.wake) != 0 {
		t.Error("wakes queue up for a busy stream")
	}
}

func TestPacerBoundsRoundTimeShare(t *testing.T) {
	start := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	p := newPacer(start)
	// A quiet feed's rounds go at once, up to the burst.
	if d := p.delay(start); d != 0 {
		t.Fatalf("first round waits %v, want 0", d)
	}
	p.spend(fanoutBurst + 100*time.Millisecond)
	// 100ms over the burst: at fanoutShare a second, that is paid back after 400ms.
	want := time.Duration(float64(100*time.Millisecond) / fanoutShare)
	if d := p.delay(start); d != want {
		t.Errorf("after overspending by 100ms, wait %v, want %v", d, want)
	}
	if d := p.delay(start.Add(want)); d != 0 {
		t.Errorf("after waiting %v, wait %v more, want 0", want, d)
	}
	// Over a long run of back-to-back rounds, rounds take at most fanoutShare of the time.
	now := start.Add(time.Hour)
	p = newPacer(now)
	var busy time.Duration
	for range 1000 {
		now = now.Add(p.delay(now))
		p.spend(50 * time.Millisecond)
		busy += 50 * time.Millisecond
		now = now.Add(50 * time.Millisecond)
	}
	elapsed := now.Sub(start.Add(time.Hour))
	if share := float64(busy-fanoutBurst) / float64(elapsed); share > fanoutShare+0.001 {
		t.Errorf("rounds took %.3f of the time beyond the burst, want at most %v", share, fanoutShare)
	}
}
