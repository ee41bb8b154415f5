//go:build unix

package store

import (
	"os"
	"syscall"
)

// unlockFile drops bbolt's flock on f. Closing f alone would not: the memory map bbolt
// made keeps the open file, and with it the lock, alive.
func unlockFile(f *os.File) {
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN) // best effort on a path that already failed
}
