package shim

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/device"
	"github.com/hashicorp/nomad/plugins/shared/structs"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"

	dev "github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/tools/testwait"
)

// A Nomad client sees the agent's groups as Nomad device groups: typed attributes
// with units Nomad's scheduler can compare, health with reasons, PCI bus IDs; and what
// it gets passes Nomad's own validation of plugin output.
func TestFingerprintTranslatesInventory(t *testing.T) {
	snap := snapshot("GPU-a", "GPU-b", "GPU-c")
	g := &snap.Inventory.Groups[0]
	g.Attributes = map[string]dev.Value{
		"memory":             {Kind: dev.KindInt, Int: 81559, Unit: "MiB"},
		"power_limit":        {Kind: dev.KindInt, Int: 700, Unit: "W"},
		"bar1":               {Kind: dev.KindInt, Int: 3 << 10, Unit: "B"},
		"l2_cache":           {Kind: dev.KindInt, Int: 1000, Unit: "B"},
		"max_temperature":    {Kind: dev.KindFloat, Float: 87.5, Unit: "C"},
		"compute_capability": {Kind: dev.KindString, Str: "9.0"},
		"mig":                {Kind: dev.KindBool, Bool: false},
	}
	snap.State.Devices["GPU-b"] = dev.DeviceState{Health: dev.HealthUnhealthy, Reason: "XID 79"}
	snap.State.Devices["GPU-c"] = dev.DeviceState{Health: dev.HealthUnknown}
	l := newFakeLedger()
	path := socketPath(t)
	startAgent(t, fake(newSnapshots(snap), l), path)
	p := newShim(t, map[string]any{"address": "unix://" + path})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := p.Fingerprint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := nextFingerprint(t, ch)
	if got.Error != nil {
		t.Fatalf("fingerprint error: %v", got.Error)
	}
	want := []*device.DeviceGroup{{
		Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3",
		Attributes: map[string]*structs.Attribute{
			"memory":             structs.NewIntAttribute(81559, "MiB"),
			"power_limit":        structs.NewIntAttribute(700, "W"),
			"bar1":               structs.NewIntAttribute(3, "KiB"),
			"l2_cache":           structs.NewFloatAttribute(1000.0/1024, "KiB"),
			"max_temperature":    structs.NewFloatAttribute(87.5, ""),
			"compute_capability": structs.NewStringAttribute("9.0"),
			"mig":                structs.NewBoolAttribute(false),
		},
		Devices: []*device.Device{
			{ID: "GPU-a", Healthy: true, HwLocality: &device.DeviceLocality{PciBusID: "00000000:01:00.0"}},
			{ID: "GPU-b", HealthDesc: "XID 79", HwLocality: &device.DeviceLocality{PciBusID: "00000000:02:00.0"}},
			{ID: "GPU-c", HealthDesc: "health unknown", HwLocality: &device.DeviceLocality{PciBusID: "00000000:03:00.0"}},
		},
	}}
	if !reflect.DeepEqual(got.Devices, want) {
		t.Errorf("fingerprint:\n got %# v\nwant %# v", got.Devices, want)
	}
	for _, g := range got.Devices {
		if err := g.Validate(); err != nil {
			t.Errorf("Nomad's own validation refuses group %s: %v", g.Name, err)
		}
	}
}

// A change Nomad can see (health) is a new message; a change it cannot see (a
// reservation's holder, a new since-time) is not.
func TestFingerprintSendsOnlyVisibleChanges(t *testing.T) {
	p := New(nil)
	updates := make(chan client.Update[*pb.FingerprintResponse])
	out := make(chan *device.FingerprintResponse)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.fingerprint(ctx, "unix:///x.sock", updates, out) }()
	defer func() { cancel(); close(updates); <-done }()

	push := func(what string, snap *pb.FingerprintResponse) {
		t.Helper()
		select {
		case updates <- client.Update[*pb.FingerprintResponse]{Snapshot: snap}:
		case <-time.After(testwait.Timeout):
			t.Fatalf("the shim did not take %s: still sending the previous message?", what)
		}
	}
	take := func(what string) *device.FingerprintResponse {
		t.Helper()
		select {
		case m := <-out:
			return m
		case <-time.After(testwait.Timeout):
			t.Fatalf("no message for %s", what)
		}
		panic("unreachable")
	}
	gpu := func(id string, h pb.Health, reason string, holder *pb.Holder) *pb.Device {
		return &pb.Device{Id: id, Health: h, HealthReason: reason, HealthSince: timestamppb.Now(), Holder: holder}
	}
	snap := func(devs ...*pb.Device) *pb.FingerprintResponse {
		return &pb.FingerprintResponse{Timestamp: timestamppb.Now(), Groups: []*pb.DeviceGroup{{
			Vendor: "nvidia", Type: "gpu", Name: h100.Name, Plugin: "nvidia-example", Devices: devs,
		}}}
	}

	push("the first snapshot", snap(gpu("GPU-a", pb.Health_HEALTH_HEALTHY, "", nil), gpu("GPU-b", pb.Health_HEALTH_HEALTHY, "", nil)))
	if m := take("the first snapshot"); len(m.Devices) != 1 || len(m.Devices[0].Devices) != 2 {
		t.Fatalf("first message: %# v", m.Devices)
	}
	held := &pb.Holder{ReservationId: "r1", OwnerId: "nomad/x"}
	push("a holder change", snap(gpu("GPU-a", pb.Health_HEALTH_HEALTHY, "", held), gpu("GPU-b", pb.Health_HEALTH_HEALTHY, "", nil)))
	push("a health change", snap(gpu("GPU-a", pb.Health_HEALTH_HEALTHY, "", held), gpu("GPU-b", pb.Health_HEALTH_UNHEALTHY, "XID 48", nil)))
	m := take("the health change")
	if b := m.Devices[0].Devices[1]; b.ID != "GPU-b" || b.Healthy || b.HealthDesc != "XID 48" {
		t.Fatalf("after a holder change and a health change: GPU-b = %+v; want the health change", b)
	}
	// The same health again, with new since-times and holders: nothing to send, so the
	// shim takes the next update at once.
	push("the same health again", snap(gpu("GPU-a", pb.Health_HEALTH_HEALTHY, "", nil), gpu("GPU-b", pb.Health_HEALTH_UNHEALTHY, "XID 48", nil)))
	// Nothing was sent for it: the shim takes the next update at once.
	select {
	case updates <- client.Update[*pb.FingerprintResponse]{Err: status.Error(codes.Unavailable, "gone"), RetryIn: time.Second}:
	case <-time.After(testwait.Timeout):
		t.Fatal("the shim did not take the disconnection: did it send a message for an invisible change?")
	}
	m = take("the disconnection")
	for _, d := range m.Devices[0].Devices {
		if d.Healthy || d.HealthDesc != "devicehost agent at unix:///x.sock unreachable (Unavailable)" {
			t.Errorf("disconnected: %s healthy=%v reason %q", d.ID, d.Healthy, d.HealthDesc)
		}
	}
}

// While the agent is gone, every device Nomad knows is unhealthy with the reason; when
// the agent is back on the same socket, the devices are back as they are there.
func TestFingerprintWhileAgentUnreachable(t *testing.T) {
	snaps := newSnapshots(snapshot("GPU-a", "GPU-b"))
	path := socketPath(t)
	agent := startAgent(t, fake(snaps, newFakeLedger()), path)
	p := newShim(t, map[string]any{"address": "unix://" + path})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := p.Fingerprint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	allHealthy := func(m *device.FingerprintResponse) bool {
		for _, g := range m.Devices {
			for _, d := range g.Devices {
				if !d.Healthy {
					return false
				}
			}
		}
		return len(m.Devices) == 1 && len(m.Devices[0].Devices) == 2
	}
	waitFingerprint(t, "both devices healthy", ch, allHealthy)

	agent.Stop()
	m := nextFingerprint(t, ch)
	for _, d := range m.Devices[0].Devices {
		if d.Healthy || !strings.Contains(d.HealthDesc, "devicehost agent at unix://"+path+" unreachable") {
			t.Errorf("with the agent gone, %s: healthy=%v reason %q; want unhealthy, saying the agent is unreachable", d.ID, d.Healthy, d.HealthDesc)
		}
	}

	startAgent(t, fake(snaps, newFakeLedger()), path)
	waitFingerprint(t, "both devices healthy after the agent came back", ch, allHealthy)
}

// A shim whose agent was never reached reports no devices (rather than an error, which
// would make Nomad drop the plugin for good).
func TestFingerprintAgentNeverReached(t *testing.T) {
	p := newShim(t, map[string]any{"address": "unix://" + socketPath(t)})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := p.Fingerprint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m := nextFingerprint(t, ch)
	if m.Error != nil || len(m.Devices) != 0 {
		t.Fatalf("got %+v; want an empty inventory", m)
	}
}

// The stream ends, and its goroutine with it, when Nomad's context ends.
func TestFingerprintEndsWithContext(t *testing.T) {
	path := socketPath(t)
	startAgent(t, fake(newSnapshots(snapshot("GPU-a")), newFakeLedger()), path)
	p := newShim(t, map[string]any{"address": "unix://" + path})
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := p.Fingerprint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	nextFingerprint(t, ch)
	cancel()
	select {
	case _, ok := <-ch:
		for ok {
			_, ok = <-ch
		}
	case <-time.After(testwait.Timeout):
		t.Fatal("channel still open after ctx ended")
	}
}

// Stats reach Nomad with their units, the metric's name as description and a summary
// per device (GPU utilization for a GPU).
func TestStatsTranslates(t *testing.T) {
	now := time.Now().Truncate(time.Millisecond)
	stats := dev.StatsSnapshot{Time: now, Groups: []dev.GroupStats{{
		GroupKey: h100, Plugin: "nvidia-example",
		Devices: []dev.DeviceStats{{ID: "GPU-a", Time: now, Values: map[string]dev.Value{
			"gpu_utilization": {Kind: dev.KindInt, Int: 97, Unit: "%"},
			"memory_used":     {Kind: dev.KindInt, Int: 1024, Unit: "MiB"},
			"power":           {Kind: dev.KindFloat, Float: 350.5, Unit: "W"},
			"pstate":          {Kind: dev.KindString, Str: "P0"},
		}}},
	}}}
	mgr := &devicetest.Fake{WatchStatsFunc: func(ctx context.Context, _ time.Duration) <-chan dev.StatsSnapshot {
		ch := make(chan dev.StatsSnapshot, 1)
		ch <- stats
		return ch
	}}
	path := socketPath(t)
	startAgent(t, mgr, path)
	p := newShim(t, map[string]any{"address": "unix://" + path})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := p.Stats(ctx, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var m *device.StatsResponse
	select {
	case m = <-ch:
	case <-time.After(testwait.Timeout):
		t.Fatal("no stats")
	}
	if m.Error != nil || len(m.Groups) != 1 {
		t.Fatalf("stats %+v", m)
	}
	g := m.Groups[0]
	if g.Vendor != "nvidia" || g.Type != "gpu" || g.Name != h100.Name {
		t.Errorf("group %s/%s/%s", g.Vendor, g.Type, g.Name)
	}
	s := g.InstanceStats["GPU-a"]
	if s == nil {
		t.Fatalf("no stats for GPU-a: %+v", g.InstanceStats)
	}
	if !s.Timestamp.Equal(now) {
		t.Errorf("timestamp %v, want %v", s.Timestamp, now)
	}
	if s.Summary == nil || s.Summary.Desc != "gpu_utilization" || *s.Summary.IntNumeratorVal != 97 || s.Summary.Unit != "%" {
		t.Errorf("summary %+v, want gpu_utilization 97 %%", s.Summary)
	}
	mem := s.Stats.Attributes["memory_used"]
	if mem == nil || *mem.IntNumeratorVal != 1024 || mem.Unit != "MiB" {
		t.Errorf("memory_used %+v", mem)
	}
	pw := s.Stats.Attributes["power"]
	if pw == nil || *pw.FloatNumeratorVal != 350.5 || pw.Unit != "W" {
		t.Errorf("power %+v", pw)
	}
	if ps := s.Stats.Attributes["pstate"]; ps == nil || *ps.StringVal != "P0" {
		t.Errorf("pstate %+v", ps)
	}
}
