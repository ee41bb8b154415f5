package e2e

import (
	"os"
	"runtime"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if runtime.GOOS != "linux" {
		// The tests find plugin processes in /proc to SIGKILL them.
		os.Exit(0)
	}
	goleak.VerifyTestMain(m,
		// Nomad v1.6.3's device plugin client (run here by Nomad's own device manager)
		// sends a stream's final error to its channel without watching the request's
		// context, so when the device manager has stopped reading at shutdown that
		// goroutine stays blocked: Nomad's leak, not ours (our adapter, which uses the
		// same client, drains the channel; its tests check that with goleak).
		goleak.IgnoreTopFunction("github.com/hashicorp/nomad/plugins/device.(*devicePluginClient).handleFingerprint"),
		goleak.IgnoreTopFunction("github.com/hashicorp/nomad/plugins/device.(*devicePluginClient).handleStats"),
		goleak.Cleanup(func(code int) {
			cleanupBinaries()
			os.Exit(code)
		}))
}
