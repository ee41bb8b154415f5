package cutfs_test

import (
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"

	"github.com/devicehost/devicehost/tools/cutfs"
)

// TestMain runs the bbolt helper when the test binary is started as one (see
// bolt_test.go), and otherwise the tests, checking that no goroutine outlives them.
func TestMain(m *testing.M) {
	if role := os.Getenv(helperEnv); role != "" {
		os.Exit(runHelper(role, os.Getenv(helperDirEnv)))
	}
	goleak.VerifyTestMain(m)
}

// needFUSE skips a test that cannot mount.
func needFUSE(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("cutfs tests mount with mount(2): they need root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("no FUSE: %v", err)
	}
}

// env is a backing directory and its mount.
type env struct {
	t       *testing.T
	backing string
	mnt     string
	fs      *cutfs.FS
}

// mount mounts a new, empty backing directory; the mount ends with the test.
func mount(t *testing.T) *env {
	t.Helper()
	needFUSE(t)
	e := &env{t: t, backing: t.TempDir(), mnt: t.TempDir()}
	e.mount()
	t.Cleanup(func() {
		if err := e.fs.Unmount(); err != nil {
			t.Errorf("Unmount: %v", err)
		}
	})
	return e
}

func (e *env) mount() {
	e.t.Helper()
	f, err := cutfs.Mount(e.backing, e.mnt, cutfs.Options{})
	if err != nil {
		e.t.Fatalf("Mount: %v", err)
	}
	e.fs = f
}

// remount unmounts and mounts the backing directory again: the power is back.
func (e *env) remount() {
	e.t.Helper()
	if err := e.fs.Unmount(); err != nil {
		e.t.Fatalf("Unmount: %v", err)
	}
	e.mount()
}

// powerCycle cuts the power, and mounts again.
func (e *env) powerCycle(mode cutfs.Mode, rng *rand.Rand) cutfs.CutStats {
	e.t.Helper()
	stats, err := e.fs.Cut(mode, rng)
	if err != nil {
		e.t.Fatalf("Cut: %v", err)
	}
	e.remount()
	return stats
}

func (e *env) path(name string) string { return filepath.Join(e.mnt, name) }

// write writes data to the file name (created or truncated), fsyncing it if sync.
func (e *env) write(name string, data []byte, sync bool) {
	e.t.Helper()
	f, err := os.OpenFile(e.path(name), os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		e.t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(data); err != nil {
		e.t.Fatal(err)
	}
	if sync {
		if err := f.Sync(); err != nil {
			e.t.Fatal(err)
		}
	}
}

// syncDir fsyncs the directory name ("" for the root).
func (e *env) syncDir(name string) {
	e.t.Helper()
	d, err := os.Open(e.path(name))
	if err != nil {
		e.t.Fatal(err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		e.t.Fatalf("fsync %s/: %v", name, err)
	}
}

// read returns the content of the file name, or nil if it does not exist.
func (e *env) read(name string) []byte {
	e.t.Helper()
	b, err := os.ReadFile(e.path(name))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		e.t.Fatal(err)
	}
	if b == nil {
		b = []byte{}
	}
	return b
}
