package main

import (
	"fmt"
	"os"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/manager"
	"github.com/devicehost/devicehost/pluginloader"
)

// newManager builds the real device manager from the agent's configuration. It is the
// only place the agent depends on package manager; the rest speaks device.Manager.
func newManager(cfg agentConfig, log hclog.Logger) (*manager.Manager, error) {
	mc := manager.Config{
		Logger:         log,
		PluginDir:      cfg.PluginDir,
		StateDir:       cfg.StateDir,
		StatsInterval:  cfg.StatsInterval,
		ReserveTimeout: cfg.ReserveTimeout,
		StartTimeout:   cfg.StartTimeout,
		ReadyTimeout:   cfg.ReadyTimeout,
		Plugins:        make(map[string]manager.PluginConfig, len(cfg.Plugins)),
	}
	for name, p := range cfg.Plugins {
		mc.Plugins[name] = manager.PluginConfig{
			ConfigJSON: p.ConfigJSON,
			SHA256:     p.SHA256,
			Env:        p.Env,
			InheritEnv: p.InheritEnv,
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
