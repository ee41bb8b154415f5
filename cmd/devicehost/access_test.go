package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/logtest"
)

// runAgentWithConfig runs serveAgent on mgr with the config file content (its
// addresses under dir), until the test ends, and returns the agent's log.
func runAgentWithConfig(t *testing.T, mgr device.Manager, content string) *logtest.Recorder {
	t.Helper()
	cfg := defaultAgentConfig()
	if err := loadConfigFile(writeConfig(t, "devicehost.hcl", content), &cfg); err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Recorder{}
	log := hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Info, JSONFormat: true})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	listening := make(chan struct{})
	go func() {
		done <- serveAgent(ctx, cfg, log, func(hclog.Logger) (device.Manager, error) { return mgr, nil }, nil, func(endpoint.Address) { close(listening) }, reloadHook{})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serveAgent: %v", err)
		}
	})
	select {
	case <-listening:
	case err := <-done:
		done <- err
		t.Fatalf("serveAgent: %v", err)
	}
	return logs
}

func reserveAt(t *testing.T, path, owner string) error {
	t.Helper()
	conn, err := endpoint.Dial(endpoint.Address{Network: "unix", Path: path}, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = pb.NewDeviceHostClient(conn).Reserve(ctx, &pb.ReserveRequest{OwnerId: owner, Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: []string{"GPU-0"}})
	return err
}

// The config file's listener blocks are served beside listen, each with its grants;
// listen stays admin; the CLI reads through a read-only listener.
func TestAgentServesListenersWithTheirGrants(t *testing.T) {
	dir, err := os.MkdirTemp("", "dhacc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	mgr := &devicetest.Fake{
		ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
			return device.Reservation{ID: "r", OwnerID: req.OwnerID}, nil
		},
		StateFunc: func() device.State {
			return device.State{Plugins: []device.PluginState{{Name: "fake", Status: device.PluginRunning}}}
		},
	}
	logs := runAgentWithConfig(t, mgr, fmt.Sprintf(`
listen = "unix://%[1]s/admin.sock"
listener "kubelet-bridge" {
  address = "unix://%[1]s/bridge.sock"
  allow   = ["read", "reserve:k8s/"]
}
listener "monitoring" {
  address = "unix://%[1]s/ro.sock"
  allow   = ["read"]
  mode    = "0666"
}
grant {
  uid   = %[2]d
  allow = ["reserve:nomad/"]
}
`, dir, os.Getuid()+1))
	sock := func(name string) string { return filepath.Join(dir, name+".sock") }
	for name, want := range map[string]os.FileMode{"admin": 0o660, "bridge": 0o660, "ro": 0o666} {
		if fi, err := os.Stat(sock(name)); err != nil || fi.Mode().Perm() != want {
			t.Errorf("%s.sock: %v, %v; want mode %v", name, fi.Mode(), err, want)
		}
	}
	for _, tt := range []struct {
		sock, owner string
		want        codes.Code
	}{
		{"admin", "anyone", codes.OK},
		{"bridge", "k8s/ns/pod/c", codes.OK},
		{"bridge", "nomad/default/job/a/t", codes.PermissionDenied},
		{"ro", "k8s/ns/pod/c", codes.PermissionDenied},
	} {
		if err := reserveAt(t, sock(tt.sock), tt.owner); status.Code(err) != tt.want {
			t.Errorf("Reserve for %s on %s.sock: %v, want %s", tt.owner, tt.sock, err, tt.want)
		}
	}
	if out := mustRunCLI(t, "plugins", "-address", "unix://"+sock("ro")); !strings.Contains(out, "fake") {
		t.Errorf("plugins through the read-only listener: %q", out)
	}
	for _, want := range []string{`"name":"kubelet-bridge"`, `"allow":"read, reserve:k8s/"`, `"name":"main"`, `"allow":"admin"`, fmt.Sprintf(`"peer":"uid=%d"`, os.Getuid()+1)} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the start log does not say %s:\n%s", want, logs)
		}
	}
	if strings.Contains(logs.String(), "access control is off") {
		t.Error("the log says access control is off while listeners have grants")
	}
}

// Without listener or grant blocks, everything is allowed on listen, and the agent says
// so once.
func TestAgentSaysAccessControlIsOff(t *testing.T) {
	dir, err := os.MkdirTemp("", "dhacc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	mgr := &devicetest.Fake{ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
		return device.Reservation{ID: "r", OwnerID: req.OwnerID}, nil
	}}
	logs := runAgentWithConfig(t, mgr, fmt.Sprintf("listen = \"unix://%s/admin.sock\"\n", dir))
	if err := reserveAt(t, filepath.Join(dir, "admin.sock"), "anyone"); err != nil {
		t.Error(err)
	}
	if n := logs.Count("access control is off"); n != 1 {
		t.Errorf("said %d times that access control is off, want once:\n%s", n, logs)
	}
}
