package hosted

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/deviceplugin/deviceplugintest"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakePlugin is a kubelet device plugin: it serves the DevicePlugin service on a
// socket in the host's directory and registers there, as a real one does.
type fakePlugin struct {
	dpapi.UnimplementedDevicePluginServer
	t        *testing.T
	dir      string
	endpoint string
	resource string
	preStart bool

	srv     *grpc.Server
	updates chan []*dpapi.Device

	mu        sync.Mutex
	allocated [][]string
	preStarts [][]string
}

func newFakePlugin(t *testing.T, dir, endpoint, resource string, devs []*dpapi.Device) *fakePlugin {
	t.Helper()
	f := &fakePlugin{t: t, dir: dir, endpoint: endpoint, resource: resource, updates: make(chan []*dpapi.Device, 16)}
	f.updates <- devs
	return f
}

// serve starts its server (again, after stop).
func (f *fakePlugin) serve() {
	f.t.Helper()
	sock := filepath.Join(f.dir, f.endpoint)
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		f.t.Fatal(err)
	}
	f.srv = grpc.NewServer()
	dpapi.RegisterDevicePluginServer(f.srv, f)
	srv := f.srv
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	f.t.Cleanup(func() { srv.Stop(); <-done })
}

// stop stops its server: its streams end, as when the plugin's process exits.
func (f *fakePlugin) stop() { f.srv.Stop() }

// register registers with the host's kubelet.sock.
func (f *fakePlugin) register() error {
	return registerWith(f.dir, &dpapi.RegisterRequest{Version: dpapi.Version, Endpoint: f.endpoint, ResourceName: f.resource,
		Options: &dpapi.DevicePluginOptions{PreStartRequired: f.preStart}})
}

func registerWith(dir string, req *dpapi.RegisterRequest) error {
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, SocketName), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = dpapi.NewRegistrationClient(conn).Register(ctx, req)
	return err
}

func (f *fakePlugin) GetDevicePluginOptions(context.Context, *dpapi.Empty) (*dpapi.DevicePluginOptions, error) {
	return &dpapi.DevicePluginOptions{PreStartRequired: f.preStart}, nil
}

func (f *fakePlugin) ListAndWatch(_ *dpapi.Empty, s grpc.ServerStreamingServer[dpapi.ListAndWatchResponse]) error {
	var last []*dpapi.Device
	for {
		select {
		case devs := <-f.updates:
			last = devs
		case <-s.Context().Done():
			f.updates <- last // for the next stream
			return nil
		}
		if err := s.Send(&dpapi.ListAndWatchResponse{Devices: last}); err != nil {
			return err
		}
	}
}

func (f *fakePlugin) Allocate(_ context.Context, req *dpapi.AllocateRequest) (*dpapi.AllocateResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	resp := &dpapi.AllocateResponse{}
	for _, c := range req.GetContainerRequests() {
		f.allocated = append(f.allocated, c.GetDevicesIds())
		resp.ContainerResponses = append(resp.ContainerResponses, &dpapi.ContainerAllocateResponse{
			Envs:        map[string]string{"FAKE_DEVICES": strings.Join(c.GetDevicesIds(), ",")},
			Devices:     []*dpapi.DeviceSpec{{HostPath: "/dev/fuse", ContainerPath: "/dev/fuse", Permissions: "rw"}},
			Mounts:      []*dpapi.Mount{{HostPath: "/opt/fake", ContainerPath: "/fake", ReadOnly: true}},
			Annotations: map[string]string{"a": "b"},
			CdiDevices:  []*dpapi.CDIDevice{{Name: "devic.es/fuse=" + c.GetDevicesIds()[0]}},
		})
	}
	return resp, nil
}

func (f *fakePlugin) PreStartContainer(_ context.Context, req *dpapi.PreStartContainerRequest) (*dpapi.PreStartContainerResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.preStarts = append(f.preStarts, req.GetDevicesIds())
	return &dpapi.PreStartContainerResponse{}, nil
}

// host is a configured host with a Fingerprint stream running.
type host struct {
	p   *Plugin
	dir string
	*deviceplugintest.Inventories
}

func startHost(t *testing.T) *host {
	t.Helper()
	dir, err := os.MkdirTemp("", "dph") // short: socket paths
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p := New(nil)
	if err := p.SetConfig(context.Background(), fmt.Appendf(nil, `{"dir":%q}`, dir)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Shutdown) // after the stream has ended
	return &host{p: p, dir: dir, Inventories: deviceplugintest.WatchFingerprint(t, p)}
}

func device(r *pb.FingerprintResponse, id string) *pb.Device {
	for _, g := range r.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetId() == id {
				return d
			}
		}
	}
	return nil
}

func healthy(d *pb.Device) bool { return d != nil && d.GetHealth() == pb.Health_HEALTH_HEALTHY }

func fuseDevices(n int) []*dpapi.Device {
	var devs []*dpapi.Device
	for i := range n {
		devs = append(devs, &dpapi.Device{ID: fmt.Sprintf("fuse-%d", i), Health: dpapi.Healthy,
			Topology: &dpapi.TopologyInfo{Nodes: []*dpapi.NUMANode{{ID: 1}}}})
	}
	return devs
}

func TestRegisteredPluginIsAGroupAndReserveCallsAllocate(t *testing.T) {
	h := startHost(t)
	f := newFakePlugin(t, h.dir, "fuse.sock", "devic.es/fuse", fuseDevices(4))
	f.preStart = true
	f.serve()
	if err := f.register(); err != nil {
		t.Fatal(err)
	}
	r := h.WaitFor(t, "4 healthy fuse devices", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "fuse-3")) })
	if len(r.GetGroups()) != 1 {
		t.Fatalf("groups %v, want one", r.GetGroups())
	}
	g := r.GetGroups()[0]
	if g.GetVendor() != "devic.es" || g.GetType() != "fuse" || len(g.GetDevices()) != 4 || g.GetAttributes()["resource"].GetStringValue() != "devic.es/fuse" {
		t.Errorf("group %v, want vendor devic.es, type fuse, 4 devices, resource devic.es/fuse", g)
	}
	if n := device(r, "fuse-0").GetLocality().GetNumaNode(); n != 1 {
		t.Errorf("fuse-0 NUMA node %d, want the topology's 1", n)
	}

	res, err := h.p.Reserve(context.Background(), []string{"fuse-1", "fuse-2"})
	if err != nil {
		t.Fatal(err)
	}
	if res.GetEnvs()["FAKE_DEVICES"] != "fuse-1,fuse-2" || len(res.GetDevices()) != 1 || res.GetDevices()[0].GetHostPath() != "/dev/fuse" ||
		len(res.GetMounts()) != 1 || !res.GetMounts()[0].GetReadOnly() || len(res.GetCdiDevices()) != 1 {
		t.Errorf("Reserve answered %v, want Allocate's envs, device, mount and CDI device", res)
	}
	f.mu.Lock()
	alloc, pre := f.allocated, f.preStarts
	f.mu.Unlock()
	if len(alloc) != 1 || len(pre) != 1 || strings.Join(pre[0], ",") != "fuse-1,fuse-2" {
		t.Errorf("Allocate calls %v, PreStartContainer calls %v; want one each of fuse-1,fuse-2", alloc, pre)
	}
	if _, err := h.p.Reserve(context.Background(), []string{"nope"}); status.Code(err) != codes.NotFound {
		t.Errorf("Reserve of an unknown ID: %v, want NOT_FOUND", err)
	}
}

func TestPluginRestartKeepsItsDevices(t *testing.T) {
	h := startHost(t)
	f := newFakePlugin(t, h.dir, "fuse.sock", "devic.es/fuse", fuseDevices(2))
	f.serve()
	if err := f.register(); err != nil {
		t.Fatal(err)
	}
	h.WaitFor(t, "fuse-1 healthy", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "fuse-1")) })

	f.stop()
	r := h.WaitFor(t, "fuse-1 unhealthy", func(r *pb.FingerprintResponse) bool {
		d := device(r, "fuse-1")
		return d != nil && !healthy(d)
	})
	if reason := device(r, "fuse-1").GetHealthReason(); !strings.Contains(reason, "device plugin fuse.sock not connected") {
		t.Errorf("reason %q, want it to say the plugin is not connected", reason)
	}
	if _, err := h.p.Reserve(context.Background(), []string{"fuse-1"}); status.Code(err) != codes.Unavailable {
		t.Errorf("Reserve while the plugin is down: %v, want UNAVAILABLE", err)
	}

	f.serve()
	if err := f.register(); err != nil {
		t.Fatalf("a restarted plugin's registration: %v", err)
	}
	h.WaitFor(t, "fuse-1 healthy again", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "fuse-1")) })
}

func TestRegistrationsRefused(t *testing.T) {
	h := startHost(t)
	f := newFakePlugin(t, h.dir, "fuse.sock", "devic.es/fuse", fuseDevices(1))
	f.serve()
	if err := f.register(); err != nil {
		t.Fatal(err)
	}
	h.WaitFor(t, "fuse-0 healthy", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "fuse-0")) })
	tests := []struct {
		name string
		req  *dpapi.RegisterRequest
		code codes.Code
		want string
	}{
		{"a second plugin of the resource", &dpapi.RegisterRequest{Version: dpapi.Version, Endpoint: "other.sock", ResourceName: "devic.es/fuse"},
			codes.AlreadyExists, "resource devic.es/fuse is served by the plugin at fuse.sock, which is still connected"},
		{"old version", &dpapi.RegisterRequest{Version: "v1alpha", Endpoint: "x.sock", ResourceName: "devic.es/x"}, codes.InvalidArgument, `version "v1alpha"`},
		{"endpoint out of the directory", &dpapi.RegisterRequest{Version: dpapi.Version, Endpoint: "../x.sock", ResourceName: "devic.es/x"}, codes.InvalidArgument, `endpoint "../x.sock"`},
		{"the host's own socket", &dpapi.RegisterRequest{Version: dpapi.Version, Endpoint: SocketName, ResourceName: "devic.es/x"}, codes.InvalidArgument, "endpoint"},
		{"no domain", &dpapi.RegisterRequest{Version: dpapi.Version, Endpoint: "x.sock", ResourceName: "fuse"}, codes.InvalidArgument, "has no domain"},
		{"kubernetes.io", &dpapi.RegisterRequest{Version: dpapi.Version, Endpoint: "x.sock", ResourceName: "kubernetes.io/x"}, codes.InvalidArgument, "kubernetes.io"},
	}
	for _, tt := range tests {
		err := registerWith(h.dir, tt.req)
		if status.Code(err) != tt.code || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want %v saying %q", tt.name, err, tt.code, tt.want)
		}
	}
}

func TestBoundsOnWhatAPluginSends(t *testing.T) {
	h := startHost(t)
	var devs []*dpapi.Device
	for i := range MaxDevices + 50 {
		devs = append(devs, &dpapi.Device{ID: fmt.Sprintf("big-%d", i), Health: dpapi.Healthy})
	}
	big := newFakePlugin(t, h.dir, "big.sock", "devic.es/big", devs)
	big.serve()
	if err := big.register(); err != nil {
		t.Fatal(err)
	}
	h.WaitFor(t, "the big resource", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "big-0")) })
	// A second resource reporting an ID the first has: left out.
	dup := newFakePlugin(t, h.dir, "dup.sock", "devic.es/dup", []*dpapi.Device{{ID: "big-0", Health: dpapi.Healthy}, {ID: "dup-0", Health: dpapi.Healthy}})
	dup.serve()
	if err := dup.register(); err != nil {
		t.Fatal(err)
	}
	r := h.WaitFor(t, "both resources", func(r *pb.FingerprintResponse) bool {
		return healthy(device(r, "dup-0")) && healthy(device(r, "big-0"))
	})
	for _, g := range r.GetGroups() {
		switch g.GetType() {
		case "big":
			if len(g.GetDevices()) != MaxDevices {
				t.Errorf("big: %d devices, want the bound %d", len(g.GetDevices()), MaxDevices)
			}
		case "dup":
			if len(g.GetDevices()) != 1 || g.GetDevices()[0].GetId() != "dup-0" {
				t.Errorf("dup: %v, want only dup-0 (big-0 is the other resource's)", g.GetDevices())
			}
		}
	}
}

// A plugin registered with a host that restarts registers again, as with the kubelet:
// the new host removes the plugins' sockets, and a plugin watching its own sees it go.
func TestHostStartRemovesPluginSockets(t *testing.T) {
	h := startHost(t)
	f := newFakePlugin(t, h.dir, "fuse.sock", "devic.es/fuse", fuseDevices(1))
	f.serve()
	if err := f.register(); err != nil {
		t.Fatal(err)
	}
	h.WaitFor(t, "fuse-0 healthy", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "fuse-0")) })
	other := filepath.Join(h.dir, "checkpoint")
	if err := os.WriteFile(other, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	h.p.Shutdown()

	again := New(nil)
	if err := again.SetConfig(context.Background(), fmt.Appendf(nil, `{"dir":%q}`, h.dir)); err != nil {
		t.Fatal(err)
	}
	defer again.Shutdown()
	if _, err := os.Stat(filepath.Join(h.dir, "fuse.sock")); !os.IsNotExist(err) {
		t.Errorf("the plugin's socket after the host's start: %v, want it removed", err)
	}
	if _, err := os.Stat(other); err != nil {
		t.Errorf("a file that is not a socket: %v, want it kept", err)
	}
	if _, err := os.Stat(filepath.Join(h.dir, SocketName)); err != nil {
		t.Errorf("kubelet.sock: %v", err)
	}
}

func TestShutdownRemovesTheSocket(t *testing.T) {
	h := startHost(t)
	if _, err := os.Stat(filepath.Join(h.dir, SocketName)); err != nil {
		t.Fatal(err)
	}
	h.p.Shutdown()
	if _, err := os.Stat(filepath.Join(h.dir, SocketName)); !os.IsNotExist(err) {
		t.Errorf("kubelet.sock after Shutdown: %v, want it gone", err)
	}
}
