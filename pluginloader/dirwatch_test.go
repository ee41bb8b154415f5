package pluginloader

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/tools/logtest"
)

// These tests run the plugin dir watcher in a synctest bubble, so that settle periods
// and rescans take no real time. Only the unwatched watcher (a failing watch: the
// inotify limit) can run in one: fsnotify's reader goroutine sits in a system call,
// which a bubble cannot wait out, so the watched path is tested through the manager
// (manager/plugindir_test.go) with real time.

const (
	testSettle = time.Second
	testRescan = 5 * time.Second
)

// appliedSets records what the watcher hands on.
type appliedSets struct {
	mu   sync.Mutex
	sets []map[string]DirBinary
	last map[string]DirBinary
}

func (a *appliedSets) apply(bins map[string]DirBinary) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.sets = append(a.sets, bins)
	a.last = bins
}

// lastOf is the binary name in the last set handed on.
func (a *appliedSets) lastOf(name string) DirBinary {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.last[name]
}

// take returns the plugin names of each set handed on since the last call.
func (a *appliedSets) take() [][]string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out [][]string
	for _, s := range a.sets {
		out = append(out, slices.Sorted(maps.Keys(s)))
	}
	a.sets = nil
	return out
}

// startUnwatched starts a watcher whose watch always fails on an empty plugin dir,
// stopped at the end of the bubble. It returns the dir, the watcher, what it hands on
// and its log.
func startUnwatched(t *testing.T) (string, *DirWatch, *appliedSets, *logtest.Recorder) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "plugins")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Recorder{}
	got := &appliedSets{}
	d := WatchDir(dir, DirWatchConfig{
		Settle:   testSettle,
		Rescan:   testRescan,
		Log:      hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Debug}),
		Apply:    got.apply,
		watchErr: errors.New("too many open files (inotify instances limit)"),
	})
	if start := d.Start(nil, ""); len(start) != 0 {
		t.Fatalf("Start(nil) = %v, want nothing", start)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		d.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return dir, d, got, logs
}

// dropIn writes an executable plugin binary to dir/name.
func dropIn(t *testing.T, dir, name string) {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o755); err != nil {
		t.Fatal(err)
	}
}

// wantApplied checks the sets handed on since the last check.
func wantApplied(t *testing.T, got *appliedSets, when string, want ...[]string) {
	t.Helper()
	synctest.Wait()
	if g := got.take(); !slices.EqualFunc(g, want, slices.Equal) {
		t.Errorf("%s: handed on %q, want %q", when, g, want)
	}
}

func TestDirWatchUnwatchedRescansAndSettles(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		dir, _, got, logs := startUnwatched(t)
		dropIn(t, dir, "a")
		wantApplied(t, got, "before a rescan")

		time.Sleep(testRescan) // the rescan finds a; it settles from then on
		wantApplied(t, got, "at the rescan that found it")
		time.Sleep(testSettle)
		wantApplied(t, got, "once settled", []string{"a"})

		if err := os.Remove(filepath.Join(dir, "a")); err != nil {
			t.Fatal(err)
		}
		time.Sleep(testRescan) // the next rescan sees it gone
		wantApplied(t, got, "at the rescan that found it gone")
		time.Sleep(testSettle)
		wantApplied(t, got, "once gone for the settle period", []string{})

		if n := logs.Count("cannot watch the plugin dir; listing it periodically instead"); n != 1 {
			t.Errorf("%d lines about the failing watch, want 1 (once per distinct error)", n)
		}
	})
}

func TestDirWatchGoneAndBackWithinSettleIsReplaced(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		dir, d, got, _ := startUnwatched(t)
		dropIn(t, dir, "a")
		d.Poke() // a listing now, not at the next rescan
		time.Sleep(testSettle)
		wantApplied(t, got, "after a poke and the settle period", []string{"a"})
		first := got.lastOf("a").File

		// Unlinked and written again (install, cp --remove-destination): the name is
		// gone for less than the settle period, so a is never left out, only handed on
		// again as other content once the new file settled.
		if err := os.Remove(filepath.Join(dir, "a")); err != nil {
			t.Fatal(err)
		}
		d.Poke()
		wantApplied(t, got, "just gone")
		dropIn(t, dir, "a")
		d.Poke()
		wantApplied(t, got, "back, not settled")
		time.Sleep(testSettle)
		wantApplied(t, got, "after the new file settled", []string{"a"})
		if again := got.lastOf("a").File; again.SameContent(first) {
			t.Errorf("the rewritten binary has the same content identity as the first (%+v)", first)
		}
	})
}
