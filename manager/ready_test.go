package manager

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/testwait"
)

// These tests check that one broken plugin does not hold the node's readiness for
// ReadyTimeout, and that a configured plugin without a binary is listed as
// failed without holding it either.

// readyWithin waits for m's Ready for up to d and fails the test otherwise.
func readyWithin(t *testing.T, m *Manager, d time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	select {
	case <-m.Ready():
		return time.Since(start)
	case <-time.After(d):
		t.Fatalf("not ready within %v (ReadyTimeout is an hour): a broken plugin holds readiness", d)
		return 0
	}
}

func TestBrokenPluginDoesNotHoldReady(t *testing.T) {
	good := fixture{name: "good", cfg: fixtureplugin.Config{Groups: widgets("good", "g0")}}
	tests := []struct {
		name        string
		broken      fixture
		process     bool          // a real process, else in-process
		fpTimeout   time.Duration // FingerprintTimeout
		wantErr     string        // in the broken plugin's last error
		wantRunning bool          // the broken plugin is still running (its answers refused)
	}{
		{name: "crash at start", process: true,
			broken: fixture{name: "broken", cfg: fixtureplugin.Config{Groups: widgets("broken", "b0"),
				ExitAfter: fixtureplugin.Duration(time.Millisecond), FingerprintDelay: fixtureplugin.Duration(time.Minute)}},
			wantErr: "exit status 3"},
		{name: "refused handshake", process: true,
			broken:  fixture{name: "broken", env: []string{"FIXTURE_PROTOCOL=2"}},
			wantErr: "launch"},
		{name: "only invalid fingerprints",
			broken:  fixture{name: "broken", cfg: fixtureplugin.Config{Groups: widgets("broken", "b0"), FingerprintInvalid: true}},
			wantErr: "fingerprint rejected", wantRunning: true},
		{name: "fingerprint error",
			broken:  fixture{name: "broken", cfg: fixtureplugin.Config{FingerprintError: "no NVML"}},
			wantErr: "no NVML"},
		{name: "no first fingerprint in time", fpTimeout: 300 * time.Millisecond,
			broken:  fixture{name: "broken", cfg: fixtureplugin.Config{FingerprintHang: true}},
			wantErr: "no fingerprint within 300ms"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, _ := testConfig(t)
			cfg.ReadyTimeout = time.Hour
			cfg.FingerprintTimeout = time.Hour // only the deadline a case sets may settle it
			if tc.fpTimeout > 0 {
				cfg.FingerprintTimeout = tc.fpTimeout
			}
			cfg.RestartBaseDelay, cfg.RestartMaxDelay = time.Minute, time.Minute // one attempt in the test's time
			var m *Manager
			if tc.process {
				m = startManager(t, cfg, good, tc.broken)
			} else {
				m, _ = startFixtures(t, cfg, good, tc.broken)
			}
			took := readyWithin(t, m, testwait.Timeout)
			t.Logf("ready after %v", took)
			snap := m.Snapshot()
			if st := snap.State.Devices["g0"]; st.Health != device.HealthHealthy {
				t.Errorf("g0 at Ready = %+v, want healthy", st)
			}
			ps := pluginOf(snap, "broken")
			if ps.Status == device.PluginRunning != tc.wantRunning || !strings.Contains(ps.LastError, tc.wantErr) {
				t.Errorf("broken plugin at Ready = %+v, want running %v with a last error about %q", ps, tc.wantRunning, tc.wantErr)
			}
		})
	}
}

// TestHungPluginHoldsReadyOnlyUntilItsOwnDeadline: a plugin hung at start holds
// readiness until its start deadline, not ReadyTimeout.
func TestHungPluginHoldsReadyOnlyUntilItsOwnDeadline(t *testing.T) {
	healthy := newFakeDevices("healthy", group("acme", "gpu", "A1", "a0"))
	stuck := newFakeDevices("stuck", group("acme", "gpu", "S1", "s0"))
	stuck.hangStart = true
	cfg, _ := testConfig(t)
	cfg.ReadyTimeout = time.Hour
	cfg.StartTimeout = 300 * time.Millisecond
	cfg.RestartBaseDelay, cfg.RestartMaxDelay = time.Minute, time.Minute
	m, _ := startInprocManager(t, cfg, healthy, stuck)
	took := readyWithin(t, m, testwait.Timeout)
	// A deadline kept, not speed: a lower bound, which load only makes easier to meet
	// (half the deadline, since the launch began before readyWithin's clock did).
	if took < cfg.StartTimeout/2 {
		t.Errorf("ready after %v, before the hung plugin's start deadline %v", took, cfg.StartTimeout)
	}
	if ps := pluginOf(m.Snapshot(), "stuck"); ps.Status != device.PluginRestarting || !strings.Contains(ps.LastError, "deadline exceeded") {
		t.Errorf("stuck at Ready = %+v, want restarting after its start deadline", ps)
	}
}

// TestConfiguredPluginWithoutBinaryIsListedAsFailed: a plugin block whose binary is not
// in the plugin dir (a typo, say) shows in ListPlugins as failed, and holds nothing.
func TestConfiguredPluginWithoutBinaryIsListedAsFailed(t *testing.T) {
	bin, err := os.ReadFile(fixtureBin)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "found"), bin, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg, logs := testConfig(t)
	cfg.ReadyTimeout = time.Hour
	cfg.PluginDir = dir
	cfg.Plugins = map[string]PluginConfig{
		"found":   {ConfigJSON: fixtureplugin.Config{Groups: widgets("found", "d0")}.JSON()},
		"widgets": {ConfigJSON: []byte(`{}`)},
	}
	m, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { shutdown(t, m) })
	readyWithin(t, m, testwait.Timeout)
	snap := waitSnapshot(t, m, "d0", healthIs(device.HealthHealthy, "d0"))
	ps := pluginOf(snap, "widgets")
	want := device.PluginState{Name: "widgets", Path: filepath.Join(dir, "widgets"), Status: device.PluginFailed,
		LastError: "no such plugin binary in " + dir, LastErrorAt: ps.LastErrorAt}
	if ps != want || ps.LastErrorAt.IsZero() {
		t.Errorf("widgets = %+v, want %+v", ps, want)
	}
	logs.waitLine(t, "[ERROR]", "plugin configured but not found", "plugin=widgets", dir)
}
