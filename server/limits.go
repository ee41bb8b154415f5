package server

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/endpoint"
)

// Defaults of Config's stream limits.
const (
	// DefaultMaxStreams is the most Fingerprint and Stats streams served at once when
	// Config.MaxStreams is zero. A stream whose client never reads costs the agent about
	// 16 KiB (scripts/bench: its handler goroutine and grpc-go's per-stream state; the
	// messages it has not taken are shared with the other streams), and some 4 KiB more
	// once its flow-control window is full (the fan-out's sender left waiting on it), so
	// this bounds what careless clients can pin to some 20 MiB. A node-local agent has a
	// handful of watchers; raise it for more.
	DefaultMaxStreams = 1024
	// DefaultMaxStreamsPerConn is the most Fingerprint and Stats streams one client
	// connection may hold when Config.MaxStreamsPerConn is zero.
	DefaultMaxStreamsPerConn = 100
)

// Transport settings. The flow-control windows are static (grpc-go's BDP estimation,
// which can grow them to many MiB per connection, is off): requests are small, so a
// client cannot make the agent buffer more than these per stream and per connection.
// Sending is bounded by grpc-go's write quota (64 KiB of queued frames per stream, fixed
// in grpc-go): once a client stops reading, its stream's Send blocks there, and the
// frames it holds are the fan-out's shared encodings, not copies.
const (
	streamWindow = 64 << 10
	connWindow   = 256 << 10
	// unaryHeadroom is how many calls beyond MaxStreamsPerConn one connection may have in
	// flight (HTTP/2 MAX_CONCURRENT_STREAMS); further calls wait in the client.
	unaryHeadroom = 128
)

// Keepalive defaults (Config.Keepalive, Config.KeepaliveEnforcement zero values). The
// server pings a connection idle for a minute and closes it when the ping is not
// answered within 20 s, so a vanished peer on TCP does not hold its streams forever.
// Clients may ping as often as endpoint.Dial's clients do, with or without open calls
// (grpc-go's default of 5 min would make the server hang up on a client that pings more
// often). This server is the one place the agent sets keepalive.
var (
	defaultKeepalive            = keepalive.ServerParameters{Time: time.Minute, Timeout: 20 * time.Second}
	defaultKeepaliveEnforcement = endpoint.ServerKeepalivePolicy
)

// streamLimits counts the open Fingerprint and Stats streams, in all and per connection,
// and refuses one beyond either limit. It is also a grpc stats.Handler, to give each
// connection its own counter. Safe for concurrent use.
type streamLimits struct {
	max, maxPerConn int64
	open            atomic.Int64
	conns           atomic.Uint64 // connections seen, to number them
}

// connStreams counts one connection's open streams.
type connStreams struct {
	id   uint64
	open atomic.Int64
}

// connID numbers the connection ctx belongs to (0 when it has none).
func connID(ctx context.Context) uint64 {
	if c, _ := ctx.Value(connKey{}).(*connStreams); c != nil {
		return c.id
	}
	return 0
}

type connKey struct{}

// acquire counts a new stream of the connection ctx belongs to, or refuses it with
// RESOURCE_EXHAUSTED naming the limit, its value and the setting that raises it. A nil
// release and an error, or a release to call once the stream ends.
func (l *streamLimits) acquire(ctx context.Context) (release func(), err error) {
	if n := l.open.Add(1); n > l.max {
		l.open.Add(-1)
		return nil, status.Error(codes.ResourceExhausted, fmt.Sprintf(
			"stream limit reached: %d Fingerprint and Stats streams are open on this agent, the most it serves at once (setting max_streams = %d); close streams you do not need, or raise max_streams",
			l.max, l.max))
	}
	conn, _ := ctx.Value(connKey{}).(*connStreams)
	if conn == nil {
		return func() { l.open.Add(-1) }, nil
	}
	if n := conn.open.Add(1); n > l.maxPerConn {
		conn.open.Add(-1)
		l.open.Add(-1)
		return nil, status.Error(codes.ResourceExhausted, fmt.Sprintf(
			"stream limit of one connection reached: %d Fingerprint and Stats streams are open on this connection, the most one connection may hold (setting max_streams_per_connection = %d); open another connection, or raise max_streams_per_connection",
			l.maxPerConn, l.maxPerConn))
	}
	return func() {
		conn.open.Add(-1)
		l.open.Add(-1)
	}, nil
}

// TagConn implements stats.Handler: every connection gets its own stream counter.
func (l *streamLimits) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return context.WithValue(ctx, connKey{}, &connStreams{id: l.conns.Add(1)})
}

// HandleConn implements stats.Handler.
func (l *streamLimits) HandleConn(context.Context, stats.ConnStats) {}

// TagRPC implements stats.Handler.
func (l *streamLimits) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

// HandleRPC implements stats.Handler.
func (l *streamLimits) HandleRPC(context.Context, stats.RPCStats) {}

// transportOptions are the gRPC server options that bound what one connection and one
// stream may hold, and the keepalive policy.
func transportOptions(maxPerConn int, kp keepalive.ServerParameters, kep keepalive.EnforcementPolicy) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.StaticStreamWindowSize(streamWindow),
		grpc.StaticConnWindowSize(connWindow),
		grpc.MaxConcurrentStreams(uint32(maxPerConn + unaryHeadroom)),
		grpc.KeepaliveParams(kp),
		grpc.KeepaliveEnforcementPolicy(kep),
	}
}
