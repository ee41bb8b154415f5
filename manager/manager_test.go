package manager

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

func TestInventoryAggregatesPluginsAndKeepsDeviceBindings(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "shared"))
	beta := newFakeDevices("beta", group("acme", "fpga", "B1", "b0"))
	cfg, logs := testConfig(t)
	m, _ := startInprocManager(t, cfg, alpha, beta)

	// Once the host is ready, an ID stays with the plugin that reported it first (before
	// it is ready, two reporters get neither: TestIDsContestedAtStartBoundToNeither).
	waitSnapshot(t, m, "alpha's devices", healthIs(device.HealthHealthy, "a0", "shared"))
	waitReady(t, m)
	beta.setGroups(group("acme", "fpga", "B1", "b0", "shared"))
	logs.waitLine(t, "[ERROR]", "device IDs bound to another plugin refused", "plugin=beta")
	snap := waitSnapshot(t, m, "beta's devices", healthIs(device.HealthHealthy, "b0"))

	if got, want := deviceIDs(snap.Inventory), []string{"alpha/a0", "alpha/shared", "beta/b0"}; !slices.Equal(got, want) {
		t.Errorf("inventory = %v, want %v (a duplicate ID stays bound to the first plugin)", got, want)
	}
	if got, want := pluginOf(snap, "beta").DeviceCount, 1; got != want {
		t.Errorf("beta DeviceCount = %d, want %d", got, want)
	}
	logs.waitLine(t, "[ERROR]", "device IDs bound to another plugin refused", "plugin=beta", "bound_to=alpha", "devices=shared")
	if got := pluginOf(m.Snapshot(), "beta").LastError; !strings.Contains(got, `shared bound to plugin "alpha"`) {
		t.Errorf("beta LastError = %q, want it to name the refused ID and the plugin it is bound to", got)
	}

	// When alpha stops reporting the ID, it is still alpha's: beta, which still reports
	// it, does not get it.
	alpha.setGroups(group("acme", "gpu", "A1", "a0"))
	snap = waitSnapshot(t, m, "alpha without shared", func(s device.Snapshot) bool {
		return !slices.Contains(deviceIDs(s.Inventory), "alpha/shared")
	})
	beta.setGroups(group("acme", "fpga", "B1", "b0", "shared"), group("acme", "fpga", "B2", "b1"))
	snap = waitSnapshot(t, m, "beta's new group", healthIs(device.HealthHealthy, "b1"))
	if got, want := deviceIDs(snap.Inventory), []string{"alpha/a0", "beta/b0", "beta/b1"}; !slices.Equal(got, want) {
		t.Errorf("inventory after alpha dropped shared = %v, want %v", got, want)
	}
	if _, ok := snap.State.Devices["shared"]; ok {
		t.Errorf("shared has a state %+v though no plugin serves it", snap.State.Devices["shared"])
	}
}

// A plugin whose every fingerprint is rejected is not left "running" with no devices:
// its first-fingerprint deadline still applies, so it is restarted, and its status says
// why.
func TestOnlyRejectedFingerprintsRestartThePlugin(t *testing.T) {
	bad := newFakeDevices("bad", group("acme", "gpu", "A1", "x0", "x0")) // duplicate ID
	cfg, logs := testConfig(t)
	cfg.FingerprintTimeout = 300 * time.Millisecond
	m, _ := startInprocManager(t, cfg, bad)
	logs.waitLine(t, "fingerprint rejected", "plugin=bad", "duplicate")
	snap := waitSnapshot(t, m, "bad restarted", func(s device.Snapshot) bool { return pluginOf(s, "bad").Restarts >= 1 })
	if got := pluginOf(snap, "bad").LastError; !strings.Contains(got, "no fingerprint within") && !strings.Contains(got, "fingerprint rejected") {
		t.Errorf("last error = %q, want it to say the fingerprint was rejected or never came", got)
	}
	if got := deviceIDs(snap.Inventory); len(got) != 0 {
		t.Errorf("inventory = %v, want none from a plugin whose fingerprints are all rejected", got)
	}
}

func TestRejectedFingerprintKeepsLastGoodInventory(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
	cfg, logs := testConfig(t)
	m, _ := startInprocManager(t, cfg, alpha)
	good := waitSnapshot(t, m, "alpha's devices", healthIs(device.HealthHealthy, "a0", "a1"))

	alpha.setGroups(group("acme", "gpu", "A1", "a0", "a0")) // duplicate ID: rejected
	logs.waitLine(t, "fingerprint rejected", "plugin=alpha", "duplicate")
	if got, want := deviceIDs(m.Inventory()), deviceIDs(good.Inventory); !slices.Equal(got, want) {
		t.Errorf("inventory after a rejected fingerprint = %v, want the last good %v", got, want)
	}

	// A later good fingerprint is taken again.
	alpha.setGroups(withUnhealthy(group("acme", "gpu", "A1", "a0", "a1"), "a1", "fan stuck"))
	snap := waitSnapshot(t, m, "a1 unhealthy", healthIs(device.HealthUnhealthy, "a1"))
	if got, want := snap.State.Devices["a1"].Reason, "fan stuck"; got != want {
		t.Errorf("a1 reason = %q, want %q", got, want)
	}
}

func TestHealthSinceMovesOnlyOnChange(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, alpha)
	first := waitSnapshot(t, m, "alpha's devices", healthIs(device.HealthHealthy, "a0", "a1"))

	alpha.setGroups(withUnhealthy(group("acme", "gpu", "A1", "a0", "a1"), "a1", "hot"))
	second := waitSnapshot(t, m, "a1 unhealthy", healthIs(device.HealthUnhealthy, "a1"))
	if got, want := second.State.Devices["a0"].Since, first.State.Devices["a0"].Since; !got.Equal(want) {
		t.Errorf("a0 Since = %v, want unchanged %v", got, want)
	}
	if !second.State.Devices["a1"].Since.After(first.State.Devices["a1"].Since) {
		t.Errorf("a1 Since = %v, want after %v", second.State.Devices["a1"].Since, first.State.Devices["a1"].Since)
	}
}

// TestStalledWatcherSlowsNobody: one watcher never reads; 50 others and the manager go on.
func TestStalledWatcherSlowsNobody(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, alpha)
	waitSnapshot(t, m, "alpha's devices", healthIs(device.HealthHealthy, "a0"))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stalled := m.Watch(ctx) // never read
	live := make([]<-chan device.Snapshot, 50)
	for i := range live {
		live[i] = m.Watch(ctx)
	}

	// Many changes; the last one makes a0 unhealthy with reason "change 20".
	const changes = 20
	for i := 1; i <= changes; i++ {
		alpha.setGroups(withUnhealthy(group("acme", "gpu", "A1", "a0"), "a0", fmt.Sprintf("change %d", i)))
	}
	wantReason := "change 20"
	deadline := time.NewTimer(testwait.Timeout)
	defer deadline.Stop()
	for i, ch := range live {
		for seen := false; !seen; {
			select {
			case snap := <-ch:
				seen = snap.State.Devices["a0"].Reason == wantReason
			case <-deadline.C:
				t.Fatalf("live watcher %d did not see %q within %v", i, wantReason, testwait.Timeout)
			}
		}
	}
	// The stalled watcher holds exactly one value: the latest at the time, never a backlog.
	if got := len(stalled); got != 1 {
		t.Errorf("stalled watcher has %d buffered snapshots, want 1", got)
	}
	if snap := <-stalled; snap.Seq != m.Snapshot().Seq {
		t.Errorf("stalled watcher's buffered snapshot Seq = %d, want the latest %d", snap.Seq, m.Snapshot().Seq)
	}
}

func TestWatchClosesOnCancelAndShutdown(t *testing.T) {
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	ch := m.Watch(ctx)
	<-ch // the current snapshot
	cancel()
	waitClosed(t, ch)

	ch2 := m.Watch(context.Background())
	stats := m.WatchStats(context.Background(), 0)
	shutdown(t, m)
	waitClosed(t, ch2)
	waitClosed(t, stats)
	if _, err := m.Reserve(context.Background(), device.ReserveRequest{}); !errors.Is(err, device.ErrShuttingDown) {
		t.Errorf("Reserve after Shutdown: %v, want ErrShuttingDown", err)
	}
}

// waitClosed drains ch until it is closed, failing after testwait.Timeout.
func waitClosed[T any](t *testing.T, ch <-chan T) {
	t.Helper()
	deadline := time.NewTimer(testwait.Timeout)
	defer deadline.Stop()
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-deadline.C:
			t.Fatalf("channel not closed within %v", testwait.Timeout)
		}
	}
}

func TestPluginExitMarksDevicesUnhealthyAndRestarts(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
	cfg, _ := testConfig(t)
	m, l := startInprocManager(t, cfg, alpha)
	waitSnapshot(t, m, "alpha's devices", healthIs(device.HealthHealthy, "a0", "a1"))

	p, _ := l.latest("alpha")
	p.exit("exit status 3")
	snap := waitSnapshot(t, m, "devices unhealthy", healthIs(device.HealthUnhealthy, "a0", "a1"))
	if got, want := snap.State.Devices["a0"].Reason, "plugin exited: exit status 3"; got != want {
		t.Errorf("a0 reason = %q, want %q", got, want)
	}

	snap = waitSnapshot(t, m, "devices healthy after restart", healthIs(device.HealthHealthy, "a0", "a1"))
	ps := pluginOf(snap, "alpha")
	if ps.Status != device.PluginRunning || ps.Restarts != 1 || ps.LastError != "plugin exited: exit status 3" || ps.LastErrorAt.IsZero() {
		t.Errorf("plugin state after restart = %+v, want running, 1 restart, last error %q", ps, "plugin exited: exit status 3")
	}
	if _, n := l.latest("alpha"); n != 2 {
		t.Errorf("launches = %d, want 2", n)
	}
}

func TestPermanentLaunchFailureIsNotRetried(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	alpha.rejectConfig = "simulate: unknown machine"
	cfg, logs := testConfig(t)
	cfg.ReadyTimeout = time.Hour // only the failure may make it ready
	m, l := startInprocManager(t, cfg, alpha)

	snap := waitSnapshot(t, m, "alpha failed", func(s device.Snapshot) bool { return pluginOf(s, "alpha").Status == device.PluginFailed })
	if got := pluginOf(snap, "alpha").LastError; !strings.Contains(got, "simulate: unknown machine") {
		t.Errorf("LastError = %q, want the plugin's reason", got)
	}
	select {
	case <-m.Ready():
	case <-time.After(testwait.Timeout):
		t.Fatal("a failed plugin holds Ready")
	}
	logs.waitLine(t, "will not be restarted", "plugin=alpha")
	// Run has returned for good: no second launch can follow.
	if _, n := l.latest("alpha"); n != 0 {
		t.Errorf("successful launches = %d, want 0", n)
	}
}

func TestReadyDoesNotWaitBeyondReadyTimeout(t *testing.T) {
	healthy := newFakeDevices("healthy", group("acme", "gpu", "A1", "a0"))
	silent := newFakeDevices("silent", group("acme", "gpu", "S1", "s0"))
	silent.hangFP = true
	cfg, logs := testConfig(t)
	cfg.ReadyTimeout = 300 * time.Millisecond
	cfg.FingerprintTimeout = time.Minute // only ReadyTimeout may end the wait
	m, _ := startInprocManager(t, cfg, healthy, silent)

	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	start := time.Now()
	inv, err := m.WaitForFirstFingerprint(ctx)
	if err != nil {
		t.Fatalf("WaitForFirstFingerprint: %v", err)
	}
	t.Logf("ready after %v with ReadyTimeout %v", time.Since(start), cfg.ReadyTimeout)
	if got, want := deviceIDs(inv), []string{"healthy/a0"}; !slices.Equal(got, want) {
		t.Errorf("inventory = %v, want %v", got, want)
	}
	logs.waitLine(t, "ready without a first fingerprint", "plugins=silent")
}

func TestNoFirstFingerprintRestartsThePlugin(t *testing.T) {
	silent := newFakeDevices("silent", group("acme", "gpu", "S1", "s0"))
	silent.hangFP = true
	cfg, _ := testConfig(t)
	cfg.FingerprintTimeout = 100 * time.Millisecond
	m, _ := startInprocManager(t, cfg, silent)

	snap := waitSnapshot(t, m, "a restart", func(s device.Snapshot) bool { return pluginOf(s, "silent").Restarts >= 1 })
	if got := pluginOf(snap, "silent").LastError; !strings.Contains(got, "no fingerprint within 100ms") {
		t.Errorf("LastError = %q, want it to say no fingerprint came", got)
	}
	// Once the plugin talks, it is taken.
	silent.set(func(f *fakeDevices) { f.hangFP = false })
	waitSnapshot(t, m, "s0 healthy", healthIs(device.HealthHealthy, "s0"))
}

func TestHangAtStartDoesNotHoldUpOtherPlugins(t *testing.T) {
	healthy := newFakeDevices("healthy", group("acme", "gpu", "A1", "a0"))
	stuck := newFakeDevices("stuck", group("acme", "gpu", "S1", "s0"))
	stuck.hangStart = true
	cfg, _ := testConfig(t)
	cfg.StartTimeout = 200 * time.Millisecond
	m, _ := startInprocManager(t, cfg, healthy, stuck)

	waitSnapshot(t, m, "healthy's device", healthIs(device.HealthHealthy, "a0"))
	snap := waitSnapshot(t, m, "stuck restarting", func(s device.Snapshot) bool {
		ps := pluginOf(s, "stuck")
		return ps.Status == device.PluginRestarting && !ps.NextRetry.IsZero()
	})
	if got := pluginOf(snap, "stuck").LastError; !strings.Contains(got, "deadline exceeded") {
		t.Errorf("stuck LastError = %q, want the start deadline", got)
	}
}

func TestRestartBackoffGrowsAndIsCapped(t *testing.T) {
	crashy := newFakeDevices("crashy", group("acme", "gpu", "C1", "c0"))
	crashy.hangStart = true // every launch fails at the start deadline
	cfg, _ := testConfig(t)
	cfg.StartTimeout = 10 * time.Millisecond
	cfg.RestartBaseDelay = 20 * time.Millisecond
	cfg.RestartMaxDelay = 80 * time.Millisecond
	m, _ := startInprocManager(t, cfg, crashy)

	// NextRetry - LastErrorAt is the delay chosen after each failure: 20, 40, 80, 80, 80 ms ±20%.
	want := []time.Duration{20, 40, 80, 80, 80}
	var got []time.Duration
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	seen := -1
	for snap := range m.Watch(ctx) {
		ps := pluginOf(snap, "crashy")
		if ps.Status != device.PluginRestarting || ps.Restarts == seen {
			continue
		}
		seen = ps.Restarts
		got = append(got, ps.NextRetry.Sub(ps.LastErrorAt))
		if len(got) == len(want) {
			break
		}
	}
	if len(got) != len(want) {
		t.Fatalf("saw %d restarts within %v, want %d", len(got), testwait.Timeout, len(want))
	}
	for i := range want {
		lo, hi := time.Duration(float64(want[i]*time.Millisecond)*0.8), time.Duration(float64(want[i]*time.Millisecond)*1.2)
		if got[i] < lo || got[i] > hi {
			t.Errorf("delay %d = %v, want %v ±20%%", i, got[i], want[i]*time.Millisecond)
		}
	}
}

func TestStatsFanOutUsesOneStreamPerPlugin(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, alpha)
	waitSnapshot(t, m, "alpha's devices", healthIs(device.HealthHealthy, "a0", "a1"))

	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	watchers := make([]<-chan device.StatsSnapshot, 20)
	for i := range watchers {
		watchers[i] = m.WatchStats(ctx, 0)
	}
	for i, ch := range watchers {
		waitStats(t, ch, func(s device.StatsSnapshot) bool { return statValue(s, "a1", "seq") >= 3 }, "watcher %d: seq 3 for a1", i)
	}
	if got := alpha.streams(); got != 1 {
		t.Errorf("stats streams opened = %d with %d watchers, want 1", got, len(watchers))
	}
}

// waitStats reads ch until ok accepts a snapshot.
func waitStats(t *testing.T, ch <-chan device.StatsSnapshot, ok func(device.StatsSnapshot) bool, format string, args ...any) device.StatsSnapshot {
	t.Helper()
	deadline := time.NewTimer(testwait.Timeout)
	defer deadline.Stop()
	for {
		select {
		case s, open := <-ch:
			if !open {
				t.Fatalf("stats channel closed before: "+format, args...)
			}
			if ok(s) {
				return s
			}
		case <-deadline.C:
			t.Fatalf("timed out waiting for: "+format, args...)
		}
	}
}

// statValue returns the int value of metric for device id in s, or -1.
func statValue(s device.StatsSnapshot, id, metric string) int64 {
	for _, g := range s.Groups {
		for _, d := range g.Devices {
			if d.ID == id {
				if v, ok := d.Values[metric]; ok {
					return v.Int
				}
			}
		}
	}
	return -1
}

func TestStatsErrorsBackOffAndAreLogged(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	alpha.statsErr = "sensor bus on fire"
	cfg, logs := testConfig(t)
	m, _ := startInprocManager(t, cfg, alpha)

	line := logs.waitLine(t, "stats stream failed", "plugin=alpha")
	if !strings.Contains(line, "sensor bus on fire") {
		t.Errorf("stats failure log line = %q, want the plugin's error in it", line)
	}
	// The stream resumes once the plugin is fixed.
	alpha.set(func(f *fakeDevices) { f.statsErr = "" })
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	waitStats(t, m.WatchStats(ctx, 0), func(s device.StatsSnapshot) bool { return statValue(s, "a0", "seq") >= 1 }, "stats after recovery")
	if got := pluginOf(m.Snapshot(), "alpha").LastError; !strings.Contains(got, "sensor bus on fire") {
		t.Errorf("LastError = %q, want the stats error", got)
	}
}

func TestReserve(t *testing.T) {
	alpha := newFakeDevices("alpha",
		group("acme", "gpu", "A1", "a0", "a1", "a2"),
		withUnhealthy(group("acme", "gpu", "A2", "b0", "b1"), "b1", "ecc errors"))
	beta := newFakeDevices("beta", group("acme", "gpu", "A1", "z0"))
	cfg, _ := testConfig(t)
	cfg.ReserveTimeout = 300 * time.Millisecond
	m, _ := startInprocManager(t, cfg, alpha, beta)
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	a1 := device.GroupKey{Vendor: "acme", Type: "gpu", Name: "A1"}
	a2 := device.GroupKey{Vendor: "acme", Type: "gpu", Name: "A2"}

	held, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "alloc-1", Group: a1, DeviceIDs: []string{"a0"}})
	if err != nil {
		t.Fatalf("Reserve a0: %v", err)
	}
	if held.ID == "" || held.Plugin != "alpha" || held.Container.Envs["FAKE_VISIBLE_DEVICES"] != "a0" || held.State != device.ReservationActive {
		t.Errorf("reservation = %+v, want an active one from alpha with FAKE_VISIBLE_DEVICES=a0", held)
	}

	tests := []struct {
		name     string
		req      device.ReserveRequest
		reserve  func(ctx context.Context, ids []string) (*pb.ContainerReservation, error)
		wantErr  error
		wantText []string // substrings of the error
	}{
		{name: "unknown group", req: device.ReserveRequest{OwnerID: "o", Group: device.GroupKey{Vendor: "acme", Type: "gpu", Name: "nope"}, DeviceIDs: []string{"a1"}},
			wantErr: device.ErrUnknownDevice, wantText: []string{"acme/gpu/nope"}},
		{name: "unknown device", req: device.ReserveRequest{OwnerID: "o", Group: a1, DeviceIDs: []string{"a1", "x9"}},
			wantErr: device.ErrUnknownDevice, wantText: []string{"device x9 is not in group " + a1.String()}},
		{name: "unknown devices", req: device.ReserveRequest{OwnerID: "o", Group: a1, DeviceIDs: []string{"x8", "a1", "x9"}},
			wantErr: device.ErrUnknownDevice, wantText: []string{"devices x8, x9 are not in group " + a1.String()}},
		{name: "device of another group", req: device.ReserveRequest{OwnerID: "o", Group: a1, DeviceIDs: []string{"b0"}},
			wantErr: device.ErrUnknownDevice, wantText: []string{"b0"}},
		{name: "devices of two plugins", req: device.ReserveRequest{OwnerID: "o", Group: a1, DeviceIDs: []string{"a1", "z0"}},
			wantErr: device.ErrUnknownDevice, wantText: []string{"alpha", "beta"}},
		{name: "unhealthy", req: device.ReserveRequest{OwnerID: "o", Group: a2, DeviceIDs: []string{"b0", "b1"}},
			wantErr: device.ErrUnhealthyDevice, wantText: []string{"b1", "ecc errors"}},
		{name: "held by another owner", req: device.ReserveRequest{OwnerID: "alloc-2", Group: a1, DeviceIDs: []string{"a0", "a1"}},
			wantErr: device.ErrDeviceHeld, wantText: []string{"a0", held.ID, "alloc-1"}},
		{name: "overlap by the same owner", req: device.ReserveRequest{OwnerID: "alloc-1", Group: a1, DeviceIDs: []string{"a0", "a1"}},
			wantErr: device.ErrDeviceHeld, wantText: []string{"a0"}},
		{name: "plugin refuses", req: device.ReserveRequest{OwnerID: "o", Group: a1, DeviceIDs: []string{"a1"}},
			reserve: func(context.Context, []string) (*pb.ContainerReservation, error) {
				return nil, errors.New("widget a1 is on fire")
			},
			wantErr: device.ErrPluginResponse, wantText: []string{"alpha", "widget a1 is on fire"}},
		{name: "plugin answers LD_PRELOAD", req: device.ReserveRequest{OwnerID: "o", Group: a1, DeviceIDs: []string{"a1"}},
			reserve: func(context.Context, []string) (*pb.ContainerReservation, error) {
				return &pb.ContainerReservation{Envs: map[string]string{"LD_PRELOAD": "/evil.so"}}, nil
			},
			wantErr: device.ErrPluginResponse, wantText: []string{"alpha", "LD_PRELOAD", "env name denied"}},
		// The fake blocks until its call's context ends, so only ReserveTimeout
		// (named in the error) can end this Reserve.
		{name: "plugin hangs", req: device.ReserveRequest{OwnerID: "o", Group: a1, DeviceIDs: []string{"a1"}},
			reserve: func(ctx context.Context, _ []string) (*pb.ContainerReservation, error) {
				<-ctx.Done()
				return nil, ctx.Err()
			},
			wantErr: device.ErrPluginUnavailable, wantText: []string{"alpha", "300ms"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			alpha.set(func(f *fakeDevices) { f.reserve = tc.reserve })
			_, err := m.Reserve(ctx, tc.req)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("Reserve(%+v) error = %v, want %v", tc.req, err, tc.wantErr)
			}
			for _, s := range tc.wantText {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not name %q", err, s)
				}
			}
		})
	}
	alpha.set(func(f *fakeDevices) { f.reserve = nil })

	// The request rules are validate's, checked by the server; the manager only asserts
	// what it cannot run without, before the plugin is asked.
	calls := alpha.reserveCalls()
	for _, req := range []device.ReserveRequest{
		{Group: a1, DeviceIDs: []string{"a1"}},
		{OwnerID: "o", Group: a1},
	} {
		if _, err := m.Reserve(ctx, req); err == nil || !strings.HasPrefix(err.Error(), "reserve: internal: ") {
			t.Errorf("Reserve(%+v) error = %v, want an internal error", req, err)
		}
	}
	if got := alpha.reserveCalls(); got != calls {
		t.Errorf("plugin Reserve calls %d, want %d: a request the manager cannot run must not reach the plugin", got, calls)
	}

	// A retry by the same owner gets the same reservation.
	again, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "alloc-1", Group: a1, DeviceIDs: []string{"a0"}})
	if err != nil || again.ID != held.ID {
		t.Errorf("retried Reserve = %v, %v; want reservation %s", again.ID, err, held.ID)
	}
	// The holder shows in State and in snapshots.
	want := &device.Holder{ReservationID: held.ID, OwnerID: "alloc-1"}
	if got := m.State().Devices["a0"].Holder; got == nil || *got != *want {
		t.Errorf("State a0 holder = %v, want %v", got, want)
	}
	if got := m.State().Devices["a1"].Holder; got != nil {
		t.Errorf("State a1 holder = %v, want none", got)
	}

	// Release frees it and lists it as released; the garbage collector then has the
	// plugin clean up, with a state dir or without one (a temporary ledger).
	rel, err := m.Release(ctx, device.ReleaseRequest{OwnerID: "alloc-1"})
	if err != nil || !slices.Equal(rel.Released, []string{held.ID}) || len(rel.AlreadyReleased) != 0 {
		t.Fatalf("Release = %+v, %v; want [%s] released now", rel, err, held.ID)
	}
	if got := m.State().Devices["a0"].Holder; got != nil {
		t.Errorf("State a0 holder after Release = %v, want none", got)
	}
	list, err := m.Reservations(ctx, device.ReservationFilter{DeviceID: "a0"})
	if err != nil || len(list) != 1 || list[0].State != device.ReservationReleased {
		t.Errorf("Reservations(a0) = %+v, %v; want one released", list, err)
	}
	alpha.waitReleased(t, held.ID)
	if _, err := m.Release(ctx, device.ReleaseRequest{ReservationID: "no-such"}); !errors.Is(err, device.ErrNotFound) {
		t.Errorf("Release(unknown) = %v, want ErrNotFound", err)
	}
	// Now another owner may have a0.
	if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "alloc-2", Group: a1, DeviceIDs: []string{"a0", "a1"}}); err != nil {
		t.Errorf("Reserve after release: %v", err)
	}
}

func TestReserveWhilePluginDownIsUnavailable(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	cfg, _ := testConfig(t)
	cfg.RestartBaseDelay = time.Minute // stays down once it exits
	cfg.RestartMaxDelay = time.Minute
	m, l := startInprocManager(t, cfg, alpha)
	waitSnapshot(t, m, "a0", healthIs(device.HealthHealthy, "a0"))
	p, _ := l.latest("alpha")
	p.exit("signal: killed")
	waitSnapshot(t, m, "alpha restarting", func(s device.Snapshot) bool { return pluginOf(s, "alpha").Status == device.PluginRestarting })

	_, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "o", Group: device.GroupKey{Vendor: "acme", Type: "gpu", Name: "A1"}, DeviceIDs: []string{"a0"}})
	if !errors.Is(err, device.ErrPluginUnavailable) || !strings.Contains(err.Error(), "plugin exited: signal: killed") {
		t.Errorf("Reserve on a down plugin = %v, want ErrPluginUnavailable saying the plugin exited", err)
	}
}

// gatedStore holds the first Check's answer until gate is closed, so that another
// Reserve can run from start to end between one Reserve's Check and what follows it.
type gatedStore struct {
	reservationStore
	checked chan struct{} // closed once the first Check has read the store
	gate    chan struct{}
	calls   atomic.Int32
}

func (s *gatedStore) Check(ownerID string, deviceIDs, takeOver []string, opts map[string]string, consumes []device.Consumption, caps device.Capacity) (*device.Reservation, error) {
	r, err := s.reservationStore.Check(ownerID, deviceIDs, takeOver, opts, consumes, caps)
	if s.calls.Add(1) == 1 {
		close(s.checked)
		<-s.gate
	}
	return r, err
}

func TestReserveNeverAsksThePluginForAHeldDevice(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	gs := &gatedStore{reservationStore: m.store, checked: make(chan struct{}), gate: make(chan struct{})}
	m.store = gs // before any Reserve; no goroutine of the manager reads m.store
	a1 := device.GroupKey{Vendor: "acme", Type: "gpu", Name: "A1"}

	firstErr := make(chan error, 1)
	go func() {
		_, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "first", Group: a1, DeviceIDs: []string{"a0"}})
		firstErr <- err
	}()
	select {
	case <-gs.checked:
	case <-ctx.Done():
		t.Fatal("first Reserve never checked the store")
	}
	_, errSecond := m.Reserve(ctx, device.ReserveRequest{OwnerID: "second", Group: a1, DeviceIDs: []string{"a0"}})
	close(gs.gate)
	var errFirst error
	select {
	case errFirst = <-firstErr:
	case <-ctx.Done():
		t.Fatal("first Reserve never returned")
	}

	if (errFirst == nil) == (errSecond == nil) {
		t.Fatalf("Reserve errors = %v and %v, want exactly one to succeed", errFirst, errSecond)
	}
	for _, err := range []error{errFirst, errSecond} {
		if err != nil && !errors.Is(err, device.ErrDeviceHeld) {
			t.Errorf("refused Reserve error = %v, want ErrDeviceHeld", err)
		}
	}
	if got := alpha.reserveCalls(); got != 1 {
		t.Errorf("plugin Reserve calls = %d, want 1: the refused Reserve must not ask the plugin for a0 while it is held or being reserved", got)
	}
	// The second came while the first was in flight: its holder is the first owner,
	// with no reservation ID yet.
	var held *device.HeldError
	want := []device.Conflict{{Holder: device.Holder{OwnerID: "first"}, Overlap: []string{"a0"}, Held: []string{"a0"}}}
	if !errors.As(errSecond, &held) || held.OwnerID != "second" || !reflect.DeepEqual(held.Conflicts, want) {
		t.Errorf("second Reserve error = %#v, want a *device.HeldError for owner second with %+v", errSecond, want)
	}
	if want := `owner "second": a0 being reserved for owner "first": device held`; errSecond != nil && errSecond.Error() != want {
		t.Errorf("second Reserve error = %q, want %q", errSecond, want)
	}
}
