package server

import (
	"context"
	"runtime/trace"

	"google.golang.org/grpc/stats"

	"github.com/devicehost/devicehost/internal/steps"
)

// traceTasks is a grpc stats.Handler that, while the process is being traced
// (runtime/trace), makes each call a trace task named after its method, from when its
// headers arrive to when its status is sent: the regions its handler marks (see
// Server.Reserve and manager.Manager.Reserve) fall in it, and the task's span less
// theirs is gRPC's own part (decoding, encoding, writing). tools/hostbench reads them
// for its Reserve breakdown; `go tool trace` shows them. While calls are timed
// (internal/steps) it begins and ends each call's record at the same points. When
// neither is on it does nothing but two checks per call.
type traceTasks struct{}

type traceTaskKey struct{}

// TagRPC implements stats.Handler: it starts the call's task.
func (traceTasks) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	ctx = steps.Begin(ctx, info.FullMethodName)
	if !trace.IsEnabled() {
		return ctx
	}
	ctx, task := trace.NewTask(ctx, info.FullMethodName)
	return context.WithValue(ctx, traceTaskKey{}, task)
}

// HandleRPC implements stats.Handler: it ends the call's task when the call ends.
func (traceTasks) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.End); !ok {
		return
	}
	steps.End(ctx)
	if task, ok := ctx.Value(traceTaskKey{}).(*trace.Task); ok {
		task.End()
	}
}

// TagConn implements stats.Handler.
func (traceTasks) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

// HandleConn implements stats.Handler.
func (traceTasks) HandleConn(context.Context, stats.ConnStats) {}
