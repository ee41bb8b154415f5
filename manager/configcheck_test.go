package manager

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/supervise"
	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

// A new config the plugin rejects is refused before the running process is stopped
// for it: SetPlugins says which plugin and why, and the plugin serves on untouched.
func TestSetPluginsRefusesAConfigThePluginRejects(t *testing.T) {
	cfg, logs := testConfig(t)
	m := startManager(t, cfg, fixture{name: "a", cfg: fixtureplugin.Config{Groups: widgets("a", "a0")}})
	waitSnapshot(t, m, "a0", healthIs(device.HealthHealthy, "a0"))
	before := pid(t, m, "a")

	bad := fixtureplugin.Config{Groups: widgets("a", "a0"), RejectConfig: "widgets must be blue"}.JSON()
	err := m.SetPlugins(map[string]PluginConfig{"a": {ConfigJSON: bad}})
	var rej *ConfigRejectedError
	if !errors.As(err, &rej) || rej.Plugin != "a" || !errors.Is(err, pluginloader.ErrConfigRejected) ||
		!strings.Contains(err.Error(), "widgets must be blue") {
		t.Fatalf("SetPlugins with a config the plugin rejects: got %v, want a *ConfigRejectedError of plugin a with its message", err)
	}
	if after := pid(t, m, "a"); after != before {
		t.Errorf("a rejected config restarted the plugin: pid %d, then %d", before, after)
	}
	if got := logs.lines("[ERROR]"); len(got) > 0 {
		t.Errorf("ERROR lines for a refused config, which SetPlugins returns:\n%s", strings.Join(got, "\n"))
	}

	// The settings in force are the old ones: the same again changes nothing.
	if err := m.SetPlugins(map[string]PluginConfig{"a": {ConfigJSON: fixtureplugin.Config{Groups: widgets("a", "a0")}.JSON()}}); err != nil {
		t.Fatalf("SetPlugins with the running settings: %v", err)
	}
	if after := pid(t, m, "a"); after != before {
		t.Errorf("the running settings again restarted the plugin: pid %d, then %d", before, after)
	}
}

// A plugin that rejects its config at start is handed to OnConfigRejected, not logged
// as a failure, and is listed as failed.
func TestOnConfigRejectedAtStart(t *testing.T) {
	cfg, logs := testConfig(t)
	got := make(chan *ConfigRejectedError, 1)
	cfg.OnConfigRejected = func(e *ConfigRejectedError) { got <- e }
	m := startManager(t, cfg, fixture{name: "a", cfg: fixtureplugin.Config{Groups: widgets("a", "a0"), RejectConfig: "widgets must be blue"}})
	rej := <-got
	if rej.Plugin != "a" || !errors.Is(rej, pluginloader.ErrConfigRejected) || !strings.Contains(rej.Error(), "widgets must be blue") {
		t.Errorf("OnConfigRejected got %v (plugin %q), want plugin a's rejection with its message", rej, rej.Plugin)
	}
	var ce *pluginloader.ConfigError
	if !errors.As(rej, &ce) || ce.Message != "widgets must be blue" {
		t.Errorf("rejection %v: want a *pluginloader.ConfigError with the plugin's message", rej)
	}
	waitSnapshot(t, m, "a failed", func(s device.Snapshot) bool { return pluginOf(s, "a").Status == device.PluginFailed })
	if lines := logs.lines("plugin failed and will not be restarted"); len(lines) > 0 {
		t.Errorf("the rejection was logged too:\n%s", strings.Join(lines, "\n"))
	}
}

// launchCounter launches real plugin processes and counts the launches per plugin.
// Safe for concurrent use.
type launchCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *launchCounter) launch(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options) (supervise.Plugin, error) {
	c.mu.Lock()
	if c.n == nil {
		c.n = make(map[string]int)
	}
	c.n[bin.Name]++
	c.mu.Unlock()
	return supervise.LaunchProcess(ctx, bin, opts)
}

func (c *launchCounter) count(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[name]
}

// A reload's check asks the running process: no process is launched for it, whether
// the plugin rejects the new config (nothing restarts) or accepts it (one restart, on
// the new config).
func TestSetPluginsChecksOnTheRunningProcess(t *testing.T) {
	cfg, _ := testConfig(t)
	var lc launchCounter
	m := startWith(t, withFixtures(cfg, fixture{name: "a", cfg: fixtureplugin.Config{Groups: widgets("a", "a0")}}), lc.launch)
	waitSnapshot(t, m, "a0", healthIs(device.HealthHealthy, "a0"))
	if n := lc.count("a"); n != 1 {
		t.Fatalf("launches of a before the reload: %d, want 1", n)
	}

	bad := fixtureplugin.Config{Groups: widgets("a", "a0"), RejectConfig: "widgets must be blue"}.JSON()
	if err := m.SetPlugins(map[string]PluginConfig{"a": {ConfigJSON: bad}}); !errors.Is(err, pluginloader.ErrConfigRejected) {
		t.Fatalf("SetPlugins with a config the plugin rejects: got %v, want ErrConfigRejected", err)
	}
	if n := lc.count("a"); n != 1 {
		t.Errorf("launches of a after a refused reload: %d, want 1 (the check launched a process)", n)
	}

	good := fixtureplugin.Config{Groups: widgets("a", "a1")}.JSON()
	if err := m.SetPlugins(map[string]PluginConfig{"a": {ConfigJSON: good}}); err != nil {
		t.Fatalf("SetPlugins with a config the plugin accepts: %v", err)
	}
	waitSnapshot(t, m, "a1", healthIs(device.HealthHealthy, "a1"))
	if n := lc.count("a"); n != 2 {
		t.Errorf("launches of a after an accepted reload: %d, want 2 (the restart only)", n)
	}
}

// A plugin without CheckConfig (UNIMPLEMENTED) gets its new config applied as before
// the check existed: SetPlugins succeeds, the plugin restarts on it, and a rejection at
// that start goes to OnConfigRejected.
func TestSetPluginsAppliesAConfigThePluginCannotCheck(t *testing.T) {
	cfg, _ := testConfig(t)
	got := make(chan *ConfigRejectedError, 1)
	cfg.OnConfigRejected = func(e *ConfigRejectedError) { got <- e }
	env := []string{"FIXTURE_NO_CHECK_CONFIG=1"}
	m := startManager(t, cfg, fixture{name: "a", cfg: fixtureplugin.Config{Groups: widgets("a", "a0")}, env: env})
	waitSnapshot(t, m, "a0", healthIs(device.HealthHealthy, "a0"))
	before := pid(t, m, "a")

	good := fixtureplugin.Config{Groups: widgets("a", "a1")}.JSON()
	if err := m.SetPlugins(map[string]PluginConfig{"a": {ConfigJSON: good, Env: env}}); err != nil {
		t.Fatalf("SetPlugins with a new config: %v", err)
	}
	waitSnapshot(t, m, "a1", healthIs(device.HealthHealthy, "a1"))
	if after := pid(t, m, "a"); after == before {
		t.Errorf("the new config was not applied: the plugin runs on as pid %d", before)
	}

	bad := fixtureplugin.Config{Groups: widgets("a", "a1"), RejectConfig: "widgets must be blue"}.JSON()
	if err := m.SetPlugins(map[string]PluginConfig{"a": {ConfigJSON: bad, Env: env}}); err != nil {
		t.Fatalf("SetPlugins with a config the plugin cannot check: got %v, want nil (applied unchecked)", err)
	}
	rej := <-got
	if rej.Plugin != "a" || !strings.Contains(rej.Error(), "widgets must be blue") {
		t.Errorf("OnConfigRejected got %v (plugin %q), want plugin a's rejection at its start", rej, rej.Plugin)
	}
	waitSnapshot(t, m, "a failed", func(s device.Snapshot) bool { return pluginOf(s, "a").Status == device.PluginFailed })
}
