package manager

import (
	"context"
	"errors"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/inventory"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/testwait"
)

// These tests check what a failing plugin leaves in answers and in the log,
// and how fast a plugin killed after it served is back.

// goPluginNoise is the kind of error go-plugin makes of a plugin killed before its
// handshake: 16 lines, tabs, and a socket path.
var goPluginNoise = "Unrecognized remote plugin message: \n\nThis usually means\n" +
	strings.Repeat("\tthe plugin was not compiled for this architecture, or the socket /tmp/plugin1234567 is gone\n", 13) +
	"Failed to read any lines from plugin's stdout"

// checkLine fails t unless s is one line of at most limit bytes.
func checkLine(t *testing.T, what, s string, limit int) {
	t.Helper()
	if strings.ContainsAny(s, "\n\r\t") || len(s) > limit || s == "" {
		t.Errorf("%s = %q (%d bytes), want one non-empty line of at most %d bytes", what, s, len(s), limit)
	}
}

// TestPluginErrorsAreOneBoundedLine: a plugin that dies with a 16-line reason leaves one
// line of at most 300 bytes as its last error, its devices' reason, and in the
// UNAVAILABLE error of a Reserve of its devices.
func TestPluginErrorsAreOneBoundedLine(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	cfg, _ := testConfig(t)
	cfg.RestartBaseDelay, cfg.RestartMaxDelay = time.Minute, time.Minute // stays down
	m, l := startInprocManager(t, cfg, alpha)
	waitSnapshot(t, m, "a0", healthIs(device.HealthHealthy, "a0"))
	p, _ := l.latest("alpha")
	p.exit(goPluginNoise)
	snap := waitSnapshot(t, m, "alpha restarting", func(s device.Snapshot) bool { return pluginOf(s, "alpha").Status == device.PluginRestarting })

	last := pluginOf(snap, "alpha").LastError
	checkLine(t, "LastError", last, inventory.MaxErrorLen)
	if !strings.HasPrefix(last, "plugin exited: Unrecognized remote plugin message:; This usually means; the plugin was not compiled") || !strings.HasSuffix(last, "...") {
		t.Errorf("LastError = %q, want the lines joined with \"; \", cut with ...", last)
	}
	checkLine(t, "a0 reason", snap.State.Devices["a0"].Reason, inventory.MaxErrorLen)
	_, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "o", Group: acmeA1, DeviceIDs: []string{"a0"}})
	if !errors.Is(err, device.ErrPluginUnavailable) {
		t.Fatalf("Reserve on the dead plugin = %v, want ErrPluginUnavailable", err)
	}
	checkLine(t, "Reserve error", err.Error(), inventory.MaxErrorLen+100)
}

// TestPluginFailingTheSameWayIsLoggedOncePerChange: a plugin whose launch fails with
// the same error again and again is logged once, then with a count when the error
// changes, and when it serves again.
func TestPluginFailingTheSameWayIsLoggedOncePerChange(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	alpha.launchErr = "plugin binary gone\n\tsecond line"
	cfg, logs := testConfig(t)
	cfg.RestartBaseDelay, cfg.RestartMaxDelay = 5*time.Millisecond, 10*time.Millisecond
	m, _ := startInprocManager(t, cfg, alpha)
	waitSnapshot(t, m, "5 restarts", func(s device.Snapshot) bool { return pluginOf(s, "alpha").Restarts >= 5 })
	first := logs.lines("[WARN]", "plugin stopped; restarting", "plugin=alpha")
	if len(first) != 1 || !strings.Contains(first[0], `error="launch: plugin binary gone; second line"`) {
		t.Errorf("WARN lines for 5 identical stops = %q, want one, with the error on one line", first)
	}

	alpha.set(func(f *fakeDevices) { f.launchErr = "permission denied" })
	count := logs.waitLine(t, "[WARN]", "plugin stopped repeatedly with the same error", "plugin=alpha", "plugin binary gone")
	if n := timesIn(t, count); n < 5 {
		t.Errorf("count line %q, want times >= 5", count)
	}
	logs.waitLine(t, "[WARN]", "plugin stopped; restarting", "plugin=alpha", "permission denied")
	logs.waitLine(t, "[DEBUG]", "plugin stopped again with the same error", "plugin=alpha", "permission denied")

	alpha.set(func(f *fakeDevices) { f.launchErr = "" })
	up := logs.waitLine(t, "[INFO]", "plugin serving again after stopping repeatedly with the same error", "plugin=alpha", "permission denied")
	if n := timesIn(t, up); n < 2 {
		t.Errorf("recovery line %q, want times >= 2", up)
	}
	if n := len(logs.lines("[WARN]", "plugin stopped; restarting", "plugin=alpha")); n != 2 {
		t.Errorf("%d WARN stop lines for two distinct errors, want 2", n)
	}
}

// timesIn returns the times=N field of a log line.
func timesIn(t *testing.T, line string) int {
	t.Helper()
	m := regexp.MustCompile(`times=(\d+)`).FindStringSubmatch(line)
	if m == nil {
		t.Fatalf("no times= in %q", line)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// TestProcessKilledAfterServingIsBackAtOnce SIGKILLs a fixture process 6 times, each
// time after it served for over ServedReset: every restart is due after the base delay
// (±20%), not the doubled backoff of a plugin that never served (0.2s, 0.4s ... 6.4s). It reports
// the time from the last kill to every device healthy.
func TestProcessKilledAfterServingIsBackAtOnce(t *testing.T) {
	cfg, _ := testConfig(t)
	cfg.RestartBaseDelay, cfg.RestartMaxDelay = DefaultRestartBaseDelay, DefaultRestartMaxDelay
	cfg.StableRunReset, cfg.ServedReset = DefaultStableRunReset, DefaultServedReset
	m := startManager(t, cfg, fixture{name: "fx", cfg: fixtureplugin.Config{Groups: widgets("fx", "k0", "k1")}})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	watch := m.Watch(ctx)
	stats := m.WatchStats(ctx, 0)

	var killed time.Time
	for kill := 1; kill <= 6; kill++ {
		waitWithin(t, watch, testwait.Timeout, "k0, k1 healthy", healthIs(device.HealthHealthy, "k0", "k1"))
		// Serving for over ServedReset: the stats stream opens at the first fingerprint
		// and sends one message per StatsInterval (100ms), so seq 13 is 1.2s in.
		waitStats(t, stats, func(s device.StatsSnapshot) bool { return statValue(s, "k0", "seq") >= 13 }, "kill %d: 1.2s of stats", kill)
		killed = time.Now()
		if err := syscall.Kill(pid(t, m, "fx"), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		snap := waitWithin(t, watch, testwait.Timeout, "restarting", func(s device.Snapshot) bool {
			ps := pluginOf(s, "fx")
			return ps.Status == device.PluginRestarting && ps.Restarts == kill-1
		})
		ps := pluginOf(snap, "fx")
		if delay, most := ps.NextRetry.Sub(ps.LastErrorAt), cfg.RestartBaseDelay*12/10; delay > most {
			t.Errorf("kill %d: restart due after %v, want at most %v (the base delay): it served, so it inherits no backoff", kill, delay, most)
		}
	}
	waitWithin(t, watch, testwait.Timeout, "healthy after the last kill", healthIs(device.HealthHealthy, "k0", "k1"))
	t.Logf("every device healthy %v after the last of 6 SIGKILLs", time.Since(killed))
}
