package pluginloader_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/pluginloader"
)

// hostModeEnv makes the test binary act as a host: it launches the fixture binary named
// by the variable, prints the plugin's PID and waits to be killed.
const (
	hostModeEnv    = "PLUGINLOADER_TEST_HOST"
	hostSurviveEnv = "PLUGINLOADER_TEST_HOST_SURVIVE"
)

func runAsHost(bin string) int {
	opts := pluginloader.Options{SurviveHost: os.Getenv(hostSurviveEnv) != ""}
	opts.DisableAutoMTLS = opts.SurviveHost
	p, err := pluginloader.Launch(context.Background(), pluginloader.Binary{Name: "fixture", Path: bin}, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(p.PID())
	select {} // until SIGKILLed by the test
}

// startHost runs the test binary as a host process and returns it with its plugin's PID.
func startHost(t *testing.T, survive bool) (*exec.Cmd, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), hostModeEnv+"="+fixtureBin)
	if survive {
		cmd.Env = append(cmd.Env, hostSurviveEnv+"=1")
	}
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("host printed no plugin PID: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("host printed %q, want a PID", line)
	}
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
	return cmd, pid
}

// alive reports whether pid is a running process (a zombie counts as gone).
func alive(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the ")" that ends the command name.
	rest := string(stat[strings.LastIndexByte(string(stat), ')')+1:])
	return !strings.HasPrefix(strings.TrimSpace(rest), "Z")
}

// waitGone waits until pid is gone or ctx ends.
func waitGone(ctx context.Context, pid int) error {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for alive(pid) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("plugin pid %d still running: %w", pid, ctx.Err())
		case <-tick.C:
		}
	}
	return nil
}

// A host killed with SIGKILL must not leave its plugins running (and holding devices);
// only a plugin launched with SurviveHost, for reattaching, outlives it.
func TestPluginDiesWithHost(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("needs /proc")
	}

	host, pid := startHost(t, false)
	if err := host.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = host.Wait()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if err := waitGone(ctx, pid); err != nil {
		t.Fatalf("after the host was SIGKILLed: %v", err)
	}

	host, pid = startHost(t, true)
	if err := host.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = host.Wait()
	// The kernel delivers the parent-death signal as the parent exits, before Wait
	// returns; a plugin that is still running now was not tied to the host.
	if !alive(pid) {
		t.Fatalf("plugin pid %d launched with SurviveHost died with its host", pid)
	}
}
