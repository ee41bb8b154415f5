package server

import (
	"context"
	"runtime"

	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"

	"github.com/devicehost/devicehost/device"
)

// afterReplies runs what a unary call's handler deferred with device.AfterReply once
// the call's reply is written. Its unary interceptor gives the handler a context that
// defers (device.WithAfterReply); it is also a grpc stats.Handler, whose End runs the
// deferred work: registered after the others, so after the call's trace task has ended,
// its reply is written (replyWritten) and its end is logged. A stream gets no such
// context: what it defers runs at once (its End comes only when the stream ends).
type afterReplies struct{}

// replyWritten is a grpc stats.Handler whose End waits, for a unary call of a listener
// connection, until the connection has been written to since the handler returned: the
// reply, unless another stream's message came first. grpc-go's End comes once the reply
// is queued for the connection's writer goroutine, not written; on one thread (max_procs
// = 1) that goroutine runs only when End's goroutine lets it, and
// what the other handlers' End do would go first: the call's log line (a write to the
// log) and the deferred work, which readies goroutines of its own (the watchers' feed,
// the garbage collector after a Release, which calls the plugin) that run ahead of the
// writer. So End yields until the write, at most maxReplyYields times. Registered after
// traceTasks (a call's task ends when its reply is queued, as before) and before
// callLog and afterReplies.
type replyWritten struct{}

// maxReplyYields bounds replyWritten's yields: each lets every runnable goroutine run
// once; the writer flushes within two (it yields once itself to batch a small write).
const maxReplyYields = 8

type afterReplyRunKey struct{}

// runSlot is where the unary interceptor leaves the call's run func for End, with the
// connection (nil if not a listenerConn's) and its write count when the handler
// returned, for replyWritten.
type runSlot struct {
	run    func()
	conn   *connAddr
	writes uint64
}

// TagRPC implements stats.Handler: it gives the call a slot for its run func.
func (afterReplies) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, afterReplyRunKey{}, &runSlot{})
}

// HandleRPC implements stats.Handler: at the call's end it runs the deferred work.
func (afterReplies) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.End); !ok {
		return
	}
	if slot, ok := ctx.Value(afterReplyRunKey{}).(*runSlot); ok && slot.run != nil {
		slot.run()
	}
}

// TagConn implements stats.Handler.
func (afterReplies) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

// HandleConn implements stats.Handler.
func (afterReplies) HandleConn(context.Context, stats.ConnStats) {}

// unary is the interceptor that lets a unary handler defer work past its reply.
func (afterReplies) unary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	slot, ok := ctx.Value(afterReplyRunKey{}).(*runSlot)
	if !ok {
		return handler(ctx, req)
	}
	ctx, slot.run = device.WithAfterReply(ctx)
	resp, err := handler(ctx, req)
	if p, _ := peer.FromContext(ctx); p != nil {
		if a, ok := p.Addr.(*connAddr); ok {
			slot.conn, slot.writes = a, a.writes.Load()
		}
	}
	return resp, err
}

// TagRPC implements stats.Handler.
func (replyWritten) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

// HandleRPC implements stats.Handler: at a unary call's end it waits for the reply's
// write (see replyWritten).
func (replyWritten) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.End); !ok {
		return
	}
	slot, ok := ctx.Value(afterReplyRunKey{}).(*runSlot)
	if !ok || slot.conn == nil {
		return
	}
	for i := 0; i < maxReplyYields && slot.conn.writes.Load() == slot.writes; i++ {
		runtime.Gosched()
	}
}

// TagConn implements stats.Handler.
func (replyWritten) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

// HandleConn implements stats.Handler.
func (replyWritten) HandleConn(context.Context, stats.ConnStats) {}
