//go:build !linux

// Package datasync flushes a file's data to its disk.
package datasync

import "os"

// File flushes f (fsync where there is no fdatasync).
func File(f *os.File) error { return f.Sync() }
