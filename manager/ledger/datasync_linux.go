package ledger

import (
	"os"
	"syscall"
)

// datasync flushes f's data, and only the metadata needed to read it back (fdatasync):
// a write within the file's size needs none.
func datasync(f *os.File) error { return syscall.Fdatasync(int(f.Fd())) }
