// Package e2e proves the Nomad integration with real third-party code: Nomad's
// example device plugin under the real devicehost agent through the adapter, and
// Nomad's own client device manager driving nomad-device-devicehost against a real
// `devicehost agent -dev`. Every binary is built from source by the tests, once per
// run (with -race when the tests run with it).
package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	// Nomad's example device plugin: built as a binary by the tests; imported here so
	// its dependencies stay in go.mod and go.sum.
	_ "github.com/hashicorp/nomad/plugins/device/cmd/example"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/nomad/shim"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/agenttest"
	"github.com/devicehost/devicehost/tools/proc"
	"github.com/devicehost/devicehost/tools/testwait"
)

// Main packages the tests build, and the file names they get.
const (
	examplePkg  = "github.com/hashicorp/nomad/plugins/device/cmd/example/cmd"
	exampleName = "nomad-example-device"
	adapterPkg  = "./cmd/devicehost-plugin-nomad"
	adapterName = "devicehost-plugin-nomad"
	shimPkg     = "./cmd/nomad-device-devicehost"
	agentName   = "devicehost" // agenttest.Binary, from the main module
)

// binaries are the built programs, by name.
var binaries struct {
	once  sync.Once
	dir   string
	paths map[string]string
	err   error
}

// build builds every binary the tests use once per test run and returns its path by
// file name: devicehost (agenttest.Binary, from the main module), Nomad's
// example device plugin (unmodified, from the Nomad v1.6.3 module), the adapter and
// the shim.
func build(t testing.TB) map[string]string {
	t.Helper()
	agent := agenttest.Binary(t)
	binaries.once.Do(func() {
		binaries.paths, binaries.err = buildAll(agent)
	})
	if binaries.err != nil {
		t.Fatalf("build: %v", binaries.err)
	}
	return binaries.paths
}

func buildAll(agent string) (map[string]string, error) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		return nil, err
	}
	here, err := goEnv(goTool, "", "GOMOD")
	if err != nil {
		return nil, err
	}
	nomadRoot := filepath.Dir(here)
	dir, err := os.MkdirTemp("", "dhnomad-bin")
	if err != nil {
		return nil, err
	}
	binaries.dir = dir
	flags := []string{"build"}
	if raceEnabled {
		flags = append(flags, "-race")
	}
	run := func(root, pkg, name string) error {
		args := append(append([]string{}, flags...), "-o", filepath.Join(dir, name), pkg)
		cmd := exec.Command(goTool, args...)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go %s (in %s): %w\n%s", strings.Join(args, " "), root, err, out)
		}
		return nil
	}
	for _, b := range []struct{ root, pkg, name string }{
		{nomadRoot, examplePkg, exampleName},
		{nomadRoot, adapterPkg, adapterName},
		{nomadRoot, shimPkg, shim.BinaryName},
	} {
		if err := run(b.root, b.pkg, b.name); err != nil {
			return nil, err
		}
	}
	return map[string]string{
		agentName:       agent,
		exampleName:     filepath.Join(dir, exampleName),
		adapterName:     filepath.Join(dir, adapterName),
		shim.BinaryName: filepath.Join(dir, shim.BinaryName),
	}, nil
}

func goEnv(goTool, dir, key string) (string, error) {
	cmd := exec.Command(goTool, "env", key)
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go env %s: %w", key, err)
	}
	v := strings.TrimSpace(string(out))
	if v == "" || v == os.DevNull {
		return "", fmt.Errorf("go env %s: not in a module", key)
	}
	return v, nil
}

func cleanupBinaries() {
	agenttest.RemoveBinary()
	if binaries.dir != "" {
		os.RemoveAll(binaries.dir)
	}
}

// tempDir makes a fresh directory with a name short enough for Unix socket paths
// (t.TempDir's names carry the test's name), removed at cleanup.
func tempDir(t testing.TB, prefix string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// install copies the binary src to dir/name, mode 0755.
func install(t testing.TB, src, dir, name string) string {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, name)
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

// startAgent runs bin with args as agenttest.Start does, with TMPDIR set to tmp (a
// SIGKILLed -dev agent cannot remove its temporary directory), its stdout and stderr
// recorded together in Stdout.
func startAgent(t testing.TB, bin, tmp string, args ...string) *agenttest.Process {
	t.Helper()
	return agenttest.Start(t, agenttest.Command{Path: bin, Args: args, TempDir: tmp, MergeOutput: true})
}

// dial connects a client to address, waits until the agent serves, and closes it at
// cleanup.
func dial(t testing.TB, address string) *client.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	c, err := client.Dial(ctx, address, client.WithoutReachCheck())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.WaitServing(ctx); err != nil {
		t.Fatal(err)
	}
	return c
}

// waitDevices reads the agent's inventory until ok accepts a snapshot, and returns it.
func waitDevices(t testing.TB, c *client.Client, what string, ok func(*pb.FingerprintResponse) bool) *pb.FingerprintResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	var last *pb.FingerprintResponse
	for u := range c.WatchDevices(ctx) {
		if u.Disconnected() {
			continue
		}
		last = u.Snapshot
		if ok(u.Snapshot) {
			return u.Snapshot
		}
	}
	t.Fatalf("no inventory with %s; last: %v", what, last)
	return nil
}

// findDevice returns the device id of group vendor/type/name in snap, or nil.
func findDevice(snap *pb.FingerprintResponse, group, id string) *pb.Device {
	for _, g := range snap.GetGroups() {
		if g.GetVendor()+"/"+g.GetType()+"/"+g.GetName() != group {
			continue
		}
		for _, d := range g.GetDevices() {
			if d.GetId() == id {
				return d
			}
		}
	}
	return nil
}

// processes returns the IDs of the running processes whose executable is exe and
// whose arguments after the program name start with args.
func processes(exe string, args ...string) []int {
	all, _ := proc.List()
	var pids []int
	for _, p := range all {
		if p.Exe != exe || p.Zombie() || len(p.Argv) < 1+len(args) || !equal(p.Argv[1:1+len(args)], args) {
			continue
		}
		pids = append(pids, p.PID)
	}
	return pids
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// onlyProcess waits until exactly one process runs exe with args and returns it.
func onlyProcess(t testing.TB, exe string, args ...string) int {
	t.Helper()
	deadline := time.Now().Add(testwait.Timeout)
	for {
		pids := processes(exe, args...)
		if len(pids) == 1 {
			return pids[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("processes of %s %q: %v; want exactly one", exe, args, pids)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// noProcesses fails the test unless, within a few seconds (a process being killed
// takes a moment to go), no process runs exe.
func noProcesses(t testing.TB, when, exe string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		pids := processes(exe)
		if len(pids) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s: processes of %s still running: %v", when, exe, pids)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// goroutinesIn returns the IDs of the goroutines that have fn on their stack.
func goroutinesIn(fn string) map[string]bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	ids := make(map[string]bool)
	for _, g := range strings.Split(string(buf), "\n\n") {
		if header, _, ok := strings.Cut(g, " ["); ok && strings.Contains(g, fn) {
			ids[strings.TrimPrefix(header, "goroutine ")] = true
		}
	}
	return ids
}

// noNewGoroutineIn fails the test unless, within a few seconds, no goroutine has fn on
// its stack but those in before (goroutinesIn(fn) taken when the test started: another
// test's leftovers, such as the one Nomad's own device manager leaks, are not this
// test's).
func noNewGoroutineIn(t testing.TB, fn string, before map[string]bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var left []string
		for id := range goroutinesIn(fn) {
			if !before[id] {
				left = append(left, id)
			}
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Errorf("goroutines %v in %s are left over:\n%s", left, fn, buf[:runtime.Stack(buf, true)])
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// errContains reports whether err's text holds every one of want.
func errContains(err error, want ...string) bool {
	if err == nil {
		return false
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			return false
		}
	}
	return true
}
