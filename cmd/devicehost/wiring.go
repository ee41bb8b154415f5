package main

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager"
	"github.com/devicehost/devicehost/pluginloader"
)

// realManager wires the agent to the real device manager: factory builds it for the
// agent's configuration, and setPlugins hands a reload's plugin blocks to the one it
// built, which is what a reload needs of it beyond device.Manager. This is the only
// place the agent depends on package manager; the rest speaks device.Manager, so tests
// run the agent on a fake. Used from serveAgent's goroutine only: it calls factory at
// start and a reload's setPlugins between its other events.
type realManager struct {
	cfg      agentConfig
	onCommit func(time.Duration, int) // told of every ledger commit when set (the metrics' ObserveLedgerCommit)
	built    *manager.Manager         // what factory built; nil before
}

// factory is a device.Factory of the real manager.
func (r *realManager) factory(log hclog.Logger) (device.Manager, error) {
	m, err := newManager(r.cfg, log, r.onCommit)
	if err != nil {
		return nil, err
	}
	r.built = m
	return m, nil
}

// setPlugins hands cfg's plugin blocks to the manager factory built (see
// manager.SetPlugins).
func (r *realManager) setPlugins(cfg agentConfig) error {
	if r.built == nil {
		return errors.New("the device manager has not started")
	}
	return r.built.SetPlugins(pluginConfigs(cfg))
}

// pluginConfigs maps the config file's plugin blocks onto the manager's settings.
func pluginConfigs(cfg agentConfig) map[string]manager.PluginConfig {
	out := make(map[string]manager.PluginConfig, len(cfg.Plugins))
	for name, p := range cfg.Plugins {
		out[name] = manager.PluginConfig{
			ConfigJSON: p.ConfigJSON,
			SHA256:     p.SHA256,
			Env:        p.Env,
			InheritEnv: p.InheritEnv,
			Reattach:   p.Reattach,
			DeviceIDs:  p.DeviceIDs,
		}
	}
	return out
}

// newManager builds the real device manager. log is the root logger: the manager names
// its own lines "manager" and each plugin's after the plugin.
func newManager(cfg agentConfig, log hclog.Logger, onCommit func(time.Duration, int)) (*manager.Manager, error) {
	mc := manager.Config{
		Logger:         log,
		OnLedgerCommit: onCommit,
		PluginDir:      cfg.PluginDir,
		StateDir:       cfg.StateDir,
		StatsInterval:  cfg.StatsInterval,
		ReserveTimeout: cfg.ReserveTimeout,
		StartTimeout:   cfg.StartTimeout,
		ReadyTimeout:   cfg.ReadyTimeout,

		GCInterval:         cfg.GCInterval,
		GCMaxReservations:  cfg.GCMaxReservations,
		GCParallelDestroys: cfg.GCParallelDestroys,

		Plugins: pluginConfigs(cfg),
	}
	if len(cfg.Bundled) > 0 {
		self, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("find this executable to run bundled plugins: %w", err)
		}
		for _, name := range cfg.Bundled {
			mc.Binaries = append(mc.Binaries, pluginloader.Binary{
				Name: name,
				Path: self,
				Args: []string{"plugin", name},
			})
		}
	}
	m, err := manager.New(mc)
	if errors.Is(err, manager.ErrNoPluginDir) {
		return nil, fmt.Errorf("plugin_dir %s (-plugin-dir) does not exist: create it, or set plugin_dir in the config file or -plugin-dir to the directory of the plugin executables", cfg.PluginDir)
	}
	return m, err
}
