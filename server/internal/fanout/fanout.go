package fanout

import (
	"cmp"
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// How a feed sends (see Feeds for its contract).
//
// All the streams of one kind (Fingerprint; Stats at one interval) share one feed: one
// Manager subscription, whose values the feed's goroutine encodes once per distinct
// filter (a group), and then sends to every stream in a round. A round's sends are made
// by fanoutWorkers goroutines of its own, each taking fanoutChunk streams at a time in
// the order of their connections (so that grpc-go writes a connection's messages out
// together) and calling their SendMsg in turn. Waking each stream's own goroutine to
// send would cost a goroutine switch per stream and message, more than the send itself;
// and with at most fanoutWorkers sends running at once, a change going to 10,000 streams
// never makes 10,000 goroutines runnable and starves the unary calls behind them.
//
// One goroutine at a time sends on a stream: the stream's handler sends its first
// message, then the rounds' workers. A round that reaches a stream still sending an
// earlier value skips it, and the goroutine sending it sends the newest frame when it is
// done (latest-value delivery: a slow reader skips to the newest snapshot, never a
// backlog). A send can block: grpc-go's SendMsg waits once a stream holds 64 KiB its
// client has not taken (a client that does not read). A worker that has made no progress
// for stuckAfter is left to its send, another takes over the rest of its streams, and it
// ends when its send does (the client reads, or the stream ends). So a stream whose
// client never reads holds one goroutine besides its handler, and blocks no one.
//
// Changes that arrive during a round are coalesced: the next round sends the newest.
// And rounds are paced: under a sustained stream of changes (a Reserve and a Release
// each change the holders), a feed's rounds take at most fanoutShare of the time, so
// that 10,000 streams cannot take the CPU that Reserve needs. A round counts as its wall
// time, and at least fanoutMessageCost per message sent: the workers' sends are only
// part of what a message costs (grpc-go's writers send it out after them, and its
// reader, usually on the same node, decodes it), so a cheap round still paces by the
// messages it makes. fanoutBurst of round time is allowed at once, so that a change
// after a quiet spell goes out at once.

const (
	// fanoutWorkers is how many goroutines send a round, at most.
	fanoutWorkers = 2
	// fanoutChunk is how many streams (in connection order) a worker takes at once.
	fanoutChunk = 16
	// stuckAfter is how long a worker may go without starting another send before the
	// round leaves it to its send and goes on without it.
	stuckAfter = 5 * time.Millisecond
	// fanoutShare is the share of the time a feed's rounds may take, over time.
	fanoutShare = 0.25
	// fanoutMessageCost is the least a round is charged per message it sent (see
	// above): about the wall time a message took a round when each stream's goroutine
	// sent its own, which fanoutShare was set for, so that under a sustained stream of
	// changes as many messages go out per second as then (hostbench's Reserve row).
	fanoutMessageCost = 4 * time.Microsecond
	// fanoutBurst is how much round time a feed may spend at once.
	fanoutBurst = 200 * time.Millisecond
)

// pacer is a token bucket of round time: it fills at fanoutShare per second of wall
// time, up to fanoutBurst, and each round takes its cost out. Used by one goroutine.
type pacer struct {
	tokens time.Duration
	at     time.Time // when tokens was last filled
}

func newPacer(now time.Time) pacer { return pacer{tokens: fanoutBurst, at: now} }

// delay is how long to wait before the next round may start.
func (p *pacer) delay(now time.Time) time.Duration {
	p.tokens = min(fanoutBurst, p.tokens+time.Duration(float64(now.Sub(p.at))*fanoutShare))
	p.at = now
	if p.tokens >= 0 {
		return 0
	}
	return time.Duration(float64(-p.tokens) / fanoutShare)
}

// spend takes a round's cost out.
func (p *pacer) spend(d time.Duration) { p.tokens -= d }

// Feeds is a server's open feeds of one kind (values of type T), by key. Safe for
// concurrent use.
//
// Concurrency and cleanup. A stream's handler calls Feeds.Join, then Sub.Start (which
// sends its first message on the handler's goroutine and hands the stream over to the
// feed), then waits for Sub.Failed, Sub.Gone or its own end, and calls Sub.Leave in every
// case, Start or not; Leave returns once no goroutine is sending on the stream, so the
// handler may return. One goroutine at a time sends on a stream. The feed's goroutine
// starts with its first stream and ends when its last stream leaves, the Manager closes
// the subscription, or the quit channel given to NewFeeds closes; each change's sends
// run on at most fanoutWorkers goroutines of their own, and one left to a stuck send
// ends when that send returns. The owner closes quit, stops its gRPC server (so that
// every send returns), and calls Feeds.Close, which refuses later joins and waits for
// all of those goroutines. Feeds, Sub's exported methods and Codec are safe for
// concurrent use; a Frame is never modified once made.
type Feeds[T any] struct {
	quit <-chan struct{} // the server's: closed by its Shutdown
	wg   sync.WaitGroup  // the feeds' goroutines

	mu     sync.Mutex
	closed bool
	m      map[string]*feed[T]
}

// NewFeeds makes the feeds of a server whose Shutdown closes quit. The server must close
// quit and then call Close, which waits for every goroutine the feeds started.
func NewFeeds[T any](quit <-chan struct{}) *Feeds[T] {
	return &Feeds[T]{quit: quit, m: make(map[string]*feed[T])}
}

// feed is one Manager subscription shared by streams, and their groups by filter.
type feed[T any] struct {
	set    *Feeds[T]
	key    string
	cancel context.CancelFunc // ends the subscription
	gone   chan struct{}      // closed when the Manager closed the subscription

	mu     sync.Mutex
	have   bool // latest holds a value
	latest T
	groups map[string]*group[T] // by filter key
	refs   int                  // streams joined
	order  []*Sub               // every sub, by connection; nil when it must be rebuilt
}

// group is the streams of a feed with the same filter, and the latest value encoded for
// that filter.
type group[T any] struct {
	encode func(T) *Frame
	cur    atomic.Pointer[Frame] // written by the feed's goroutine, or at creation
	subs   map[*Sub]struct{}
}

// Sender sends a stream's messages: its grpc.ServerStream. SendMsg is given *Frame
// values only, which the server's Codec sends as they are.
type Sender interface {
	SendMsg(m any) error
}

// Sub is one stream of a feed. One goroutine at a time holds it to send (see the top of
// this file): its handler from Join until Start returns, then a round's worker that
// claims it. Its handler must call Leave when the stream ends.
type Sub struct {
	feed   interface{ leave(*Sub) } // the feed it joined
	filter string
	// conn is its connection, so that a round sends to one connection's streams in a row.
	conn   uint64
	cur    *atomic.Pointer[Frame] // its group's latest frame
	gone   <-chan struct{}        // its feed's gone
	stream Sender
	failed chan struct{} // closed when a send failed; err says why

	mu      sync.Mutex
	sending bool // a goroutine holds the stream to send
	handler bool // the one holding it is the handler, which has not started it
	left    bool // the handler has left: no more sends
	err     error
	idle    chan struct{} // closed when sending ends, for a handler that waits to leave

	last *Frame // the frame sent last; used by the goroutine holding the stream
	// sentSeq is the seq of a first frame newer than the feed's (see Start), until the
	// feed sends a newer one; 0 otherwise. Used by the goroutine holding the stream.
	sentSeq uint64
}

// Join adds stream, of connection conn (an ID the caller gives each client connection)
// with filter key filter (encoded by encode), to the feed named key, subscribing to the
// Manager with subscribe when that feed is not open. It returns the stream's Sub, held
// by the caller until it calls Start, the frame its group holds now (nil when the feed
// has no value yet) and whether the feed had a value before this call. A false ok means
// the server is shutting down (Close was called). The caller must call s.Leave when the
// stream ends.
//
// subscribe runs on the caller's goroutine, so that a Manager that panics is caught by
// the handler's recovery like any other panic. The subscription's context ends when
// the last stream of the feed leaves.
func (fs *Feeds[T]) Join(key string, subscribe func(context.Context) <-chan T, stream Sender, conn uint64, filter string, encode func(T) *Frame) (s *Sub, cur *Frame, hadValue, ok bool) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.closed {
		return nil, nil, false, false
	}
	f := fs.m[key]
	if f == nil {
		ctx, cancel := context.WithCancel(context.Background())
		subscribed := false
		defer func() {
			if !subscribed {
				cancel()
			}
		}()
		ch := subscribe(ctx)
		subscribed = true
		f = &feed[T]{set: fs, key: key, cancel: cancel, gone: make(chan struct{}), groups: make(map[string]*group[T])}
		fs.m[key] = f
		fs.wg.Add(1)
		// Started once this stream has joined (deferred calls run last in, first out),
		// so that its first value goes to this stream too.
		defer func() { go f.run(ctx, ch) }()
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	f.refs++
	g := f.groups[filter]
	if g == nil {
		g = &group[T]{encode: encode, subs: make(map[*Sub]struct{})}
		if f.have {
			g.cur.Store(encode(f.latest))
		}
		f.groups[filter] = g
	}
	s = &Sub{
		feed: f, filter: filter, conn: conn, cur: &g.cur, gone: f.gone, stream: stream, failed: make(chan struct{}),
		sending: true, handler: true,
	}
	g.subs[s] = struct{}{}
	f.order = nil
	return s, g.cur.Load(), f.have, true
}

// Leave removes s from its feed, once a send in progress on it has ended; the last
// stream to leave ends the feed's subscription. Called once by the stream's handler,
// which must not use the stream after, whether or not it called Start.
func (s *Sub) Leave() { s.feed.leave(s) }

// leave is Sub.Leave.
func (f *feed[T]) leave(s *Sub) {
	s.stopSending()
	fs := f.set
	fs.mu.Lock()
	defer fs.mu.Unlock()
	f.mu.Lock()
	if g := f.groups[s.filter]; g != nil {
		delete(g.subs, s)
		if len(g.subs) == 0 {
			delete(f.groups, s.filter)
		}
	}
	f.refs--
	f.order = nil
	last := f.refs == 0
	f.mu.Unlock()
	if last {
		if fs.m[f.key] == f {
			delete(fs.m, f.key)
		}
		f.cancel()
	}
}

// Close stops new joins and waits for every goroutine the feeds started: each feed's,
// which ends when the server's quit channel is closed (close it first), and each
// round's workers, of which one left to a stuck send ends when that send returns (it
// does once the stream ends: the server calls Close after its gRPC server stopped).
// Safe to call more than once.
func (fs *Feeds[T]) Close() {
	fs.mu.Lock()
	fs.closed = true
	fs.mu.Unlock()
	fs.wg.Wait()
}

// run publishes the values of ch, paced, until ch closes, ctx ends (the last stream
// left) or the server quits.
func (f *feed[T]) run(ctx context.Context, ch <-chan T) {
	defer f.set.wg.Done()
	pace := newPacer(time.Now())
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		var v T
		var ok bool
		select {
		case <-ctx.Done():
			return
		case <-f.set.quit:
			return
		case v, ok = <-ch:
		}
		if d := pace.delay(time.Now()); ok && d > 0 {
			timer.Reset(d)
			select {
			case <-ctx.Done():
				return
			case <-f.set.quit:
				return
			case <-timer.C:
			}
			select { // a newer value replaces v (the Manager's delivery is latest-value)
			case v, ok = <-ch:
			default:
			}
		}
		if !ok {
			f.set.mu.Lock()
			if f.set.m[f.key] == f {
				delete(f.set.m, f.key) // later streams subscribe afresh
			}
			f.set.mu.Unlock()
			close(f.gone)
			return
		}
		start := time.Now()
		sent := f.publish(ctx, v)
		pace.spend(max(time.Since(start), time.Duration(sent)*fanoutMessageCost))
	}
}

// publish encodes v once per group and sends it to every stream in one round. It
// returns how many messages the round sent.
func (f *feed[T]) publish(ctx context.Context, v T) (sent int64) {
	f.mu.Lock()
	f.latest, f.have = v, true
	groups := make([]*group[T], 0, len(f.groups))
	for _, g := range f.groups {
		groups = append(groups, g)
	}
	f.mu.Unlock()

	// Groups made after the copy above encode f.latest themselves, under f.mu.
	for _, g := range groups {
		g.cur.Store(g.encode(v))
	}

	f.mu.Lock()
	if f.order == nil {
		// Consecutive sends to one connection are written out together (grpc-go's
		// writer batches what is queued), rather than one write per message.
		f.order = make([]*Sub, 0, f.refs)
		for _, g := range f.groups {
			for s := range g.subs {
				f.order = append(f.order, s)
			}
		}
		slices.SortFunc(f.order, func(a, b *Sub) int { return cmp.Compare(a.conn, b.conn) })
	}
	subs := f.order // never modified: a change makes a new one
	f.mu.Unlock()
	return f.round(ctx, subs)
}

// Start sends first (unless nil), then the group's newest frame unless it is seen (the
// group's frame when the stream joined), and gives the stream over to the rounds.
// Called at most once by the stream's handler, which holds it since Join; the handler
// must not send on the stream after. A failed send closes Failed.
//
// first may be newer than the feed's frames (a value the handler took from the Manager
// itself, which the feed's goroutine has yet to publish): the stream then gets no frame
// of the feed until one with a higher seq, so it never goes back, nor gets one value
// twice. Past that one, every frame of the feed goes out as it comes.
func (s *Sub) Start(first, seen *Frame) {
	if first != nil {
		if !s.send(first) {
			return
		}
		if first != seen {
			s.sentSeq = first.seq
		}
	}
	s.last = seen
	s.flush()
}

// claim takes s to send, unless another goroutine holds it (it sends the newest frame
// when it is done), the handler has left or a send failed.
func (s *Sub) claim() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sending || s.left || s.err != nil {
		return false
	}
	s.sending = true
	return true
}

// flush sends the group's newest frame until the last one sent is the newest, and gives
// s up. Called by the goroutine holding s. It returns how many messages it sent.
func (s *Sub) flush() (sent int64) {
	for {
		if fr := s.cur.Load(); fr != nil && fr != s.last {
			s.last = fr
			if fr.seq == 0 || fr.seq > s.sentSeq {
				s.sentSeq = 0 // caught up with the first frame
				sent++
				if !s.send(fr) {
					return sent
				}
			}
		}
		s.mu.Lock()
		// A round that stored a newer frame before this lock skipped s, as it was held.
		if fr := s.cur.Load(); fr != nil && fr != s.last && !s.left {
			s.mu.Unlock()
			continue
		}
		s.release()
		s.mu.Unlock()
		return sent
	}
}

// send sends fr on the stream. When that fails it records why, gives s up and returns
// false.
func (s *Sub) send(fr *Frame) bool {
	err := fr.err
	if err == nil {
		err = s.stream.SendMsg(fr)
	}
	if err == nil {
		return true
	}
	s.mu.Lock()
	s.err = err
	close(s.failed)
	s.release()
	s.mu.Unlock()
	return false
}

// release gives s up. s.mu must be held.
func (s *Sub) release() {
	s.sending, s.handler = false, false
	if s.idle != nil {
		close(s.idle)
		s.idle = nil
	}
}

// Failed is closed when a send on the stream failed; Err then says why. No more is sent
// on it.
func (s *Sub) Failed() <-chan struct{} { return s.failed }

// Err is why a send failed, once Failed is closed; nil before.
func (s *Sub) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Gone is closed when the Manager closed the feed's subscription: the stream gets no
// more values.
func (s *Sub) Gone() <-chan struct{} { return s.gone }

// stopSending marks the stream gone, so that no round sends on it any more, and waits
// for a send in progress to end. Called by Leave.
func (s *Sub) stopSending() {
	s.mu.Lock()
	s.left = true
	if s.handler { // it leaves without having started s, which it holds
		s.release()
	}
	var idle chan struct{}
	if s.sending {
		if s.idle == nil {
			s.idle = make(chan struct{})
		}
		idle = s.idle
	}
	s.mu.Unlock()
	if idle != nil {
		<-idle
	}
}

// round is one value's sends to the streams of a feed.
type round struct {
	subs   []*Sub
	next   atomic.Int64  // where the next chunk starts
	sent   atomic.Int64  // messages sent by its workers (not counting those left stuck)
	stop   atomic.Bool   // the feed ended: claim no more
	active atomic.Int32  // workers neither done nor left to a stuck send
	done   chan struct{} // closed by the last active worker
}

// worker is one goroutine sending a round. Its mutex orders its taking of streams
// against the round's giving its rest to another worker (see stuck).
type worker struct {
	r *round

	mu        sync.Mutex
	pos, end  int    // its chunk: r.subs[pos:end] are still to send
	taken     uint64 // streams taken so far
	left      bool   // left to a stuck send; its rest went to another worker
	done      bool   // ended
	seenTaken uint64 // taken at the round's last look (the round's goroutine only)
}

// round sends the group's latest frame to every stream in subs, with the workers
// described at the top of this file. It returns when every stream has been taken and
// every worker not left to a stuck send is done, or ctx ends, or the server quits, with
// how many messages were sent by then.
func (f *feed[T]) round(ctx context.Context, subs []*Sub) (sent int64) {
	r := &round{subs: subs, done: make(chan struct{})}
	n := min(fanoutWorkers, (len(subs)+fanoutChunk-1)/fanoutChunk)
	if n == 0 {
		return 0
	}
	r.active.Store(int32(n))
	workers := make([]*worker, n)
	for i := range workers {
		workers[i] = &worker{r: r}
		f.set.wg.Add(1)
		go workers[i].run(&f.set.wg)
	}
	ticker := time.NewTicker(stuckAfter)
	defer ticker.Stop()
	for {
		select {
		case <-r.done:
			return r.sent.Load()
		case <-ctx.Done():
			r.stop.Store(true)
			return r.sent.Load()
		case <-f.set.quit:
			r.stop.Store(true)
			return r.sent.Load()
		case <-ticker.C:
			for i, w := range workers {
				if pos, end, stuck := w.stuck(); stuck {
					// Left to its send; a new worker takes the rest of its chunk.
					workers[i] = &worker{r: r, pos: pos, end: end}
					f.set.wg.Add(1)
					go workers[i].run(&f.set.wg)
				}
			}
		}
	}
}

// stuck reports whether w has taken no stream since the round last looked while not
// done; if so it leaves w to its send and returns the rest of its chunk.
func (w *worker) stuck() (pos, end int, stuck bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done || w.left || w.taken != w.seenTaken {
		w.seenTaken = w.taken
		return 0, 0, false
	}
	w.left = true
	pos, end = w.pos, w.end
	w.pos = w.end
	return pos, end, true
}

// run sends to the streams it takes until none is left, or it is left to a stuck send.
func (w *worker) run(wg *sync.WaitGroup) {
	defer wg.Done()
	for {
		s := w.take()
		if s == nil {
			break
		}
		if s.claim() {
			w.r.sent.Add(s.flush())
		}
	}
	w.mu.Lock()
	left := w.left
	w.done = true
	w.mu.Unlock()
	if !left && w.r.active.Add(-1) == 0 {
		close(w.r.done)
	}
}

// take returns the next stream of w's chunk, taking a new chunk when it is used up; nil
// when the round has none left, it stopped, or w was left to a stuck send.
func (w *worker) take() *Sub {
	w.mu.Lock()
	defer w.mu.Unlock()
	r := w.r
	if w.left || r.stop.Load() {
		return nil
	}
	if w.pos >= w.end {
		start := int(r.next.Add(fanoutChunk)) - fanoutChunk
		if start >= len(r.subs) {
			return nil
		}
		w.pos, w.end = start, min(start+fanoutChunk, len(r.subs))
	}
	s := r.subs[w.pos]
	w.pos++
	w.taken++
	return s
}
