package manager

import (
	"fmt"
	"io"
	"os"
	"testing"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"

	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

// fixtureBin is the fixture plugin binary, built once for the real-process tests.
var fixtureBin string

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "manager-fixture-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if fixtureBin, err = fixtureplugin.Build(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	// go-plugin's TestPluginGRPCConn (deviceplugintest, every in-process launch) logs
	// at DEBUG to hclog's default output, stderr: a few lines per launch that bury a
	// failure's own output. Nothing here reads that output.
	hclog.DefaultOutput = io.Discard
	if code := m.Run(); code != 0 {
		return code
	}
	// Every test shuts its manager down: nothing it started may be left running.
	if err := goleak.Find(); err != nil {
		fmt.Fprintf(os.Stderr, "goroutines leaked: %v\n", err)
		return 1
	}
	return 0
}
