// Package datasync flushes a file's data to its disk.
package datasync

import (
	"os"
	"syscall"
)

// File flushes f's data, and only the metadata needed to read it back (fdatasync): a
// write within the file's size, into blocks it already has, needs none.
func File(f *os.File) error { return syscall.Fdatasync(int(f.Fd())) }
