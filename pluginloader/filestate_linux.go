//go:build linux

package pluginloader

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// statFile describes the file at path (symlinks followed), for the plugin dir watcher.
func statFile(path string) (FileState, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return FileState{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return FileState{
		id:    fileID{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim.Nano()},
		ctime: st.Ctim.Nano(),
		mode:  st.Mode,
	}, nil
}

// beingWritten reports whether some process has the file at path open for writing, and
// whether that could be told. It takes a read lease on the file and lets it go at once:
// Linux grants one only while nobody has the file open for writing. That needs the
// agent to own the file (or CAP_LEASE) and a file system with leases; elsewhere known is
// false. A writer opening the file in the microseconds the lease is held waits that long.
func beingWritten(path string) (writing, known bool) {
	// Non-blocking: a FIFO swapped in since the listing must not hang the watcher.
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return false, false
	}
	defer f.Close()
	fd := f.Fd()
	if _, err := unix.FcntlInt(fd, unix.F_SETLEASE, unix.F_RDLCK); err != nil {
		return errors.Is(err, unix.EAGAIN), errors.Is(err, unix.EAGAIN)
	}
	_, _ = unix.FcntlInt(fd, unix.F_SETLEASE, unix.F_UNLCK) // closing the file ends it anyway
	return false, true
}
