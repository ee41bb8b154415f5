package e2e

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/client/devicemanager"
	"github.com/hashicorp/nomad/client/devicemanager/state"
	"github.com/hashicorp/nomad/helper/pluginutils/loader"
	"github.com/hashicorp/nomad/nomad/structs"
	"github.com/hashicorp/nomad/nomad/structs/config"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/device"

	"github.com/devicehost/devicehost/integrations/nomad/shim"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/logtest"
	"github.com/devicehost/devicehost/tools/testwait"
)

const h100 = "NVIDIA H100 80GB HBM3"

// nomadDevices is Nomad's client device manager (client/devicemanager of v1.6.3) set
// up as a Nomad client sets it up: a plugin loader over a plugin_dir holding
// nomad-device-devicehost with its config block, an updater that receives the node's
// devices, and a state store.
type nomadDevices struct {
	mgr  devicemanager.Manager
	node *nodeRecorder
	log  *logtest.Recorder
}

// Its log is kept from level on, and shown if the test fails.
func startNomadDevices(t testing.TB, shimBin, address string, level hclog.Level) *nomadDevices {
	t.Helper()
	return startNomadDevicesWith(t, shimBin, map[string]any{"address": address}, level)
}

// startNomadDevicesWith is startNomadDevices with cfg as the shim's config block.
func startNomadDevicesWith(t testing.TB, shimBin string, cfg map[string]any, level hclog.Level) *nomadDevices {
	t.Helper()
	dir := tempDir(t, "dhnp")
	install(t, shimBin, dir, shim.BinaryName)
	logs := &logtest.Recorder{}
	log := hclog.New(&hclog.LoggerOptions{Name: "nomad", Level: level, Output: logs})
	l, err := loader.NewPluginLoader(&loader.PluginLoaderConfig{
		Logger:    log,
		PluginDir: dir,
		Configs: []*config.PluginConfig{{
			Name:   shim.BinaryName,
			Config: cfg,
		}},
		SupportedVersions: loader.AgentSupportedApiVersions,
	})
	if err != nil {
		t.Fatalf("Nomad's plugin loader: %v\n%s", err, logs)
	}
	n := &nomadDevices{node: newNodeRecorder(), log: logs}
	n.mgr = devicemanager.New(&devicemanager.Config{
		Logger:        log,
		Loader:        l,
		PluginConfig:  &base.AgentConfig{},
		Updater:       n.node.update,
		StatsInterval: 200 * time.Millisecond,
		State:         &memState{},
	})
	n.mgr.Run()
	t.Cleanup(func() {
		n.mgr.Shutdown()
		if t.Failed() {
			t.Logf("Nomad device manager log:\n%s", logs)
		}
	})
	return n
}

// reserve is what Nomad's device hook does for a task: Reserve of the allocated
// devices.
func (n *nomadDevices) reserve(ids ...string) (*device.ContainerReservation, error) {
	return n.reserveIn("nvidia", "gpu", h100, ids...)
}

// reserveIn is reserve of devices of the group vendor/typ/name.
func (n *nomadDevices) reserveIn(vendor, typ, name string, ids ...string) (*device.ContainerReservation, error) {
	return n.mgr.Reserve(&structs.AllocatedDeviceResource{Vendor: vendor, Type: typ, Name: name, DeviceIDs: ids})
}

// memState is the device manager's state store, in memory.
type memState struct {
	mu sync.Mutex
	s  *state.PluginState
}

func (m *memState) GetDevicePluginState() (*state.PluginState, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.s, nil
}

func (m *memState) PutDevicePluginState(s *state.PluginState) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.s = s
	return nil
}

// nodeRecorder keeps every device list the device manager hands the node, in order.
type nodeRecorder struct {
	mu      sync.Mutex
	updates [][]*structs.NodeDeviceResource
	changed chan struct{}
	next    int // first update the next wait looks at
}

func newNodeRecorder() *nodeRecorder { return &nodeRecorder{changed: make(chan struct{}, 1)} }

func (r *nodeRecorder) update(devs []*structs.NodeDeviceResource) {
	r.mu.Lock()
	r.updates = append(r.updates, devs)
	r.mu.Unlock()
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// wait returns the first update, after the one the last wait returned, that ok
// accepts.
func (r *nodeRecorder) wait(t testing.TB, what string, ok func([]*structs.NodeDeviceResource) bool) []*structs.NodeDeviceResource {
	t.Helper()
	deadline := time.After(testwait.Timeout)
	for {
		r.mu.Lock()
		for ; r.next < len(r.updates); r.next++ {
			if u := r.updates[r.next]; ok(u) {
				r.next++
				r.mu.Unlock()
				return u
			}
		}
		var last []*structs.NodeDeviceResource
		if n := len(r.updates); n > 0 {
			last = r.updates[n-1]
		}
		r.mu.Unlock()
		select {
		case <-r.changed:
		case <-deadline:
			t.Fatalf("the node never got %s; last update: %s", what, describe(last))
		}
	}
}

// h100s returns the H100 group of devs, or nil.
func h100s(devs []*structs.NodeDeviceResource) *structs.NodeDeviceResource {
	for _, d := range devs {
		if d.Vendor == "nvidia" && d.Type == "gpu" && d.Name == h100 {
			return d
		}
	}
	return nil
}

// eightH100s accepts an update with 8 H100s whose health healthy() accepts.
func eightH100s(healthy func(*structs.NodeDevice) bool) func([]*structs.NodeDeviceResource) bool {
	return func(devs []*structs.NodeDeviceResource) bool {
		g := h100s(devs)
		if g == nil || len(g.Instances) != 8 {
			return false
		}
		for _, d := range g.Instances {
			if !healthy(d) {
				return false
			}
		}
		return true
	}
}

func describe(devs []*structs.NodeDeviceResource) string {
	var b strings.Builder
	for _, g := range devs {
		b.WriteString(g.Vendor + "/" + g.Type + "/" + g.Name + ":")
		for _, d := range g.Instances {
			b.WriteString(" " + d.ID)
			if !d.Healthy {
				b.WriteString(" (unhealthy: " + d.HealthDescription + ")")
			}
		}
		b.WriteString("; ")
	}
	return b.String()
}

// Nomad's own client device manager loads nomad-device-devicehost against `devicehost
// agent -dev`: it fingerprints 8 H100s with their attributes; reserving 2 gives
// NVIDIA_VISIBLE_DEVICES with both UUIDs; a crash of the agent's GPU plugin shows as
// unhealthy, then healthy; a second allocation reserving one of those GPUs takes it
// over; a GPU held by a non-Nomad owner is refused naming it; stats arrive with a
// summary; and while the agent itself is gone every GPU is unhealthy, and healthy again
// when it is back.
func TestNomadDeviceManagerOnDevAgent(t *testing.T) {
	bins := build(t)
	tmp := tempDir(t, "dhnm")
	address := "unix://" + filepath.Join(tmp, "dh.sock")
	agent := startAgent(t, bins[agentName], tmp, "agent", "-dev", "-listen", address, "-log-json")
	c := dial(t, address)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()

	n := startNomadDevices(t, bins[shim.BinaryName], address, hclog.Debug)
	node := n.node.wait(t, "8 healthy H100s", eightH100s(func(d *structs.NodeDevice) bool { return d.Healthy }))
	g := h100s(node)
	if mem := g.Attributes["memory"]; mem == nil || mem.Int == nil || mem.Unit != "MiB" || *mem.Int < 80000 {
		t.Errorf("memory attribute %#v; want about 80 GiB in MiB", mem)
	}
	for _, d := range g.Instances {
		if d.Locality == nil || d.Locality.PciBusID == "" {
			t.Errorf("%s has no PCI bus ID", d.ID)
		}
	}
	ids := make([]string, 0, 8)
	for _, d := range g.Instances {
		ids = append(ids, d.ID)
	}
	slices.Sort(ids)

	// Reserve 2: NVIDIA_VISIBLE_DEVICES names both.
	res, err := n.reserve(ids[0], ids[1])
	if err != nil {
		t.Fatalf("Reserve of 2 GPUs: %v", err)
	}
	visible := strings.Split(res.Envs["NVIDIA_VISIBLE_DEVICES"], ",")
	slices.Sort(visible)
	if !slices.Equal(visible, ids[:2]) {
		t.Errorf("NVIDIA_VISIBLE_DEVICES=%q; want %s and %s", res.Envs["NVIDIA_VISIBLE_DEVICES"], ids[0], ids[1])
	}
	first, err := c.Reservations(ctx, &pb.ListReservationsRequest{DeviceId: ids[0], State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil || len(first) != 1 || !strings.HasPrefix(first[0].GetOwnerId(), shim.OwnerPrefix) {
		t.Fatalf("the agent's reservation of %s: %v, %v; want one of a %q owner", ids[0], first, err, shim.OwnerPrefix)
	}

	// The agent's GPU plugin crashes: Nomad sees the GPUs unhealthy, then healthy.
	pid := onlyProcess(t, bins[agentName], "plugin", "nvidia-example")
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	n.node.wait(t, "8 unhealthy H100s after the plugin crash", eightH100s(func(d *structs.NodeDevice) bool { return !d.Healthy && d.HealthDescription != "" }))
	n.node.wait(t, "8 healthy H100s after the plugin restart", eightH100s(func(d *structs.NodeDevice) bool { return d.Healthy }))

	// A second allocation gets one of the two: taken over, in one call.
	res, err = n.reserve(ids[1])
	if err != nil {
		t.Fatalf("Reserve of a GPU an earlier Nomad allocation holds: %v", err)
	}
	if got := res.Envs["NVIDIA_VISIBLE_DEVICES"]; got != ids[1] {
		t.Errorf("NVIDIA_VISIBLE_DEVICES=%q, want %s", got, ids[1])
	}
	old, err := c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: first[0].GetOwnerId()})
	if err != nil || len(old) != 1 || old[0].GetState() != pb.ReservationState_RESERVATION_STATE_RELEASED {
		t.Errorf("the first allocation's reservation: %v, %v; want it released", old, err)
	}
	now, err := c.Reservations(ctx, &pb.ListReservationsRequest{DeviceId: ids[1], State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil || len(now) != 1 || now[0].GetOwnerId() == first[0].GetOwnerId() || !slices.Equal(now[0].GetDeviceIds(), ids[1:2]) {
		t.Errorf("who holds %s now: %v, %v; want the second allocation alone", ids[1], now, err)
	}
	// Atomically: the agent released the first in the write that made the second
	// (released at the second's creation, to the nanosecond), not in a call before it.
	if len(old) == 1 && len(now) == 1 && !old[0].GetReleasedAt().AsTime().Equal(now[0].GetCreatedAt().AsTime()) {
		t.Errorf("the first reservation was released at %v, the second made at %v; want one write, one time",
			old[0].GetReleasedAt().AsTime(), now[0].GetCreatedAt().AsTime())
	}

	// A GPU held by a non-Nomad owner is refused, naming it.
	if _, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-7", Vendor: "nvidia", Type: "gpu", Name: h100, DeviceIds: ids[5:6]}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.reserve(ids[5]); !errContains(err, ids[5], `"job-7"`) {
		t.Errorf("Reserve of a GPU job-7 holds: %v; want a refusal naming job-7", err)
	}

	// Stats reach Nomad, with a summary per GPU.
	deadline := time.Now().Add(testwait.Timeout)
	for {
		s := statsOf(n.mgr.AllStats(), ids[0])
		if s != nil && s.Summary != nil && s.Summary.Desc == "gpu_utilization" && s.Stats.Attributes["memory_used"] != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no stats with a gpu_utilization summary for %s: %+v", ids[0], s)
		}
		time.Sleep(50 * time.Millisecond)
	}

	// The agent goes away: every GPU unhealthy, saying so; back when it is.
	agent.Kill()
	n.node.wait(t, "8 H100s unhealthy with the agent gone", eightH100s(func(d *structs.NodeDevice) bool {
		return !d.Healthy && strings.Contains(d.HealthDescription, "devicehost agent at "+address+" unreachable")
	}))
	startAgent(t, bins[agentName], tmp, "agent", "-dev", "-listen", address, "-log-json")
	n.node.wait(t, "8 healthy H100s with the agent back", eightH100s(func(d *structs.NodeDevice) bool {
		return d.Healthy && slices.Contains(ids, d.ID)
	}))
}

// statsOf returns the stats of device id, or nil.
func statsOf(groups []*device.DeviceGroupStats, id string) *device.DeviceStats {
	for _, g := range groups {
		if s := g.InstanceStats[id]; s != nil {
			return s
		}
	}
	return nil
}
