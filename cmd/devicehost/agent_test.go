package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/server"
)

// runningAgent is serveAgent running in-process on a fake manager.
type runningAgent struct {
	addr   endpoint.Address
	cancel context.CancelFunc
	done   chan struct{} // closed when serveAgent has returned err
	err    error
}

// stop ends the agent as SIGTERM does and returns serveAgent's result. Safe to call
// more than once.
func (a *runningAgent) stop() error {
	a.cancel()
	<-a.done
	return a.err
}

// startInProcessAgent runs serveAgent on mgr in a goroutine, listening on a socket in
// a fresh directory, and returns once it listens. Cleanup stops it. reload, if given,
// is the agent's reload hook (by default it never reloads).
func startInProcessAgent(t *testing.T, mgr device.Manager, reload ...reloadHook) *runningAgent {
	t.Helper()
	dir, err := os.MkdirTemp("", "dhag")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg := defaultAgentConfig()
	cfg.Listen = "unix://" + filepath.Join(dir, "devicehost.sock")
	ctx, cancel := context.WithCancel(context.Background())
	a := &runningAgent{cancel: cancel, done: make(chan struct{})}
	listening := make(chan endpoint.Address, 1)
	factory := func(hclog.Logger) (device.Manager, error) { return mgr, nil }
	var hook reloadHook
	if len(reload) > 0 {
		hook = reload[0]
	}
	go func() {
		defer close(a.done)
		a.err = serveAgent(ctx, cfg, hclog.NewNullLogger(), factory, nil, func(addr endpoint.Address) { listening <- addr }, hook)
	}()
	t.Cleanup(func() { a.stop() })
	select {
	case a.addr = <-listening:
	case <-a.done:
		t.Fatalf("serveAgent: %v", a.err)
	}
	return a
}

func TestAgentShutsTheAPIDownBeforeTheManager(t *testing.T) {
	ready := make(chan struct{})
	shutdown := make(chan bool, 1) // whether the socket still existed when the manager was shut down
	var sock string
	mgr := &devicetest.Fake{
		ReadyFunc: func() <-chan struct{} { return ready },
		StateFunc: func() device.State {
			return device.State{Plugins: []device.PluginState{{Name: "fake", Status: device.PluginRunning}}}
		},
		ShutdownFunc: func(context.Context) error {
			_, err := os.Stat(sock)
			select {
			case shutdown <- err == nil:
			default: // a second Shutdown: the first one is what counts
			}
			return nil
		},
	}
	a := startInProcessAgent(t, mgr)
	sock = a.addr.Path

	// Reachable, and NOT_SERVING until the manager is ready.
	conn, err := endpoint.Dial(a.addr, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	health := healthpb.NewHealthClient(conn)
	watch, err := health.Watch(ctx, &healthpb.HealthCheckRequest{Service: server.ServiceName})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []healthpb.HealthCheckResponse_ServingStatus{healthpb.HealthCheckResponse_NOT_SERVING, healthpb.HealthCheckResponse_SERVING} {
		resp, err := watch.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetStatus() != want {
			t.Fatalf("health = %v, want %v", resp.GetStatus(), want)
		}
		if want == healthpb.HealthCheckResponse_NOT_SERVING {
			close(ready)
		}
	}
	if out := mustRunCLI(t, "plugins", "-address", a.addr.String()); !strings.Contains(out, "fake") {
		t.Errorf("plugins output %q does not list the fake plugin", out)
	}

	cancel() // end the health Watch: an open call would hold the API's graceful stop
	if err := a.stop(); err != nil {
		t.Errorf("serveAgent after the signal: %v, want nil (exit 0)", err)
	}
	if socketThere := <-shutdown; socketThere {
		t.Error("the manager was shut down while the API socket still existed; want the API stopped first")
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket still there after shutdown: %v", err)
	}
}

func TestAgentStartFailures(t *testing.T) {
	t.Run("manager fails to start", func(t *testing.T) {
		dir := t.TempDir()
		cfg := defaultAgentConfig()
		sock := filepath.Join(dir, "dh.sock")
		cfg.Listen = "unix://" + sock
		factory := func(hclog.Logger) (device.Manager, error) { return nil, errors.New("plugin dir /nope: no such file") }
		err := serveAgent(context.Background(), cfg, hclog.NewNullLogger(), factory, nil, nil, reloadHook{})
		if err == nil || !strings.Contains(err.Error(), "start the device manager: plugin dir /nope") {
			t.Errorf("serveAgent: %v, want the manager's error", err)
		}
		if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("socket left behind: %v", err)
		}
	})
	t.Run("another agent listens", func(t *testing.T) {
		first := startInProcessAgent(t, &devicetest.Fake{})
		cfg := defaultAgentConfig()
		cfg.Listen = first.addr.String()
		factory := func(hclog.Logger) (device.Manager, error) {
			t.Error("the manager was started although the socket is taken")
			return &devicetest.Fake{}, nil
		}
		err := serveAgent(context.Background(), cfg, hclog.NewNullLogger(), factory, nil, nil, reloadHook{})
		if want := "another devicehost is listening on " + first.addr.Path; err == nil || err.Error() != want {
			t.Errorf("serveAgent: %v, want %q", err, want)
		}
	})
}

// A plugin dir that does not exist stops the agent with one line that names the
// setting and the path, and nothing logged before it.
func TestAgentMissingPluginDir(t *testing.T) {
	dir := tempDir(t, "dhpd")
	missing := filepath.Join(dir, "plugins")
	r := runCLI(t, "agent", "-plugin-dir", missing, "-state-dir", filepath.Join(dir, "state"),
		"-listen", "unix://"+filepath.Join(dir, "dh.sock"))
	want := "devicehost: start the device manager: plugin_dir " + missing + " (-plugin-dir) does not exist: " +
		"create it, or set plugin_dir in the config file or -plugin-dir to the directory of the plugin executables\n"
	if r.code != 1 || r.stderr != want {
		t.Errorf("exit %d stderr:\n%s\nwant exit 1 and:\n%s", r.code, r.stderr, want)
	}
}

// The dev banner's grpcurl examples talk to the agent's socket, and the one of a
// stream (which the agent never ends) ends by itself.
func TestDevBannerGrpcurlExamples(t *testing.T) {
	const sock = "/tmp/devicehost-dev-1/devicehost.sock"
	var buf bytes.Buffer
	printDevBanner(&buf, endpoint.Address{Network: "unix", Path: sock}, "/tmp/devicehost-dev-1/state", "/tmp/devicehost-dev-1")
	stream := regexp.MustCompile(`DeviceHost/(Fingerprint|Stats)\b|Health/Watch\b`)
	streams := 0
	for _, l := range strings.Split(buf.String(), "\n") {
		if !strings.Contains(l, "grpcurl ") {
			continue
		}
		if !strings.Contains(l, " -unix "+sock+" ") {
			t.Errorf("%q does not talk to the socket %s", l, sock)
		}
		if stream.MatchString(l) {
			streams++
			if !regexp.MustCompile(`grpcurl .*-max-time \d+ `).MatchString(l) {
				t.Errorf("%q streams until interrupted; want -max-time", l)
			}
		}
	}
	if streams == 0 {
		t.Errorf("no grpcurl example of a stream in the banner:\n%s", buf.String())
	}
	// Its PID, so that the tour kills this agent's plugin, not every one on the machine.
	if want := fmt.Sprintf("  PID:    %d (its plugins are its children: pkill -P %d -f", os.Getpid(), os.Getpid()); !strings.Contains(buf.String(), want) {
		t.Errorf("the banner does not name the agent's PID (%q):\n%s", want, buf.String())
	}
}
