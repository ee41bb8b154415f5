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
// the call's status is sent. Its unary interceptor gives the handler a context that
// defers (device.WithAfterReply); it is also a grpc stats.Handler, whose End runs the
// deferred work: registered after the others, so after the call's trace task has ended
// and its end is logged. A stream gets no such context: what it defers runs at once
// (its End comes only when the stream ends).
//
// Sent is not yet written: End comes once the reply is queued for the connection's
// writer goroutine. On one thread (the agent's default max_procs) that goroutine runs
// only when End's goroutine lets it, and the deferred work readies goroutines of its
// own (the watchers' feed, the garbage collector after a Release, which calls the
// plugin) that would run ahead of it: the reply waited for all of them. So End first
// yields until the connection has been written to since the handler returned (the
// reply, unless another stream's message came first), at most maxReplyYields times.
type afterReplies struct{}

// maxReplyYields bounds End's yields waiting for the reply's write: each lets every
// runnable goroutine run once; the writer flushes within two (it yields once itself
// to batch a small write).
const maxReplyYields = 8

type afterReplyRunKey struct{}

// runSlot is where the unary interceptor leaves the call's run func for End, with the
// connection (nil if not a listenerConn's, or if the handler deferred nothing) and its
// write count when the handler returned.
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
		for i := 0; slot.conn != nil && i < maxReplyYields && slot.conn.writes.Load() == slot.writes; i++ {
			runtime.Gosched()
		}
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
	if p, _ := peer.FromContext(ctx); p != nil && device.AfterReplyPending(ctx) {
		if a, ok := p.Addr.(*connAddr); ok {
			slot.conn, slot.writes = a, a.writes.Load()
		}
	}
	return resp, err
}
