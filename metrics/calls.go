package metrics

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/devicehost/devicehost/device"
)

// The result label of the Reserve and Release histograms: what the manager answered,
// by the sentinel its error wraps.
const (
	resultOK = "ok"
)

// results maps the manager's sentinel errors to result labels, checked in order.
var results = []struct {
	err   error
	label string
}{
	{device.ErrInvalidRequest, "invalid_request"},
	{device.ErrDeviceHeld, "device_held"},
	{device.ErrDeviceCordoned, "device_cordoned"},
	{device.ErrNoCDIDevices, "no_cdi_devices"},
	{device.ErrTooManyAccesses, "too_many_admin_accesses"},
	{device.ErrOptionsDiffer, "plugin_options_differ"},
	{device.ErrPermissionDenied, "permission_denied"},
	{device.ErrUnknownDevice, "device_unknown"},
	{device.ErrUnhealthyDevice, "device_unhealthy"},
	{device.ErrPluginUnavailable, "plugin_unavailable"},
	{device.ErrPluginResponse, "plugin_response_invalid"},
	{device.ErrNotFound, "not_found"},
	{device.ErrShuttingDown, "shutting_down"},
	{context.Canceled, "canceled"},
	{context.DeadlineExceeded, "deadline_exceeded"},
}

// result is the label for err: "ok", a sentinel's label, or "error" for anything else
// (so the label's values are bounded whatever the error says).
func result(err error) string {
	if err == nil {
		return resultOK
	}
	for _, r := range results {
		if errors.Is(err, r.err) {
			return r.label
		}
	}
	return "error"
}

// Instrument returns mgr with its Reserve and Release timed into
// devicehost_reserve_duration_seconds and devicehost_release_duration_seconds; every
// other method is mgr's own. Serve the API on what it returns.
func (m *Metrics) Instrument(mgr device.Manager) device.Manager {
	return &timedManager{Manager: mgr, m: m}
}

// timedManager is a device.Manager whose Reserve and Release are timed.
type timedManager struct {
	device.Manager
	m *Metrics
}

func (t *timedManager) Reserve(ctx context.Context, req device.ReserveRequest) (device.Reservation, error) {
	start := time.Now()
	r, err := t.Manager.Reserve(ctx, req)
	t.m.reserve.WithLabelValues(result(err)).Observe(time.Since(start).Seconds())
	return r, err
}

func (t *timedManager) Release(ctx context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
	start := time.Now()
	r, err := t.Manager.Release(ctx, req)
	t.m.release.WithLabelValues(result(err)).Observe(time.Since(start).Seconds())
	return r, err
}

// grpcMetrics is go-grpc-middleware's prometheus provider (grpc_server_started_total,
// grpc_server_handled_total{grpc_code}, grpc_server_msg_{received,sent}_total,
// grpc_server_handling_seconds), recording only the methods the server serves: a
// client calling made-up method names must not grow the series without bound.
type grpcMetrics struct {
	prom   *grpcprom.ServerMetrics
	unary  grpc.UnaryServerInterceptor
	stream grpc.StreamServerInterceptor
	known  atomic.Pointer[map[string]bool] // full method names; nil until CollectServer
}

func newGRPCMetrics() *grpcMetrics {
	prom := grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
		grpcprom.WithHistogramBuckets(prometheus.ExponentialBuckets(0.0005, 2, 16)),
	))
	return &grpcMetrics{prom: prom, unary: prom.UnaryServerInterceptor(), stream: prom.StreamServerInterceptor()}
}

func (g *grpcMetrics) served(fullMethod string) bool {
	known := g.known.Load()
	return known != nil && (*known)[fullMethod]
}

// ServerOptions returns the gRPC server options that record the gRPC server metrics.
// They are grpc.UnaryInterceptor and grpc.StreamInterceptor, which grpc-go runs before
// (outside) every chained interceptor, so the metrics see the code a handler's panic
// is turned into by the server's recovery; the server must not set those two options
// itself (server.New chains its own). Calls are recorded once CollectServer has named
// the methods served; calls of other method names are not recorded.
func (m *Metrics) ServerOptions() []grpc.ServerOption {
	g := m.grpc
	return []grpc.ServerOption{
		grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			if !g.served(info.FullMethod) {
				return handler(ctx, req)
			}
			return g.unary(ctx, req, info, handler)
		}),
		grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			if !g.served(info.FullMethod) {
				return handler(srv, ss)
			}
			return g.stream(srv, ss, info, handler)
		}),
	}
}

// Server is what CollectServer needs of the API server (server.Server has it).
type Server interface {
	// OpenStreams returns the Fingerprint and Stats streams open now.
	OpenStreams() int
	// GetServiceInfo returns the services served and their methods.
	GetServiceInfo() map[string]grpc.ServiceInfo
}

// CollectServer exports srv's open streams as devicehost_api_open_streams, and starts
// recording the gRPC calls of the methods srv serves, every one of them pre-registered
// at zero (so rates exist before the first call). Call it once, after the services are
// registered and before srv serves.
func (m *Metrics) CollectServer(srv Server) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.haveServer {
		return errors.New("metrics: CollectServer called twice")
	}
	streams := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "devicehost_api_open_streams",
		Help: "Fingerprint and Stats streams of the host API open now (limited by max_streams).",
	}, func() float64 { return float64(srv.OpenStreams()) })
	if err := m.reg.Register(streams); err != nil {
		return fmt.Errorf("metrics: register devicehost_api_open_streams: %w", err)
	}
	info := srv.GetServiceInfo()
	known := make(map[string]bool)
	for svc, si := range info {
		for _, mi := range si.Methods {
			known["/"+svc+"/"+mi.Name] = true
		}
	}
	m.grpc.prom.InitializeMetrics(srv)
	m.grpc.known.Store(&known)
	m.haveServer = true
	return nil
}
