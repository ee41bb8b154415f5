//go:build !unix

package cdi

import (
	"errors"
	"io/fs"
	"os"
)

// renameOpen: not on Windows, where an open file cannot be renamed.
const renameOpen = false

// tempFile is a temporary spec file being written (see tempfile_unix.go, the one the
// runtimes that read CDI specs run on).
type tempFile struct{ f *os.File }

func createTemp(dir string) (*tempFile, error) {
	f, err := os.CreateTemp(dir, tempPrefix+"*"+tempSuffix)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err // without the random name, so a failure reads the same each time
		}
		return nil, err
	}
	if err := f.Chmod(specFileMode); err != nil {
		f.Close()
		os.Remove(f.Name())
		return nil, err
	}
	return &tempFile{f: f}, nil
}

func (t *tempFile) write(data []byte) error    { _, err := t.f.Write(data); return err }
func (t *tempFile) close() error               { return t.f.Close() }
func (t *tempFile) renameTo(path string) error { return os.Rename(t.f.Name(), path) }
func (t *tempFile) remove()                    { os.Remove(t.f.Name()) }
