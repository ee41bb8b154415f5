package server

import (
	"context"
	"net"
	"strings"
	"sync/atomic"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

// callLog is a grpc stats.Handler that logs every call once, when it ends: method, code,
// duration, peer and, when it failed, the error message. The peer is the client's
// address on tcp; on a unix socket, whose clients have no address, it is the client
// process's uid, gid and pid (peer_uid, peer_gid, peer_pid) where Serve could read them
// (see taggedListener), and left out where it could not.
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

// callInfo is what HandleRPC learns of a call before it ends.
type callInfo struct {
	method       string
	serverStream atomic.Bool // set by Begin: the server sends a stream of messages
}

type callKey struct{}

// TagRPC implements stats.Handler: it keeps the method name for HandleRPC.
func (l callLog) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, callKey{}, &callInfo{method: info.FullMethodName})
}

// HandleRPC implements stats.Handler: it logs the call's end. It is called for every
// message of every stream too (a fan-out round: one per watcher), so it looks up the
// call in ctx, a walk up the context's chain, only for the events it uses.
func (l callLog) HandleRPC(ctx context.Context, s stats.RPCStats) {
	switch s.(type) {
	case *stats.Begin, *stats.End:
	default:
		return
	}
	call, _ := ctx.Value(callKey{}).(*callInfo)
	if call == nil {
		return
	}
	switch s := s.(type) {
	case *stats.Begin:
		call.serverStream.Store(s.IsServerStream)
		return
	case *stats.End:
		st := status.Convert(s.Error)
		args := []any{"method", call.method, "code", st.Code().String(), "duration", s.EndTime.Sub(s.BeginTime).String()}
		if s.Error != nil {
			args = append(args, "error", st.Message())
		}
		if p, ok := peer.FromContext(ctx); ok {
			args = append(args, peerArgs(p.Addr)...)
		}
		l.log.Log(callLevel(call.method, st.Code(), call.serverStream.Load()), "finished call", args...)
	}
}

// callLevel is the level a call of method that ended with code is logged at. A stream
// the server sends on (Fingerprint, Stats, a health Watch) ends only when its client
// ends it, by cancelling or by its deadline, or when the server stops: a client ending
// its own stream is no event, so CANCELED and DEADLINE_EXCEEDED streams are logged at
// DEBUG. Other codes keep go-grpc-middleware's server levels, and the successful calls
// of quietServices are DEBUG too.
func callLevel(method string, code codes.Code, serverStream bool) hclog.Level {
	if serverStream && (code == codes.Canceled || code == codes.DeadlineExceeded) {
		return hclog.Debug
	}
	level := hclogLevel(logging.DefaultServerCodeToLevel(code))
	service, _, _ := strings.Cut(strings.TrimPrefix(method, "/"), "/")
	if quietServices[service] && level == hclog.Info {
		level = hclog.Debug
	}
	return level
}

// peerArgs are the log fields that name a call's peer: its listener where the server
// has named listeners, the address of a tcp client, the uid, gid and pid of a unix
// socket's, and none for an address that says nothing (a unix client's unnamed socket
// is "" or "@").
func peerArgs(a net.Addr) []any {
	var args []any
	if ca, ok := a.(*connAddr); ok {
		if ca.listener.Name != "" {
			args = append(args, "listener", ca.listener.Name)
		}
		if ca.hasCred {
			return append(args, "peer_uid", ca.cred.uid, "peer_gid", ca.cred.gid, "peer_pid", ca.cred.pid)
		}
		a = ca.remote
	}
	if a == nil {
		return args
	}
	if s := a.String(); s != "" && s != "@" {
		args = append(args, "peer", s)
	}
	return args
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
