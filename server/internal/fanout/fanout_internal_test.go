package fanout

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testFeeds is a Feeds[int] on a manager channel the test writes.
type testFeeds struct {
	fs   *Feeds[int]
	ch   chan int
	quit chan struct{}
}

func newTestFeeds(t *testing.T) *testFeeds {
	t.Helper()
	tf := &testFeeds{ch: make(chan int), quit: make(chan struct{})}
	tf.fs = NewFeeds[int](tf.quit)
	t.Cleanup(func() {
		close(tf.quit)
		tf.fs.Close()
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

func (e *countingEncoder) encode(v int) *Frame {
	e.calls.Add(1)
	return NewFrame([]byte{byte(v)})
}

// fakeStream is a stream's sender: it records the values sent on got, in order. While
// gate is open (not nil and not closed), each send first waits for it to close. It
// notes sends that overlap, which grpc-go does not allow on one stream.
type fakeStream struct {
	got      chan int
	gate     chan struct{}
	openGate sync.Once
	entered  chan struct{} // gets a value when a send starts, if not nil
	err      error         // what every send returns
	inSend   atomic.Int32
	overlap  atomic.Bool
}

// open lets its sends through from now on.
func (fs *fakeStream) open() { fs.openGate.Do(func() { close(fs.gate) }) }

func newFakeStream(gated bool) *fakeStream {
	fs := &fakeStream{got: make(chan int, 100)}
	if gated {
		fs.gate = make(chan struct{})
		fs.entered = make(chan struct{}, 100)
	}
	return fs
}

func (fs *fakeStream) SendMsg(m any) error {
	if fs.inSend.Add(1) > 1 {
		fs.overlap.Store(true)
	}
	defer fs.inSend.Add(-1)
	if fs.entered != nil {
		fs.entered <- struct{}{}
	}
	if fs.gate != nil {
		<-fs.gate
	}
	fs.got <- int(m.(*Frame).data[0])
	return fs.err
}

// want receives the next value the stream sent and checks it is v.
func (fs *fakeStream) want(t *testing.T, ctx context.Context, v int) {
	t.Helper()
	select {
	case got := <-fs.got:
		if got != v {
			t.Errorf("stream got %d, want %d", got, v)
		}
	case <-ctx.Done():
		t.Fatalf("stream did not get %d", v)
	}
}

// open joins stream to the feed with filter, as a handler does, and starts it (which
// sends the group's current frame, if any). The test must call Leave.
func (tf *testFeeds) open(t *testing.T, filter string, enc *countingEncoder, stream *fakeStream) *Sub {
	t.Helper()
	s, cur, _, ok := tf.fs.Join("", tf.subscribe, stream, 0, filter, enc.encode)
	if !ok {
		t.Fatal("join refused")
	}
	s.Start(cur, cur)
	return s
}

func TestFeedEncodesOncePerFilterAndChange(t *testing.T) {
	tf := newTestFeeds(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	var encA, encB countingEncoder
	var streams []*fakeStream
	for i := range 5 {
		enc, filter := &encA, "a"
		if i >= 3 {
			enc, filter = &encB, "b"
		}
		st := newFakeStream(false)
		s := tf.open(t, filter, enc, st)
		defer s.Leave()
		streams = append(streams, st)
	}
	for v := 1; v <= 3; v++ {
		tf.send(t, ctx, v)
		for _, st := range streams {
			st.want(t, ctx, v)
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
	sa, curA, _, _ := tf.fs.Join("", tf.subscribe, newFakeStream(false), 0, "a", encA.encode)
	defer sa.Leave()
	sc, curC, hadValue, _ := tf.fs.Join("", tf.subscribe, newFakeStream(false), 0, "c", encC.encode)
	defer sc.Leave()
	if !hadValue || curA == nil || curA.data[0] != 3 || curC == nil || curC.data[0] != 3 {
		t.Errorf("joining a feed with a value: hadValue %v, frames %v %v, want the latest (3)", hadValue, curA, curC)
	}
	if encA.calls.Load() != 3 || encC.calls.Load() != 1 {
		t.Errorf("joining: %d more encodings for a known filter (want 0), %d for a new one (want 1)", encA.calls.Load()-3, encC.calls.Load())
	}
}

func TestFeedStreamsThatBlockDelayNoOne(t *testing.T) {
	tf := newTestFeeds(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	var enc countingEncoder
	// More streams whose sends block (clients that do not read) than a round has
	// workers, and one stream that takes every value.
	var blocked []*fakeStream
	for range 3 * fanoutWorkers {
		st := newFakeStream(true)
		s := tf.open(t, "", &enc, st)
		defer s.Leave() // after the gates open (deferred calls run last in, first out)
		blocked = append(blocked, st)
	}
	defer func() {
		for _, st := range blocked {
			st.open()
		}
	}()
	reader := newFakeStream(false)
	s := tf.open(t, "", &enc, reader)
	defer s.Leave()

	const changes = 20
	for v := 1; v <= changes; v++ {
		tf.send(t, ctx, v)
		reader.want(t, ctx, v)
	}
	// Each blocked stream has one send in progress, the first value it was sent.
	first := make([]int, len(blocked))
	for i, st := range blocked {
		select {
		case <-st.entered:
		case <-ctx.Done():
			t.Fatalf("blocked stream %d was never sent to", i)
		}
		if n := st.inSend.Load(); n != 1 {
			t.Errorf("blocked stream %d: %d sends in progress, want 1", i, n)
		}
	}
	// Unblocked, each sends the value it was blocked on, then the newest: no backlog.
	for i, st := range blocked {
		st.open()
		select {
		case first[i] = <-st.got:
		case <-ctx.Done():
			t.Fatalf("blocked stream %d: no value after its gate opened", i)
		}
		if first[i] != changes {
			st.want(t, ctx, changes)
		}
	}
	// One more change reaches every stream, each exactly once and in one send at a
	// time: nothing queued behind the unblocked sends.
	tf.send(t, ctx, changes+1)
	reader.want(t, ctx, changes+1)
	for i, st := range blocked {
		st.want(t, ctx, changes+1)
		if st.overlap.Load() {
			t.Errorf("blocked stream %d: sends overlapped", i)
		}
	}
}

func TestStreamSendsItsFirstMessageThenTheNewest(t *testing.T) {
	tf := newTestFeeds(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var enc countingEncoder
	reader := newFakeStream(false)
	s := tf.open(t, "", &enc, reader)
	defer s.Leave()
	tf.send(t, ctx, 1)
	reader.want(t, ctx, 1)

	// A stream joins and its handler's first send (of value 1) blocks; two changes go
	// to the other stream meanwhile.
	slow := newFakeStream(true)
	ss, cur, _, _ := tf.fs.Join("", tf.subscribe, slow, 0, "", enc.encode)
	started := make(chan struct{})
	go func() {
		defer close(started)
		ss.Start(cur, cur)
	}()
	defer func() { slow.open(); <-started; ss.Leave() }()
	select {
	case <-slow.entered:
	case <-ctx.Done():
		t.Fatal("the handler's first send never started")
	}
	for v := 2; v <= 3; v++ {
		tf.send(t, ctx, v)
		reader.want(t, ctx, v)
	}
	// The stream gets its first message, then the newest; not the one in between.
	slow.open()
	slow.want(t, ctx, 1)
	slow.want(t, ctx, 3)
	tf.send(t, ctx, 4)
	reader.want(t, ctx, 4)
	slow.want(t, ctx, 4)
	if slow.overlap.Load() {
		t.Error("the handler's send and a round's overlapped")
	}
}

func TestStreamWithAFreshFirstMessageSkipsTheFrameItJoinedWith(t *testing.T) {
	tf := newTestFeeds(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var enc countingEncoder
	reader := newFakeStream(false)
	s := tf.open(t, "", &enc, reader)
	defer s.Leave()
	tf.send(t, ctx, 1)
	reader.want(t, ctx, 1)

	// As a Stats stream joining a feed with a value does: its first message is a fresh
	// one (9), and the frame the group held when it joined (1) is not sent after it.
	st := newFakeStream(false)
	ss, cur, _, _ := tf.fs.Join("", tf.subscribe, st, 0, "", enc.encode)
	defer ss.Leave()
	ss.Start(NewFrame([]byte{9}), cur)
	st.want(t, ctx, 9)
	tf.send(t, ctx, 2)
	reader.want(t, ctx, 2)
	st.want(t, ctx, 2)
}

func TestLeaveWaitsForTheSendInProgress(t *testing.T) {
	tf := newTestFeeds(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var enc countingEncoder
	reader := newFakeStream(false)
	s := tf.open(t, "", &enc, reader)
	defer s.Leave()
	leaving := newFakeStream(true)
	ls := tf.open(t, "", &enc, leaving)
	defer leaving.open()

	tf.send(t, ctx, 1)
	reader.want(t, ctx, 1)
	select {
	case <-leaving.entered: // a worker is sending 1 on it, blocked
	case <-ctx.Done():
		t.Fatal("no round sent on the stream")
	}

	left := make(chan struct{})
	go func() {
		defer close(left)
		ls.Leave()
	}()
	// Once Leave waits for the send, let the send end; Leave must not have returned
	// before it.
	for waiting := false; !waiting; {
		ls.mu.Lock()
		waiting = ls.idle != nil
		ls.mu.Unlock()
		select {
		case <-left:
			t.Fatal("Leave returned while a send on the stream was in progress")
		case <-ctx.Done():
			t.Fatal("Leave never waited for the send in progress")
		default:
		}
		runtime.Gosched()
	}
	leaving.open()
	leaving.want(t, ctx, 1)
	select {
	case <-left:
	case <-ctx.Done():
		t.Fatal("Leave did not return once the send ended")
	}
	// No later round sends on it: two more changes (each round ends before the next
	// begins) go to the other stream only.
	for v := 2; v <= 3; v++ {
		tf.send(t, ctx, v)
		reader.want(t, ctx, v)
	}
	select {
	case v := <-leaving.got:
		t.Errorf("a round sent %d on a stream whose handler has left", v)
	default:
	}
}

func TestFailedSendEndsTheStream(t *testing.T) {
	tf := newTestFeeds(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var enc countingEncoder
	reader := newFakeStream(false)
	s := tf.open(t, "", &enc, reader)
	defer s.Leave()
	broken := newFakeStream(false)
	broken.err = errors.New("stream reset")
	bs := tf.open(t, "", &enc, broken)
	defer bs.Leave()

	tf.send(t, ctx, 1)
	reader.want(t, ctx, 1)
	broken.want(t, ctx, 1)
	select {
	case <-bs.Failed():
	case <-ctx.Done():
		t.Fatal("a failed send did not end the stream")
	}
	if err := bs.Err(); !errors.Is(err, broken.err) {
		t.Errorf("Err() = %v, want the send's error %v", err, broken.err)
	}
	for v := 2; v <= 3; v++ {
		tf.send(t, ctx, v)
		reader.want(t, ctx, v)
	}
	select {
	case v := <-broken.got:
		t.Errorf("a round sent %d on a stream whose send failed", v)
	default:
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

// TestUnstrict: a StrictServices stream gives up the stream it wraps; another does not.
func TestUnstrict(t *testing.T) {
	inner := &grpcStream{}
	if got, ok := Unstrict(strictStream{inner}); !ok || got != inner {
		t.Errorf("Unstrict(strictStream) = %T, %v; want the wrapped stream", got, ok)
	}
	if got, ok := Unstrict(inner); ok {
		t.Errorf("Unstrict(another stream) = %T, true", got)
	}
}

// grpcStream stands for grpc-go's stream.
type grpcStream struct{ grpc.ServerStream }
