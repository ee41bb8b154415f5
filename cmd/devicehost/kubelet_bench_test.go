package main

import (
	"context"
	"path/filepath"
	"slices"
	"testing"
	"time"

	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/integrations/kubernetes"
	"github.com/devicehost/devicehost/integrations/kubernetes/kubelettest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// BenchmarkKubeletAllocate compares, on a real `agent -dev`, reserving one GPU
// through the kubelet bridge (the stand-in kubelet's Allocate, which the bridge turns
// into a Reserve) with reserving it through the client package directly. Each
// iteration does one of each, in turn, and records their latencies; it reports both
// medians and their ratio, which scripts/bench prints. Every reservation is released
// again outside the timing. An op is both calls.
func BenchmarkKubeletAllocate(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	addr := endpoint.Address{Network: "unix", Path: filepath.Join(tempDir(b, "dhkb"), "devicehost.sock")}
	agent := startAgentProcess(b, addr, "agent", "-dev", "-listen", addr.String(), "-state-dir", tempDir(b, "dhkbs"))
	agent.client(b, ctx) // serving
	c, err := client.Dial(ctx, addr.String())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	fp, err := c.Devices(ctx)
	if err != nil {
		b.Fatal(err)
	}
	g := fp.GetGroups()[0]
	var gpus []string
	for _, d := range g.GetDevices() {
		gpus = append(gpus, d.GetId())
	}

	dpDir := tempDir(b, "dhkbd")
	k, err := kubelettest.Start(dpDir)
	if err != nil {
		b.Fatal(err)
	}
	defer k.Close()
	bridge, err := kubernetes.New(kubernetes.Config{
		Client:             c,
		DevicePluginDir:    dpDir,
		PodResourcesSocket: filepath.Join(dpDir, "no-pod-resources.sock"), // releases are the benchmark's
	})
	if err != nil {
		b.Fatal(err)
	}
	bctx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- bridge.Run(bctx) }()
	defer func() {
		stop()
		<-ran
	}()
	if _, err := k.WaitDevices(ctx, "nvidia.com/gpu", kubelettest.AllHealth(len(gpus), dpapi.Healthy)); err != nil {
		b.Fatal(err)
	}
	plugin, err := k.Client("nvidia.com/gpu")
	if err != nil {
		b.Fatal(err)
	}

	// release frees gpu again: its active reservation released (not timed).
	release := func(b *testing.B, gpu string) {
		b.Helper()
		rs, err := c.Reservations(ctx, &pb.ListReservationsRequest{DeviceId: gpu, State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
		if err != nil || len(rs) != 1 {
			b.Fatalf("reservations of %s: %v, %v; want one", gpu, rs, err)
		}
		if _, err := c.ReleaseReservation(ctx, rs[0].GetReservationId()); err != nil {
			b.Fatal(err)
		}
	}
	direct := func(gpu string) error {
		_, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "bench", Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName(), DeviceIds: []string{gpu}})
		return err
	}
	viaBridge := func(gpu string) error {
		_, err := plugin.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{{DevicesIds: []string{gpu}}}})
		return err
	}
	// The two paths take turns, so that a change in the machine's load (it is shared)
	// weighs on both alike.
	var latDirect, latBridge []time.Duration
	timed := func(reserve func(string) error, gpu string) time.Duration {
		start := time.Now()
		err := reserve(gpu)
		d := time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		release(b, gpu)
		b.StartTimer()
		return d
	}
	i := 0
	for b.Loop() {
		gpu := gpus[i%len(gpus)]
		if i%2 == 0 {
			latDirect = append(latDirect, timed(direct, gpu))
			latBridge = append(latBridge, timed(viaBridge, gpu))
		} else {
			latBridge = append(latBridge, timed(viaBridge, gpu))
			latDirect = append(latDirect, timed(direct, gpu))
		}
		i++
	}
	p50 := func(lat []time.Duration) float64 {
		slices.Sort(lat)
		return float64(lat[len(lat)/2].Nanoseconds()) / 1e3
	}
	d, br := p50(latDirect), p50(latBridge)
	b.ReportMetric(d, "direct-p50-µs")
	b.ReportMetric(br, "bridge-p50-µs")
	b.ReportMetric(br/d, "bridge/direct-p50")
}
