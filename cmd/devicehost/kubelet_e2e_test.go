package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	prapi "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/integrations/kubernetes/kubelettest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

const e2eGPUResource = "nvidia.com/gpu"

// fingerprintRecorder reads a Fingerprint stream to its end, keeping every snapshot
// with the time it arrived.
type fingerprintRecorder struct {
	mu    sync.Mutex
	snaps []*pb.FingerprintResponse
	done  chan struct{}
}

func recordFingerprints(stream interface {
	Recv() (*pb.FingerprintResponse, error)
}) *fingerprintRecorder {
	r := &fingerprintRecorder{done: make(chan struct{})}
	go func() {
		defer close(r.done)
		for {
			fp, err := stream.Recv()
			if err != nil {
				return
			}
			r.mu.Lock()
			r.snaps = append(r.snaps, fp)
			r.mu.Unlock()
		}
	}()
	return r
}

// first returns the first snapshot recorded that satisfies ok.
func (r *fingerprintRecorder) first(ok func(*pb.FingerprintResponse) bool) *pb.FingerprintResponse {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, fp := range r.snaps {
		if ok(fp) {
			return fp
		}
	}
	return nil
}

// healthChanged returns when the last of the devices of fp got its health.
func healthChanged(fp *pb.FingerprintResponse) time.Time {
	var last time.Time
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			if t := d.GetHealthSince().AsTime(); t.After(last) {
				last = t
			}
		}
	}
	return last
}

// The kubelet-plugin, a process of its own, against `agent -dev` and stand-ins of the
// kubelet and its PodResources API: what a node running both sees.
// startKubeletBridge starts a kubelet stand-in (device-plugin registration and pod
// resources) and the bridge between it and the agent at addr (release grace 1s, pods
// read every 100ms), with more flags for the bridge; Cleanup stops them.
func startKubeletBridge(t *testing.T, addr endpoint.Address, more ...string) (*kubelettest.Kubelet, *kubelettest.PodResources, *agentProcess) {
	t.Helper()
	dpDir := tempDir(t, "dhkd")
	k, err := kubelettest.Start(dpDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Close)
	prSock := filepath.Join(tempDir(t, "dhkp"), "kubelet.sock")
	pods, err := kubelettest.StartPodResources(prSock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pods.Close)
	bridge := startAgentProcess(t, endpoint.Address{}, append([]string{"kubelet-plugin", "-address", addr.String(),
		"-device-plugin-dir", dpDir, "-pod-resources-socket", prSock,
		"-release-grace", "1s", "-pod-resources-interval", "100ms", "-log-json"}, more...)...)
	return k, pods, bridge
}

func TestKubeletPluginEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	stateDir := tempDir(t, "dhks")
	addr := endpoint.Address{Network: "unix", Path: filepath.Join(tempDir(t, "dhka"), "devicehost.sock")}
	agentArgs := []string{"agent", "-dev", "-log-json", "-listen", addr.String(), "-state-dir", stateDir}
	agent := startAgentProcess(t, addr, agentArgs...)
	api := agent.client(t, ctx)

	k, pods, bridge := startKubeletBridge(t, addr, "-log-level", "debug")

	// 8 GPUs registered under nvidia.com/gpu, healthy, with their NUMA nodes.
	regs, err := k.WaitRegistrations(ctx, e2eGPUResource, 1)
	if err != nil {
		t.Fatal(err)
	}
	if o := regs[0].Request.GetOptions(); !o.GetGetPreferredAllocationAvailable() {
		t.Errorf("registered without GetPreferredAllocation: %v", regs[0].Request)
	}
	u, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Healthy))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range u.Devices {
		if len(d.GetTopology().GetNodes()) != 1 {
			t.Errorf("device %s: topology %v, want its NUMA node", d.GetID(), d.GetTopology())
		}
	}

	// The kubelet asks for a preferred pair, then allocates it: both UUIDs in
	// NVIDIA_VISIBLE_DEVICES, their CDI names, and a reservation at the agent.
	plugin, err := k.Client(e2eGPUResource)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]string, len(u.Devices))
	for i, d := range u.Devices {
		ids[i] = d.GetID()
	}
	pref, err := plugin.GetPreferredAllocation(ctx, &dpapi.PreferredAllocationRequest{ContainerRequests: []*dpapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: ids, AllocationSize: 2},
	}})
	if err != nil {
		t.Fatal(err)
	}
	pair := pref.GetContainerResponses()[0].GetDeviceIDs()
	if len(pair) != 2 || numaOf(u.Devices, pair[0]) != numaOf(u.Devices, pair[1]) {
		t.Errorf("preferred pair %v, want two GPUs of one NUMA node", pair)
	}
	alloc, err := plugin.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{{DevicesIds: pair}}})
	if err != nil {
		t.Fatalf("Allocate: %v", err)
	}
	car := alloc.GetContainerResponses()[0]
	visible := strings.Split(car.GetEnvs()["NVIDIA_VISIBLE_DEVICES"], ",")
	var cdi []string
	for _, c := range car.GetCdiDevices() {
		cdi = append(cdi, c.GetName())
	}
	for _, id := range pair {
		if !slices.Contains(visible, id) {
			t.Errorf("NVIDIA_VISIBLE_DEVICES = %v, does not name %s", visible, id)
		}
		if !slices.Contains(cdi, "nvidia.com/gpu="+id) {
			t.Errorf("CDI devices %v, want nvidia.com/gpu=%s", cdi, id)
		}
	}
	rs, err := api.ListReservations(ctx, &pb.ListReservationsRequest{State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil {
		t.Fatal(err)
	}
	if len(rs.GetReservations()) != 1 || !strings.HasPrefix(rs.GetReservations()[0].GetOwnerId(), "kubelet/nvidia.com/gpu/") {
		t.Fatalf("reservations after Allocate: %v, want one owned by kubelet/nvidia.com/gpu/...", rs.GetReservations())
	}
	res := rs.GetReservations()[0]
	// The kubelet starts the container right after Allocate, and PodResources lists the
	// pod from then on: set it now, as a reservation no pod holds is released after the
	// 1s grace period, however long the steps below take on a busy machine.
	const podOwner = "k8s/ml/trainer-0/main"
	pods.SetPods(kubelettest.Pod("ml", "trainer-0", "main", e2eGPUResource, pair...))

	// SIGKILL the plugin: the kubelet sees all 8 unhealthy, then healthy again.
	fctx, stopFP := context.WithCancel(ctx)
	fpStream, err := api.Fingerprint(fctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	fps := recordFingerprints(fpStream)
	pluginPID := childPID(t, agent.Cmd.Process.Pid, "plugin", "nvidia-example")
	if err := syscall.Kill(pluginPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	down, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Unhealthy))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Healthy)); err != nil {
		t.Fatal(err)
	}
	stopFP()
	<-fps.done
	if fp := fps.first(func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_UNHEALTHY)) == 8
	}); fp == nil {
		t.Error("the agent's Fingerprint never showed the 8 GPUs unhealthy")
	} else {
		t.Logf("unhealthy propagation: %v from the agent's health change (health_since) to the kubelet's ListAndWatch, %v from the snapshot's timestamp",
			down.At.Sub(healthChanged(fp)), down.At.Sub(fp.GetTimestamp().AsTime()))
	}

	// PodResources reports the pod: the reservation is handed to the pod's container,
	// so `devicehost reservations` and `devicehost devices` say which pod holds the GPUs.
	// Once the pod is gone the reservation is released after the grace period.
	if _, err := bridge.Stderr.Wait(ctx, func(l string) bool {
		var m map[string]any
		return json.Unmarshal([]byte(l), &m) == nil && m["@message"] == "reservation serves a pod" &&
			m["reservation"] == res.GetReservationId() && m["pod"] == podOwner
	}); err != nil {
		t.Fatalf("no log line recording the pod of the reservation: %v", err)
	}
	table := mustRunCLI(t, "reservations", "-address", addr.String(), "-state", "active")
	if !regexp.MustCompile(`(?m)^` + res.GetReservationId() + `\s+` + podOwner + `\s`).MatchString(table) {
		t.Errorf("devicehost reservations does not show %s serving %s:\n%s", res.GetReservationId(), podOwner, table)
	}
	if devices := mustRunCLI(t, "devices", "-address", addr.String()); strings.Count(devices, podOwner+" ("+res.GetReservationId()+")") != 2 {
		t.Errorf("devicehost devices does not show the pair held by %s:\n%s", podOwner, devices)
	}
	if _, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Healthy)); err != nil {
		t.Errorf("the kubelet's devices after the reservation went to the pod: %v", err)
	}
	// (That a GPU the pod still holds is never taken over is the bridge's decision alone:
	// TestAllocateNeverTakesOverWhatAPodHolds in integrations/kubernetes checks it.)
	pods.SetPods()
	gone := time.Now()
	for released := false; !released; {
		if err := pods.WaitLists(ctx, pods.Lists()+1); err != nil {
			t.Fatalf("waiting for the release of %s: %v", res.GetReservationId(), err)
		}
		all, err := api.ListReservations(ctx, &pb.ListReservationsRequest{OwnerId: podOwner})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range all.GetReservations() {
			if r.GetReservationId() == res.GetReservationId() && r.GetState() == pb.ReservationState_RESERVATION_STATE_RELEASED {
				released = true
				if d := r.GetReleasedAt().AsTime().Sub(gone); d < time.Second {
					t.Errorf("released %v after the pod left PodResources, before the 1s grace period", d)
				}
			}
		}
	}

	// A kubelet restart (new kubelet.sock, device-plugins directory emptied): a second
	// Register, and the devices at the new kubelet.
	if err := k.Restart(); err != nil {
		t.Fatal(err)
	}
	regs, err = k.WaitRegistrations(ctx, e2eGPUResource, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("re-registration: %v after the kubelet socket was re-created", regs[1].At.Sub(k.SocketCreated()))
	if _, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Healthy)); err != nil {
		t.Fatal(err)
	}

	// The agent restarts under the bridge: the GPUs stay, unhealthy, while it is gone,
	// and come back healthy; Allocate works again.
	if err := agent.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := agent.Wait(ctx); err != nil {
		t.Fatalf("agent exit: %v", err)
	}
	if _, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Unhealthy)); err != nil {
		t.Fatal(err)
	}
	agent = startAgentProcess(t, addr, agentArgs...)
	agent.client(t, ctx) // serving again
	if _, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Healthy)); err != nil {
		t.Fatal(err)
	}
	if plugin, err = k.Client(e2eGPUResource); err != nil {
		t.Fatal(err)
	}
	if _, err := plugin.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{{DevicesIds: ids[:1]}}}); err != nil {
		t.Errorf("Allocate after the agent restarted: %v", err)
	}

	// SIGTERM: the bridge exits 0 and removes its socket; the kubelet's stays.
	if err := bridge.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	sctx, scancel := context.WithTimeout(ctx, 15*time.Second)
	defer scancel()
	if err := bridge.Wait(sctx); err != nil {
		t.Errorf("kubelet-plugin exit after SIGTERM: %v, want exit status 0", err)
	}
	if _, err := os.Stat(filepath.Join(k.Dir(), "devicehost-nvidia.com_gpu.sock")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("plugin socket after exit: %v, want it removed", err)
	}
	if _, err := os.Stat(k.Socket()); err != nil {
		t.Errorf("kubelet socket after the plugin exited: %v, want it left alone", err)
	}
	for _, l := range append(bridge.Stderr.Lines(), agent.Stderr.Lines()...) {
		if strings.Contains(l, "DATA RACE") || strings.Contains(l, "panic:") {
			t.Errorf("log: %s", l)
		}
	}
}

func numaOf(devs []*dpapi.Device, id string) int64 {
	for _, d := range devs {
		if d.GetID() == id && len(d.GetTopology().GetNodes()) > 0 {
			return d.GetTopology().GetNodes()[0].GetID()
		}
	}
	return -1
}

// With on-demand MIG on the simulated DGX H100, the bridge serves each profile as a
// resource of its own; seven nvidia.com/mig-1g.10gb Allocates on one GPU get seven
// distinct MIG devices, that GPU turns unhealthy under nvidia.com/gpu (the kubelet
// never picks a device the agent would refuse), an Allocate of it is refused naming
// the counter, and once the partitions' pods are gone it is healthy again.
func TestKubeletPluginPartitions(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cfgPath := filepath.Join(tempDir(t, "dhkm"), "agent.hcl")
	if err := os.WriteFile(cfgPath, []byte("plugin \"nvidia-example\" {\n  config {\n    simulate = \"dgxh100\"\n    mig = \"on-demand\"\n  }\n}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := endpoint.Address{Network: "unix", Path: filepath.Join(tempDir(t, "dhka"), "devicehost.sock")}
	agent := startAgentProcess(t, addr, "agent", "-dev", "-log-json", "-listen", addr.String(), "-config", cfgPath)
	agent.client(t, ctx)
	k, pods, _ := startKubeletBridge(t, addr)

	const migResource = "nvidia.com/mig-1g.10gb"
	u, err := k.WaitDevices(ctx, migResource, kubelettest.AllHealth(56, dpapi.Healthy))
	if err != nil {
		t.Fatal(err)
	}
	gpus, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Healthy))
	if err != nil {
		t.Fatal(err)
	}
	gpu := gpus.Devices[0].GetID()
	var parts []string
	for _, d := range u.Devices {
		if strings.HasPrefix(d.GetID(), gpu+"-mig-") {
			parts = append(parts, d.GetID())
		}
	}
	if len(parts) != 7 {
		t.Fatalf("%d 1g.10gb placements of %s, want 7", len(parts), gpu)
	}
	migClient, err := k.Client(migResource)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	var holders []*prapi.PodResources
	for i, p := range parts {
		resp, err := migClient.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{{DevicesIds: []string{p}}}})
		if err != nil {
			t.Fatalf("Allocate of %s: %v", p, err)
		}
		mig := resp.GetContainerResponses()[0].GetEnvs()["NVIDIA_VISIBLE_DEVICES"]
		if !strings.HasPrefix(mig, "MIG-") || seen[mig] {
			t.Errorf("Allocate of %s: NVIDIA_VISIBLE_DEVICES=%q, want a MIG UUID of its own", p, mig)
		}
		seen[mig] = true
		holders = append(holders, kubelettest.Pod("default", fmt.Sprintf("part-%d", i), "main", migResource, p))
	}
	pods.SetPods(holders...)
	if _, err := k.WaitDevices(ctx, e2eGPUResource, func(devs []*dpapi.Device) bool {
		for _, d := range devs {
			if d.GetID() == gpu {
				return d.GetHealth() == dpapi.Unhealthy
			}
		}
		return false
	}); err != nil {
		t.Fatalf("%s under %s with its 7 partitions held: %v", gpu, e2eGPUResource, err)
	}
	gpuClient, err := k.Client(e2eGPUResource)
	if err != nil {
		t.Fatal(err)
	}
	_, err = gpuClient.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{{DevicesIds: []string{gpu}}}})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "compute-slices") {
		t.Errorf("Allocate of the whole %s beside its partitions: %v, want FailedPrecondition naming the counter", gpu, err)
	}
	// The pods end: after the grace the bridge releases the partitions, and the GPU is
	// healthy again.
	pods.SetPods()
	if _, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Healthy)); err != nil {
		t.Fatalf("%s after its partitions' pods ended: %v", gpu, err)
	}
	if _, err := gpuClient.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{{DevicesIds: []string{gpu}}}}); err != nil {
		t.Errorf("Allocate of the whole %s once its partitions were released: %v", gpu, err)
	}
}

// With MPS shares on the simulated DGX H100, the bridge serves nvidia.com/gpu.mps: the
// preferred allocation of two shares keeps them on one GPU, an Allocate answers the
// daemon's pipe directory (env and mount) and the shares' limits, the GPU they divide
// turns unhealthy under nvidia.com/gpu, and once the pod is gone its daemon is stopped.
func TestKubeletPluginMPSShares(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	t.Setenv("GORACE", "atexit_sleep_ms=0") // the simulated daemon's control clients
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	mpsDir := tempDir(t, "mps")
	cfgPath := filepath.Join(tempDir(t, "dhkm"), "agent.hcl")
	cfg := fmt.Sprintf("plugin \"nvidia-example\" {\n  config {\n    simulate = \"dgxh100\"\n    replicas = 4\n    sharing = \"mps\"\n    mps_dir = %q\n  }\n}\n", mpsDir)
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := endpoint.Address{Network: "unix", Path: filepath.Join(tempDir(t, "dhka"), "devicehost.sock")}
	agent := startAgentProcess(t, addr, "agent", "-dev", "-log-json", "-listen", addr.String(), "-config", cfgPath)
	agent.client(t, ctx)
	k, pods, _ := startKubeletBridge(t, addr)

	const mpsResource = "nvidia.com/gpu.mps"
	u, err := k.WaitDevices(ctx, mpsResource, kubelettest.AllHealth(32, dpapi.Healthy))
	if err != nil {
		t.Fatal(err)
	}
	var avail []string
	for _, d := range u.Devices {
		avail = append(avail, d.GetID())
	}
	c, err := k.Client(mpsResource)
	if err != nil {
		t.Fatal(err)
	}
	pref, err := c.GetPreferredAllocation(ctx, &dpapi.PreferredAllocationRequest{ContainerRequests: []*dpapi.ContainerPreferredAllocationRequest{{
		AvailableDeviceIDs: avail, AllocationSize: 2,
	}}})
	if err != nil {
		t.Fatal(err)
	}
	two := pref.GetContainerResponses()[0].GetDeviceIDs()
	gpu, _, _ := strings.Cut(two[0], "::")
	if len(two) != 2 || !strings.HasPrefix(two[1], gpu+"::mps::") {
		t.Fatalf("preferred 2 shares: %v, want two of one GPU", two)
	}
	resp, err := c.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{{DevicesIds: two}}})
	if err != nil {
		t.Fatalf("Allocate of %v: %v", two, err)
	}
	cr := resp.GetContainerResponses()[0]
	pipe := cr.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"]
	if !strings.HasPrefix(pipe, mpsDir+"/") || cr.GetEnvs()["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" || cr.GetEnvs()["NVIDIA_VISIBLE_DEVICES"] != gpu {
		t.Errorf("Allocate envs %v, want the daemon's pipe under %s, 50%% and %s", cr.GetEnvs(), mpsDir, gpu)
	}
	mounted := false
	for _, m := range cr.GetMounts() {
		mounted = mounted || m.GetHostPath() == pipe && m.GetContainerPath() == pipe
	}
	if !mounted {
		t.Errorf("Allocate mounts %v, want the pipe directory %s", cr.GetMounts(), pipe)
	}
	if _, err := os.Stat(filepath.Join(pipe, "control")); err != nil {
		t.Errorf("the daemon's control pipe: %v", err)
	}
	pods.SetPods(kubelettest.Pod("default", "mps", "main", mpsResource, two...))
	if _, err := k.WaitDevices(ctx, e2eGPUResource, func(devs []*dpapi.Device) bool {
		for _, d := range devs {
			if d.GetID() == gpu {
				return d.GetHealth() == dpapi.Unhealthy
			}
		}
		return false
	}); err != nil {
		t.Fatalf("%s under %s with two of its shares held: %v", gpu, e2eGPUResource, err)
	}
	pods.SetPods()
	if _, err := k.WaitDevices(ctx, e2eGPUResource, kubelettest.AllHealth(8, dpapi.Healthy)); err != nil {
		t.Fatalf("%s after its shares' pod ended: %v", gpu, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		entries, _ := os.ReadDir(mpsDir)
		if len(entries) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still holds %d daemon directories after the pod ended", mpsDir, len(entries))
		}
		time.Sleep(20 * time.Millisecond)
	}
}
