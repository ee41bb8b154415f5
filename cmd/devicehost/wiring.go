package main

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/manager"
	"github.com/devicehost/devicehost/manager/device"
	"github.com/devicehost/devicehost/pluginloader"
)

// managerFactory returns the factory of the real device manager for the agent's
// configuration. It is the only place the agent depends on package manager; the rest
// speaks device.Manager, so tests run the agent on a fake. onCommit, when set, is told
// of every ledger commit (the metrics' ObserveLedgerCommit).
func managerFactory(cfg agentConfig, onCommit func(time.Duration, int)) device.Factory {
	return func(log hclog.Logger) (device.Manager, error) {
		m, err := newManager(cfg, log, onCommit)
		if err != nil {
			return nil, err
		}
		return m, nil
	}
}

// pluginSetter is what of the real manager a reload needs: *manager.Manager has it.
type pluginSetter interface {
	SetPlugins(map[string]manager.PluginConfig) error
}

// applyPlugins hands cfg's plugin blocks to a running manager (see manager.SetPlugins).
func applyPlugins(mgr device.Manager, cfg agentConfig) error {
	ps, ok := mgr.(pluginSetter)
	if !ok {
		return fmt.Errorf("the device manager (%T) does not take plugin settings while it runs", mgr)
	}
	return ps.SetPlugins(pluginConfigs(cfg))
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
