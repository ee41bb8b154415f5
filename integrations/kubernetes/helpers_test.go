package kubernetes_test

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/kubernetes"
	"github.com/devicehost/devicehost/integrations/kubernetes/kubelettest"
	"github.com/devicehost/devicehost/tools/logtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const gpuResource = "nvidia.com/gpu"

// harness is a bridge running against a fake agent, a stand-in kubelet and a
// stand-in PodResources server.
type harness struct {
	agent   *fakeAgent
	kubelet *kubelettest.Kubelet
	pods    *kubelettest.PodResources
	client  *client.Client // the bridge's connection to the agent
	cfg     kubernetes.Config
	logs    *logtest.Recorder

	cancel context.CancelFunc
	runErr chan error
}

// startBridge runs a bridge for agent with the stand-ins, its config changed by opts
// (ReleaseGrace 1s and PodResourcesInterval 20ms unless set). Cleanup stops it (and
// checks Run returned nil) and the stand-ins.
func startBridge(t testing.TB, agent *fakeAgent, opts ...func(*kubernetes.Config)) *harness {
	t.Helper()
	return startBridgeWith(t, agent, nil, opts...)
}

// startBridgeWith is startBridge with setup called on the Bridge before it runs.
func startBridgeWith(t testing.TB, agent *fakeAgent, setup func(*kubernetes.Bridge), opts ...func(*kubernetes.Config)) *harness {
	t.Helper()
	dir := shortTempDir(t, "dpk")
	k, err := kubelettest.Start(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Close)
	prSock := filepath.Join(shortTempDir(t, "prk"), "kubelet.sock")
	pods, err := kubelettest.StartPodResources(prSock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pods.Close)
	c, err := client.Dial(context.Background(), agent.addr.String(), client.WithoutReachCheck(), client.WithBackoff(5*time.Millisecond, 50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	logs := &logtest.Recorder{}
	h := &harness{agent: agent, kubelet: k, pods: pods, client: c, logs: logs, runErr: make(chan error, 1)}
	h.cfg = kubernetes.Config{
		Client:               c,
		DevicePluginDir:      dir,
		PodResourcesSocket:   prSock,
		ReleaseGrace:         time.Second,
		PodResourcesInterval: 20 * time.Millisecond,
		Logger:               hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Debug}),
		PCIeRoot:             func(string) string { return "" },
	}
	for _, o := range opts {
		o(&h.cfg)
	}
	b, err := kubernetes.New(h.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if setup != nil {
		setup(b)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.runErr <- b.Run(ctx) }()
	t.Cleanup(func() {
		if err := h.stop(); err != nil {
			t.Errorf("Run: %v, want nil after its context ended", err)
		}
		if t.Failed() {
			t.Logf("bridge log:\n%s", logs.String())
		}
	})
	return h
}

// stop ends the bridge's Run and returns its result (nil once stopped before).
func (h *harness) stop() error {
	h.cancel()
	select {
	case err, ok := <-h.runErr:
		if ok {
			close(h.runErr)
		}
		return err
	case <-time.After(30 * time.Second):
		panic("bridge Run did not return 30s after its context ended")
	}
}

// waitGPUs waits until the kubelet sees the GPU resource's devices satisfy ok.
func (h *harness) waitGPUs(t *testing.T, ctx context.Context, what string, ok func([]*dpapi.Device) bool) kubelettest.Update {
	t.Helper()
	u, err := h.kubelet.WaitDevices(ctx, gpuResource, ok)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return u
}

// plugin returns the kubelet's client of the GPU resource's plugin, once registered.
func (h *harness) plugin(t *testing.T, ctx context.Context) dpapi.DevicePluginClient {
	t.Helper()
	if _, err := h.kubelet.WaitRegistrations(ctx, gpuResource, 1); err != nil {
		t.Fatal(err)
	}
	c, err := h.kubelet.Client(gpuResource)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// healthyPlugin is plugin, once the kubelet's ListAndWatch shows the fake agent's 8
// GPUs healthy.
func (h *harness) healthyPlugin(t *testing.T, ctx context.Context) dpapi.DevicePluginClient {
	t.Helper()
	c := h.plugin(t, ctx)
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))
	return c
}

// allocate is the kubelet's Allocate of ids for one container.
func allocate(ctx context.Context, c dpapi.DevicePluginClient, ids ...string) (*dpapi.ContainerAllocateResponse, error) {
	resp, err := c.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		return nil, err
	}
	return resp.GetContainerResponses()[0], nil
}

// testContext is a context that ends with the test or after a minute.
func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// withHealth returns a condition: n devices, id with health h, the others healthy.
func withHealth(n int, id, h string) func([]*dpapi.Device) bool {
	return func(devs []*dpapi.Device) bool {
		if len(devs) != n {
			return false
		}
		for _, d := range devs {
			want := dpapi.Healthy
			if d.GetID() == id {
				want = h
			}
			if d.GetHealth() != want {
				return false
			}
		}
		return true
	}
}

// fakeClock is a clock a test moves by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}
