package server

import (
	"context"
	"fmt"
	"runtime/debug"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// interceptors returns the server's unary and stream interceptors: panic recovery, which
// logs the panic with its stack and answers INTERNAL. Calls are logged by callLog, which
// sees the code recovery produced.
func interceptors(log hclog.Logger) (grpc.UnaryServerInterceptor, grpc.StreamServerInterceptor) {
	opt := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		method, _ := grpc.Method(ctx)
		log.Error("panic in handler", "method", method, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
		return status.Error(codes.Internal, "internal error: the request caused a panic in the host; see its log")
	})
	return recovery.UnaryServerInterceptor(opt), recovery.StreamServerInterceptor(opt)
}
