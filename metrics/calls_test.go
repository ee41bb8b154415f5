package metrics_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/metrics"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/server/servertest"
	"github.com/devicehost/devicehost/tools/logtest"
)

// logWatch is an io.Writer for a logger that lets a test wait for a line.
type logWatch struct{ logtest.Recorder }

func newLogWatch() *logWatch { return &logWatch{} }

// wait waits until the log holds a line with every one of subs.
func (w *logWatch) wait(t *testing.T, ctx context.Context, subs ...string) {
	t.Helper()
	if _, err := w.Wait(ctx, logtest.Containing(subs...)); err != nil {
		t.Fatalf("no log line with %q:\n%s", subs, w)
	}
}

// apiHost is the host API served on a fake manager with metrics wired as the agent
// wires them.
type apiHost struct {
	metrics *served
	conn    *grpc.ClientConn
	client  pb.DeviceHostClient
	logs    *logWatch
}

func startAPI(t *testing.T, mgr device.Manager) *apiHost {
	t.Helper()
	s := serve(t, metrics.Options{}, mgr)
	logs := newLogWatch()
	agent := servertest.Serve(t, servertest.SocketPath(t), server.Config{
		Manager:       s.m.Instrument(mgr),
		Logger:        hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Debug, JSONFormat: true}),
		ServerOptions: s.m.ServerOptions(),
	})
	// Before any call: the test dials below.
	if err := s.m.CollectServer(agent.Server()); err != nil {
		t.Fatal(err)
	}
	addr := agent.Addr
	conn, err := endpoint.Dial(addr, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &apiHost{metrics: s, conn: conn, client: pb.NewDeviceHostClient(conn), logs: logs}
}

// Reserve and Release latencies are counted by result; the gRPC server metrics count
// every call of the served methods, including a handler's panic (as INTERNAL), but not
// made-up method names; the open streams gauge follows the streams.
func TestCallMetrics(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	mgr := newFake(gpuSnapshot(), gpuStats())
	mgr.ReserveFunc = func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
		switch req.OwnerID {
		case "panic":
			panic("boom")
		case "late":
			return device.Reservation{}, errors.Join(errors.New("plugin gone"), device.ErrPluginUnavailable)
		case "odd":
			return device.Reservation{}, errors.New("something no sentinel names")
		}
		return device.Reservation{ID: "res-1", OwnerID: req.OwnerID, Group: req.Group, DeviceIDs: req.DeviceIDs}, nil
	}
	mgr.ReleaseFunc = func(context.Context, device.ReleaseRequest) (device.ReleaseResult, error) {
		return device.ReleaseResult{Released: []string{"res-1"}}, nil
	}
	snaps := make(chan device.Snapshot, 1)
	snaps <- gpuSnapshot()
	mgr.WatchFunc = func(context.Context) <-chan device.Snapshot { return snaps }
	h := startAPI(t, mgr)

	// Before any call: every served method is there at zero.
	f := h.metrics.scrape(t)
	if got := f.value(t, "grpc_server_handled_total", map[string]string{
		"grpc_service": server.ServiceName, "grpc_method": "Reserve", "grpc_code": "OK"}); got != 0 {
		t.Errorf("handled{Reserve, OK} before any call = %v, want 0", got)
	}
	if got := f.value(t, "devicehost_api_open_streams", nil); got != 0 {
		t.Errorf("open streams before any = %v, want 0", got)
	}

	req := func(owner string) *pb.ReserveRequest {
		return &pb.ReserveRequest{OwnerId: owner, Vendor: "nvidia", Type: "gpu", Name: h100.Name, DeviceIds: []string{"GPU-a"}}
	}
	for _, owner := range []string{"job-1", "job-2", "late", "odd", "panic"} {
		_, err := h.client.Reserve(ctx, req(owner))
		if owner == "panic" && status.Code(err) != codes.Internal {
			t.Errorf("Reserve that panics: %v, want INTERNAL", err)
		}
	}
	if _, err := h.client.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: "res-1"}}); err != nil {
		t.Fatal(err)
	}
	for _, method := range []string{"/" + server.ServiceName + "/Nope", "/made.up.Service/Anything"} {
		err := h.conn.Invoke(ctx, method, &pb.ListPluginsRequest{}, &pb.ListPluginsResponse{})
		if status.Code(err) != codes.Unimplemented {
			t.Errorf("%s: %v, want UNIMPLEMENTED", method, err)
		}
	}
	streamCtx, endStream := context.WithCancel(ctx)
	defer endStream()
	stream, err := h.client.Fingerprint(streamCtx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}

	f = h.metrics.scrape(t)
	for result, want := range map[string]float64{"ok": 2, "plugin_unavailable": 1, "error": 1} {
		if got := f.value(t, "devicehost_reserve_duration_seconds", map[string]string{"result": result}); got != want {
			t.Errorf("reserve durations{%s} counted %v, want %v", result, got, want)
		}
	}
	if got := f.value(t, "devicehost_release_duration_seconds", map[string]string{"result": "ok"}); got != 1 {
		t.Errorf("release durations{ok} counted %v, want 1", got)
	}
	reserve := map[string]string{"grpc_service": server.ServiceName, "grpc_method": "Reserve", "grpc_type": "unary"}
	if got := f.value(t, "grpc_server_started_total", reserve); got != 5 {
		t.Errorf("started{Reserve} = %v, want 5", got)
	}
	// The panic is INTERNAL: the metrics' interceptor runs outside the server's recovery.
	for code, want := range map[string]float64{"OK": 2, "Unavailable": 1, "Unknown": 1, "Internal": 1, "NotFound": 0} {
		if got := f.value(t, "grpc_server_handled_total", map[string]string{"grpc_method": "Reserve", "grpc_code": code}); got != want {
			t.Errorf("handled{Reserve, %s} = %v, want %v", code, got, want)
		}
	}
	if got := f.value(t, "grpc_server_handling_seconds", reserve); got != 5 {
		t.Errorf("handling seconds{Reserve} counted %v, want 5", got)
	}
	for _, name := range []string{"grpc_server_started_total", "grpc_server_handled_total"} {
		for _, m := range f[name].GetMetric() {
			if l := labels(m); l["grpc_method"] == "Nope" || l["grpc_method"] == "Anything" {
				t.Errorf("%s has a series for the made-up method %v", name, l)
			}
		}
	}
	fp := map[string]string{"grpc_method": "Fingerprint", "grpc_type": "server_stream"}
	if got := f.value(t, "grpc_server_started_total", fp); got != 1 {
		t.Errorf("started{Fingerprint} = %v, want 1", got)
	}
	if got := f.value(t, "grpc_server_msg_sent_total", fp); got < 1 {
		t.Errorf("msg sent{Fingerprint} = %v, want at least 1", got)
	}
	if got := f.value(t, "devicehost_api_open_streams", nil); got != 1 {
		t.Errorf("open streams with one Fingerprint open = %v, want 1", got)
	}

	// The stream ends: the server logs the call once it has counted it out.
	endStream()
	h.logs.wait(t, ctx, `"finished call"`, `"method":"/devicehost.v1.DeviceHost/Fingerprint"`)
	f = h.metrics.scrape(t)
	if got := f.value(t, "devicehost_api_open_streams", nil); got != 0 {
		t.Errorf("open streams after the stream ended = %v, want 0", got)
	}
}
