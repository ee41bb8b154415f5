// Command devicehost-plugin-nomad is a devicehost plugin that runs one unmodified Nomad
// device plugin binary (see package adapter): copy it into devicehost's plugin dir under
// the name of its plugin block, once per Nomad plugin, and name the Nomad binary in that
// block's nomad_plugin. When the Nomad plugin exits unexpectedly this process exits with
// status 1, and devicehost restarts both with its backoff. See docs/nomad.md.
package main

import (
	"os"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/integrations/nomad/adapter"
)

func main() {
	log := deviceplugin.Logger()
	a := adapter.New(adapter.Options{
		Logger: log,
		OnExit: func(error) { os.Exit(1) },
	})
	deviceplugin.Serve(a)
	a.Close()
}
