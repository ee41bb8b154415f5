package main

import (
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

		Plugins: make(map[string]manager.PluginConfig, len(cfg.Plugins)),
	}
	for name, p := range cfg.Plugins {
		mc.Plugins[name] = manager.PluginConfig{
			ConfigJSON: p.ConfigJSON,
			SHA256:     p.SHA256,
			Env:        p.Env,
			InheritEnv: p.InheritEnv,
			Reattach:   p.Reattach,
		}
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
	return manager.New(mc)
}
