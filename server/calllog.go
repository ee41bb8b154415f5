package server

import (
	"context"
	"strings"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

// callLog is a grpc stats.Handler that logs every call once, when it ends: method, code,
// duration, peer and, when it failed, the error message.
//
// It is a stats handler rather than an interceptor because grpc-go ends some calls
// before any interceptor runs (a request over the size limit, for one) and a stats
// handler sees the end of every call the server accepted, with the status the client
// got. Safe for concurrent use.
type callLog struct {
	log hclog.Logger
}

// quietServices are logged at DEBUG when their calls succeed, so that health probes and
// grpcurl's reflection do not fill the log.
var quietServices = map[string]bool{
	"grpc.health.v1.Health":                    true,
	"grpc.reflection.v1.ServerReflection":      true,
	"grpc.reflection.v1alpha.ServerReflection": true,
}

type methodKey struct{}

// TagRPC implements stats.Handler: it keeps the method name for HandleRPC.
func (l callLog) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, methodKey{}, info.FullMethodName)
}

// HandleRPC implements stats.Handler: it logs the call's end.
func (l callLog) HandleRPC(ctx context.Context, s stats.RPCStats) {
	end, ok := s.(*stats.End)
	if !ok {
		return
	}
	method, _ := ctx.Value(methodKey{}).(string)
	st := status.Convert(end.Error)
	level := hclogLevel(logging.DefaultServerCodeToLevel(st.Code()))
	service, _, _ := strings.Cut(strings.TrimPrefix(method, "/"), "/")
	if quietServices[service] && level == hclog.Info {
		level = hclog.Debug
	}
	args := []any{"method", method, "code", st.Code().String(), "duration", end.EndTime.Sub(end.BeginTime).String()}
	if end.Error != nil {
		args = append(args, "error", st.Message())
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil && p.Addr.String() != "" {
		args = append(args, "peer", p.Addr.String())
	}
	l.log.Log(level, "finished call", args...)
}

// TagConn implements stats.Handler.
func (l callLog) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

// HandleConn implements stats.Handler.
func (l callLog) HandleConn(context.Context, stats.ConnStats) {}

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
