package manager

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/testwait"
)

// These tests run the manager on a watched plugin dir, with the fixture binary (built
// in TestMain) copied in and out of it as an operator would.

var fixtureBytes = sync.OnceValues(func() ([]byte, error) { return os.ReadFile(fixtureBin) })

// fixtureContent returns the fixture binary's bytes.
func fixtureContent(t testing.TB) []byte {
	t.Helper()
	b, err := fixtureBytes()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// pluginDir returns an empty plugin dir that passes the trust check.
func pluginDir(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "plugins")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// copyIn writes the fixture to dir/name as `cp` does (create, write, close) with mode
// 0755, and returns when the file is complete.
func copyIn(t testing.TB, dir, name string) time.Time {
	t.Helper()
	return writeFile(t, filepath.Join(dir, name), fixtureContent(t), 0o755)
}

// writeFile writes data to path, then sets mode (past the umask); it returns when done.
func writeFile(t testing.TB, path string, data []byte, mode os.FileMode) time.Time {
	t.Helper()
	if err := os.WriteFile(path, data, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
	return time.Now()
}

// moveIn writes the fixture to a file beside dir and renames it onto dir/name, as a
// deployment that replaces a binary atomically does; it returns when renamed.
func moveIn(t testing.TB, dir, name string) time.Time {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(dir), name+".new")
	writeFile(t, tmp, fixtureContent(t), 0o755)
	if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
		t.Fatal(err)
	}
	return time.Now()
}

// dirConfig is testConfig (with a state dir) on a plugin dir, with a settle period
// shorter than the default so that the tests run quicker.
func dirConfig(t *testing.T, dir string) (Config, *logRecorder) {
	t.Helper()
	cfg, logs := durableConfig(t)
	cfg.PluginDir = dir
	cfg.PluginDirSettle = 100 * time.Millisecond
	return cfg, logs
}

// startDirManager starts New on cfg and shuts it down in t.Cleanup.
func startDirManager(t *testing.T, cfg Config) *Manager {
	t.Helper()
	m, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { shutdown(t, m) })
	return m
}

// fixtureCfg is the plugin settings of a fixture reporting its PID and the given IDs.
func fixtureCfg(plugin string, ids ...string) PluginConfig {
	return PluginConfig{ConfigJSON: fixtureplugin.Config{Groups: widgets(plugin, ids...), ReportPID: true, LogRelease: true}.JSON()}
}

// groupPID is the "pid" attribute the fixture reports on its group named plugin.
func groupPID(s device.Snapshot, plugin string) int64 {
	for _, g := range s.Inventory.Groups {
		if g.Plugin == plugin {
			if v, ok := g.Attributes["pid"]; ok {
				return v.Int
			}
		}
	}
	return 0
}

// inInventory reports whether every id is in s's inventory.
func inInventory(s device.Snapshot, ids ...string) bool {
	have := make(map[string]bool)
	for _, g := range s.Inventory.Groups {
		for _, d := range g.Devices {
			have[d.ID] = true
		}
	}
	for _, id := range ids {
		if !have[id] {
			return false
		}
	}
	return true
}

func hasPlugin(s device.Snapshot, name string) bool {
	return slices.ContainsFunc(s.State.Plugins, func(p device.PluginState) bool { return p.Name == name })
}

func TestPluginDirDropInIsLaunched(t *testing.T) {
	dir := pluginDir(t)
	cfg, logs := dirConfig(t, dir)
	cfg.PluginDirSettle = 0 // the default, whose timing this test reports
	cfg.Plugins = map[string]PluginConfig{"fx": fixtureCfg("fx", "d0", "d1")}
	m := startDirManager(t, cfg)
	waitReady(t, m)
	if ps := pluginOf(m.Snapshot(), "fx"); ps.Status != device.PluginFailed {
		t.Fatalf("fx before its binary = %+v, want listed as failed (configured, no binary)", ps)
	}

	// A plugin with a config block, and one without (the fixture's default devices).
	complete := copyIn(t, dir, "fx")
	waitSnapshot(t, m, "d0, d1 healthy", healthIs(device.HealthHealthy, "d0", "d1"))
	t.Logf("drop-in (settle %v): devices visible %v after the file was complete", DefaultPluginDirSettle, time.Since(complete))
	complete = copyIn(t, dir, "plain")
	snap := waitSnapshot(t, m, "w0, w1 healthy", healthIs(device.HealthHealthy, "w0", "w1"))
	t.Logf("drop-in (settle %v): devices visible %v after the file was complete", DefaultPluginDirSettle, time.Since(complete))
	if ps := pluginOf(snap, "plain"); ps.Status != device.PluginRunning || ps.Restarts != 0 || ps.Path != filepath.Join(dir, "plain") {
		t.Errorf("plain = %+v, want running from %s, no restarts", ps, filepath.Join(dir, "plain"))
	}
	logs.waitLine(t, "plugin added", "plugin=plain")
	if ps := pluginOf(snap, "fx"); ps.Status != device.PluginRunning || ps.LastError != "" {
		t.Errorf("fx = %+v, want running, its missing-binary error gone", ps)
	}

	// Shutdown stops the plugins started after New too.
	pids := []int{pid(t, m, "fx"), pid(t, m, "plain")}
	shutdown(t, m)
	for _, p := range pids {
		if err := syscall.Kill(p, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("plugin process %d after Shutdown: kill(0) = %v, want ESRCH (gone)", p, err)
		}
	}
}

func TestPluginDirReplaceRestartsOnTheNewBinaryKeepingReservations(t *testing.T) {
	dir := pluginDir(t)
	copyIn(t, dir, "fx")
	cfg, logs := dirConfig(t, dir)
	cfg.Plugins = map[string]PluginConfig{"fx": fixtureCfg("fx", "d0", "d1")}
	m := startDirManager(t, cfg)
	snap := waitSnapshot(t, m, "d0 healthy", healthIs(device.HealthHealthy, "d0", "d1"))
	r, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "job-1", Group: widgetKey("fx"), DeviceIDs: []string{"d0"}})
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	watch := m.Watch(ctx)
	replacements := []struct {
		name    string
		replace func() time.Time
	}{
		{"mv of a new file onto its name", func() time.Time { return moveIn(t, dir, "fx") }},
		{"unlink and write again (install, cp --remove-destination)", func() time.Time {
			if err := os.Remove(filepath.Join(dir, "fx")); err != nil {
				t.Fatal(err)
			}
			// The watcher has seen it gone: it comes back within the settle period.
			logs.waitLine(t, "plugin binary gone; its plugin is stopped unless it is back within the settle period", "plugin=fx")
			return copyIn(t, dir, "fx")
		}},
	}
	for _, rep := range replacements {
		old := groupPID(snap, "fx")
		done := rep.replace()
		snap = waitWithin(t, watch, testwait.Timeout, "d0 and d1 healthy from a new process", func(s device.Snapshot) bool {
			if !inInventory(s, "d0", "d1") {
				t.Fatalf("%s: the devices left the inventory during the restart: %v", rep.name, deviceIDs(s.Inventory))
			}
			return healthIs(device.HealthHealthy, "d0", "d1")(s) && groupPID(s, "fx") != old
		})
		t.Logf("%s: restarted on the new binary %v after it was in place", rep.name, time.Since(done))
		if h := snap.State.Devices["d0"].Holder; h == nil || h.ReservationID != r.ID {
			t.Errorf("%s: d0 holder = %v, want the reservation %s kept", rep.name, h, r.ID)
		}
		if ps := pluginOf(snap, "fx"); ps.Restarts != 0 || ps.Status != device.PluginRunning {
			t.Errorf("%s: fx = %+v, want running afresh (no restarts)", rep.name, ps)
		}
		if got, listed := reservation(t, m, r.ID); !listed || got.State != device.ReservationActive {
			t.Errorf("%s: reservation = %+v (listed %v), want it still active", rep.name, got, listed)
		}
	}
	if n := len(logs.lines("restarting plugin", "plugin=fx", `reason="plugin binary replaced"`)); n != 2 {
		t.Errorf("%d restart lines for 2 replacements, want 2", n)
	}
	// A device it reserved stays held; another owner cannot take it.
	if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-2", Group: widgetKey("fx"), DeviceIDs: []string{"d0"}}); !errors.Is(err, device.ErrDeviceHeld) {
		t.Errorf("Reserve of d0 by another owner after the replacements: %v, want ErrDeviceHeld", err)
	}
}

func TestPluginDirChmodOfARunningPluginRestartsNothing(t *testing.T) {
	dir := pluginDir(t)
	copyIn(t, dir, "fx")
	cfg, logs := dirConfig(t, dir)
	cfg.Plugins = map[string]PluginConfig{"fx": fixtureCfg("fx", "d0")}
	m := startDirManager(t, cfg)
	waitSnapshot(t, m, "d0 healthy", healthIs(device.HealthHealthy, "d0"))
	before := pid(t, m, "fx")
	if err := os.Chmod(filepath.Join(dir, "fx"), 0o750); err != nil {
		t.Fatal(err)
	}
	// A drop-in after it, seen after the chmod, orders the check.
	copyIn(t, dir, "later")
	waitSnapshot(t, m, "the later plugin", healthIs(device.HealthHealthy, "w0"))
	if after := pid(t, m, "fx"); after != before {
		t.Errorf("fx restarted by a chmod: pid %d, then %d", before, after)
	}
	if lines := logs.lines("restarting plugin", "plugin=fx"); len(lines) > 0 {
		t.Errorf("restart lines after a chmod: %q", lines)
	}
}

func TestPluginDirRemoveStopsThePluginAndKeepsItsReservations(t *testing.T) {
	dir := pluginDir(t)
	copyIn(t, dir, "fx")
	copyIn(t, dir, "other")
	cfg, logs := dirConfig(t, dir)
	cfg.gcRetryMin = 50 * time.Millisecond
	cfg.RemovedPluginGrace = time.Second
	cfg.Plugins = map[string]PluginConfig{"other": fixtureCfg("other", "o0")}
	m := startDirManager(t, cfg)
	waitSnapshot(t, m, "both plugins", healthIs(device.HealthHealthy, "w0", "w1", "o0"))
	ctx := context.Background()
	r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-1", Group: device.GroupKey{Vendor: "fixture", Type: "widget", Name: "Widget 1000"}, DeviceIDs: []string{"w0"}})
	if err != nil {
		t.Fatal(err)
	}
	proc := pid(t, m, "fx")

	if err := os.Remove(filepath.Join(dir, "fx")); err != nil {
		t.Fatal(err)
	}
	snap := waitSnapshot(t, m, "fx gone", func(s device.Snapshot) bool { return !hasPlugin(s, "fx") })
	if inInventory(snap, "w0") || inInventory(snap, "w1") {
		t.Errorf("inventory after the removal: %v, want w0, w1 gone", deviceIDs(snap.Inventory))
	}
	if _, ok := snap.State.Devices["w0"]; ok {
		t.Errorf("w0 still has a state after its plugin was removed: %+v", snap.State.Devices["w0"])
	}
	if !healthIs(device.HealthHealthy, "o0")(snap) {
		t.Errorf("the other plugin's device after the removal: %+v", snap.State.Devices["o0"])
	}
	logs.waitLine(t, "plugin removed; stopping it", "plugin=fx")
	applied(m)
	if err := syscall.Kill(proc, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("plugin process %d after the removal: kill(0) = %v, want ESRCH (gone)", proc, err)
	}

	// The reservation stays listed, active, and can be released.
	if got, listed := reservation(t, m, r.ID); !listed || got.State != device.ReservationActive || got.Plugin != "fx" {
		t.Fatalf("reservation after the removal = %+v (listed %v), want active, of fx", got, listed)
	}
	if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-2", Group: device.GroupKey{Vendor: "fixture", Type: "widget", Name: "Widget 1000"}, DeviceIDs: []string{"w1"}}); !errors.Is(err, device.ErrUnknownDevice) {
		t.Errorf("Reserve of a removed plugin's device: %v, want ErrUnknownDevice", err)
	}
	res := release(t, m, device.ReleaseRequest{ReservationID: r.ID})
	if !slices.Equal(res.Released, []string{r.ID}) {
		t.Errorf("Release = %+v, want %s released", res, r.ID)
	}
	// Its cleanup waits for the plugin while it may come back, then is given up on.
	logs.waitLine(t, "reservation cleanup failed; will retry", "reservation_id="+r.ID, `plugin \"fx\" was removed`)
	if got, _ := reservation(t, m, r.ID); !got.CleanupPending {
		t.Errorf("reservation of a plugin removed %v ago = %+v, want its cleanup pending", time.Second, got)
	}
	logs.waitLine(t, "plugin cleanup of a released reservation skipped", "plugin=fx", "reservation_id="+r.ID)
	waitReservation(t, m, r.ID, "counted cleaned up", cleanedUp)
}

func TestPluginDirCleanupWaitsForAConfiguredPluginToComeBack(t *testing.T) {
	dir := pluginDir(t)
	copyIn(t, dir, "fx")
	cfg, logs := dirConfig(t, dir)
	cfg.gcRetryMin = 50 * time.Millisecond
	cfg.RemovedPluginGrace = time.Millisecond // not what keeps it: its config block is
	cfg.Plugins = map[string]PluginConfig{"fx": fixtureCfg("fx", "d0")}
	m := startDirManager(t, cfg)
	waitSnapshot(t, m, "d0", healthIs(device.HealthHealthy, "d0"))
	r, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "job-1", Group: widgetKey("fx"), DeviceIDs: []string{"d0"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "fx")); err != nil {
		t.Fatal(err)
	}
	snap := waitSnapshot(t, m, "fx failed without a binary", func(s device.Snapshot) bool {
		return pluginOf(s, "fx").Status == device.PluginFailed && !inInventory(s, "d0")
	})
	if got := pluginOf(snap, "fx").LastError; !strings.Contains(got, "no such plugin binary in "+dir) {
		t.Errorf("fx last error = %q, want no such plugin binary", got)
	}
	release(t, m, device.ReleaseRequest{ReservationID: r.ID})
	logs.waitLine(t, "reservation cleanup failed; will retry", "reservation_id="+r.ID, "attempt=2", "configured but has no binary")

	copyIn(t, dir, "fx")
	logs.waitLine(t, "test.fx: fixture: release", "reservation_id="+r.ID, "failed=false")
	waitReservation(t, m, r.ID, "cleaned up by the plugin back in place", cleanedUp)
	if lines := logs.lines("plugin cleanup of a released reservation skipped"); len(lines) > 0 {
		t.Errorf("cleanup given up on: %q", lines)
	}
}

func TestPluginDirHalfWrittenBinaryWaitsUntilComplete(t *testing.T) {
	dir := pluginDir(t)
	cfg, logs := dirConfig(t, dir)
	m := startDirManager(t, cfg)
	waitReady(t, m)

	data := fixtureContent(t)
	path := filepath.Join(dir, "slow")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Chmod(0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data[:len(data)/2]); err != nil {
		t.Fatal(err)
	}
	// The watcher has looked at the settled half and waits for the writer to close it.
	logs.waitLine(t, "plugin binary still open for writing; waiting until it is closed", "plugin=slow")
	if hasPlugin(m.Snapshot(), "slow") {
		t.Fatalf("half-written plugin listed: %+v", pluginOf(m.Snapshot(), "slow"))
	}
	if _, err := f.Write(data[len(data)/2:]); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	complete := time.Now()
	snap := waitSnapshot(t, m, "the completed plugin's devices", healthIs(device.HealthHealthy, "w0", "w1"))
	t.Logf("held open while half written, then completed: devices visible %v after the close", time.Since(complete))
	if ps := pluginOf(snap, "slow"); ps.Restarts != 0 || ps.LastError != "" {
		t.Errorf("slow = %+v, want its first launch to have worked (never launched half-written)", ps)
	}
}

func TestPluginDirTrustRefusalThenChmodFix(t *testing.T) {
	dir := pluginDir(t)
	cfg, logs := dirConfig(t, dir)
	m := startDirManager(t, cfg)
	waitReady(t, m)

	path := filepath.Join(dir, "loose")
	writeFile(t, path, fixtureContent(t), 0o777)
	logs.waitLine(t, "plugins refused and not run", path, "writable by group and others", "fix: chmod go-w")
	if hasPlugin(m.Snapshot(), "loose") {
		t.Fatalf("a world-writable binary is listed: %+v", pluginOf(m.Snapshot(), "loose"))
	}
	if err := os.Chmod(path, 0o755); err != nil {
		t.Fatal(err)
	}
	waitSnapshot(t, m, "the fixed plugin's devices", healthIs(device.HealthHealthy, "w0", "w1"))
}

func TestPluginDirFailedPluginGetsAnotherChanceWhenItsFileChanges(t *testing.T) {
	dir := pluginDir(t)
	writeFile(t, filepath.Join(dir, "fx"), []byte("#!/bin/sh\necho hello\nexec sleep 30\n"), 0o755)
	cfg, logs := dirConfig(t, dir)
	cfg.Plugins = map[string]PluginConfig{"fx": fixtureCfg("fx", "d0")}
	m := startDirManager(t, cfg)
	snap := waitSnapshot(t, m, "fx failed", func(s device.Snapshot) bool { return pluginOf(s, "fx").Status == device.PluginFailed })
	if got := pluginOf(snap, "fx").LastError; !strings.Contains(got, "instead of a go-plugin handshake") {
		t.Errorf("fx last error = %q, want not a plugin", got)
	}
	logs.waitLine(t, "will not be restarted until its binary or settings change", "plugin=fx", "plugin dir")

	// Any change of its file is another try, a chmod included (it fails the same way).
	if err := os.Chmod(filepath.Join(dir, "fx"), 0o750); err != nil {
		t.Fatal(err)
	}
	waitLines(t, logs, 2, "will not be restarted until its binary or settings change", "plugin=fx")

	moveIn(t, dir, "fx")
	snap = waitSnapshot(t, m, "fx running the real plugin", healthIs(device.HealthHealthy, "d0"))
	if ps := pluginOf(snap, "fx"); ps.Status != device.PluginRunning || ps.LastError != "" {
		t.Errorf("fx = %+v, want running without the old error", ps)
	}
}

// A plugin dir that is not there at start is one error naming it, not a watch that
// falls back to listing a dir that does not exist.
func TestPluginDirMissingAtStart(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "nope")
	cfg, logs := dirConfig(t, dir)
	m, err := New(cfg)
	if err == nil {
		shutdown(t, m)
		t.Fatal("New succeeded on a plugin dir that does not exist")
	}
	if !errors.Is(err, ErrNoPluginDir) || err.Error() != "plugin dir "+dir+": no such directory" {
		t.Errorf("New: %q (ErrNoPluginDir: %v), want %q", err, errors.Is(err, ErrNoPluginDir), "plugin dir "+dir+": no such directory")
	}
	if l := logs.lines("plugin dir"); len(l) > 0 {
		t.Errorf("logged about the plugin dir besides the error: %q", l)
	}
}

func TestPluginDirRemovedAndMadeAgain(t *testing.T) {
	dir := pluginDir(t)
	copyIn(t, dir, "fx")
	cfg, logs := dirConfig(t, dir)
	cfg.PluginDirRescan = 100 * time.Millisecond
	m := startDirManager(t, cfg)
	waitSnapshot(t, m, "fx", healthIs(device.HealthHealthy, "w0"))

	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	waitSnapshot(t, m, "fx stopped with its dir", func(s device.Snapshot) bool { return !hasPlugin(s, "fx") })
	logs.waitLine(t, "[WARN]", "plugin dir no longer watched") // removed, or replaced: whichever the watcher saw first
	logs.waitLine(t, "[ERROR]", "plugin dir is gone; the plugins from it are stopped")

	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	logs.waitLine(t, "watching the plugin dir again")
	copyIn(t, dir, "fx")
	waitSnapshot(t, m, "fx back", healthIs(device.HealthHealthy, "w0", "w1"))
}

func TestPluginDirReserveOfAPluginRemovedMidCall(t *testing.T) {
	dir := pluginDir(t)
	copyIn(t, dir, "hang")
	cfg, _ := dirConfig(t, dir)
	cfg.ReserveTimeout = time.Minute
	cfg.Plugins = map[string]PluginConfig{"hang": {ConfigJSON: fixtureplugin.Config{Groups: widgets("hang", "h0"), ReserveHang: true}.JSON()}}
	m := startDirManager(t, cfg)
	waitSnapshot(t, m, "h0", healthIs(device.HealthHealthy, "h0"))

	type result struct {
		r   device.Reservation
		err error
	}
	done := make(chan result, 1)
	go func() {
		r, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "job-1", Group: widgetKey("hang"), DeviceIDs: []string{"h0"}})
		done <- result{r, err}
	}()
	// The call is under way (the fixture hangs in it) when the binary goes.
	claimed := time.NewTicker(5 * time.Millisecond)
	defer claimed.Stop()
	deadline := time.NewTimer(testwait.Timeout)
	defer deadline.Stop()
	for !isClaimed(m, "h0") {
		select {
		case <-claimed.C:
		case res := <-done:
			t.Fatalf("Reserve returned before the plugin was removed: %+v, %v", res.r, res.err)
		case <-deadline.C:
			t.Fatal("Reserve never claimed h0")
		}
	}
	if err := os.Remove(filepath.Join(dir, "hang")); err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-done:
		if !errors.Is(res.err, device.ErrPluginUnavailable) {
			t.Errorf("Reserve on a plugin removed mid-call: %+v, %v; want ErrPluginUnavailable", res.r, res.err)
		}
	case <-time.After(testwait.Timeout):
		t.Fatal("Reserve still waiting on a removed plugin")
	}
	if all, _ := m.Reservations(context.Background(), device.ReservationFilter{}); len(all) != 0 {
		t.Errorf("reservations after a failed Reserve: %+v, want none", all)
	}
}

// waitLines waits until n log lines hold every one of subs.
func waitLines(t *testing.T, r *logRecorder, n int, subs ...string) {
	t.Helper()
	deadline := time.NewTimer(testwait.Timeout)
	defer deadline.Stop()
	for {
		changed := r.Changed()
		if len(r.lines(subs...)) >= n {
			return
		}
		select {
		case <-changed:
		case <-deadline.C:
			t.Fatalf("%d log lines with %q within %v, want %d; log:\n%s", len(r.lines(subs...)), subs, testwait.Timeout, n, r.String())
		}
	}
}

// applied waits until the change of the plugin set under way (if any) is done: the
// plugins it stops have stopped.
func applied(m *Manager) {
	m.reconfMu.Lock()
	defer m.reconfMu.Unlock()
}

// isClaimed reports whether a Reserve of id is in flight.
func isClaimed(m *Manager, id string) bool {
	m.claimMu.Lock()
	defer m.claimMu.Unlock()
	_, ok := m.claims[id]
	return ok
}

// BenchmarkPluginDirDropIn measures drop-in to devices visible: the fixture binary
// written into a watched plugin dir (default settle period), then the time until its
// devices are in the inventory, healthy; then it is removed again.
func BenchmarkPluginDirDropIn(b *testing.B) {
	dir := pluginDir(b)
	cfg, _ := testConfig(b)
	cfg.PluginDir = dir
	m, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer shutdown(b, m)
	ctx := context.Background()
	var total, worst time.Duration
	for b.Loop() {
		watch, cancel := watchCtx(ctx, m)
		complete := copyIn(b, dir, "fx")
		waitSnap(b, watch, func(s device.Snapshot) bool { return healthIs(device.HealthHealthy, "w0", "w1")(s) })
		took := time.Since(complete)
		total += took
		worst = max(worst, took)
		if err := os.Remove(filepath.Join(dir, "fx")); err != nil {
			b.Fatal(err)
		}
		waitSnap(b, watch, func(s device.Snapshot) bool { return !hasPlugin(s, "fx") })
		cancel()
	}
	b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "ms-to-visible")
	b.ReportMetric(float64(worst.Milliseconds()), "ms-worst")
}

func watchCtx(ctx context.Context, m *Manager) (<-chan device.Snapshot, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(ctx, testwait.Timeout)
	return m.Watch(ctx), cancel
}

func waitSnap(b *testing.B, ch <-chan device.Snapshot, ok func(device.Snapshot) bool) {
	b.Helper()
	for s := range ch {
		if ok(s) {
			return
		}
	}
	b.Fatal("watch ended before the snapshot waited for")
}
