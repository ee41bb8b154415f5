//go:build linux

package pluginloader

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

func TestBeingWritten(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "plugin")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if writing, known := beingWritten(path); !writing || !known {
		t.Errorf("file open for writing: beingWritten = %v, %v; want true, true", writing, known)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if writing, known := beingWritten(path); writing || !known {
		t.Errorf("closed file: beingWritten = %v, %v; want false, true", writing, known)
	}
	// Opened for reading only, by someone else: not a writer.
	r, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if writing, _ := beingWritten(path); writing {
		t.Error("file open for reading only: beingWritten says it is being written")
	}

	// A FIFO (swapped in after the listing checked for a regular file) must not block
	// the watcher: opening one for reading waits for a writer unless non-blocking.
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if writing, known := beingWritten(fifo); writing || known {
		t.Errorf("FIFO: beingWritten = %v, %v; want false, false (cannot tell)", writing, known)
	}
	if writing, known := beingWritten(filepath.Join(dir, "missing")); writing || known {
		t.Errorf("missing file: beingWritten = %v, %v; want false, false", writing, known)
	}
}
