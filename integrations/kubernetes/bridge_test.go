package kubernetes_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/integrations/kubernetes"
	"github.com/devicehost/devicehost/integrations/kubernetes/kubelettest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// The kubelet sees the agent's 8 GPUs under nvidia.com/gpu: registered with the
// v1beta1 API on a socket of the bridge's own, with GetPreferredAllocation offered,
// and each GPU healthy with its NUMA node.
func TestRegistersAndListsDevices(t *testing.T) {
	ctx := testContext(t)
	h := startBridge(t, startAgent(t, eightGPUs()))

	regs, err := h.kubelet.WaitRegistrations(ctx, gpuResource, 1)
	if err != nil {
		t.Fatal(err)
	}
	want := &dpapi.RegisterRequest{
		Version:      dpapi.Version,
		Endpoint:     "devicehost-nvidia.com_gpu.sock",
		ResourceName: gpuResource,
		Options:      &dpapi.DevicePluginOptions{GetPreferredAllocationAvailable: true},
	}
	if got := regs[0].Request; !proto.Equal(got, want) {
		t.Errorf("RegisterRequest = %v, want %v", got, want)
	}
	u := h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))
	for i, d := range u.Devices {
		wantDev := &dpapi.Device{ID: gpuID(i), Health: dpapi.Healthy,
			Topology: &dpapi.TopologyInfo{Nodes: []*dpapi.NUMANode{{ID: int64(i / 4)}}}}
		if !proto.Equal(d, wantDev) {
			t.Errorf("device %d = %v, want %v", i, d, wantDev)
		}
	}
}

// A device that turns unhealthy at the agent turns unhealthy at the kubelet, alone,
// and healthy again when it recovers; a device without a NUMA node has no topology.
func TestHealthFollowsTheAgent(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent)
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))

	agent.setHealth(gpuID(3), device.HealthUnhealthy, "XID 79")
	h.waitGPUs(t, ctx, "GPU 3 unhealthy", withHealth(8, gpuID(3), dpapi.Unhealthy))
	agent.setHealth(gpuID(3), device.HealthHealthy, "")
	h.waitGPUs(t, ctx, "GPU 3 healthy again", kubelettest.AllHealth(8, dpapi.Healthy))
	// Unknown health (a plugin not yet fingerprinted) is not healthy either.
	agent.setHealth(gpuID(5), device.HealthUnknown, "starting")
	h.waitGPUs(t, ctx, "GPU 5 of unknown health", withHealth(8, gpuID(5), dpapi.Unhealthy))
}

// A cordoned device is offered to no pod: unhealthy for the kubelet while cordoned,
// healthy as soon as it is uncordoned, whatever its own health says.
func TestCordonedDeviceIsUnhealthy(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent)
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))

	agent.cordon(gpuID(2), &device.Cordon{Reason: "ECC storm", By: "admin"})
	h.waitGPUs(t, ctx, "GPU 2 unhealthy while cordoned", withHealth(8, gpuID(2), dpapi.Unhealthy))
	agent.cordon(gpuID(2), nil)
	h.waitGPUs(t, ctx, "GPU 2 healthy once uncordoned", kubelettest.AllHealth(8, dpapi.Healthy))
}

// While the agent is unreachable the kubelet keeps every device, unhealthy; when the
// agent is back the real state returns.
func TestAgentGoneMarksEverythingUnhealthy(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent)
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))

	agent.stop()
	h.waitGPUs(t, ctx, "8 unhealthy GPUs while the agent is gone", kubelettest.AllHealth(8, dpapi.Unhealthy))
	c := h.plugin(t, ctx)
	_, err := allocate(ctx, c, gpuID(0))
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "not reachable") {
		t.Errorf("Allocate while the agent is gone: %v, want UNAVAILABLE saying the agent is not reachable", err)
	}

	agent.setHealth(gpuID(1), device.HealthUnhealthy, "XID 48") // changed while away
	agent.start(t)
	h.waitGPUs(t, ctx, "the agent's state back", withHealth(8, gpuID(1), dpapi.Unhealthy))
}

// The device-list strategy decides which lists the container gets: envvar only the
// env (a runtime injecting from NVIDIA_VISIBLE_DEVICES), cdi-cri only the CDI names
// (a runtime with CDI on); mounts and device nodes come in both.
func TestAllocateDeviceListStrategy(t *testing.T) {
	for _, tc := range []struct {
		strategy         string
		wantEnv, wantCDI bool
	}{
		{"envvar", true, false},
		{"cdi-cri", false, true},
		{"cdi-cri,envvar", true, true},
	} {
		t.Run(tc.strategy, func(t *testing.T) {
			ctx := testContext(t)
			strategy, err := kubernetes.ParseDeviceListStrategy(tc.strategy)
			if err != nil {
				t.Fatal(err)
			}
			h := startBridge(t, startAgent(t, eightGPUs()), func(c *kubernetes.Config) { c.DeviceListStrategy = strategy })
			got, err := allocate(ctx, h.healthyPlugin(t, ctx), gpuID(2), gpuID(3))
			if err != nil {
				t.Fatalf("Allocate: %v", err)
			}
			if env := got.GetEnvs()["NVIDIA_VISIBLE_DEVICES"]; (env != "") != tc.wantEnv {
				t.Errorf("NVIDIA_VISIBLE_DEVICES = %q; want it set: %v", env, tc.wantEnv)
			}
			if cdi := got.GetCdiDevices(); (len(cdi) == 2) != tc.wantCDI || (len(cdi) != 0 && len(cdi) != 2) {
				t.Errorf("CDI devices %v; want both GPUs' names: %v", cdi, tc.wantCDI)
			}
			if len(got.GetMounts()) != 1 || len(got.GetDevices()) != 1 {
				t.Errorf("mounts %v, devices %v: want the plugin's one of each", got.GetMounts(), got.GetDevices())
			}
		})
	}
}

func TestParseDeviceListStrategy(t *testing.T) {
	for _, bad := range []string{"", "env", "envvar,", "cdi-annotations", "envvar;cdi-cri"} {
		if _, err := kubernetes.ParseDeviceListStrategy(bad); err == nil || !strings.Contains(err.Error(), "envvar, cdi-cri or both") {
			t.Errorf("ParseDeviceListStrategy(%q) = %v, want an error naming the choices", bad, err)
		}
	}
	if s, err := kubernetes.ParseDeviceListStrategy(" cdi-cri , envvar "); err != nil || s.String() != kubernetes.DefaultDeviceListStrategy {
		t.Errorf("ParseDeviceListStrategy(both) = %v (%q), %v", s, s.String(), err)
	}
}

// Allocate of two GPUs is one Reserve at the agent whose answer the container gets:
// NVIDIA_VISIBLE_DEVICES with both UUIDs, their CDI names, mounts and device nodes. A
// retried Allocate gets the same reservation, not a second one.
func TestAllocateReserves(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent)
	c := h.healthyPlugin(t, ctx)

	got, err := allocate(ctx, c, gpuID(2), gpuID(3))
	if err != nil {
		t.Fatalf("Allocate: %v", err)
	}
	want := &dpapi.ContainerAllocateResponse{
		Envs:       map[string]string{"NVIDIA_VISIBLE_DEVICES": gpuID(2) + "," + gpuID(3)},
		Mounts:     []*dpapi.Mount{{HostPath: "/usr/lib/nvidia", ContainerPath: "/usr/local/nvidia", ReadOnly: true}},
		Devices:    []*dpapi.DeviceSpec{{HostPath: "/dev/nvidiactl", ContainerPath: "/dev/nvidiactl", Permissions: "rw"}},
		CdiDevices: []*dpapi.CDIDevice{{Name: "nvidia.com/gpu=" + gpuID(2)}, {Name: "nvidia.com/gpu=" + gpuID(3)}},
	}
	if !proto.Equal(got, want) {
		t.Errorf("Allocate answer:\n got %v\nwant %v", got, want)
	}
	rs := agent.active()
	if len(rs) != 1 || !slices.Equal(rs[0].DeviceIDs, []string{gpuID(2), gpuID(3)}) || !strings.HasPrefix(rs[0].OwnerID, "kubelet/nvidia.com/gpu/") {
		t.Fatalf("reservations after Allocate: %+v, want one of GPUs 2 and 3 owned by kubelet/nvidia.com/gpu/...", rs)
	}

	// The kubelet retries (its answer was lost), in another order.
	if _, err := allocate(ctx, c, gpuID(3), gpuID(2)); err != nil {
		t.Fatalf("retried Allocate: %v", err)
	}
	if n := agent.reserveCount(); n != 1 {
		t.Errorf("%d reservations made after a retried Allocate, want 1", n)
	}
	if rs2 := agent.active(); len(rs2) != 1 || rs2[0].ID != rs[0].ID {
		t.Errorf("reservations after the retry: %+v, want only %s", rs2, rs[0].ID)
	}
	// The kubelet still sees both reserved GPUs healthy: they are its own allocation.
	h.waitGPUs(t, ctx, "8 healthy GPUs with two allocated", kubelettest.AllHealth(8, dpapi.Healthy))
}

// Two containers of one Allocate get one reservation each.
func TestAllocateTwoContainers(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent)
	c := h.healthyPlugin(t, ctx)

	resp, err := c.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{
		{DevicesIds: []string{gpuID(0)}}, {DevicesIds: []string{gpuID(1), gpuID(4)}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(resp.GetContainerResponses()); n != 2 {
		t.Fatalf("%d container responses, want 2", n)
	}
	if got := resp.GetContainerResponses()[1].GetEnvs()["NVIDIA_VISIBLE_DEVICES"]; got != gpuID(1)+","+gpuID(4) {
		t.Errorf("second container's NVIDIA_VISIBLE_DEVICES = %q, want %s,%s", got, gpuID(1), gpuID(4))
	}
	if n := len(agent.active()); n != 2 {
		t.Errorf("%d reservations, want 2", n)
	}
}

// A device another owner holds at the agent is unhealthy for the kubelet (so it
// allocates it to no pod); an Allocate that names it anyway fails with
// FAILED_PRECONDITION naming the device, the reservation and its owner.
func TestDeviceHeldByAnotherOwner(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent)
	c := h.healthyPlugin(t, ctx)

	res, err := h.client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-42", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{gpuID(6)}})
	if err != nil {
		t.Fatal(err)
	}
	h.waitGPUs(t, ctx, "GPU 6 unhealthy while job-42 holds it", withHealth(8, gpuID(6), dpapi.Unhealthy))

	_, err = allocate(ctx, c, gpuID(5), gpuID(6))
	want := `allocate nvidia.com/gpu (GPU-05, GPU-06): GPU-06 held by reservation ` + res.GetReservationId() + ` of owner "job-42"`
	if status.Code(err) != codes.FailedPrecondition || status.Convert(err).Message() != want {
		t.Errorf("Allocate of a held GPU: %v\nwant FailedPrecondition %q", err, want)
	}
	if rs := agent.reservations(device.ReservationFilter{OwnerID: "job-42"}); len(rs) != 1 || rs[0].State != device.ReservationActive {
		t.Errorf("job-42's reservation after the refused Allocate: %+v, want it untouched", rs)
	}

	if _, err := h.client.ReleaseOwner(ctx, "job-42"); err != nil {
		t.Fatal(err)
	}
	h.waitGPUs(t, ctx, "GPU 6 healthy once released", kubelettest.AllHealth(8, dpapi.Healthy))
}

// Unhealthy, unknown and malformed requests fail with the agent's code and a message
// that names the device.
func TestAllocateErrors(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent)
	c := h.plugin(t, ctx)
	agent.setHealth(gpuID(7), device.HealthUnhealthy, "XID 79")
	h.waitGPUs(t, ctx, "GPU 7 unhealthy", withHealth(8, gpuID(7), dpapi.Unhealthy))

	for _, tc := range []struct {
		name string
		ids  []string
		code codes.Code
		msg  string
	}{
		{"unhealthy", []string{gpuID(7)}, codes.FailedPrecondition, "GPU-07 (unhealthy: XID 79)"},
		{"unknown", []string{gpuID(1), "GPU-99"}, codes.NotFound, "GPU-99: not a device of nvidia.com/gpu on this node"},
		{"empty", nil, codes.InvalidArgument, "a container request with no devices"},
		{"twice", []string{gpuID(1), gpuID(1)}, codes.InvalidArgument, "device GPU-01 asked for twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := allocate(ctx, c, tc.ids...)
			if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("Allocate %v: %v, want %v containing %q", tc.ids, err, tc.code, tc.msg)
			}
		})
	}
	if n := agent.reserveCount(); n != 0 {
		t.Errorf("%d reservations made by failed Allocates, want 0", n)
	}
}

// The kubelet allocates a device again once the pod that had it is gone, possibly
// before the release loop has released the old reservation: the bridge takes its own
// stale reservation over, in one Reserve the agent makes atomic (no Release call, so
// the devices are never free in between).
func TestAllocateReplacesOwnStaleReservation(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent, func(c *kubernetes.Config) { c.ReleaseGrace = time.Hour })
	c := h.healthyPlugin(t, ctx)

	if _, err := allocate(ctx, c, gpuID(0), gpuID(1)); err != nil {
		t.Fatal(err)
	}
	old := agent.active()[0]
	if _, err := allocate(ctx, c, gpuID(1), gpuID(2)); err != nil {
		t.Fatalf("Allocate of a device of the bridge's earlier reservation: %v", err)
	}
	rs := agent.active()
	if len(rs) != 1 || rs[0].ID == old.ID || !slices.Equal(rs[0].DeviceIDs, []string{gpuID(1), gpuID(2)}) {
		t.Errorf("active reservations: %+v, want only a new one of GPUs 1 and 2 (%s released)", rs, old.ID)
	}
	if got, want := agent.takeOverRequests(), [][]string{{"kubelet/" + gpuResource + "/"}}; !reflect.DeepEqual(got, want) || agent.releaseCount() != 0 {
		t.Errorf("take-over prefixes asked %q and %d Release calls; want %q and none", got, agent.releaseCount(), want)
	}
	if !strings.Contains(h.logs.String(), "took over an earlier reservation") || !strings.Contains(h.logs.String(), old.ID) {
		t.Errorf("no log line says %s was taken over:\n%s", old.ID, h.logs)
	}
}

// A kubelet restart empties the device-plugins directory and makes a new
// kubelet.sock: the bridge serves its socket again and registers again, once: kubelet
// 1.37 refuses a second registration of an endpoint it is connected to, and a bridge
// that sent one anyway would retry it forever. The pass after the bridge saw the new
// socket succeeds with no registration refused, and the new kubelet sees the devices.
func TestRegistersAgainAfterKubeletRestart(t *testing.T) {
	ctx := testContext(t)
	passes := newSyncPasses()
	h := startBridgeWith(t, startAgent(t, eightGPUs()), func(b *kubernetes.Bridge) {
		kubernetes.SetAfterSync(b, passes.record)
	})
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))

	for n := 2; n <= 3; n++ {
		if err := h.kubelet.Restart(); err != nil {
			t.Fatal(err)
		}
		created := h.kubelet.SocketCreated()
		if err := passes.waitOK(ctx, n-1); err != nil {
			t.Fatalf("after kubelet restart %d: %v; refused: %d", n-1, err, len(h.kubelet.Refused()))
		}
		regs := h.kubelet.Registrations()
		if len(regs) != n {
			t.Fatalf("after kubelet restart %d: %d registrations in all, want %d", n-1, len(regs), n)
		}
		t.Logf("registration %d: %v after the kubelet socket was created", n, regs[n-1].At.Sub(created))
		if refused := h.kubelet.Refused(); len(refused) > 0 {
			t.Fatalf("after kubelet restart %d: %d registrations refused as already connected (first at %v after the socket was created)",
				n-1, len(refused), refused[0].At.Sub(created))
		}
		h.waitGPUs(t, ctx, "8 healthy GPUs at the restarted kubelet", kubelettest.AllHealth(8, dpapi.Healthy))
		if _, err := os.Stat(filepath.Join(h.kubelet.Dir(), "devicehost-nvidia.com_gpu.sock")); err != nil {
			t.Errorf("plugin socket after re-registration: %v", err)
		}
	}
}

// syncPasses records the registrar's passes (kubernetes.SetAfterSync).
type syncPasses struct {
	mu      sync.Mutex
	changed chan struct{}
	okAt    int // the most kubelet.sock creations seen by a pass that succeeded; -1: none
}

func newSyncPasses() *syncPasses { return &syncPasses{changed: make(chan struct{}), okAt: -1} }

func (p *syncPasses) record(creates int, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if ok && creates > p.okAt {
		p.okAt = creates
	}
	close(p.changed)
	p.changed = make(chan struct{})
}

// waitOK waits for a pass that succeeded after the registrar had seen creates
// kubelet.sock creations.
func (p *syncPasses) waitOK(ctx context.Context, creates int) error {
	for {
		p.mu.Lock()
		done, ch := p.okAt >= creates, p.changed
		p.mu.Unlock()
		if done {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("no registration pass succeeded after the bridge saw kubelet.sock created %d times: %w", creates, ctx.Err())
		}
	}
}

// A plugin socket removed while the kubelet stays is served again and registered
// again.
func TestServesAgainWhenSocketRemoved(t *testing.T) {
	ctx := testContext(t)
	h := startBridge(t, startAgent(t, eightGPUs()))
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))

	if err := os.Remove(filepath.Join(h.kubelet.Dir(), "devicehost-nvidia.com_gpu.sock")); err != nil {
		t.Fatal(err)
	}
	if _, err := h.kubelet.WaitRegistrations(ctx, gpuResource, 2); err != nil {
		t.Fatal(err)
	}
	h.waitGPUs(t, ctx, "8 healthy GPUs on the new socket", kubelettest.AllHealth(8, dpapi.Healthy))
	c := h.plugin(t, ctx)
	if _, err := allocate(ctx, c, gpuID(0)); err != nil {
		t.Errorf("Allocate on the new socket: %v", err)
	}
}

// With the kubelet gone, the bridge waits for its socket and registers as soon as it
// appears.
func TestRegistersWhenKubeletComesUp(t *testing.T) {
	ctx := testContext(t)
	h := startBridge(t, startAgent(t, eightGPUs()))
	h.kubelet.Stop() // before or after the bridge registered
	before := len(h.kubelet.Registrations())
	if err := h.kubelet.Restart(); err != nil {
		t.Fatal(err)
	}
	if _, err := h.kubelet.WaitRegistrations(ctx, gpuResource, before+1); err != nil {
		t.Fatal(err)
	}
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))
}

// When Run's context ends the bridge stops serving, removes its socket and returns
// nil; the kubelet's stream ends.
func TestStopRemovesSockets(t *testing.T) {
	ctx := testContext(t)
	h := startBridge(t, startAgent(t, eightGPUs()))
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))
	if err := h.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	sock := filepath.Join(h.kubelet.Dir(), "devicehost-nvidia.com_gpu.sock")
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("plugin socket after stop: %v, want it removed", err)
	}
	if _, err := os.Stat(h.kubelet.Socket()); err != nil {
		t.Errorf("the kubelet's socket after the bridge stopped: %v, want it left alone", err)
	}
}

// A careless kubelet cannot make the bridge do unbounded work: too many container
// requests or devices are refused before anything is reserved.
func TestAllocateBounds(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent)
	c := h.plugin(t, ctx)
	many := make([]*dpapi.ContainerAllocateRequest, 257)
	for i := range many {
		many[i] = &dpapi.ContainerAllocateRequest{DevicesIds: []string{gpuID(0)}}
	}
	_, err := c.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: many})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "257 container requests; at most 256") {
		t.Errorf("257 container requests: %v, want InvalidArgument", err)
	}
	ids := make([]string, 4097)
	for i := range ids {
		ids[i] = "X"
	}
	_, err = allocate(ctx, c, ids...)
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "4097 devices; at most 4096") {
		t.Errorf("4097 devices: %v, want InvalidArgument", err)
	}
	if n := agent.reserveCount(); n != 0 {
		t.Errorf("%d reservations made, want none", n)
	}
}
