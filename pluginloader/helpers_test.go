package pluginloader_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"

	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

var (
	// fixtureBin is the fixture plugin binary, built once in TestMain.
	fixtureBin string
	// nvidiaBin is the nvidia-example binary, or "" with nvidiaSkip saying why.
	nvidiaBin  string
	nvidiaSkip string
)

func TestMain(m *testing.M) {
	if bin := os.Getenv(hostModeEnv); bin != "" {
		os.Exit(runAsHost(bin))
	}
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "pluginloader-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)

	fixtureBin, err = fixtureplugin.Build(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	nvidiaBin, nvidiaSkip = buildNvidia(dir)

	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutine leak:", err)
			return 1
		}
	}
	return code
}

// buildNvidia builds ./plugins/nvidia-example when it is there (another change adds it).
func buildNvidia(dir string) (bin, skip string) {
	if _, err := os.Stat(filepath.Join("..", "plugins", "nvidia-example", "main.go")); err != nil {
		return "", "plugins/nvidia-example does not exist in this tree yet"
	}
	bin, err := fixtureplugin.BuildPackage(dir, "nvidia-example", "github.com/devicehost/devicehost/plugins/nvidia-example")
	if err != nil {
		return "", fmt.Sprintf("plugins/nvidia-example does not build: %v", err)
	}
	return bin, ""
}

// testContext is bounded well inside the test binary's timeout, so a hang fails one test.
func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// hangDeadline is a context for a call that must end on its own, by a deadline or a
// kill of the code under test: 60s, far beyond what such a call takes on a loaded
// machine and far short of the 1000s sleeps a test's processes hang in.
func hangDeadline(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// returnsBefore runs call on a goroutine of its own and fails the test if it has not
// returned when ctx ends. A call that hangs is left running.
func returnsBefore(t *testing.T, ctx context.Context, what string, call func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); call() }()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatalf("%s has not returned: %v", what, context.Cause(ctx))
	}
}

// testLogger logs to the test's output at DEBUG, named "host".
func testLogger(t *testing.T) hclog.Logger {
	t.Helper()
	return hclog.New(&hclog.LoggerOptions{Name: "host", Level: hclog.Debug, Output: t.Output()})
}

// fixtureBinary is the fixture binary as Discover would return it.
func fixtureBinary() pluginloader.Binary {
	return pluginloader.Binary{Name: fixtureplugin.Name, Path: fixtureBin}
}

// launch launches bin with opts (a test logger unless opts has one) and kills it in
// cleanup.
func launch(t *testing.T, bin pluginloader.Binary, opts pluginloader.Options) *pluginloader.Plugin {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = testLogger(t)
	}
	p, err := pluginloader.Launch(testContext(t), bin, opts)
	if err != nil {
		t.Fatalf("Launch %s: %v", bin.Name, err)
	}
	t.Cleanup(func() { p.Kill(context.Background()) })
	return p
}

// launchFixture launches the fixture binary with cfg as its config block.
func launchFixture(t *testing.T, cfg fixtureplugin.Config, opts pluginloader.Options) *pluginloader.Plugin {
	t.Helper()
	opts.ConfigJSON = cfg.JSON()
	return launch(t, fixtureBinary(), opts)
}

// copyBinary copies src into dir as name with mode perm, and returns the new path.
func copyBinary(t *testing.T, src, dir, name string, perm os.FileMode) string {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, name)
	if err := os.WriteFile(dst, b, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dst, perm); err != nil { // not subject to the umask
		t.Fatal(err)
	}
	return dst
}

// waitContext bounds a wait for something that takes milliseconds when it works.
func waitContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}
