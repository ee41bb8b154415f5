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
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		cleanupBinaries()
		os.Exit(code)
	}))
}
