package manager

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/testwait"
)

func TestSetPluginsAppliesAddedChangedAndRemovedSettings(t *testing.T) {
	cfg, logs := durableConfig(t)
	cfg.Binaries = []pluginloader.Binary{{Name: "a", Path: fixtureBin}, {Name: "b", Path: fixtureBin}}
	cfg.Plugins = map[string]PluginConfig{"a": fixtureCfg("a", "a0"), "b": fixtureCfg("b", "b0")}
	m := startDirManager(t, cfg)
	snap := waitSnapshot(t, m, "a0, b0", healthIs(device.HealthHealthy, "a0", "b0"))
	oldA, oldB := groupPID(snap, "a"), groupPID(snap, "b")
	ctx := context.Background()
	r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-1", Group: widgetKey("a"), DeviceIDs: []string{"a0"}})
	if err != nil {
		t.Fatal(err)
	}

	// a changed, b's block removed (it runs on with no config: the fixture's default
	// devices), c added without a binary.
	err = m.SetPlugins(map[string]PluginConfig{"a": fixtureCfg("a", "a0", "a1"), "c": fixtureCfg("c", "c0")})
	if err != nil {
		t.Fatalf("SetPlugins: %v", err)
	}
	snap = waitSnapshot(t, m, "a restarted with a1, b with the default devices", func(s device.Snapshot) bool {
		return healthIs(device.HealthHealthy, "a0", "a1", "w0", "w1")(s) && !inInventory(s, "b0")
	})
	if groupPID(snap, "a") == oldA {
		t.Errorf("a's process %d was not restarted for its new settings", oldA)
	}
	if p := pid(t, m, "b"); int64(p) == oldB {
		t.Errorf("b's process %d was not restarted without its block", oldB)
	}
	if h := snap.State.Devices["a0"].Holder; h == nil || h.ReservationID != r.ID {
		t.Errorf("a0 holder after the restart = %v, want reservation %s", h, r.ID)
	}
	if ps := pluginOf(snap, "c"); ps.Status != device.PluginFailed || !strings.Contains(ps.LastError, "no such plugin binary") {
		t.Errorf("c = %+v, want listed as failed without a binary", ps)
	}
	logs.waitLine(t, "restarting plugin", "plugin=a", `reason="plugin settings changed"`)
	logs.waitLine(t, "restarting plugin", "plugin=b", `reason="plugin settings changed"`)
	select {
	case <-m.Ready():
	default:
		t.Error("Ready open again after plugins were restarted and added")
	}

	// The same settings again change nothing; c's block gone takes c off the list.
	pidA := pid(t, m, "a")
	if err := m.SetPlugins(map[string]PluginConfig{"a": fixtureCfg("a", "a0", "a1")}); err != nil {
		t.Fatal(err)
	}
	snap = waitSnapshot(t, m, "c gone", func(s device.Snapshot) bool { return !hasPlugin(s, "c") })
	if p := pid(t, m, "a"); p != pidA {
		t.Errorf("a restarted (pid %d, then %d) by the same settings", pidA, p)
	}

}

func TestSetPluginsRefusesWhatItCannotHonour(t *testing.T) {
	cfg, _ := testConfig(t)
	m := startManager(t, cfg, fixture{name: "a", cfg: fixtureplugin.Config{Groups: widgets("a", "a0")}})
	waitSnapshot(t, m, "a0", healthIs(device.HealthHealthy, "a0"))
	before := pid(t, m, "a")
	err := m.SetPlugins(map[string]PluginConfig{"a": {Reattach: true}})
	if err == nil || !strings.Contains(err.Error(), `plugin "a": Reattach needs a StateDir`) {
		t.Errorf("SetPlugins with Reattach and no StateDir: %v, want it refused naming the plugin", err)
	}
	if after := pid(t, m, "a"); after != before {
		t.Errorf("a refused change restarted the plugin: pid %d, then %d", before, after)
	}

	shutdown(t, m)
	if err := m.SetPlugins(nil); !errors.Is(err, device.ErrShuttingDown) {
		t.Errorf("SetPlugins after Shutdown: %v, want ErrShuttingDown", err)
	}
}

func TestSetPluginsGivesAFailedPluginAnotherTry(t *testing.T) {
	cfg, _ := testConfig(t)
	cfg.ReadyTimeout = testwait.Timeout
	m := startManager(t, cfg, fixture{name: "picky", cfg: fixtureplugin.Config{RejectConfig: "simulate: no such machine"}})
	waitSnapshot(t, m, "picky failed", func(s device.Snapshot) bool { return pluginOf(s, "picky").Status == device.PluginFailed })
	if err := m.SetPlugins(map[string]PluginConfig{"picky": {ConfigJSON: fixtureplugin.Config{Groups: widgets("picky", "p0")}.JSON()}}); err != nil {
		t.Fatal(err)
	}
	snap := waitSnapshot(t, m, "picky running with its fixed config", healthIs(device.HealthHealthy, "p0"))
	if ps := pluginOf(snap, "picky"); ps.Status != device.PluginRunning || ps.LastError != "" {
		t.Errorf("picky = %+v, want running with no last error", ps)
	}
}
