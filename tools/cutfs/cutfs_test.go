package cutfs_test

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/devicehost/devicehost/tools/cutfs"
)

// durable makes the file name hold data, synced, with its name synced.
func (e *env) durable(name string, data []byte) {
	e.t.Helper()
	e.write(name, data, true)
	e.syncDir("")
}

func (e *env) wantContent(name string, want []byte) {
	e.t.Helper()
	got := e.read(name)
	switch {
	case want == nil && got != nil:
		e.t.Errorf("%s exists (%d bytes), want it gone", name, len(got))
	case want != nil && got == nil:
		e.t.Errorf("%s is gone, want %d bytes", name, len(want))
	case !bytes.Equal(got, want):
		e.t.Errorf("%s = %.40q (%d bytes), want %.40q (%d bytes)", name, got, len(got), want, len(want))
	}
}

// overwrite writes data at off of the existing file name, fsyncing if sync.
func (e *env) overwrite(name string, data []byte, off int64, sync bool) {
	e.t.Helper()
	f, err := os.OpenFile(e.path(name), os.O_WRONLY, 0)
	if err != nil {
		e.t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(data, off); err != nil {
		e.t.Fatal(err)
	}
	if sync {
		if err := f.Sync(); err != nil {
			e.t.Fatal(err)
		}
	}
}

func TestUnsyncedWriteIsDropped(t *testing.T) {
	e := mount(t)
	e.durable("a", []byte("hello, world"))
	e.overwrite("a", []byte("HELLO"), 0, false)
	e.overwrite("a", bytes.Repeat([]byte("x"), 10000), 5, false) // grows it too
	e.wantContent("a", append([]byte("HELLO"), bytes.Repeat([]byte("x"), 10000)...))
	stats := e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("a", []byte("hello, world"))
	if stats.DroppedBlocks != 3 || stats.KeptBlocks != 0 || stats.UndoneDirChanges != 0 {
		t.Errorf("stats = %+v, want 3 dropped blocks", stats)
	}
}

func TestSyncedWriteIsKept(t *testing.T) {
	e := mount(t)
	e.durable("a", []byte("one"))
	e.overwrite("a", []byte("two"), 0, true)
	e.overwrite("a", []byte("333"), 0, false)
	e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("a", []byte("two"))
}

func TestFdatasyncCoversData(t *testing.T) {
	e := mount(t)
	e.durable("a", []byte("old"))
	f, err := os.OpenFile(e.path("a"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	data := bytes.Repeat([]byte("new data "), 2000)
	if _, err := f.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		t.Fatal(err)
	}
	// A sync through another descriptor of the same file covers this one's writes.
	if _, err := f.WriteAt([]byte("more"), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	g, err := os.Open(e.path("a"))
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := unix.Fdatasync(int(g.Fd())); err != nil {
		t.Fatal(err)
	}
	if got := e.fs.Syncs(); got != 4 { // the file's and the directory's, then these two
		t.Errorf("Syncs = %d, want 4", got)
	}
	e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("a", append(data, "more"...))
}

func TestTruncateIsRolledBack(t *testing.T) {
	e := mount(t)
	orig := bytes.Repeat([]byte("0123456789"), 1000)
	e.durable("shrunk", orig)
	e.durable("grown", orig)
	if err := os.Truncate(e.path("shrunk"), 100); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(e.path("grown"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(50000); err != nil { // as bbolt grows its file
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("tail"), 40000); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.path("shrunk"), []byte("short"), 0o644); err != nil { // O_TRUNC
		t.Fatal(err)
	}
	e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("shrunk", orig)
	e.wantContent("grown", orig)
}

func TestCreatedFileNeedsDirSync(t *testing.T) {
	e := mount(t)
	if err := os.Mkdir(e.path("d"), 0o755); err != nil {
		t.Fatal(err)
	}
	e.syncDir("")
	e.write("d/synced-name", []byte("data"), true)
	e.syncDir("d")
	e.write("d/unsynced-data", []byte("data"), false)
	e.syncDir("d")
	e.write("d/unsynced-name", []byte("data"), true)
	// A directory made and synced inside, but not named durably by its parent.
	if err := os.Mkdir(e.path("lost"), 0o755); err != nil {
		t.Fatal(err)
	}
	e.write("lost/f", []byte("data"), true)
	e.syncDir("lost")
	stats := e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("d/synced-name", []byte("data"))
	e.wantContent("d/unsynced-data", []byte{}) // the name is synced, its data not
	e.wantContent("d/unsynced-name", nil)
	if _, err := os.Stat(e.path("lost")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stat lost: %v, want it gone", err)
	}
	if stats.UndoneDirChanges != 2 { // d/unsynced-name, lost
		t.Errorf("UndoneDirChanges = %d, want 2", stats.UndoneDirChanges)
	}
}

func TestUnsyncedUnlinkIsUndone(t *testing.T) {
	e := mount(t)
	e.durable("kept", []byte("durable content"))
	e.durable("gone", []byte("bye"))
	e.overwrite("kept", []byte("DURABLE"), 0, false) // unsynced, then unlinked
	if err := os.Remove(e.path("kept")); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(e.path("gone")); err != nil {
		t.Fatal(err)
	}
	e.syncDir("") // makes both unlinks durable...
	e.durable("kept", []byte("second life"))
	if err := os.Remove(e.path("kept")); err != nil { // ...and not this one
		t.Fatal(err)
	}
	stats := e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("kept", []byte("second life"))
	e.wantContent("gone", nil)
	if stats.UndoneDirChanges != 1 {
		t.Errorf("UndoneDirChanges = %d, want 1", stats.UndoneDirChanges)
	}

	// An unsynced unlink of a file with unsynced data: the synced data comes back.
	e.overwrite("kept", []byte("SECOND"), 0, false)
	if err := os.Remove(e.path("kept")); err != nil {
		t.Fatal(err)
	}
	e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("kept", []byte("second life"))
}

func TestRenameNeedsDirSync(t *testing.T) {
	for _, syncDir := range []bool{false, true} {
		e := mount(t)
		e.durable("config", []byte("version 1"))
		e.durable("moved", []byte("m"))
		// The atomic replace: temp file, fsync, rename over, fsync the directory.
		e.write("config.tmp", []byte("version 2"), true)
		if err := os.Rename(e.path("config.tmp"), e.path("config")); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(e.path("sub"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(e.path("moved"), e.path("sub/moved")); err != nil {
			t.Fatal(err)
		}
		if syncDir {
			e.syncDir("sub")
			e.syncDir("")
		}
		stats := e.powerCycle(cutfs.DropUnsynced, nil)
		e.wantContent("config.tmp", nil)
		if syncDir {
			e.wantContent("config", []byte("version 2"))
			e.wantContent("sub/moved", []byte("m"))
			e.wantContent("moved", nil)
			if stats.UndoneDirChanges != 0 {
				t.Errorf("UndoneDirChanges = %d, want 0", stats.UndoneDirChanges)
			}
			continue
		}
		e.wantContent("config", []byte("version 1"))
		e.wantContent("moved", []byte("m"))
		if _, err := os.Stat(e.path("sub")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("stat sub: %v, want it gone", err)
		}
		// In the root: config (another file), moved, sub; in sub: moved.
		if stats.UndoneDirChanges != 4 {
			t.Errorf("UndoneDirChanges = %d, want 4", stats.UndoneDirChanges)
		}
	}
}

func TestEveryRequestFailsAfterCut(t *testing.T) {
	e := mount(t)
	e.durable("a", []byte("hello"))
	if err := os.Mkdir(e.path("d"), 0o755); err != nil {
		t.Fatal(err)
	}
	open, err := os.OpenFile(e.path("a"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	dir, err := os.Open(e.mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	if _, err := e.fs.Cut(cutfs.DropUnsynced, nil); err != nil {
		t.Fatal(err)
	}
	ops := map[string]func() error{
		"stat":     func() error { _, err := os.Stat(e.path("a")); return err },
		"open":     func() error { f, err := os.Open(e.path("a")); f.Close(); return err },
		"create":   func() error { return os.WriteFile(e.path("b"), nil, 0o644) },
		"mkdir":    func() error { return os.Mkdir(e.path("e"), 0o755) },
		"unlink":   func() error { return os.Remove(e.path("a")) },
		"rmdir":    func() error { return syscall.Rmdir(e.path("d")) },
		"rename":   func() error { return os.Rename(e.path("a"), e.path("c")) },
		"truncate": func() error { return os.Truncate(e.path("a"), 0) },
		"readdir":  func() error { _, err := os.ReadDir(e.mnt); return err },
		"read":     func() error { _, err := open.ReadAt(make([]byte, 5), 0); return err },
		"write":    func() error { _, err := open.WriteAt([]byte("x"), 0); return err },
		"fsync":    open.Sync,
		"fstat":    func() error { _, err := open.Stat(); return err },
		"fsyncdir": dir.Sync,
	}
	for name, op := range ops {
		if err := op(); !errors.Is(err, syscall.EIO) {
			t.Errorf("%s after the cut: %v, want EIO", name, err)
		}
	}
	if _, err := e.fs.Cut(cutfs.DropUnsynced, nil); !errors.Is(err, cutfs.ErrCut) {
		t.Errorf("second Cut: %v, want ErrCut", err)
	}
	// Unmount does not wait for the files still open.
	if err := e.fs.Unmount(); err != nil {
		t.Fatal(err)
	}
	if err := e.fs.Unmount(); err != nil {
		t.Errorf("second Unmount: %v", err)
	}
	if _, err := e.fs.Cut(cutfs.DropUnsynced, nil); !errors.Is(err, cutfs.ErrUnmounted) {
		t.Errorf("Cut after Unmount: %v, want ErrUnmounted", err)
	}
	e.mount()
	e.wantContent("a", []byte("hello"))
}

func TestCutAtSync(t *testing.T) {
	e := mount(t)
	e.durable("a", []byte("v1")) // sync 1 (file), sync 2 (directory)
	if err := e.fs.CutAtSync(2, cutfs.DropUnsynced, nil); err == nil {
		t.Error("CutAtSync(2) after sync 2: no error")
	}
	if err := e.fs.CutAtSync(4, cutfs.DropUnsynced, nil); err != nil {
		t.Fatal(err)
	}
	e.overwrite("a", []byte("v2"), 0, true) // sync 3
	f, err := os.OpenFile(e.path("a"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("v3"), 0); err != nil {
		t.Fatal(err)
	}
	select {
	case <-e.fs.CutDone():
		t.Fatal("cut before sync 4")
	default:
	}
	if err := f.Sync(); !errors.Is(err, syscall.EIO) { // sync 4: trips the cut
		t.Fatalf("sync 4: %v, want EIO", err)
	}
	<-e.fs.CutDone()
	stats, err := e.fs.CutResult()
	if err != nil || stats.DroppedBlocks != 1 {
		t.Errorf("CutResult = %+v, %v; want 1 dropped block", stats, err)
	}
	if got := e.fs.Syncs(); got != 4 {
		t.Errorf("Syncs = %d, want 4", got)
	}
	e.remount()
	e.wantContent("a", []byte("v2"))
}

func TestKeepRandomKeepsSomeBlocks(t *testing.T) {
	const blocks = 64
	old := bytes.Repeat([]byte{'o'}, blocks*4096)
	next := bytes.Repeat([]byte{'n'}, blocks*4096)
	run := func() (cutfs.CutStats, []byte) {
		e := mount(t)
		e.durable("f", old)
		e.overwrite("f", next, 0, false)
		stats := e.powerCycle(cutfs.KeepRandom, rand.New(rand.NewPCG(7, 7)))
		return stats, e.read("f")
	}
	stats, got := run()
	if len(got) != len(old) {
		t.Fatalf("size %d, want %d", len(got), len(old))
	}
	kept := 0
	for b := range blocks {
		block := got[b*4096 : (b+1)*4096]
		switch {
		case bytes.Equal(block, next[:4096]):
			kept++
		case !bytes.Equal(block, old[:4096]):
			t.Fatalf("block %d is torn", b)
		}
	}
	if stats.KeptBlocks != kept || stats.DroppedBlocks != blocks-kept {
		t.Errorf("stats %+v, but %d blocks kept", stats, kept)
	}
	if kept == 0 || kept == blocks {
		t.Errorf("%d of %d blocks kept: want some kept and some dropped", kept, blocks)
	}
	stats2, got2 := run()
	if stats2 != stats || !bytes.Equal(got2, got) {
		t.Errorf("the same seed gave %+v, then %+v", stats, stats2)
	}
}

func TestCleanUnmountKeepsEverything(t *testing.T) {
	e := mount(t)
	e.write("a", []byte("never synced"), false)
	e.remount()
	e.wantContent("a", []byte("never synced"))
	stats := e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("a", []byte("never synced"))
	if stats != (cutfs.CutStats{}) {
		t.Errorf("stats = %+v, want nothing undone", stats)
	}
}

func TestUnsyncedRmdirIsUndone(t *testing.T) {
	e := mount(t)
	// makeAndRemove makes d with a file and a symlink, durably, then removes all three.
	makeAndRemove := func() {
		if err := os.Mkdir(e.path("d"), 0o750); err != nil {
			t.Fatal(err)
		}
		e.write("d/f", []byte("in d"), true)
		if err := os.Symlink("f", e.path("d/link")); err != nil {
			t.Fatal(err)
		}
		e.syncDir("d")
		e.syncDir("")
		for _, name := range []string{"d/f", "d/link", "d"} {
			if err := os.Remove(e.path(name)); err != nil {
				t.Fatal(err)
			}
		}
	}
	makeAndRemove()
	e.syncDir("") // only d's removal is synced...
	e.write("d", []byte("a file now"), true)
	// ...but d's own entries were not: still, d is gone for good.
	e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("d", nil)

	makeAndRemove()
	stats := e.powerCycle(cutfs.DropUnsynced, nil)
	e.wantContent("d/f", []byte("in d"))
	e.wantContent("d/link", []byte("in d"))
	if target, err := os.Readlink(e.path("d/link")); err != nil || target != "f" {
		t.Errorf("d/link -> %q, %v; want f", target, err)
	}
	if fi, err := os.Stat(e.path("d")); err != nil || fi.Mode().Perm() != 0o750 {
		t.Errorf("d: %v, %v; want mode 0750", fi, err)
	}
	if stats.UndoneDirChanges != 3 {
		t.Errorf("UndoneDirChanges = %d, want 3", stats.UndoneDirChanges)
	}
}
