package server

import (
	"context"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// interceptors returns the server's unary and stream interceptor chains, outermost first:
// logging sees the code that panic recovery produced.
func interceptors(log hclog.Logger) ([]grpc.UnaryServerInterceptor, []grpc.StreamServerInterceptor) {
	logger := hclogAdapter{log: log}
	logOpts := []logging.Option{
		logging.WithLogOnEvents(logging.FinishCall),
		logging.WithDurationField(func(d time.Duration) logging.Fields {
			return logging.Fields{fieldDuration, d.String()}
		}),
	}
	recoverOpts := []recovery.Option{
		recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
			method, _ := grpc.Method(ctx)
			log.Error("panic in handler", "method", method, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			return status.Error(codes.Internal, "internal error: the request caused a panic in the host; see its log")
		}),
	}
	return []grpc.UnaryServerInterceptor{
			logging.UnaryServerInterceptor(logger, logOpts...),
			recovery.UnaryServerInterceptor(recoverOpts...),
		}, []grpc.StreamServerInterceptor{
			logging.StreamServerInterceptor(logger, logOpts...),
			recovery.StreamServerInterceptor(recoverOpts...),
		}
}

// Field names the logging middleware uses, and the ones the adapter writes instead.
const (
	fieldService  = "grpc.service"
	fieldMethod   = "grpc.method"
	fieldCode     = "grpc.code"
	fieldError    = "grpc.error"
	fieldPeer     = "peer.address"
	fieldDuration = "grpc.duration"
)

// quietServices are logged at DEBUG when their calls succeed, so that health probes and
// grpcurl's reflection do not fill the log.
var quietServices = map[string]bool{
	"grpc.health.v1.Health":                    true,
	"grpc.reflection.v1.ServerReflection":      true,
	"grpc.reflection.v1alpha.ServerReflection": true,
}

// hclogAdapter is the logging middleware's Logger writing through hclog: one line per
// call with the full method, the code, the duration and, when it failed, the error. The
// middleware's other fields (start time, component, method type) are dropped.
type hclogAdapter struct {
	log hclog.Logger
}

// Log implements logging.Logger.
func (a hclogAdapter) Log(_ context.Context, lvl logging.Level, msg string, fields ...any) {
	var service, method string
	var out []any
	it := logging.Fields(fields).Iterator()
	for it.Next() {
		k, v := it.At()
		switch k {
		case fieldService:
			service = fmt.Sprint(v)
		case fieldMethod:
			method = fmt.Sprint(v)
		case fieldCode:
			out = append(out, "code", v)
		case fieldDuration:
			out = append(out, "duration", v)
		case fieldError:
			out = append(out, "error", v)
		case fieldPeer:
			out = append(out, "peer", v)
		}
	}
	level := hclogLevel(lvl)
	if quietServices[service] && level == hclog.Info {
		level = hclog.Debug
	}
	a.log.Log(level, msg, append([]any{"method", "/" + service + "/" + method}, out...)...)
}

func hclogLevel(l logging.Level) hclog.Level {
	switch {
	case l >= logging.LevelError:
		return hclog.Error
	case l >= logging.LevelWarn:
		return hclog.Warn
	case l >= logging.LevelInfo:
		return hclog.Info
	default:
		return hclog.Debug
	}
}
