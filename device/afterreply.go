package device

import (
	"context"
	"sync"
)

// Work a call's answer does not need (waking the GC for its own bookkeeping, telling
// watchers of a change) can wait until the answer is on its way: the server runs it
// once the call's reply is written to the connection, so the caller does not wait for
// it. On two shared
// cores each such wake-up of another goroutine cost a Reserve 5 to 10 µs while the
// caller waited (docs/benchmarks.md#where-a-reserve-goes).

type afterReplyKey struct{}

// afterReply is one call's deferred work.
type afterReply struct {
	mu   sync.Mutex
	fns  []func()
	done bool // the reply is out: later work runs at once
}

// WithAfterReply returns ctx in which AfterReply defers work, and the func that runs it,
// in the order it was deferred, once the call's reply is written. run must be called
// exactly once; work deferred after it runs at once.
func WithAfterReply(ctx context.Context) (_ context.Context, run func()) {
	a := &afterReply{}
	return context.WithValue(ctx, afterReplyKey{}, a), func() {
		a.mu.Lock()
		fns := a.fns
		a.fns, a.done = nil, true
		a.mu.Unlock()
		for _, f := range fns {
			f()
		}
	}
}

// AfterReply runs f once the reply of the call ctx belongs to is sent (WithAfterReply),
// or at once when ctx belongs to no such call or its reply is already out. f must not
// block: the server's goroutine for the call runs it.
func AfterReply(ctx context.Context, f func()) {
	if a, ok := ctx.Value(afterReplyKey{}).(*afterReply); ok {
		a.mu.Lock()
		if !a.done {
			a.fns = append(a.fns, f)
			a.mu.Unlock()
			return
		}
		a.mu.Unlock()
	}
	f()
}
