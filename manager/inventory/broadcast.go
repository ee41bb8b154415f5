package inventory

import (
	"context"
	"sync"
)

// broadcast hands the latest value of T to any number of watchers without ever waiting
// for one of them.
//
// Each watcher has a channel with a buffer of one. publish replaces a value the watcher
// has not read yet with the new one, so a reader that falls behind gets the newest value
// and never a backlog, and a reader that never reads costs one buffered value and slows
// nobody. A watcher's channel is closed when its context ends or when close is called.
// Safe for concurrent use; values must be immutable, as every watcher gets the same one.
type broadcast[T any] struct {
	mu     sync.Mutex
	closed bool
	subs   map[*watcher[T]]struct{}
}

type watcher[T any] struct {
	ch    chan T
	every uint64 // deliver every n-th publication (downsampling); at least 1
	seen  uint64 // publications seen since subscribing
	stop  func() bool
}

// subscribe registers a watcher that gets one value out of every `every` publications
// (every < 1 means 1), starting with initial when one is given. The channel is closed
// when ctx ends or the broadcast is closed; after close it is returned closed.
func (b *broadcast[T]) subscribe(ctx context.Context, every int, initial *T) <-chan T {
	w := &watcher[T]{ch: make(chan T, 1), every: uint64(max(every, 1))}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || ctx.Err() != nil {
		close(w.ch)
		return w.ch
	}
	if initial != nil {
		w.ch <- *initial // the buffer is empty: never blocks
	}
	if b.subs == nil {
		b.subs = make(map[*watcher[T]]struct{})
	}
	b.subs[w] = struct{}{}
	w.stop = context.AfterFunc(ctx, func() { b.unsubscribe(w) })
	return w.ch
}

func (b *broadcast[T]) unsubscribe(w *watcher[T]) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.subs[w]; ok {
		delete(b.subs, w)
		close(w.ch)
	}
}

// publish offers v to every watcher, replacing any value a watcher has not read yet. It
// never blocks: senders are serialised by b.mu and only they write to a watcher's
// channel, so after the stale value is taken out the buffer has room.
func (b *broadcast[T]) publish(v T) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for w := range b.subs {
		w.seen++
		if w.seen%w.every != 0 {
			continue
		}
		select {
		case <-w.ch: // drop the stale value
		default:
		}
		w.ch <- v
	}
}

// len returns the number of watchers.
func (b *broadcast[T]) len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.subs)
}

// close closes every watcher's channel; later subscribers get a closed channel and
// later publications go nowhere.
func (b *broadcast[T]) close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	for w := range b.subs {
		w.stop()
		delete(b.subs, w)
		close(w.ch)
	}
}
