package main

import (
	"strings"
	"testing"
)

func TestVersion(t *testing.T) {
	old := version
	t.Cleanup(func() { version = old })
	for _, v := range []string{"dev", "abc1234", "abc1234-dirty"} {
		version = v
		if got, want := mustRunCLI(t, "version"), "devicehost "+v+"\n"; got != want {
			t.Errorf("version %q: printed %q, want %q", v, got, want)
		}
	}
	if r := runCLI(t, "version", "extra"); r.code != 2 {
		t.Errorf("version extra: exit %d, want 2", r.code)
	}
	if r := runCLI(t, "help"); !strings.Contains(r.stderr, "  version ") {
		t.Errorf("usage does not list version:\n%s", r.stderr)
	}
}
