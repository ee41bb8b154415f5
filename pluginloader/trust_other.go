//go:build !unix

package pluginloader

import (
	"fmt"
	"os"
	"path/filepath"
)

// CheckPath resolves path and, off Unix, where files have no owner to check, only
// refuses a world-writable file (see the Unix version for the rules there).
func CheckPath(path string) (string, error) {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return "", err
	}
	fi, err := os.Stat(real)
	if err != nil {
		return "", err
	}
	if fi.Mode().Perm()&0o002 != 0 {
		return "", fmt.Errorf("%s is world-writable (mode %s): %w", real, fi.Mode(), ErrInsecurePath)
	}
	return real, nil
}

func checkDir(path string) (string, error) { return CheckPath(path) }
