package nvidia

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/hashicorp/go-hclog"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// wantHealth is what a fingerprint must say about some GPUs; the rest must be healthy.
type wantHealth map[int]string // GPU index -> substring of its reason

func checkHealth(t *testing.T, step string, resp *pb.FingerprintResponse, machine string, want wantHealth) {
	t.Helper()
	devs := devices(resp)
	if len(devs) != 8 {
		t.Fatalf("%s: %d devices, want 8", step, len(devs))
	}
	for i := range 8 {
		d := devs[simulatedUUID(machine, i)]
		reason, bad := want[i]
		switch {
		case bad && (d.GetHealth() != pb.Health_HEALTH_UNHEALTHY || !strings.Contains(d.GetHealthReason(), reason)):
			t.Errorf("%s: GPU %d is %v %q, want unhealthy with %q", step, i, d.GetHealth(), d.GetHealthReason(), reason)
		case !bad && (d.GetHealth() != pb.Health_HEALTH_HEALTHY || d.GetHealthReason() != ""):
			t.Errorf("%s: GPU %d is %v %q, want healthy", step, i, d.GetHealth(), d.GetHealthReason())
		}
	}
}

// Injected faults drive the same XID path real NVML does: a critical XID makes a GPU
// unhealthy with the XID in the reason, an application XID does not, a lasting fault
// keeps it unhealthy, and each GPU recovers a quiet period after its last XID.
func TestInjectedFaultsDriveHealth(t *testing.T) {
	const m = "dgxh100"
	stamp := func(d time.Duration) string { return t0.Add(d).Format(time.RFC3339) }
	p, clk := newTestPlugin(t, Config{
		Simulate:          m,
		FingerprintPeriod: "1h",
		HealthQuietPeriod: "5m",
		InjectFaults: []FaultConfig{
			{GPUIndex: ptr(0), XID: 79, After: "10s"},
			{GPUIndex: ptr(1), XID: 13, After: "5s"}, // application error
			{GPUID: simulatedUUID(m, 2), XID: 48, After: "20s", For: "1m"},
		},
	})
	s := startFingerprint(t, p)
	checkHealth(t, "start", s.next(t), m, nil)

	clk.Advance(10 * time.Second) // XID 13 on GPU 1 at 5s, XID 79 on GPU 0 at 10s
	checkHealth(t, "t=10s", s.next(t), m, wantHealth{0: "XID 79 (critical) at " + stamp(10*time.Second)})

	clk.Advance(10 * time.Second) // GPU 2's fault starts
	checkHealth(t, "t=20s", s.next(t), m, wantHealth{
		0: "XID 79", 2: "XID 48 (critical) at " + stamp(20*time.Second)})

	clk.Advance(time.Minute) // and ends: its last XID
	checkHealth(t, "t=80s", s.next(t), m, wantHealth{
		0: "XID 79", 2: "XID 48 (critical) at " + stamp(80*time.Second)})

	clk.Advance(3*time.Minute + 50*time.Second) // five minutes after GPU 0's XID
	checkHealth(t, "t=5m10s", s.next(t), m, wantHealth{2: "XID 48"})

	clk.Advance(10 * time.Second) // five minutes after GPU 2's first XID: not enough
	if healthy, _, until := p.rt.health.status(simulatedUUID(m, 2), clk.Now()); healthy || !until.Equal(t0.Add(6*time.Minute+20*time.Second)) {
		t.Errorf("t=5m20s: GPU 2 healthy=%v until %v, want unhealthy until t0+6m20s", healthy, until)
	}

	clk.Advance(time.Minute) // five minutes after its last one
	checkHealth(t, "t=6m20s", s.next(t), m, nil)
}

func TestFaultsNameRealGPUs(t *testing.T) {
	tests := []struct {
		name   string
		fault  FaultConfig
		wantIn string
	}{
		{"index past the end", FaultConfig{GPUIndex: ptr(8), XID: 79, After: "1s"}, "inject_faults[0].gpu_index = 8"},
		{"unknown ID", FaultConfig{GPUID: "GPU-nope", XID: 79, After: "1s"}, `inject_faults[0].gpu_id = "GPU-nope"`},
		{"other machine's ID", FaultConfig{GPUID: simulatedUUID("dgxa100", 0), XID: 79, After: "1s"}, "gpu_id"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, _ := newUnconfigured(t)
			err := p.SetConfig(context.Background(), mustJSON(t, Config{Simulate: "dgxh100", InjectFaults: []FaultConfig{tt.fault}}))
			if err == nil || !strings.Contains(err.Error(), tt.wantIn) {
				t.Errorf("SetConfig error = %v, want one mentioning %q", err, tt.wantIn)
			}
		})
	}
}

func TestHealthBook(t *testing.T) {
	h := newHealthBook(5 * time.Minute)
	at := t0.Add(time.Minute)
	changed := h.changes()
	h.markUnhealthy("GPU-a", at, "XID 79")
	select {
	case <-changed:
	default:
		t.Fatalf("markUnhealthy did not signal a change")
	}
	h.markUnhealthy("GPU-a", at.Add(-time.Second), "older event") // ignored

	tests := []struct {
		name        string
		id          string
		now         time.Time
		wantHealthy bool
		wantReason  string
	}{
		{"never failed", "GPU-b", at, true, ""},
		{"at the XID", "GPU-a", at, false, "XID 79"},
		{"just before the quiet period ends", "GPU-a", at.Add(5*time.Minute - time.Nanosecond), false, "XID 79"},
		{"quiet period over", "GPU-a", at.Add(5 * time.Minute), true, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			healthy, reason, until := h.status(tt.id, tt.now)
			if healthy != tt.wantHealthy || reason != tt.wantReason {
				t.Errorf("status = %v %q, want %v %q", healthy, reason, tt.wantHealthy, tt.wantReason)
			}
			if !healthy && !until.Equal(at.Add(5*time.Minute)) {
				t.Errorf("until = %v, want %v", until, at.Add(5*time.Minute))
			}
		})
	}
}

// scriptedEventSet answers Wait from a list, then reports timeouts; it records Free.
// Make it with newScriptedEventSet.
type scriptedEventSet struct {
	nvml.EventSet
	mu      sync.Mutex
	results []waitResult
	freed   bool
	drained chan struct{} // closed once results is empty
}

func newScriptedEventSet(results []waitResult) *scriptedEventSet {
	s := &scriptedEventSet{results: results, drained: make(chan struct{})}
	if len(results) == 0 {
		close(s.drained)
	}
	return s
}

type waitResult struct {
	ev  nvml.EventData
	ret nvml.Return
}

func (s *scriptedEventSet) Wait(uint32) (nvml.EventData, nvml.Return) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.results) == 0 {
		return nvml.EventData{}, nvml.ERROR_TIMEOUT
	}
	r := s.results[0]
	s.results = s.results[1:]
	if len(s.results) == 0 {
		close(s.drained)
	}
	return r.ev, r.ret
}

func (s *scriptedEventSet) Free() nvml.Return {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.freed = true
	return nvml.SUCCESS
}

// deviceWithUUID is a GPU on a driver that reports no recovery action.
func deviceWithUUID(id string, ret nvml.Return) nvml.Device {
	return &mock.Device{GetUUIDFunc: func() (string, nvml.Return) { return id, ret },
		GetFieldValuesFunc: func([]nvml.FieldValue) nvml.Return { return nvml.ERROR_NOT_SUPPORTED }}
}

// deviceWithAction is a GPU whose driver asks for recovery action a.
func deviceWithAction(id string, a nvml.DeviceGpuRecoveryAction) nvml.Device {
	return &mock.Device{GetUUIDFunc: func() (string, nvml.Return) { return id, nvml.SUCCESS },
		GetFieldValuesFunc: func(v []nvml.FieldValue) nvml.Return {
			v[0].ValueType = uint32(nvml.VALUE_TYPE_UNSIGNED_LONG_LONG)
			v[0].Value = [8]byte{byte(a)}
			return nvml.SUCCESS
		}}
}

// The real-NVML corner cases the simulation never produces.
func TestXIDWatchCornerCases(t *testing.T) {
	xid := func(dev nvml.Device, n uint64) waitResult {
		return waitResult{ev: nvml.EventData{Device: dev, EventType: nvml.EventTypeXidCriticalError, EventData: n}}
	}
	tests := []struct {
		name    string
		results []waitResult
		want    map[string]string // GPU -> reason substring; others healthy
	}{
		{"critical XID", []waitResult{xid(deviceWithUUID("GPU-a", nvml.SUCCESS), 79)},
			map[string]string{"GPU-a": "XID 79 (critical)"}},
		{"application XIDs", []waitResult{
			xid(deviceWithUUID("GPU-a", nvml.SUCCESS), 13), xid(deviceWithUUID("GPU-a", nvml.SUCCESS), 31),
			xid(deviceWithUUID("GPU-a", nvml.SUCCESS), 43), xid(deviceWithUUID("GPU-a", nvml.SUCCESS), 45),
			xid(deviceWithUUID("GPU-a", nvml.SUCCESS), 68), xid(deviceWithUUID("GPU-b", nvml.SUCCESS), 109)}, nil},
		{"other event type", []waitResult{{ev: nvml.EventData{Device: deviceWithUUID("GPU-a", nvml.SUCCESS),
			EventType: nvml.EventTypeSingleBitEccError}}}, nil},
		{"GPU not watched", []waitResult{xid(deviceWithUUID("GPU-ignored", nvml.SUCCESS), 79)}, nil},
		{"driver asks for nothing after a critical XID", []waitResult{xid(deviceWithAction("GPU-a", nvml.GPU_RECOVERY_ACTION_NONE), 79)}, nil},
		{"driver asks for a reboot after an application XID", []waitResult{xid(deviceWithAction("GPU-b", nvml.GPU_RECOVERY_ACTION_NODE_REBOOT), 13)},
			map[string]string{"GPU-b": `XID 13 at 2026-01-02T03:04:05Z; recovery action "node reboot" required`}},
		{"unidentified GPU", []waitResult{xid(deviceWithUUID("", nvml.ERROR_UNKNOWN), 79)},
			map[string]string{"GPU-a": "unidentified GPU", "GPU-b": "unidentified GPU"}},
		{"no device", []waitResult{xid(nil, 79)},
			map[string]string{"GPU-a": "XID 79", "GPU-b": "XID 79"}},
		{"wait fails", []waitResult{{ret: nvml.ERROR_GPU_IS_LOST}},
			map[string]string{"GPU-a": "NVML event wait failed", "GPU-b": "NVML event wait failed"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := newFakeClock()
			set := newScriptedEventSet(tt.results)
			w := &xidWatch{logger: hclog.NewNullLogger(), clock: clk, health: newHealthBook(time.Minute),
				set: set, gpus: map[string]bool{"GPU-a": true, "GPU-b": true}, poll: time.Millisecond}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); w.run(ctx) }()

			select {
			case <-set.drained:
			case <-time.After(10 * time.Second):
				t.Fatalf("the watch did not take its %d scripted results within 10s", len(tt.results))
			}
			if tt.results[len(tt.results)-1].ret != nvml.SUCCESS {
				clk.waitForTimerAt(t, t0.Add(waitErrorBackoff)) // backing off, not spinning
			}
			cancel()
			<-done
			if !set.freed {
				t.Errorf("event set not freed")
			}
			// Wait until the last scripted result has been handled: run has returned.
			for _, id := range []string{"GPU-a", "GPU-b"} {
				healthy, reason, _ := w.health.status(id, clk.Now())
				want, bad := tt.want[id]
				if bad != !healthy || (bad && !strings.Contains(reason, want)) {
					t.Errorf("%s: healthy=%v %q, want unhealthy=%v with %q", id, healthy, reason, bad, want)
				}
			}
		})
	}
}

// Where the driver reports a recovery action, a GPU's health follows it instead of the
// XID list: "none" keeps a GPU healthy through a critical XID, any other action makes
// it unhealthy with the action in the reason (an application XID too) until the
// driver reports none again, at once, without a quiet period.
func TestRecoveryActionsDriveHealth(t *testing.T) {
	const m = "dgxh100"
	p, clk := newTestPlugin(t, Config{
		Simulate:          m,
		FingerprintPeriod: "1h",
		InjectFaults: []FaultConfig{
			{GPUIndex: ptr(0), XID: 79, After: "10s", RecoveryAction: "none"},
			{GPUIndex: ptr(1), XID: 48, After: "10s", For: "1m", RecoveryAction: "gpu_reset"},
			{GPUIndex: ptr(2), XID: 13, After: "10s", RecoveryAction: "node_reboot"},
			{GPUIndex: ptr(3), XID: 79, After: "10s", RecoveryAction: "drain_p2p"},
			{GPUIndex: ptr(4), XID: 79, After: "10s", RecoveryAction: "drain_and_reset"},
		},
	})
	s := startFingerprint(t, p)
	checkHealth(t, "start", s.next(t), m, nil)

	clk.Advance(10 * time.Second)
	at := t0.Add(10 * time.Second).Format(time.RFC3339)
	want := wantHealth{
		1: `XID 48 at ` + at + `; recovery action "GPU reset" required`,
		2: `XID 13 at ` + at + `; recovery action "node reboot" required`,
		3: `recovery action "drain P2P" required`,
		4: `recovery action "drain and reset" required`,
	}
	checkHealth(t, "t=10s", waitForHealth(t, s, m, want), m, want)

	clk.Advance(time.Minute) // GPU 1 was reset; the others still wait for theirs
	delete(want, 1)
	checkHealth(t, "t=70s", waitForHealth(t, s, m, want), m, want)
}

// waitForHealth reads fingerprints until one matches want (each XID event is its own
// change, so several may come), failing after 10 s.
func waitForHealth(t *testing.T, s *stream[*pb.FingerprintResponse], machine string, want wantHealth) *pb.FingerprintResponse {
	t.Helper()
	deadline := time.After(10 * time.Second)
	var last *pb.FingerprintResponse
	for {
		select {
		case resp := <-s.msgs:
			last = resp
			if healthMatches(resp, machine, want) {
				return resp
			}
		case <-deadline:
			t.Fatalf("no fingerprint with health %v within 10 s; last: %v", want, last)
			return nil
		}
	}
}

func healthMatches(resp *pb.FingerprintResponse, machine string, want wantHealth) bool {
	devs := devices(resp)
	for i := range 8 {
		d := devs[simulatedUUID(machine, i)]
		reason, bad := want[i]
		if bad != (d.GetHealth() == pb.Health_HEALTH_UNHEALTHY) || !strings.Contains(d.GetHealthReason(), reason) {
			return false
		}
	}
	return true
}
