//go:build unix

package endpoint

import (
	"fmt"
	"os"
	"syscall"
)

// lockDir takes an exclusive flock on dir and returns its release. Listen holds it while
// it binds or replaces a socket in dir, so that of two hosts that find the same stale
// socket, the second sees the first one's live socket instead of removing it.
func lockDir(dir string) (unlock func(), err error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("lock socket directory: %w", err)
	}
	for {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock socket directory %s: %w", dir, err)
	}
	return func() { f.Close() }, nil // closing the only descriptor drops the lock
}
