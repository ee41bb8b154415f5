package cdi

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// A spec write's temporary file is tempPrefix, a random number, tempSuffix, in the
// spec's directory (createTemp); RemoveStaleTemps removes those a killed writer left.
const (
	tempPrefix = "spec."
	tempSuffix = ".tmp"
)

// maxWritten bounds the descriptors of written files a directory keeps open for the
// next Ahead to close; past it, Write closes its own.
const maxWritten = 16

// ahead is a spec directory's temporary file made before the Write that will use it,
// and the descriptors of the files written since, left for Ahead to close: the work
// of a spec write that can be done while no one waits. Shared by a writer and its
// siblings.
type ahead struct {
	dir string

	mu      sync.Mutex
	used    bool        // Ahead was called: Write leaves its descriptor to it
	ready   *tempFile   // made by Ahead, not yet written
	written []*tempFile // renamed into place, descriptors still open
}

// Ahead does the part of the next Write in w's directory (w's or a sibling's) that
// does not depend on the spec: it makes the temporary file that Write would make, and
// closes the files earlier Writes left open for it. A Write that finds the file makes
// two system calls (write, rename) rather than four, and leaves the close to the next
// Ahead. For a caller that writes specs while someone waits (the DRA driver, one per
// claim in NodePrepareResources) and has moments when no one does. Without Ahead,
// Write does all of it itself. Discard undoes it.
func (w *Writer) Ahead() error {
	a := w.ahead
	a.mu.Lock()
	a.used = true
	written := a.written
	a.written = nil
	need := a.ready == nil
	a.mu.Unlock()
	for _, t := range written {
		t.close()
	}
	if !need {
		return nil
	}
	t, err := createTempIn(a.dir)
	if err != nil {
		return fmt.Errorf("cdi: %w", err)
	}
	a.mu.Lock()
	if a.ready == nil {
		a.ready, t = t, nil
	}
	a.mu.Unlock()
	if t != nil { // another Ahead was quicker
		t.close()
		t.remove()
	}
	return nil
}

// Discard removes the temporary file Ahead made, if unused, and closes the
// descriptors it would have closed; Write does all of its work itself again until the
// next Ahead. For a caller that stops.
func (w *Writer) Discard() {
	a := w.ahead
	a.mu.Lock()
	a.used = false
	ready, written := a.ready, a.written
	a.ready, a.written = nil, nil
	a.mu.Unlock()
	for _, t := range written {
		t.close()
	}
	if ready != nil {
		ready.close()
		ready.remove()
	}
}

// writeAtomic writes data to path through a temporary file in the directory (made
// 0755 if missing) renamed over it, mode specFileMode whatever the umask: readers of
// the path see the old content or the new, never a part. It takes Ahead's file when
// there is one.
func (a *ahead) writeAtomic(path string, data []byte) error {
	a.mu.Lock()
	t, keep := a.ready, renameOpen && a.used && len(a.written) < maxWritten
	a.ready = nil
	a.mu.Unlock()
	fresh := t == nil
	if fresh {
		var err error
		if t, err = createTempIn(a.dir); err != nil {
			return err
		}
	}
	err := t.write(data)
	if err == nil && !keep {
		err = t.close()
	}
	if err == nil {
		err = t.renameTo(path)
		if errors.Is(err, fs.ErrNotExist) && !fresh {
			// Ahead's file is gone (the directory was cleaned): once more, afresh.
			t.close()
			a.mu.Lock()
			a.used = false // until the next Ahead: this write closes its own
			a.mu.Unlock()
			return a.writeAtomic(path, data)
		}
	}
	if err != nil {
		t.close()
		t.remove()
		return err
	}
	if keep {
		a.mu.Lock()
		keep = a.used // not if Discard came meanwhile
		if keep {
			a.written = append(a.written, t)
		}
		a.mu.Unlock()
		if !keep {
			t.close()
		}
	}
	return nil
}

// RemoveStaleTemps removes the temporary files of spec writes (tempPrefix...tempSuffix) in dir
// last modified more than olderThan ago: what a writer killed in a write, or killed
// holding a file made by Ahead, left behind. A writer whose file made ahead is removed
// writes its next spec afresh. A missing dir has none.
func RemoveStaleTemps(dir string, olderThan time.Duration) (removed int, err error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("cdi: %w", err)
	}
	cutoff := time.Now().Add(-olderThan)
	var errs []error
	for _, e := range entries {
		name := e.Name()
		if !e.Type().IsRegular() || !strings.HasPrefix(name, tempPrefix) || !strings.HasSuffix(name, tempSuffix) {
			continue
		}
		info, err := e.Info()
		if err != nil || !info.ModTime().Before(cutoff) {
			continue // gone meanwhile, or in use
		}
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("cdi: %w", err))
			continue
		}
		removed++
	}
	return removed, errors.Join(errs...)
}

// createTempIn is createTemp, making dir (0755) when it is missing.
func createTempIn(dir string) (*tempFile, error) {
	t, err := createTemp(dir)
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		t, err = createTemp(dir)
	}
	if err != nil {
		return nil, fmt.Errorf("create a temporary file in %s: %w", dir, err)
	}
	return t, nil
}
