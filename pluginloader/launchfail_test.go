package pluginloader_test

import (
	"cmp"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/logtest"
)

// script writes a shell script plugin into a new temp dir and returns it as a Binary.
func script(t *testing.T, body string) pluginloader.Binary {
	t.Helper()
	path := filepath.Join(t.TempDir(), "script")
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body+"\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o755); err != nil {
		t.Fatal(err)
	}
	return pluginloader.Binary{Name: "script", Path: path}
}

// readPID waits for a process to write its PID into path.
func readPID(ctx context.Context, t *testing.T, path string) int {
	t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		if b, err := os.ReadFile(path); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
				return pid // written with one write(2): a number that parses is whole
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no PID in %s: %v", path, ctx.Err())
		case <-tick.C:
		}
	}
}

// checkShort fails unless err is one line of at most 300 bytes that names the plugin and
// holds none of go-plugin's text or socket paths.
func checkShort(t *testing.T, err error, name string) {
	t.Helper()
	msg := err.Error()
	if strings.Contains(msg, "\n") || len(msg) > 300 {
		t.Errorf("launch error is %d bytes on %d lines, want one line of at most 300:\n%s", len(msg), strings.Count(msg, "\n")+1, msg)
	}
	for _, bad := range []string{"Unrecognized remote plugin message", "This usually means", "/tmp/plugin", "plugin-dir"} {
		if strings.Contains(msg, bad) {
			t.Errorf("launch error %q holds %q", msg, bad)
		}
	}
	if !strings.Contains(msg, `plugin "`+name+`"`) {
		t.Errorf("launch error %q does not name plugin %q", msg, name)
	}
}

// TestLaunchErrors: every way a launch fails gives one short line in the loader's words,
// wrapping the sentinel a caller branches on.
func TestLaunchErrors(t *testing.T) {
	garbage := filepath.Join(t.TempDir(), "garbage")
	if err := os.WriteFile(garbage, []byte("\x7fELF\x02\x01\x01 not really"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(garbage, 0o755); err != nil {
		t.Fatal(err)
	}
	huge := strings.Repeat("v9,", 2000)

	tests := []struct {
		name    string
		bin     pluginloader.Binary
		env     []string
		config  fixtureplugin.Config
		timeout time.Duration // StartTimeout; zero: 20s, far longer than any case takes
		want    string
		is      error
	}{
		{name: "another magic cookie", bin: fixtureBinary(), env: []string{"FIXTURE_MAGIC_COOKIE=someone-else"},
			want: "has another magic cookie", is: pluginloader.ErrNotPlugin},
		{name: "prints something else", bin: script(t, `echo "hello, I am a shell script"; exec /bin/sleep 1`),
			want: `printed "hello, I am a shell script" instead of a go-plugin handshake`, is: pluginloader.ErrNotPlugin},
		{name: "exits at once", bin: script(t, "exit 7"),
			want: "exited before its handshake (exit status 7)", is: pluginloader.ErrExited},
		{name: "not a program for this machine", bin: pluginloader.Binary{Name: "garbage", Path: garbage},
			want: "could not be started: exec format error", is: syscall.ENOEXEC},
		{name: "go-plugin protocol", bin: fixtureBinary(), env: []string{"FIXTURE_PROTOCOL=2"},
			want: "speaks go-plugin protocol version 2, the host speaks 1", is: pluginloader.ErrProtocolVersion},
		{name: "plugin protocol, long list", bin: fixtureBinary(), env: []string{"FIXTURE_INFO_PROTOCOLS=" + huge},
			want: "speaks protocol versions [v9, v9", is: pluginloader.ErrProtocolVersion},
		{name: "config rejected with a long multi-line reason", bin: fixtureBinary(),
			config: fixtureplugin.Config{RejectConfig: "bad\n" + strings.Repeat("reason ", 5000)},
			want:   `plugin "fixture": bad\nreason reason`, is: pluginloader.ErrConfigRejected},
		// The start timeout must fire at SetConfig, so everything before it (process,
		// handshake, AutoMTLS, GetPluginInfo) must fit in it on a loaded machine: 500ms
		// did not always. The hang costs the whole timeout.
		{name: "SetConfig hangs", bin: fixtureBinary(), config: fixtureplugin.Config{SetConfigHang: true},
			timeout: 5 * time.Second,
			want:    "SetConfig did not answer within 5s", is: context.DeadlineExceeded},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Every other case fails at once by itself; a long start timeout keeps a slow
			// start from turning its error into a timeout.
			timeout := cmp.Or(tt.timeout, 20*time.Second)
			_, err := pluginloader.Launch(testContext(t), tt.bin, pluginloader.Options{
				Logger: testLogger(t), Env: tt.env, ConfigJSON: tt.config.JSON(), StartTimeout: timeout,
			})
			if err == nil {
				t.Fatal("Launch: no error")
			}
			t.Logf("Launch: %s", err)
			if !errors.Is(err, tt.is) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Launch: got %q, want one saying %q, wrapping %v", err, tt.want, tt.is)
			}
			checkShort(t, err, tt.bin.Name)
		})
	}
}

// TestLaunchKilledBeforeHandshake: a plugin SIGKILLed before its handshake is reported as
// such, not as go-plugin's 16 lines about architectures and dynamic libraries.
func TestLaunchKilledBeforeHandshake(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "pid")
	type result struct{ err error }
	done := make(chan result, 1)
	go func() {
		p, err := pluginloader.Launch(testContext(t), fixtureBinary(), pluginloader.Options{
			Logger: testLogger(t), Env: []string{"FIXTURE_HANG_START=1", "FIXTURE_PID_FILE=" + pidFile},
		})
		if err == nil {
			p.Kill(context.Background())
		}
		done <- result{err}
	}()
	pid := readPID(waitContext(t), t, pidFile)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := (<-done).err
	if !errors.Is(err, pluginloader.ErrExited) || !strings.Contains(err.Error(), "exited before its handshake (signal: killed)") {
		t.Fatalf("Launch: got %v, want ErrExited saying it exited before its handshake, killed", err)
	}
	checkShort(t, err, fixtureplugin.Name)
}

// TestLaunchReachesProcessGroup: a plugin that starts a child and never completes its
// handshake fails at its start timeout, and its child dies with it; so does the child
// of a plugin that is killed after it ran. The children sleep far longer than
// hangDeadline: a launch or kill that waited for a child, not for the group kill, is
// cut there.
func TestLaunchReachesProcessGroup(t *testing.T) {
	tests := []struct {
		name, body, want string
		timeout          time.Duration // StartTimeout
	}{
		// It must print before its start timeout: a long one, so that a slow start
		// cannot make this the silent case.
		{name: "prints a line", body: `/bin/sleep 1000 & echo $! > "$CHILD"; echo starting; wait`,
			timeout: 20 * time.Second, want: `printed "starting" instead of a go-plugin handshake`},
		// It never answers: the start timeout is what ends it.
		{name: "silent", body: `/bin/sleep 1000 & echo $! > "$CHILD"; wait`,
			timeout: 500 * time.Millisecond, want: "did not complete its go-plugin handshake within 500ms"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			childFile := filepath.Join(t.TempDir(), "child")
			bin, opts := script(t, tt.body), pluginloader.Options{
				Logger: testLogger(t), Env: []string{"CHILD=" + childFile}, StartTimeout: tt.timeout,
			}
			var err error
			returnsBefore(t, hangDeadline(t), "Launch", func() { _, err = pluginloader.Launch(context.Background(), bin, opts) })
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Launch: got %v, want an error saying %q", err, tt.want)
			}
			child := readPID(waitContext(t), t, childFile)
			t.Cleanup(func() { _ = syscall.Kill(child, syscall.SIGKILL) })
			if err := waitGone(waitContext(t), child); err != nil {
				t.Errorf("the plugin's child after the failed launch: %v", err)
			}
		})
	}

	t.Run("child of a running plugin", func(t *testing.T) {
		childFile := filepath.Join(t.TempDir(), "child")
		p := launch(t, fixtureBinary(), pluginloader.Options{Env: []string{"FIXTURE_CHILD_PID_FILE=" + childFile}})
		child := readPID(waitContext(t), t, childFile)
		t.Cleanup(func() { _ = syscall.Kill(child, syscall.SIGKILL) })

		// The plugin exits gracefully; its child holds stderr.
		returnsBefore(t, hangDeadline(t), "Kill", func() { p.Kill(context.Background()) })
		if err := waitGone(waitContext(t), child); err != nil {
			t.Errorf("the plugin's child after Kill: %v", err)
		}
	})
}

// TestLaunchChildOutsideGroup: a child that leaves the plugin's process group (setsid)
// escapes the kill; while it holds the plugin's stdout, the launch still ends (2s after
// the kill, not when the child, sleeping far past hangDeadline, exits), with an ERROR
// that says why.
func TestLaunchChildOutsideGroup(t *testing.T) {
	const setsid = "/usr/bin/setsid"
	if _, err := os.Stat(setsid); err != nil {
		t.Skip("needs " + setsid)
	}
	childFile := filepath.Join(t.TempDir(), "child")
	logs := &logtest.Recorder{}
	host := hclog.New(&hclog.LoggerOptions{Name: "host", Level: hclog.Info, Output: logs})

	bin := script(t, setsid+` /bin/sh -c 'echo $$ > "$CHILD"; exec /bin/sleep 1000' & until [ -s "$CHILD" ]; do /bin/sleep 0.01; done; echo starting; wait`)
	// A long start timeout: the script must get to print "starting", however slow its
	// start; the kill that follows, not the timeout, is what is checked.
	opts := pluginloader.Options{Logger: host, Env: []string{"CHILD=" + childFile}, StartTimeout: 20 * time.Second}
	var err error
	returnsBefore(t, hangDeadline(t), "Launch", func() { _, err = pluginloader.Launch(context.Background(), bin, opts) })
	child := readPID(waitContext(t), t, childFile)
	// Once it is gone, go-plugin's goroutines end (TestMain checks for leaks).
	defer func() { _ = syscall.Kill(child, syscall.SIGKILL) }()

	if err == nil || !strings.Contains(err.Error(), `printed "starting"`) {
		t.Errorf("Launch: got %v, want the not-a-handshake error", err)
	}
	if !strings.Contains(logs.String(), "[ERROR] host: plugin killed, but a process outside its process group still holds its stdout or stderr") {
		t.Errorf("no ERROR about the escaped process in:\n%s", logs)
	}
}
