package pluginloader_test

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/logtest"
)

// pluginDir makes a plugin dir (mode 0755) holding files name -> mode; a mode with
// os.ModeDir makes a folder, os.ModeSymlink a link to the file named "target".
func pluginDir(t *testing.T, files map[string]os.FileMode) string {
	t.Helper()
	dir := t.TempDir()
	for name, mode := range files {
		path := filepath.Join(dir, name)
		switch {
		case mode&os.ModeDir != 0:
			if err := os.Mkdir(path, 0o755); err != nil {
				t.Fatal(err)
			}
		case mode&os.ModeSymlink != 0:
			if err := os.Symlink(filepath.Join(dir, "target"), path); err != nil {
				t.Fatal(err)
			}
		default:
			if err := os.WriteFile(path, []byte("#!/bin/sh\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(path, mode.Perm()); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

func names(bins []pluginloader.Binary) []string {
	var out []string
	for _, b := range bins {
		out = append(out, b.Name)
	}
	return out
}

func TestDiscover(t *testing.T) {
	dir := pluginDir(t, map[string]os.FileMode{
		"b-plugin":  0o755,
		"a-plugin":  0o700,
		"target":    0o750,
		"c-link":    os.ModeSymlink,
		"notes.txt": 0o644,
		"sub":       os.ModeDir,
	})
	logs := &logtest.Recorder{}
	log := hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Info})

	bins, err := pluginloader.Discover(dir, log)
	if err != nil {
		t.Fatalf("Discover: %v", err)
	}
	if got, want := names(bins), []string{"a-plugin", "b-plugin", "c-link", "target"}; !slices.Equal(got, want) {
		t.Errorf("names: got %q, want %q (sorted, no folder, no non-executable)", got, want)
	}
	for _, b := range bins {
		if want := filepath.Join(dir, b.Name); b.Path != want {
			t.Errorf("%s: path %q, want %q", b.Name, b.Path, want)
		}
	}
	for _, want := range []string{
		"skipping folder in plugin dir: path=" + filepath.Join(dir, "sub"),
		"not executable: path=" + filepath.Join(dir, "notes.txt"),
	} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log: no line with %q in:\n%s", want, logs)
		}
	}
}

func TestDiscoverEmptyAndRelativeDir(t *testing.T) {
	dir := pluginDir(t, nil)
	t.Chdir(dir)
	bins, err := pluginloader.Discover(".", nil)
	if err != nil || len(bins) != 0 {
		t.Errorf("Discover(empty dir): got %v, %v; want none, nil", bins, err)
	}
}

func TestDiscoverRefuses(t *testing.T) {
	t.Run("world-writable dir", func(t *testing.T) {
		dir := pluginDir(t, map[string]os.FileMode{"good": 0o755})
		if err := os.Chmod(dir, 0o777); err != nil {
			t.Fatal(err)
		}
		bins, err := pluginloader.Discover(dir, nil)
		if !errors.Is(err, pluginloader.ErrInsecurePath) || !strings.Contains(err.Error(), dir) {
			t.Errorf("Discover: got err %v, want one wrapping ErrInsecurePath naming %s", err, dir)
		}
		if bins != nil {
			t.Errorf("Discover: got %q, want nothing from a world-writable dir", names(bins))
		}
	})
	t.Run("world-writable binary", func(t *testing.T) {
		dir := pluginDir(t, map[string]os.FileMode{"good": 0o755, "open": 0o777})
		bins, err := pluginloader.Discover(dir, nil)
		bad := filepath.Join(dir, "open")
		if !errors.Is(err, pluginloader.ErrInsecurePath) || !strings.Contains(err.Error(), bad) {
			t.Errorf("Discover: got err %v, want one wrapping ErrInsecurePath naming %s", err, bad)
		}
		if got := names(bins); !slices.Equal(got, []string{"good"}) {
			t.Errorf("Discover: got %q, want [good] (the safe binaries still listed)", got)
		}
	})
	t.Run("missing dir", func(t *testing.T) {
		_, err := pluginloader.Discover(filepath.Join(t.TempDir(), "nope"), nil)
		if !errors.Is(err, os.ErrNotExist) {
			t.Errorf("Discover: got %v, want os.ErrNotExist", err)
		}
	})
	t.Run("not a dir", func(t *testing.T) {
		dir := pluginDir(t, map[string]os.FileMode{"file": 0o755})
		_, err := pluginloader.Discover(filepath.Join(dir, "file"), nil)
		if err == nil || !strings.Contains(err.Error(), "not a directory") {
			t.Errorf("Discover: got %v, want a not-a-directory error", err)
		}
	})
}
