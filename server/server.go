// Package server serves the devicehost host API (devicehost.v1.DeviceHost) over gRPC as a
// thin adapter over a device.Manager: it converts between protobuf and the domain types,
// maps domain errors to gRPC codes, and adds the health service, reflection, a log line
// per call, panic recovery, the grants of each listener and peer (access.go), and the
// limits that keep many or careless clients from taking the agent down (streams,
// flow-control windows, keepalive, the paced fan-out of package fanout). It depends on
// the manager's contract only, so any device.Manager can be served. See docs/api.md.
package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server/internal/fanout"
)

// ServiceName is the host API's gRPC service name, also the name its health is reported
// under in grpc.health.v1.Health.
const ServiceName = "devicehost.v1.DeviceHost"

// DefaultMaxRecvMsgSize is the largest request the server accepts when
// Config.MaxRecvMsgSize is zero. Host API requests are small; this bounds what a broken
// or hostile client can make the server buffer.
const DefaultMaxRecvMsgSize = 4 << 20

// Config configures a Server.
type Config struct {
	// Manager serves the devices. Required.
	Manager device.Manager
	// Logger receives one line per call and panics caught in handlers. Nil means no
	// logging.
	Logger hclog.Logger
	// MaxRecvMsgSize bounds the size of a request in bytes. Zero means
	// DefaultMaxRecvMsgSize.
	MaxRecvMsgSize int
	// MaxStreams bounds the Fingerprint and Stats streams open at once, over all
	// connections; a stream beyond it is refused with RESOURCE_EXHAUSTED. Zero means
	// DefaultMaxStreams; negative is an error.
	MaxStreams int
	// MaxStreamsPerConn bounds the Fingerprint and Stats streams open at once on one
	// client connection, refused beyond like MaxStreams. Zero means
	// DefaultMaxStreamsPerConn; negative is an error. The connection's HTTP/2
	// MAX_CONCURRENT_STREAMS is this plus 128, for unary calls beside the streams.
	MaxStreamsPerConn int
	// Keepalive is when the server pings an idle connection and how long it waits for
	// the answer. The zero value means a ping after 1 minute idle, closing the
	// connection when unanswered for 20 s.
	Keepalive keepalive.ServerParameters
	// KeepaliveEnforcement is how often clients may ping. The zero value means every
	// 10 s at most, with or without open calls; a client that pings more often is
	// disconnected.
	KeepaliveEnforcement keepalive.EnforcementPolicy
	// ServerOptions are added to the gRPC server's options. A grpc.Creds among them
	// replaces the server's own, which give each listener its TLS (Listener.TLS): give
	// one only to serve with Serve alone.
	ServerOptions []grpc.ServerOption
	// PeerGrants give peers more than their listener allows (see PeerGrant), on every
	// listener ServeListener serves.
	PeerGrants []PeerGrant
}

// streamWorkers is how many goroutines serve calls, each one call after another, instead
// of grpc-go's default of a new goroutine per call. A new goroutine starts on a small
// stack and grows it, copying it each time, through the deep call path of a Reserve
// (server handler, manager, plugin gRPC client): in the agent that costs some 5% of its
// CPU, on the caller's path (scripts/bench, hostbench -only floor). A Fingerprint or
// Stats stream holds its worker while open; once every worker is busy, a call gets a
// goroutine of its own, as with grpc-go's default, so the count bounds nothing. Idle workers keep their
// stacks until Go's collector shrinks them.
const streamWorkers = 32

// Server is the gRPC host API server.
//
// Serve may be called once per listener, from any goroutine; Shutdown ends every Serve.
// Shutdown must be called: it also ends the goroutine New starts to report readiness.
type Server struct {
	pb.UnimplementedDeviceHostServer

	mgr    device.Manager
	log    hclog.Logger
	grpc   *grpc.Server
	health *health.Server
	limits *streamLimits

	fingerprints *fanout.Feeds[device.Snapshot]      // one feed: key ""
	stats        *fanout.Feeds[device.StatsSnapshot] // a feed per interval

	shutdownOnce sync.Once
	quit         chan struct{} // closed by Shutdown: streams end, health stays NOT_SERVING
	wg           sync.WaitGroup
}

var _ pb.DeviceHostServer = (*Server)(nil)

// New builds a Server for cfg. The health of ServiceName (and of the whole server, "")
// is NOT_SERVING until the Manager's Ready channel closes, then SERVING until Shutdown.
// cfg is not modified.
func New(cfg Config) (*Server, error) {
	if cfg.Manager == nil {
		return nil, errors.New("server: Config.Manager is nil")
	}
	log := cfg.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	if cfg.MaxRecvMsgSize < 0 || cfg.MaxStreams < 0 || cfg.MaxStreamsPerConn < 0 {
		return nil, fmt.Errorf("server: negative limit in Config (MaxRecvMsgSize %d, MaxStreams %d, MaxStreamsPerConn %d)",
			cfg.MaxRecvMsgSize, cfg.MaxStreams, cfg.MaxStreamsPerConn)
	}
	maxRecv := cmp.Or(cfg.MaxRecvMsgSize, DefaultMaxRecvMsgSize)
	limits := &streamLimits{
		max:        int64(cmp.Or(cfg.MaxStreams, DefaultMaxStreams)),
		maxPerConn: int64(cmp.Or(cfg.MaxStreamsPerConn, DefaultMaxStreamsPerConn)),
	}
	kp := cfg.Keepalive
	if kp == (keepalive.ServerParameters{}) {
		kp = defaultKeepalive
	}
	kep := cfg.KeepaliveEnforcement
	if kep == (keepalive.EnforcementPolicy{}) {
		kep = defaultKeepaliveEnforcement
	}
	quit := make(chan struct{})
	s := &Server{
		mgr:          cfg.Manager,
		log:          log,
		health:       health.NewServer(),
		limits:       limits,
		quit:         quit,
		fingerprints: fanout.NewFeeds[device.Snapshot](quit),
		stats:        fanout.NewFeeds[device.StatsSnapshot](quit),
	}
	unary, stream := interceptors(log)
	acc := &access{grants: slices.Clone(cfg.PeerGrants)}
	authUnary, authStream := acc.interceptors()
	opts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(maxRecv),
		grpc.ForceServerCodecV2(fanout.NewCodec()),
		grpc.UnknownServiceHandler(unknownMethod),
		grpc.Creds(listenerCreds{}),
		grpc.ChainUnaryInterceptor(unary, authUnary, afterReplies{}.unary),
		grpc.ChainStreamInterceptor(stream, authStream),
		grpc.NumStreamWorkers(streamWorkers),
	}
	opts = append(opts, statsHandlers(log, limits)...)
	opts = append(opts, transportOptions(int(limits.maxPerConn), kp, kep)...)
	opts = append(opts, cfg.ServerOptions...)
	s.grpc = grpc.NewServer(opts...)

	s.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	s.health.SetServingStatus(ServiceName, healthpb.HealthCheckResponse_NOT_SERVING)
	reg := fanout.StrictServices{Server: s.grpc}
	pb.RegisterDeviceHostServer(reg, s)
	healthpb.RegisterHealthServer(reg, s.health)
	reflection.Register(reg)

	s.wg.Add(1)
	go s.reportReady()
	return s, nil
}

// Serve accepts connections on lis until Shutdown, and closes lis when it returns; its
// clients may do everything (the admin grant). It returns nil after Shutdown. The
// clients of a unix socket are logged by their uid, gid and pid.
func (s *Server) Serve(lis net.Listener) error {
	return s.ServeListener(lis, Listener{Allow: AllowAll})
}

// ServeListener is Serve for a listener whose clients may do what l allows, with the
// server's PeerGrants, and get l.TLS. A call outside its grants fails with
// PERMISSION_DENIED naming the listener, the peer and the grant it lacked.
func (s *Server) ServeListener(lis net.Listener, l Listener) error {
	l.Allow.reserve = slices.Clone(l.Allow.reserve)
	if l.TLS != nil {
		l.TLS = l.TLS.Clone()
		if !slices.Contains(l.TLS.NextProtos, "h2") {
			l.TLS.NextProtos = append(l.TLS.NextProtos, "h2") // gRPC clients insist on it
		}
	}
	err := s.grpc.Serve(taggedListener{Listener: lis, l: &l})
	if errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return err
}

// OpenStreams returns how many Fingerprint and Stats streams are open now, over all
// connections: the count max_streams limits. Safe for concurrent use.
func (s *Server) OpenStreams() int { return int(s.limits.open.Load()) }

// GetServiceInfo returns the services the server serves and their methods (the host
// API, health and reflection), as grpc.Server.GetServiceInfo does. It makes the Server
// a reflection.ServiceInfoProvider, e.g. for metrics that pre-register each method.
func (s *Server) GetServiceInfo() map[string]grpc.ServiceInfo { return s.grpc.GetServiceInfo() }

// reportReady turns health to SERVING once the manager is ready, unless Shutdown comes
// first. After Shutdown the health server ignores status changes, so a late SERVING
// cannot undo NOT_SERVING.
func (s *Server) reportReady() {
	defer s.wg.Done()
	select {
	case <-s.mgr.Ready():
		// The overall status first: whoever sees the service SERVING (a probe with
		// -service, a Watch) finds "" SERVING too.
		s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
		s.health.SetServingStatus(ServiceName, healthpb.HealthCheckResponse_SERVING)
		s.log.Info("serving", "service", ServiceName)
	case <-s.quit:
	}
}

// Shutdown reports NOT_SERVING, ends the open Fingerprint and Stats streams (and their
// Manager watches), stops accepting connections and waits for running calls to finish. When ctx ends first,
// the remaining calls and connections are cut. It returns when the server has stopped;
// it does not shut the Manager down. Safe to call more than once.
func (s *Server) Shutdown(ctx context.Context) {
	s.shutdownOnce.Do(func() {
		s.health.Shutdown()
		close(s.quit)
	})
	stopped := make(chan struct{})
	go func() {
		s.grpc.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-ctx.Done():
		s.grpc.Stop()
		<-stopped
	}
	s.fingerprints.Close()
	s.stats.Close()
	s.wg.Wait()
}

// errServerShutdown ends streams when the server shuts down.
var errServerShutdown = status.Error(codes.Unavailable, "devicehost is shutting down")

// unknownMethod answers calls of methods the server does not serve. Going through a
// handler (rather than grpc-go's built-in answer) makes them end like any call, so they
// are logged.
func unknownMethod(_ any, stream grpc.ServerStream) error {
	method, _ := grpc.MethodFromServerStream(stream)
	return status.Error(codes.Unimplemented, fmt.Sprintf("unknown method %s", method))
}

// statsHandlers are the server's grpc stats handlers, in the order each call's End
// reaches them.
func statsHandlers(log hclog.Logger, limits *streamLimits) []grpc.ServerOption {
	return []grpc.ServerOption{
		// First, so that a call's task has ended by the time its end is logged.
		grpc.StatsHandler(traceTasks{}),
		// Then, before the log line and the deferred work: the reply is written.
		grpc.StatsHandler(replyWritten{}),
		grpc.StatsHandler(callLog{log: log}),
		grpc.StatsHandler(limits),
		// Last: what a call deferred past its reply runs after its task, its reply's
		// write and its log line.
		grpc.StatsHandler(afterReplies{}),
	}
}
