package manager

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/testwait"
)

// These tests run the fixture plugin as real processes (built once in TestMain).

// fixture is one fixture plugin process to run under its own name.
type fixture struct {
	name     string
	cfg      fixtureplugin.Config
	env      []string
	reattach bool // PluginConfig.Reattach
}

// widgets is a fixture inventory: one group named after the plugin with the given IDs.
func widgets(plugin string, ids ...string) []fixtureplugin.Group {
	return []fixtureplugin.Group{{Vendor: "fixture", Type: "widget", Name: plugin, IDs: ids}}
}

func widgetKey(plugin string) device.GroupKey {
	return device.GroupKey{Vendor: "fixture", Type: "widget", Name: plugin}
}

// withFixtures returns cfg running the given fixtures (and no other plugins).
func withFixtures(cfg Config, fixtures ...fixture) Config {
	cfg.Binaries = nil
	cfg.Plugins = make(map[string]PluginConfig)
	for _, f := range fixtures {
		cfg.Binaries = append(cfg.Binaries, pluginloader.Binary{Name: f.name, Path: fixtureBin})
		cfg.Plugins[f.name] = PluginConfig{ConfigJSON: f.cfg.JSON(), Env: f.env, Reattach: f.reattach}
	}
	return cfg
}

// startManager starts a manager with New running the given fixtures, shuts it down in
// t.Cleanup, and returns it.
func startManager(t *testing.T, cfg Config, fixtures ...fixture) *Manager {
	t.Helper()
	m, err := New(withFixtures(cfg, fixtures...))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { shutdown(t, m) })
	return m
}

// pid returns the running plugin's process ID.
func pid(t *testing.T, m *Manager, plugin string) int {
	t.Helper()
	s := m.supervisor(plugin)
	if s == nil {
		t.Fatalf("plugin %q is not one of the manager's", plugin)
	}
	p, ok := s.Current().(interface{ PID() int })
	if !ok {
		t.Fatalf("plugin %q is not running as a process", plugin)
	}
	return p.PID()
}

// waitWithin reads snapshots from ch until ok accepts one or d passes.
func waitWithin(t *testing.T, ch <-chan device.Snapshot, d time.Duration, what string, ok func(device.Snapshot) bool) device.Snapshot {
	t.Helper()
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	for {
		select {
		case snap, open := <-ch:
			if !open {
				t.Fatalf("watch closed before %s", what)
			}
			if ok(snap) {
				return snap
			}
		case <-deadline.C:
			t.Fatalf("no snapshot with %s within %v", what, d)
		}
	}
}

func TestProcessSIGKILLIsSeenAtOnceAndRecovers(t *testing.T) {
	cfg, _ := testConfig(t)
	m := startManager(t, cfg, fixture{name: "fx", cfg: fixtureplugin.Config{Groups: widgets("fx", "k0", "k1")}})
	waitSnapshot(t, m, "fx healthy", healthIs(device.HealthHealthy, "k0", "k1"))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	watch := m.Watch(ctx)
	<-watch // the current snapshot
	killed := time.Now()
	if err := syscall.Kill(pid(t, m, "fx"), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// "At once" is behaviour, not speed: the devices turn unhealthy from the exit itself
	// (the reason says so), before the plugin is restarted, not from a missed deadline.
	// How soon is for a benchmark; the wait is bounded only to fail a hang.
	snap := waitWithin(t, watch, testwait.Timeout, "k0, k1 unhealthy", healthIs(device.HealthUnhealthy, "k0", "k1"))
	seen := time.Since(killed)
	if got, want := snap.State.Devices["k0"].Reason, "plugin exited: signal: killed"; got != want {
		t.Errorf("k0 reason = %q, want %q", got, want)
	}
	if ps := pluginOf(snap, "fx"); ps.Restarts != 0 {
		t.Errorf("plugin state when its devices turned unhealthy = %+v, want no restart yet", ps)
	}
	snap = waitWithin(t, watch, testwait.Timeout, "healthy again", healthIs(device.HealthHealthy, "k0", "k1"))
	t.Logf("SIGKILL: unhealthy seen after %v, healthy again after %v", seen, time.Since(killed))
	ps := pluginOf(snap, "fx")
	if ps.Status != device.PluginRunning || ps.Restarts != 1 || ps.LastError != "plugin exited: signal: killed" {
		t.Errorf("plugin state = %+v, want running, 1 restart, last error from the kill", ps)
	}
}

func TestProcessCrashLoopShowsRestartsAndRecovers(t *testing.T) {
	cfg, _ := testConfig(t)
	m := startManager(t, cfg, fixture{name: "crashy", cfg: fixtureplugin.Config{
		Groups:    widgets("crashy", "c0"),
		ExitAfter: fixtureplugin.Duration(700 * time.Millisecond),
	}})
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	watch := m.Watch(ctx)
	waitWithin(t, watch, testwait.Timeout, "c0 healthy", healthIs(device.HealthHealthy, "c0"))
	snap := waitWithin(t, watch, testwait.Timeout, "c0 unhealthy", healthIs(device.HealthUnhealthy, "c0"))
	if got, want := snap.State.Devices["c0"].Reason, "plugin exited: exit status 3"; got != want {
		t.Errorf("c0 reason = %q, want %q", got, want)
	}
	snap = waitWithin(t, watch, testwait.Timeout, "restarting with a next retry", func(s device.Snapshot) bool {
		return pluginOf(s, "crashy").Status == device.PluginRestarting
	})
	if ps := pluginOf(snap, "crashy"); ps.NextRetry.IsZero() || ps.LastError != "plugin exited: exit status 3" || ps.LastErrorAt.IsZero() {
		t.Errorf("restarting plugin state = %+v, want next retry and last error", ps)
	}
	snap = waitWithin(t, watch, testwait.Timeout, "healthy after a restart", func(s device.Snapshot) bool {
		return healthIs(device.HealthHealthy, "c0")(s) && pluginOf(s, "crashy").Restarts >= 1
	})
	// It keeps crashing and keeps being restarted.
	waitWithin(t, watch, testwait.Timeout, "a second restart", func(s device.Snapshot) bool { return pluginOf(s, "crashy").Restarts >= 2 })
}

func TestProcessFingerprintStreamEndIsRetried(t *testing.T) {
	cfg, _ := testConfig(t)
	m := startManager(t, cfg, fixture{name: "ender", cfg: fixtureplugin.Config{
		Groups:              widgets("ender", "e0"),
		FingerprintEndAfter: 1,
	}})
	snap := waitSnapshot(t, m, "two restarts", func(s device.Snapshot) bool { return pluginOf(s, "ender").Restarts >= 2 })
	if got := pluginOf(snap, "ender").LastError; !strings.Contains(got, "fingerprint stream ended after 1 messages") {
		t.Errorf("LastError = %q, want the plugin's stream error", got)
	}
	// Each restart fingerprints again.
	waitSnapshot(t, m, "e0 healthy after restarts", func(s device.Snapshot) bool {
		return healthIs(device.HealthHealthy, "e0")(s) && pluginOf(s, "ender").Restarts >= 2
	})
}

// TestProcessHangsAreBoundedAndIsolated runs a healthy plugin beside plugins that hang
// at start, in Fingerprint, in Stats and in Reserve: each hang is cut by its deadline,
// and the healthy plugin fingerprints, streams stats and reserves meanwhile.
func TestProcessHangsAreBoundedAndIsolated(t *testing.T) {
	cfg, logs := testConfig(t)
	cfg.StartTimeout = 2 * time.Second
	cfg.FingerprintTimeout = time.Second
	cfg.ReadyTimeout = 1500 * time.Millisecond
	cfg.ReserveTimeout = 500 * time.Millisecond
	start := time.Now()
	m := startManager(t, cfg,
		fixture{name: "good", cfg: fixtureplugin.Config{Groups: widgets("good", "g0")}},
		fixture{name: "hangstart", cfg: fixtureplugin.Config{Groups: widgets("hangstart", "h0")}, env: []string{"FIXTURE_HANG_START=1"}},
		fixture{name: "fphang", cfg: fixtureplugin.Config{Groups: widgets("fphang", "f0"), FingerprintHang: true}},
		fixture{name: "statshang", cfg: fixtureplugin.Config{Groups: widgets("statshang", "s0"), StatsHang: true}},
		fixture{name: "reservehang", cfg: fixtureplugin.Config{Groups: widgets("reservehang", "r0"), ReserveHang: true}},
	)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()

	// The healthy plugin is not held up.
	waitSnapshot(t, m, "g0 healthy", healthIs(device.HealthHealthy, "g0"))
	t.Logf("healthy plugin fingerprinted after %v", time.Since(start))
	if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "o1", Group: widgetKey("good"), DeviceIDs: []string{"g0"}}); err != nil {
		t.Errorf("Reserve on the healthy plugin: %v", err)
	}
	waitStats(t, m.WatchStats(ctx, 0), func(s device.StatsSnapshot) bool { return statValue(s, "g0", "seq") >= 2 }, "stats from the healthy plugin")

	// Readiness does not wait for the plugins that never fingerprint.
	inv, err := m.WaitForFirstFingerprint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ready after %v with ReadyTimeout %v", time.Since(start), cfg.ReadyTimeout)
	if !slices.Contains(deviceIDs(inv), "good/g0") {
		t.Errorf("inventory at ready = %v, want good/g0 in it", deviceIDs(inv))
	}

	// Reserve on a hung plugin ends at ReserveTimeout.
	waitSnapshot(t, m, "r0 healthy", healthIs(device.HealthHealthy, "r0"))
	// The call's own context never ends, so only ReserveTimeout can end it; the test
	// context (20 times ReserveTimeout) is where a call without that deadline hangs.
	called := time.Now()
	reserved := make(chan error, 1)
	go func() {
		_, err := m.Reserve(context.WithoutCancel(ctx), device.ReserveRequest{OwnerID: "o2", Group: widgetKey("reservehang"), DeviceIDs: []string{"r0"}})
		reserved <- err
	}()
	select {
	case err = <-reserved:
	case <-ctx.Done():
		t.Fatalf("Reserve on a hung plugin still running after %v: ReserveTimeout (%v) did not end it", time.Since(called), cfg.ReserveTimeout)
	}
	if !errors.Is(err, device.ErrPluginUnavailable) {
		t.Errorf("Reserve on a hung plugin = %v, want ErrPluginUnavailable once ReserveTimeout (%v) passed", err, cfg.ReserveTimeout)
	}
	t.Logf("hung Reserve answered after %v (ReserveTimeout %v): %v", time.Since(called), cfg.ReserveTimeout, err)

	// A hung start and a silent fingerprint stream are failed runs, retried. On a loaded
	// machine one of fphang's runs may fail its launch first (StartTimeout): wait for a
	// run that failed for its silent stream.
	waitSnapshot(t, m, "hangstart restarted after a failed launch, fphang after no first fingerprint", func(s device.Snapshot) bool {
		hs, fp := pluginOf(s, "hangstart"), pluginOf(s, "fphang")
		return hs.Restarts >= 1 && strings.Contains(hs.LastError, "launch") &&
			fp.Restarts >= 1 && strings.Contains(fp.LastError, "no fingerprint within 1s")
	})
	// A silent stats stream is cut and reopened; the plugin's devices stay healthy.
	logs.waitLine(t, "stats stream failed", "plugin=statshang", "no stats within")
	if st := m.State().Devices["s0"]; st.Health != device.HealthHealthy {
		t.Errorf("s0 = %+v, want healthy: a stats hang is not a device fault", st)
	}
}

func TestProcessStatsAreSampledOncePerPlugin(t *testing.T) {
	cfg, _ := testConfig(t)
	m := startManager(t, cfg,
		fixture{name: "one", cfg: fixtureplugin.Config{Groups: widgets("one", "o0")}},
		fixture{name: "two", cfg: fixtureplugin.Config{Groups: widgets("two", "t0")}},
	)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if _, err := m.WaitForFirstFingerprint(ctx); err != nil {
		t.Fatal(err)
	}
	watchers := make([]<-chan device.StatsSnapshot, 20)
	for i := range watchers {
		watchers[i] = m.WatchStats(ctx, 0)
	}
	slow := m.WatchStats(ctx, 5*cfg.StatsInterval)
	var last device.StatsSnapshot
	for i, ch := range watchers {
		last = waitStats(t, ch, func(s device.StatsSnapshot) bool {
			return statValue(s, "o0", "seq") >= 5 && statValue(s, "t0", "seq") >= 5
		}, "watcher %d: seq 5 from both plugins", i)
	}
	for _, id := range []string{"o0", "t0"} {
		if got := statValue(last, id, "stats_streams"); got != 1 {
			t.Errorf("%s: the plugin saw %d stats streams with %d watchers, want 1", id, got, len(watchers))
		}
	}
	// The slow watcher got the first snapshot at once and then at most one per 5 ticks.
	waitStats(t, slow, func(device.StatsSnapshot) bool { return true }, "first slow snapshot")
	second := waitStats(t, slow, func(device.StatsSnapshot) bool { return true }, "second slow snapshot")
	third := waitStats(t, slow, func(device.StatsSnapshot) bool { return true }, "third slow snapshot")
	if gap := third.Time.Sub(second.Time); gap < 3*cfg.StatsInterval { // 5 ticks apart; margin for late ticks
		t.Errorf("slow watcher's snapshots %v apart, want about %v", gap, 5*cfg.StatsInterval)
	}
}

func TestProcessStatsErrorIsLoggedAndRetried(t *testing.T) {
	cfg, logs := testConfig(t)
	m := startManager(t, cfg, fixture{name: "sick", cfg: fixtureplugin.Config{
		Groups: widgets("sick", "x0"), StatsError: "thermal sensor unreadable",
	}})
	first := logs.waitLine(t, "stats stream failed", "plugin=sick")
	if !strings.Contains(first, "thermal sensor unreadable") {
		t.Errorf("log line %q does not carry the plugin's error", first)
	}
	// Retried: the same failure again is logged at DEBUG only, and the plugin is not
	// restarted for it.
	logs.waitLine(t, "[DEBUG]", "stats stream failed again with the same error", "plugin=sick", "thermal sensor unreadable")
	if n := len(logs.lines("[WARN]", "stats stream failed", "plugin=sick")); n != 1 {
		t.Errorf("%d WARN lines for one repeated stats error, want 1", n)
	}
	if ps := pluginOf(m.Snapshot(), "sick"); ps.Restarts != 0 || ps.Status != device.PluginRunning {
		t.Errorf("plugin state = %+v, want running without restarts", ps)
	}
}

func TestProcessReserve(t *testing.T) {
	cfg, _ := testConfig(t)
	m := startManager(t, cfg,
		fixture{name: "fx", cfg: fixtureplugin.Config{Groups: widgets("fx", "w0", "w1", "w2")}},
		fixture{name: "evil", cfg: fixtureplugin.Config{Groups: widgets("evil", "v0"), ReserveBad: true}},
		fixture{name: "grumpy", cfg: fixtureplugin.Config{Groups: widgets("grumpy", "u0"), ReserveError: "reserve: widget u0 is calibrating"}},
	)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if _, err := m.WaitForFirstFingerprint(ctx); err != nil {
		t.Fatal(err)
	}

	r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "alloc-7", Group: widgetKey("fx"), DeviceIDs: []string{"w1", "w0"}})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	if got, want := r.Container.Envs["FIXTURE_DEVICES"], "w1,w0"; got != want {
		t.Errorf("FIXTURE_DEVICES = %q, want %q", got, want)
	}
	if got, want := r.Container.CDIDevices, []string{"fixture.example/widget=w1", "fixture.example/widget=w0"}; !slices.Equal(got, want) {
		t.Errorf("CDI devices = %v, want %v", got, want)
	}
	if h := m.State().Devices["w0"].Holder; h == nil || h.OwnerID != "alloc-7" || h.ReservationID != r.ID {
		t.Errorf("w0 holder = %v, want reservation %s of alloc-7", h, r.ID)
	}

	tests := []struct {
		name    string
		plugin  string
		id      string
		wantErr error
		want    []string
	}{
		{"LD_PRELOAD in the answer", "evil", "v0", device.ErrPluginResponse, []string{`"evil"`, "LD_PRELOAD", "env name denied"}},
		// The plugin's own "reserve: " is not said twice.
		{"plugin error", "grumpy", "u0", device.ErrPluginResponse, []string{`plugin "grumpy" refused reserve: widget u0 is calibrating`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "o", Group: widgetKey(tc.plugin), DeviceIDs: []string{tc.id}})
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("Reserve error = %v, want %v", err, tc.wantErr)
			}
			for _, s := range tc.want {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not name %s", err, s)
				}
			}
		})
	}
}

// A plugin that takes no options (the fixture, through the SDK) refuses a Reserve that
// carries one, naming it; the host answers with ErrInvalidRequest (INVALID_ARGUMENT at
// the server) and holds nothing. Without options the same devices are reserved, and
// the options a Reserve carried are the reservation's.
func TestProcessReserveWithAnUnknownOption(t *testing.T) {
	cfg, _ := testConfig(t)
	m := startManager(t, cfg, fixture{name: "fx", cfg: fixtureplugin.Config{Groups: widgets("fx", "w0")}})
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if _, err := m.WaitForFirstFingerprint(ctx); err != nil {
		t.Fatal(err)
	}
	req := device.ReserveRequest{OwnerID: "o", Group: widgetKey("fx"), DeviceIDs: []string{"w0"},
		PluginOptions: map[string]string{"speed": "fast"}}
	_, err := m.Reserve(ctx, req)
	const want = `plugin "fx" refused reserve: option "speed" is unknown to plugin "fixture", which takes none: invalid request`
	if !errors.Is(err, device.ErrInvalidRequest) || err.Error() != want {
		t.Fatalf("Reserve with an unknown option: %v\nwant %s", err, want)
	}
	if h := m.State().Devices["w0"].Holder; h != nil {
		t.Errorf("w0 held by %+v after the refusal; want free", h)
	}
	if rs, err := m.Reservations(ctx, device.ReservationFilter{}); err != nil || len(rs) != 0 {
		t.Errorf("reservations after the refusal: %+v, %v; want none", rs, err)
	}
	req.PluginOptions = nil
	if _, err := m.Reserve(ctx, req); err != nil {
		t.Fatalf("the same Reserve without options: %v", err)
	}
}

func TestProcessRejectedConfigFailsThePluginOnce(t *testing.T) {
	cfg, logs := testConfig(t)
	cfg.ReadyTimeout = time.Hour
	m := startManager(t, cfg,
		fixture{name: "picky", cfg: fixtureplugin.Config{RejectConfig: "simulate: no such machine"}},
		fixture{name: "fine", cfg: fixtureplugin.Config{Groups: widgets("fine", "n0")}},
	)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if _, err := m.WaitForFirstFingerprint(ctx); err != nil {
		t.Fatalf("a failed plugin held Ready: %v", err)
	}
	ps := pluginOf(m.Snapshot(), "picky")
	if ps.Status != device.PluginFailed || !strings.Contains(ps.LastError, "simulate: no such machine") || ps.Restarts != 0 {
		t.Errorf("picky = %+v, want failed with the plugin's reason, no restarts", ps)
	}
	logs.waitLine(t, "will not be restarted", "plugin=picky", "simulate: no such machine")
}

func TestProcessPluginDirDiscovery(t *testing.T) {
	bin, err := os.ReadFile(fixtureBin)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(name string, mode os.FileMode) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, bin, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(path, mode); err != nil { // past the umask
			t.Fatal(err)
		}
		return path
	}
	write("found", 0o755)
	unsafe := write("unsafe", 0o777)

	cfg, logs := testConfig(t)
	cfg.PluginDir = dir
	cfg.Plugins = map[string]PluginConfig{"found": {ConfigJSON: fixtureplugin.Config{Groups: widgets("found", "d0")}.JSON()}}
	m, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { shutdown(t, m) })
	snap := waitSnapshot(t, m, "d0 from the discovered plugin", healthIs(device.HealthHealthy, "d0"))
	if got := len(snap.State.Plugins); got != 1 {
		t.Errorf("plugins = %+v, want only the safe one", snap.State.Plugins)
	}
	logs.waitLine(t, "plugins refused", unsafe)

	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	cfg.Plugins = nil
	if _, err := New(cfg); !errors.Is(err, pluginloader.ErrInsecurePath) {
		t.Errorf("New with a world-writable plugin dir: %v, want ErrInsecurePath", err)
	}
}

func TestShutdownStopsPluginProcesses(t *testing.T) {
	cfg, _ := testConfig(t)
	cfg.Binaries = []pluginloader.Binary{{Name: "a", Path: fixtureBin}, {Name: "b", Path: fixtureBin}}
	cfg.Plugins = map[string]PluginConfig{
		"a": {ConfigJSON: fixtureplugin.Config{Groups: widgets("a", "a0")}.JSON()},
		"b": {ConfigJSON: fixtureplugin.Config{Groups: widgets("b", "b0")}.JSON()},
	}
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	waitSnapshot(t, m, "both plugins", healthIs(device.HealthHealthy, "a0", "b0"))
	pids := []int{pid(t, m, "a"), pid(t, m, "b")}
	start := time.Now()
	shutdown(t, m)
	t.Logf("Shutdown with 2 plugins took %v", time.Since(start))
	for _, p := range pids {
		if err := syscall.Kill(p, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("plugin process %d after Shutdown: kill(0) = %v, want ESRCH (gone)", p, err)
		}
	}
}

// TestProcessGCCleanupReachesThePlugin releases reservations of two fixture processes:
// the garbage collector cleans up through each plugin's Release RPC; the one whose
// Release fails (release_error) keeps its cleanup pending and is retried, not dropped.
func TestProcessGCCleanupReachesThePlugin(t *testing.T) {
	cfg, logs := durableConfig(t)
	cfg.gcRetryMin = 50 * time.Millisecond
	m := startManager(t, cfg,
		fixture{name: "fx", cfg: fixtureplugin.Config{Groups: widgets("fx", "w0", "w1"), LogRelease: true}},
		fixture{name: "busy", cfg: fixtureplugin.Config{Groups: widgets("busy", "b0"), LogRelease: true, ReleaseError: "widget b0 still draining"}},
	)
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	r1, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "o1", Group: widgetKey("fx"), DeviceIDs: []string{"w0", "w1"}})
	if err != nil {
		t.Fatal(err)
	}
	r2, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "o2", Group: widgetKey("busy"), DeviceIDs: []string{"b0"}})
	if err != nil {
		t.Fatal(err)
	}
	release(t, m, device.ReleaseRequest{OwnerID: "o1"})
	release(t, m, device.ReleaseRequest{OwnerID: "o2"})

	logs.waitLine(t, "test.fx: fixture: release", "reservation_id="+r1.ID, `device_ids="w0,w1"`, "failed=false")
	waitReservation(t, m, r1.ID, "cleaned up", cleanedUp)

	logs.waitLine(t, "test.busy: fixture: release", "reservation_id="+r2.ID, "failed=true")
	logs.waitLine(t, "reservation cleanup failed; will retry", "reservation_id="+r2.ID, "attempt=2", "widget b0 still draining")
	if got, _ := reservation(t, m, r2.ID); got.State != device.ReservationReleased || !got.CleanupPending {
		t.Errorf("reservation whose plugin cleanup keeps failing = %+v, want released with the cleanup pending", got)
	}
}

func TestProcessNotAPluginFailsOnceWithoutRestarts(t *testing.T) {
	cfg, logs := testConfig(t)
	cfg.ReadyTimeout = time.Hour
	path := filepath.Join(t.TempDir(), "chatty")
	if err := os.WriteFile(path, []byte("#!/bin/sh\necho hello\nexec sleep 30\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	cfg = withFixtures(cfg, fixture{name: "fine", cfg: fixtureplugin.Config{Groups: widgets("fine", "n0")}})
	cfg.Binaries = append(cfg.Binaries, pluginloader.Binary{Name: "chatty", Path: path})
	m, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { shutdown(t, m) })
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if _, err := m.WaitForFirstFingerprint(ctx); err != nil {
		t.Fatalf("a binary that is not a plugin held Ready: %v", err)
	}
	snap := waitSnapshot(t, m, "chatty failed", func(s device.Snapshot) bool { return pluginOf(s, "chatty").Status == device.PluginFailed })
	ps := pluginOf(snap, "chatty")
	if !strings.Contains(ps.LastError, `printed "hello" instead of a go-plugin handshake`) || ps.Restarts != 0 {
		t.Errorf("chatty = %+v, want failed naming what it printed, no restarts", ps)
	}
	logs.waitLine(t, "will not be restarted", "plugin=chatty")
}
