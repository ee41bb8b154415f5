//go:build !unix

package store

import "os"

// unlockFile does nothing where bbolt locks differently; closing the file is all there is.
func unlockFile(*os.File) {}
