package server

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"

	"github.com/devicehost/devicehost/device"
)

// afterReplies runs what a unary call's handler deferred with device.AfterReply once
// the call's status is sent. Its unary interceptor gives the handler a context that
// defers (device.WithAfterReply); it is also a grpc stats.Handler, whose End runs the
// deferred work: registered after the others, so after the call's trace task has ended
// and its end is logged. A stream gets no such context: what it defers runs at once
// (its End comes only when the stream ends).
type afterReplies struct{}

type afterReplyRunKey struct{}

// runSlot is where the unary interceptor leaves the call's run func for End.
type runSlot struct{ run func() }

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
	return handler(ctx, req)
}
