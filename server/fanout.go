package server

import (
	"cmp"
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// The fan-out of Fingerprint and Stats.
//
// All the streams of one kind (Fingerprint; Stats at one interval) share one feed: one
// Manager subscription, whose values the feed's goroutine encodes once per distinct
// filter (a group), and then hands to the streams in rounds. A stream's own goroutine
// sends, so a client that does not read blocks only its own stream; but the feed wakes
// fanoutSenders streams at a time (a batch) and waits for them before the next batch,
// so that a change going to 10,000 streams does not make 10,000 goroutines runnable at
// once and starve every unary call behind them. A stream still sending an earlier value
// when a round reaches it is not waited for: it takes the newest value when it is done
// (latest-value delivery: a slow reader skips to the newest snapshot, never a backlog).
// Nor is one whose Send blocks: a batch not done after stuckAfter is left to finish on
// its own, and the round goes on.
//
// Changes that arrive during a round are coalesced: the next round sends the newest.
// And rounds are paced: under a sustained stream of changes (a Reserve and a Release
// each change the holders), a feed spends at most fanoutShare of the time in rounds, so
// that 10,000 streams cannot take the CPU that Reserve needs. fanoutBurst of round time
// is allowed at once, so that a change after a quiet spell goes out at once.

const (
	// fanoutSenders is how many streams of one feed a round wakes at once (a batch).
	fanoutSenders = 16
	// stuckAfter is how long a round waits for a batch before it goes on without the
	// streams that have not sent yet.
	stuckAfter = 5 * time.Millisecond
	// fanoutShare is the share of wall time a feed may spend in rounds over time.
	fanoutShare = 0.25
	// fanoutBurst is how much round time a feed may spend at once.
	fanoutBurst = 200 * time.Millisecond
)

// pacer is a token bucket of round time: it fills at fanoutShare per second of wall
// time, up to fanoutBurst, and each round takes its duration out. Used by one goroutine.
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

// spend takes a round's duration out.
func (p *pacer) spend(d time.Duration) { p.tokens -= d }

// feeds is the server's open feeds of one kind, by key. Safe for concurrent use.
type feeds[T any] struct {
	quit <-chan struct{} // the server's: closed by Shutdown
	wg   sync.WaitGroup  // the feeds' goroutines

	mu     sync.Mutex
	closed bool
	m      map[string]*feed[T]
}

func newFeeds[T any](quit <-chan struct{}) *feeds[T] {
	return &feeds[T]{quit: quit, m: make(map[string]*feed[T])}
}

// feed is one Manager subscription shared by streams, and their groups by filter.
type feed[T any] struct {
	set    *feeds[T]
	key    string
	cancel context.CancelFunc // ends the subscription
	gone   chan struct{}      // closed when the Manager closed the subscription

	mu     sync.Mutex
	have   bool // latest holds a value
	latest T
	groups map[string]*group[T] // by filter key
	refs   int                  // streams joined
	order  []*sub               // every sub, by connection; nil when it must be rebuilt
}

// group is the streams of a feed with the same filter, and the latest value encoded for
// that filter.
type group[T any] struct {
	encode func(T) *frame
	cur    atomic.Pointer[frame] // written by the feed's goroutine, or at creation
	subs   map[*sub]struct{}
}

// sub is one stream of a feed.
type sub struct {
	filter string
	// conn is its connection, so that a round sends to one connection's streams in a row.
	conn uint64
	cur  *atomic.Pointer[frame] // its group's latest frame
	gone <-chan struct{}        // its feed's gone
	// wake gets the batch of a round that woke the stream (nil: no round waits for it),
	// replacing one not taken yet. Only the feed's goroutine sends on it, holding mu.
	wake chan *batch
	busy atomic.Bool // in Send

	mu   sync.Mutex
	left bool
}

// join adds a stream of connection conn (see connID) with filter key filter (encoded by
// encode) to the feed named key, subscribing to the Manager with subscribe when that
// feed is not open. It returns the stream's sub, the frame its group holds now (nil when
// the feed has no value yet) and whether the feed had a value before this call. A false ok means the server is shutting
// down. The caller must call leave(sub) when the stream ends.
//
// subscribe runs on the caller's goroutine, so that a Manager that panics is caught by
// the handler's recovery like any other panic.
func (fs *feeds[T]) join(key string, subscribe func(context.Context) <-chan T, conn uint64, filter string, encode func(T) *frame) (f *feed[T], s *sub, cur *frame, hadValue, ok bool) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.closed {
		return nil, nil, nil, false, false
	}
	f = fs.m[key]
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
		g = &group[T]{encode: encode, subs: make(map[*sub]struct{})}
		if f.have {
			g.cur.Store(encode(f.latest))
		}
		f.groups[filter] = g
	}
	s = &sub{filter: filter, conn: conn, cur: &g.cur, gone: f.gone, wake: make(chan *batch, 1)}
	g.subs[s] = struct{}{}
	f.order = nil
	return f, s, g.cur.Load(), f.have, true
}

// leave removes s from f; the last stream to leave ends the subscription.
func (f *feed[T]) leave(s *sub) {
	s.leave()
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

// close stops new joins and waits for the feeds' goroutines, which end when the server's
// quit channel is closed.
func (fs *feeds[T]) close() {
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
		f.publish(ctx, v)
		pace.spend(time.Since(start))
	}
}

// publish encodes v once per group and sends it to every stream in one round.
func (f *feed[T]) publish(ctx context.Context, v T) {
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
		f.order = make([]*sub, 0, f.refs)
		for _, g := range f.groups {
			for s := range g.subs {
				f.order = append(f.order, s)
			}
		}
		slices.SortFunc(f.order, func(a, b *sub) int { return cmp.Compare(a.conn, b.conn) })
	}
	subs := f.order // never modified: a change makes a new one
	f.mu.Unlock()
	f.round(ctx, subs)
}

// batch is the streams of a round woken together. Each answers once (done) when it
// has sent; the last answer closes all.
type batch struct {
	left atomic.Int32
	all  chan struct{}
}

// done answers for one stream of b (nil: a wake no round waits for).
func (b *batch) done() {
	if b != nil && b.left.Add(-1) == 0 {
		close(b.all)
	}
}

// round wakes every stream in subs to send its group's latest frame, fanoutSenders at a
// time, as described at the top of this file. It returns when every batch it waited for
// is done (or given up on), or ctx ends, or the server quits.
func (f *feed[T]) round(ctx context.Context, subs []*sub) {
	timer := time.NewTimer(stuckAfter)
	defer timer.Stop()
	ctxDone := ctx.Done()
	next := make([]*sub, 0, fanoutSenders)
	for len(subs) > 0 {
		next = next[:0]
		for len(subs) > 0 && len(next) < fanoutSenders {
			s := subs[0]
			subs = subs[1:]
			if s.busy.Load() {
				s.signal(nil) // still sending an earlier value: it takes this one after
				continue
			}
			next = append(next, s)
		}
		if len(next) == 0 {
			continue
		}
		b := &batch{all: make(chan struct{})}
		b.left.Store(int32(len(next)))
		for _, s := range next {
			if !s.signal(b) {
				b.done() // it left
			}
		}
		timer.Reset(stuckAfter)
		select {
		case <-b.all:
		case <-timer.C:
			// The batch did not finish within stuckAfter: some of its streams are
			// blocked (a client that does not read) or starved. Go on without them;
			// they take the newest frame when they get to it.
		case <-ctxDone:
			return
		case <-f.set.quit:
			return
		}
	}
}

// signal wakes the stream, replacing a wake it has not taken yet; b (when not nil) is
// answered once the stream has sent. It returns false when the stream has left.
func (s *sub) signal(b *batch) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.left {
		return false
	}
	select {
	case <-s.wake: // a wake of an earlier batch, which no longer waits for it
	default:
	}
	s.wake <- b // the buffer is empty and only signal sends: never blocks
	return true
}

// leave marks the stream gone, answering a wake it did not take.
func (s *sub) leave() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.left = true
	select {
	case b := <-s.wake:
		b.done()
	default:
	}
}
