package main

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/server"
)

// notifySocket is systemd's side of the notify protocol: a unixgram socket whose path
// the agent finds in NOTIFY_SOCKET. Cleanup closes it.
type notifySocket struct{ conn *net.UnixConn }

func listenNotify(t *testing.T) *notifySocket {
	t.Helper()
	dir, err := os.MkdirTemp("", "dhsd") // short: socket paths are limited to 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	t.Setenv("NOTIFY_SOCKET", path)
	return &notifySocket{conn: conn}
}

// next returns the next datagram, or "" when none comes within wait.
func (s *notifySocket) next(t *testing.T, wait time.Duration) string {
	t.Helper()
	if err := s.conn.SetReadDeadline(time.Now().Add(wait)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, err := s.conn.Read(buf)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return ""
	}
	if err != nil {
		t.Fatalf("read NOTIFY_SOCKET: %v", err)
	}
	return string(buf[:n])
}

// Under systemd the agent says READY=1 once health is SERVING, not before, and
// STOPPING=1 when it begins to shut down: what a Type=notify unit waits for.
func TestAgentNotifiesSystemd(t *testing.T) {
	sd := listenNotify(t)
	ready := make(chan struct{})
	a := startInProcessAgent(t, &devicetest.Fake{ReadyFunc: func() <-chan struct{} { return ready }})

	conn, err := endpoint.Dial(a.addr, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	watch, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{Service: server.ServiceName})
	if err != nil {
		t.Fatal(err)
	}
	nextHealth := func() healthpb.HealthCheckResponse_ServingStatus {
		t.Helper()
		resp, err := watch.Recv()
		if err != nil {
			t.Fatalf("health watch: %v", err)
		}
		return resp.GetStatus()
	}

	if got := nextHealth(); got != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("health before the plugins are ready = %v, want NOT_SERVING", got)
	}
	// The agent is listening and not ready: nothing may have been said yet.
	if msg := sd.next(t, 200*time.Millisecond); msg != "" {
		t.Fatalf("agent notified %q while NOT_SERVING, want nothing before READY", msg)
	}

	close(ready)
	if msg := sd.next(t, 10*time.Second); msg != "READY=1" {
		t.Fatalf("after the manager is ready the agent notified %q, want READY=1", msg)
	}
	// The same event turns health SERVING; by now it has or is about to.
	if got := nextHealth(); got != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health after READY=1 = %v, want SERVING", got)
	}

	cancel() // an open Watch would hold the API's graceful stop
	if err := a.stop(); err != nil {
		t.Errorf("serveAgent: %v", err)
	}
	if msg := sd.next(t, 10*time.Second); msg != "STOPPING=1" {
		t.Errorf("on shutdown the agent notified %q, want STOPPING=1", msg)
	}
	if msg := sd.next(t, 50*time.Millisecond); msg != "" {
		t.Errorf("after STOPPING=1 the agent notified %q, want nothing more", msg)
	}
}

// A reload (SIGHUP) of a ready agent is framed by RELOADING=1 and READY=1, so systemd
// shows the unit reloading until it is done; one before READY=1 says nothing (READY=1
// would claim readiness too early).
func TestAgentNotifiesSystemdAroundAReload(t *testing.T) {
	sd := listenNotify(t)
	ready := make(chan struct{})
	signals := make(chan os.Signal, 1)
	applying := make(chan struct{})
	finish := make(chan struct{})
	hook := reloadHook{signals: signals, apply: func() {
		applying <- struct{}{}
		<-finish
	}}
	a := startInProcessAgent(t, &devicetest.Fake{ReadyFunc: func() <-chan struct{} { return ready }}, hook)

	signals <- syscall.SIGHUP
	<-applying
	finish <- struct{}{}
	if msg := sd.next(t, 200*time.Millisecond); msg != "" {
		t.Fatalf("a reload before the agent was ready notified %q, want nothing", msg)
	}
	close(ready)
	if msg := sd.next(t, 10*time.Second); msg != "READY=1" {
		t.Fatalf("after the manager is ready the agent notified %q, want READY=1", msg)
	}

	signals <- syscall.SIGHUP
	<-applying
	if msg := sd.next(t, 10*time.Second); msg != "RELOADING=1" {
		t.Errorf("while reloading the agent notified %q, want RELOADING=1", msg)
	}
	finish <- struct{}{}
	if msg := sd.next(t, 10*time.Second); msg != "READY=1" {
		t.Errorf("after the reload the agent notified %q, want READY=1", msg)
	}
	if err := a.stop(); err != nil {
		t.Errorf("serveAgent: %v", err)
	}
}

// An agent stopped before its plugins are ready never says READY=1, only STOPPING=1.
func TestAgentStoppedBeforeReadyNotifiesOnlyStopping(t *testing.T) {
	sd := listenNotify(t)
	a := startInProcessAgent(t, &devicetest.Fake{ReadyFunc: func() <-chan struct{} { return make(chan struct{}) }})
	if err := a.stop(); err != nil {
		t.Errorf("serveAgent: %v", err)
	}
	if msg := sd.next(t, 10*time.Second); msg != "STOPPING=1" {
		t.Errorf("first notification %q, want STOPPING=1 (never ready)", msg)
	}
}

// Without NOTIFY_SOCKET (not under systemd) the agent runs as ever; a NOTIFY_SOCKET
// nobody listens on is logged, not fatal.
func TestAgentWithoutSystemd(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", filepath.Join(t.TempDir(), "nobody"))
	a := startInProcessAgent(t, &devicetest.Fake{})
	if err := a.stop(); err != nil {
		t.Errorf("serveAgent with a dead NOTIFY_SOCKET: %v, want nil", err)
	}
}
