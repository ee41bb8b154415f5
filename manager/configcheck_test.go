package manager

import (
	"errors"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

// A new config the plugin rejects is refused before the running process is stopped
// for it: SetPlugins says which plugin and why, and the plugin serves on untouched.
func TestSetPluginsRefusesAConfigThePluginRejects(t *testing.T) {
	cfg, logs := testConfig(t)
	m := startManager(t, cfg, fixture{name: "a", cfg: fixtureplugin.Config{Groups: widgets("a", "a0")}})
	waitFor(t, m, "a0", healthIs(device.HealthHealthy, "a0"))
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
	logs.waitLine(t, "stopping plugin after it rejected its config", "plugin=a")
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
	waitFor(t, m, "a failed", func(s device.Snapshot) bool { return pluginOf(s, "a").Status == device.PluginFailed })
	if lines := logs.lines("plugin failed and will not be restarted"); len(lines) > 0 {
		t.Errorf("the rejection was logged too:\n%s", strings.Join(lines, "\n"))
	}
}
