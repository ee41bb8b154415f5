// Command nomad-device-devicehost is a Nomad device plugin that forwards to a devicehost
// agent (see package shim). Put it in the Nomad client's plugin_dir; its config block,
// plugin "nomad-device-devicehost", is matched by this file name. See docs/nomad.md.
package main

import (
	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins"

	"github.com/devicehost/devicehost/integrations/nomad/shim"
)

func main() {
	var p *shim.Plugin
	plugins.Serve(func(log hclog.Logger) any {
		p = shim.New(log.Named(shim.Name))
		return p
	})
	if p != nil {
		p.Close()
	}
}
