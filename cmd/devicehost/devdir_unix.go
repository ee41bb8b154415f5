//go:build unix

package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/devicehost/devicehost/manager/ledger"
)

// devDirMadeHook, set by tests only, runs between creating a dev directory and locking
// it: the moment another agent's clean-up could take the directory away.
var devDirMadeHook func(dir string)

// makeDevDir creates -dev's temporary directory in tmp and takes its lock (devLockName),
// which release drops; call release after the directory is removed. A directory that a
// starting agent's cleanDeadDevDirs removes before the lock is taken is noticed (the
// lock file is no longer the one at the path) and made again.
func makeDevDir(tmp string) (dir string, release func(), err error) {
	for range 5 {
		dir, err := os.MkdirTemp(tmp, devDirPrefix)
		if err != nil {
			return "", nil, err
		}
		if devDirMadeHook != nil {
			devDirMadeHook(dir)
		}
		lockPath := filepath.Join(dir, devLockName)
		f, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
		if errors.Is(err, os.ErrNotExist) {
			continue // removed under us: make another
		}
		if err != nil {
			os.RemoveAll(dir)
			return "", nil, fmt.Errorf("lock %s: %w", lockPath, err)
		}
		if err := flock(f, unix.LOCK_EX); err != nil {
			f.Close()
			os.RemoveAll(dir)
			return "", nil, fmt.Errorf("lock %s: %w", lockPath, err)
		}
		held, err1 := f.Stat()
		there, err2 := os.Lstat(lockPath)
		if err1 == nil && err2 == nil && os.SameFile(held, there) {
			return dir, func() { f.Close() }, nil
		}
		f.Close() // removed while we were locking it: make another
	}
	return "", nil, errors.New("could not keep a temporary directory: it was removed as soon as it was made, five times")
}

// cleanDeadDevDirs removes, from tmp, the temporary directories that -dev agents which
// are no longer running left behind (a SIGKILLed agent cannot remove its own), and
// returns the paths removed. It touches only directories named devicehost-dev-*, owned
// by this user, not symlinks, and only those provably abandoned: their lock (devLockName)
// free, and, for directories of devicehost versions that did not lock (no lock file),
// their socket not accepting connections and their state file not locked by bbolt. It
// holds the lock while it removes, so an agent that starts then waits.
func cleanDeadDevDirs(tmp string) ([]string, error) {
	entries, err := os.ReadDir(tmp)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", tmp, err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), devDirPrefix) {
			continue
		}
		dir := filepath.Join(tmp, e.Name())
		ok, err := removeIfDead(dir)
		if err != nil {
			errs = append(errs, err)
		}
		if ok {
			removed = append(removed, dir)
		}
	}
	return removed, errors.Join(errs...)
}

// removeIfDead removes dir if it is a dev directory of ours no running agent uses.
func removeIfDead(dir string) (bool, error) {
	fi, err := os.Lstat(dir)
	if err != nil || !fi.IsDir() { // gone, or not a directory (a symlink is not followed)
		return false, nil
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || int(st.Uid) != os.Getuid() {
		return false, nil
	}
	lock, err := os.OpenFile(filepath.Join(dir, devLockName), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	switch {
	case err == nil:
		defer lock.Close()
		if err := flock(lock, unix.LOCK_EX|unix.LOCK_NB); err != nil {
			return false, nil // EWOULDBLOCK: its agent runs
		}
	case errors.Is(err, os.ErrNotExist):
		// An older agent's directory, or one an agent is making this moment (which
		// makes another if this one goes): ask its socket and its state file.
		if alive(dir) {
			return false, nil
		}
	default:
		return false, nil
	}
	if err := os.RemoveAll(dir); err != nil {
		return false, fmt.Errorf("remove a dead dev agent's directory: %w", err)
	}
	return true, nil
}

// alive reports whether anything shows a process still using dir: its socket accepts
// connections (or cannot be told dead), or its ledger file is locked.
func alive(dir string) bool {
	sock := filepath.Join(dir, devSocketName)
	if fi, err := os.Lstat(sock); err == nil && fi.Mode()&os.ModeSocket != 0 {
		conn, err := net.DialTimeout("unix", sock, time.Second)
		if err == nil {
			conn.Close()
			return true
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return true // cannot tell
		}
	}
	db, err := os.OpenFile(filepath.Join(dir, devStateName, ledger.DefaultFileName), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	defer db.Close()
	return flock(db, unix.LOCK_SH|unix.LOCK_NB) != nil // bbolt holds a flock while open
}

// flock is unix.Flock on f, retried on EINTR.
func flock(f *os.File, how int) error {
	for {
		err := unix.Flock(int(f.Fd()), how)
		if err != unix.EINTR {
			return err
		}
	}
}
