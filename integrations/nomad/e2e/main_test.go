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
	code := m.Run()
	cleanupBinaries()
	if code == 0 {
		if err := goleak.Find(ignoreNomad...); err != nil {
			os.Stderr.WriteString("goleak: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}

// ignoreNomad lists goroutines of Nomad's code that outlive the tests.
var ignoreNomad []goleak.Option
