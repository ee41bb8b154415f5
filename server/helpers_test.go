package server_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/tools/logtest"
)

func TestMain(m *testing.M) {
	if path := os.Getenv(childReserveEnv); path != "" {
		runChildReserve(path)
		return
	}
	goleak.VerifyTestMain(m)
}

// testHost is a real Server on a unix socket, with a client connected to it.
type testHost struct {
	srv    *server.Server
	conn   *grpc.ClientConn
	client pb.DeviceHostClient
	health healthpb.HealthClient
	logs   *logRecorder
	addr   endpoint.Address
}

// startHost serves mgr on a socket in a fresh temporary directory and returns the
// server and its clients. Cleanup closes the client and shuts the server down.
func startHost(t *testing.T, mgr device.Manager) *testHost {
	t.Helper()
	return startHostWith(t, server.Config{Manager: mgr})
}

// startHostWith is startHost with a Config of the test's; its Logger is replaced by the
// recorder's.
func startHostWith(t testing.TB, cfg server.Config) *testHost {
	t.Helper()
	// Not t.TempDir: socket paths are limited to 108 bytes and test names are long.
	dir, err := os.MkdirTemp("", "dh")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	addr := endpoint.Address{Network: "unix", Path: filepath.Join(dir, "devicehost.sock")}
	lis, err := endpoint.Listen(addr, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	logs := &logRecorder{}
	log := hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Debug, JSONFormat: true})
	cfg.Logger = log
	srv, err := server.New(cfg)
	if err != nil {
		lis.Close()
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		if err := <-served; err != nil {
			t.Errorf("Serve returned %v, want nil after Shutdown", err)
		}
	})
	h := &testHost{srv: srv, logs: logs, addr: addr}
	h.conn = h.dial(t)
	h.client = pb.NewDeviceHostClient(h.conn)
	h.health = healthpb.NewHealthClient(h.conn)
	return h
}

// dial opens a new client connection to the host, closed when the test ends.
func (h *testHost) dial(t testing.TB) *grpc.ClientConn {
	t.Helper()
	conn, err := endpoint.Dial(h.addr, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// testContext is a context that ends with the test or after a generous deadline, so a
// broken stream fails the test instead of hanging it.
func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// watchFeed is a Manager.Watch the test drives: the server's watch gets snaps, and the
// context it was called with arrives on ctxs.
type watchFeed struct {
	snaps chan device.Snapshot
	ctxs  chan context.Context
}

func newWatchFeed() *watchFeed {
	return &watchFeed{snaps: make(chan device.Snapshot, 1), ctxs: make(chan context.Context, 1)}
}

func (w *watchFeed) Watch(ctx context.Context) <-chan device.Snapshot {
	w.ctxs <- ctx
	return w.snaps
}

// logRecorder records a JSON hclog logger's lines.
type logRecorder struct{ logtest.Recorder }

// waitCallLines waits until n lines have been logged for calls of method, and returns
// them. The server logs a call once it has answered it, so a client can see the answer
// before the line is written.
func (r *logRecorder) waitCallLines(t *testing.T, method string, n int) []map[string]any {
	t.Helper()
	ctx := testContext(t)
	for {
		changed := r.Changed()
		if lines := r.callLines(t, method); len(lines) >= n {
			return lines
		}
		select {
		case <-changed:
		case <-ctx.Done():
			t.Fatalf("no %d log lines for %s: %v", n, method, r.callLines(t, method))
		}
	}
}

// lines returns every line logged so far, decoded.
func (r *logRecorder) lines(t *testing.T) []map[string]any {
	t.Helper()
	out, err := r.JSON()
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// callLines returns the log lines written for calls of method.
func (r *logRecorder) callLines(t *testing.T, method string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, l := range r.lines(t) {
		if l["method"] == method && l["@message"] == "finished call" {
			out = append(out, l)
		}
	}
	return out
}

func assertProtoEqual(t *testing.T, what string, got, want proto.Message) {
	t.Helper()
	if !proto.Equal(got, want) {
		t.Errorf("%s:\ngot  %s\nwant %s", what, prototext.Format(got), prototext.Format(want))
	}
}
