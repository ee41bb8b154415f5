package main

import (
	"encoding/json"
	"runtime"
	"strings"
	"testing"
)

// `devicehost version` prints the version set at link time first, then what the Go
// toolchain recorded (the Go version always; module and revision where the build has
// them); -json the same as an object. Help asked for goes to stdout, a mistake's usage
// to stderr.
func TestVersion(t *testing.T) {
	old := version
	t.Cleanup(func() { version = old })
	for _, v := range []string{"dev", "abc1234", "abc1234-dirty"} {
		version = v
		got := mustRunCLI(t, "version")
		if first, _, _ := strings.Cut(got, "\n"); first != "devicehost "+v {
			t.Errorf("version %q: first line %q, want %q", v, first, "devicehost "+v)
		}
		if !strings.Contains(got, "go:       "+runtime.Version()+"\n") {
			t.Errorf("version %q: %q does not name the Go version %s", v, got, runtime.Version())
		}
	}
	var b buildInfo
	if err := json.Unmarshal([]byte(mustRunCLI(t, "version", "-json")), &b); err != nil || b.Version != version || b.GoVersion != runtime.Version() {
		t.Errorf("version -json: %+v, %v", b, err)
	}
	if r := runCLI(t, "version", "extra"); r.code != 2 {
		t.Errorf("version extra: exit %d, want 2", r.code)
	}
	if r := runCLI(t, "help"); r.code != 0 || !strings.Contains(r.stdout, "  version ") || r.stderr != "" {
		t.Errorf("help: exit %d, stdout %q, stderr %q; want the usage, listing version, on stdout", r.code, r.stdout, r.stderr)
	}
}

// Help asked for (devicehost -h, a command's -h) is printed to stdout with exit 0, so
// that `devicehost reserve -h | less` shows it; a mistake prints the usage to stderr
// with exit 2, and nothing to stdout.
func TestHelpGoesToStdout(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"--help"}, {"reserve", "-h"}, {"devices", "-help"}, {"version", "-h"}} {
		r := runCLI(t, args...)
		if r.code != 0 || !strings.Contains(r.stdout, "Usage: devicehost") || r.stderr != "" {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want the usage on stdout", args, r.code, r.stdout, r.stderr)
		}
	}
	for _, args := range [][]string{{}, {"devices", "-frobnicate"}, {"frobnicate"}} {
		r := runCLI(t, args...)
		if r.code != 2 || !strings.Contains(r.stderr, "Usage: devicehost") || r.stdout != "" {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want the usage on stderr", args, r.code, r.stdout, r.stderr)
		}
	}
}
