//go:build !unix

package main

import "os"

// makeDevDir creates -dev's temporary directory in tmp. Without flock there is no lock.
func makeDevDir(tmp string) (dir string, release func(), err error) {
	dir, err = os.MkdirTemp(tmp, devDirPrefix)
	return dir, func() {}, err
}

// cleanDeadDevDirs does nothing where a dead agent cannot be told from a live one.
func cleanDeadDevDirs(string) ([]string, error) { return nil, nil }
