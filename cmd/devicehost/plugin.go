package main

import (
	"context"

	"github.com/devicehost/devicehost/integrations/kubernetes/hosted"
	"github.com/devicehost/devicehost/plugins/hostdev/hostdev"
	"github.com/devicehost/devicehost/plugins/nvidia-example/nvidia"
)

// bundledPlugins are the plugins built into the devicehost binary, served by
// `devicehost plugin <name>` when the agent re-executes itself (agent -dev: the dev
// plugin always, the others when the config file has a plugin block for them; any
// agent: the host of the kubelet's device plugins when the config file has a
// kubernetes_device_plugins block).
var bundledPlugins = map[string]func(){
	"nvidia-example": nvidia.Main,
	hostdev.Name:     hostdev.Main,
	hosted.Name:      hosted.Main,
}

// devPluginName is the bundled plugin agent -dev runs, and devPluginConfig its config.
const (
	devPluginName   = "nvidia-example"
	devPluginConfig = `{"simulate":"dgxh100"}`
)

// runPlugin serves a bundled plugin over go-plugin on stdin/stdout until the host is
// done with it. It is not meant to be run by hand: go-plugin refuses to serve unless a
// host launched it.
func runPlugin(_ context.Context, _ *cmdEnv, args []string) error {
	if len(args) != 1 {
		return usagef("want exactly one plugin name")
	}
	serve, ok := bundledPlugins[args[0]]
	if !ok {
		return usagef("no bundled plugin %q", args[0])
	}
	serve()
	return nil
}
