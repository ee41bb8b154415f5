package nvidia

import (
	"context"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/deviceplugin/deviceplugintest"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/logtest"
)

// missingNVML behaves like go-nvml when libnvidia-ml cannot be loaded: Init fails and
// any other call would crash (here: panics, since no other function is set).
func missingNVML() nvml.Interface {
	return &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }}
}

// Without NVML and without simulate the plugin reports zero devices, says why once,
// keeps its streams open without work and ends them when asked. In a synctest bubble:
// "nothing more is sent" is checked once every goroutine of the plugin is blocked, an
// hour later on both its clock and the bubble's, not after a wall-clock window.
func TestNoNVMLNoSimulate(t *testing.T) {
	synctest.Test(t, testNoNVMLNoSimulate)
}

func testNoNVMLNoSimulate(t *testing.T) {
	logs := &logtest.Recorder{}
	p := New(hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Trace}))
	clock := newFakeClock()
	p.clock = clock
	p.openNVML = missingNVML
	t.Cleanup(p.Close)
	if err := p.SetConfig(context.Background(), nil); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	if got := strings.Count(logs.String(), "NVML is not available"); got != 1 {
		t.Errorf("logged %d lines about missing NVML, want 1:\n%s", got, logs)
	}
	if !strings.Contains(logs.String(), "ERROR_LIBRARY_NOT_FOUND") || !strings.Contains(logs.String(), "simulate") {
		t.Errorf("log does not say what failed and how to simulate:\n%s", logs)
	}

	fp := startFingerprint(t, p)
	if got := fp.next(t); len(got.GetGroups()) != 0 {
		t.Errorf("first fingerprint = %v, want empty", got)
	}
	st := startStats(t, p, time.Second)

	// Both streams stay open: nothing more is sent and neither returns, with every
	// goroutine blocked an hour (3600 stats intervals) later on the plugin's clock and
	// on the bubble's.
	synctest.Wait()
	clock.Advance(time.Hour)
	time.Sleep(time.Hour)
	synctest.Wait()
	select {
	case m := <-fp.msgs:
		t.Errorf("second fingerprint %v, want none", m)
	case m := <-st.msgs:
		t.Errorf("stats %v, want none", m)
	case err := <-fp.done:
		t.Fatalf("Fingerprint returned %v before cancel", err)
	case err := <-st.done:
		t.Fatalf("Stats returned %v before cancel", err)
	default:
	}
	if err := fp.stop(t); err != nil {
		t.Errorf("Fingerprint returned %v after cancel, want nil", err)
	}
	if err := st.stop(t); err != nil {
		t.Errorf("Stats returned %v after cancel, want nil", err)
	}

	_, err := p.Reserve(context.Background(), []string{"GPU-x"})
	if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "GPU-x") {
		t.Errorf("Reserve = %v, want NOT_FOUND naming GPU-x", err)
	}
	if got := strings.Count(logs.String(), "NVML is not available"); got != 1 {
		t.Errorf("logged %d lines about missing NVML in all, want 1", got)
	}
}

// The real go-nvml, on a machine without libnvidia-ml, must not panic either.
func TestRealNVMLAbsent(t *testing.T) {
	if ret := nvml.New().Init(); ret == nvml.SUCCESS {
		t.Skip("libnvidia-ml is installed here; TestRealNVML covers this machine")
	}
	p, _ := newTestPlugin(t, Config{})
	if p.rt.lib != nil {
		t.Fatalf("plugin kept a library that did not initialise")
	}
	resp := startFingerprint(t, p).next(t)
	if len(resp.GetGroups()) != 0 {
		t.Errorf("fingerprint = %v, want empty", resp)
	}
}

// On a machine with NVIDIA GPUs the real library goes through the same path.
func TestRealNVML(t *testing.T) {
	if ret := nvml.New().Init(); ret != nvml.SUCCESS {
		t.Skipf("no usable NVML here (%v)", ret)
	}
	p := New(hclog.New(&hclog.LoggerOptions{Output: t.Output(), Level: hclog.Debug}))
	p.eventPoll = 10 * time.Millisecond
	t.Cleanup(p.Close)
	if err := p.SetConfig(context.Background(), nil); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	fp := startFingerprint(t, p)
	resp := fp.next(t)
	t.Logf("fingerprint: %v", resp)
	ids := make([]string, 0)
	for id, d := range devices(resp) {
		ids = append(ids, id)
		if !strings.HasPrefix(id, "GPU-") || d.GetLocality().GetPciBusId() == "" {
			t.Errorf("device %v: want a GPU- UUID and a PCI bus ID", d)
		}
	}
	if len(ids) == 0 {
		t.Fatalf("NVML initialised but no GPUs fingerprinted")
	}
	for name := range wantAttrs {
		if _, ok := resp.GetGroups()[0].GetAttributes()[name]; !ok {
			t.Errorf("attribute %q missing", name)
		}
	}
	stats := startStats(t, p, 100*time.Millisecond).next(t)
	t.Logf("stats: %v", stats)
	if len(stats.GetDevices()) != len(ids) {
		t.Errorf("stats for %d devices, want %d", len(stats.GetDevices()), len(ids))
	}
	res, err := p.Reserve(context.Background(), ids)
	if err != nil || res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"] != strings.Join(ids, ",") {
		t.Errorf("Reserve(%v) = %v, %v", ids, res, err)
	}
}

func TestSetConfigAgain(t *testing.T) {
	cfg := Config{Simulate: "dgxh100", SimStateFile: ptr("")}
	p, clk := newTestPlugin(t, cfg)
	ctx := context.Background()
	first := p.rt

	// A host reattaching sends the same config: nothing changes.
	if err := p.SetConfig(ctx, mustJSON(t, cfg)); err != nil {
		t.Fatalf("same config again: %v", err)
	}
	if p.rt != first {
		t.Errorf("the same config replaced the runtime")
	}

	// A bad config is refused and the good one stays.
	if err := p.SetConfig(ctx, []byte(`{"simulate":"dgx1"}`)); err == nil {
		t.Fatalf("bad config accepted")
	}
	if p.rt != first {
		t.Errorf("a refused config replaced the runtime")
	}

	// A new config takes effect and keeps what is known about health.
	sick := simulatedUUID("dgxh100", 4)
	first.health.markUnhealthy(sick, clk.Now(), "XID 79 (critical)")
	cfg.IgnoredGPUIDs = []string{simulatedUUID("dgxh100", 0)}
	if err := p.SetConfig(ctx, mustJSON(t, cfg)); err != nil {
		t.Fatalf("new config: %v", err)
	}
	resp := startFingerprint(t, p).next(t)
	devs := devices(resp)
	if len(devs) != 7 {
		t.Errorf("after the new config %d devices, want 7", len(devs))
	}
	if d := devs[sick]; d.GetHealth() != pb.Health_HEALTH_UNHEALTHY {
		t.Errorf("GPU 4 is %v after reconfiguring, want still unhealthy", d.GetHealth())
	}
}

func TestClose(t *testing.T) {
	p, _ := newTestPlugin(t, Config{Simulate: "dgxa100"})
	p.Close()
	p.Close() // idempotent
	if _, err := p.Reserve(context.Background(), []string{simulatedUUID("dgxa100", 0)}); err == nil {
		t.Errorf("Reserve after Close succeeded")
	}
	if err := p.SetConfig(context.Background(), nil); err == nil {
		t.Errorf("SetConfig after Close succeeded")
	}
}

// One round trip over go-plugin gRPC, as the host drives the plugin.
func TestRoundTripThroughSDK(t *testing.T) {
	p, _ := newUnconfigured(t)
	c := deviceplugintest.Connect(t, p)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	info, err := c.GetPluginInfo(ctx, &pb.GetPluginInfoRequest{})
	if err != nil || info.GetName() != Name || info.GetPluginVersion() != Version {
		t.Fatalf("GetPluginInfo = %v, %v", info, err)
	}
	_, err = c.SetConfig(ctx, &pb.SetConfigRequest{ConfigJson: []byte(`{"simulate":"dgxh100","fingerprint_period":"never"}`)})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `fingerprint_period = "never"`) {
		t.Errorf("bad config: %v, want INVALID_ARGUMENT naming fingerprint_period", err)
	}
	if _, err := c.SetConfig(ctx, &pb.SetConfigRequest{ConfigJson: []byte(`{"simulate":"dgxh100"}`)}); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}

	fpCtx, fpCancel := context.WithCancel(ctx)
	fp, err := c.Fingerprint(fpCtx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	inv, err := fp.Recv()
	if err != nil {
		t.Fatalf("Fingerprint recv: %v", err)
	}
	devs := devices(inv)
	if len(devs) != 8 {
		t.Errorf("fingerprint has %d devices, want 8", len(devs))
	}
	fpCancel()

	stCtx, stCancel := context.WithCancel(ctx)
	st, err := c.Stats(stCtx, &pb.StatsRequest{Interval: durationpb.New(time.Second)})
	if err != nil {
		t.Fatalf("Stats: %v", err)
	}
	sample, err := st.Recv()
	if err != nil || len(sample.GetDevices()) != 8 {
		t.Errorf("stats = %v, %v; want 8 devices", sample, err)
	}
	stCancel()

	id := simulatedUUID("dgxh100", 3)
	res, err := c.Reserve(ctx, &pb.ReserveRequest{DeviceIds: []string{id}})
	if err != nil || res.GetReservation().GetEnvs()["NVIDIA_VISIBLE_DEVICES"] != id {
		t.Errorf("Reserve = %v, %v", res, err)
	}
	_, err = c.Reserve(ctx, &pb.ReserveRequest{DeviceIds: []string{"GPU-nope"}})
	if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "GPU-nope") {
		t.Errorf("Reserve unknown = %v, want NOT_FOUND naming GPU-nope", err)
	}
	// A whole GPU has nothing to clean up; Release is idempotent.
	for range 2 {
		if _, err := c.Release(ctx, &pb.ReleaseRequest{ReservationId: "r1", DeviceIds: []string{id}}); err != nil {
			t.Errorf("Release = %v, want success", err)
		}
	}
	if _, err := c.Reconcile(ctx, &pb.ReconcileRequest{}); err != nil {
		t.Errorf("Reconcile = %v, want success", err)
	}
}
