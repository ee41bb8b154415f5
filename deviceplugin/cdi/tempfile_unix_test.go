//go:build unix

package cdi

import (
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
)

// A spec file is specFileMode whatever the process's umask, with the chmod made only
// where the umask takes bits of it; and a failed write leaves no temporary file.
func TestWriteAtomicModeWhateverTheUmask(t *testing.T) {
	dir := t.TempDir()
	defer func() { umaskStrips = sync.OnceValue(readUmaskStrips) }()
	for _, tc := range []struct {
		mask   int
		strips bool
	}{{0o077, true}, {0o022, false}, {0o027, true}, {0o000, false}, {0o777, true}} {
		old := syscall.Umask(tc.mask)
		umaskStrips = sync.OnceValue(readUmaskStrips)
		strips := umaskStrips()
		path := filepath.Join(dir, "spec.json")
		err := (&ahead{dir: dir}).writeAtomic(path, []byte(`{"cdiVersion":"0.6.0"}`))
		syscall.Umask(old)
		if err != nil {
			t.Fatalf("umask %04o: %v", tc.mask, err)
		}
		if strips != tc.strips {
			t.Errorf("umask %04o: read as taking bits of %04o: %v, want %v", tc.mask, specFileMode, strips, tc.strips)
		}
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if m := fi.Mode().Perm(); m != specFileMode {
			t.Errorf("umask %04o: spec file mode %04o, want %04o", tc.mask, m, specFileMode)
		}
		if got, _ := os.ReadFile(path); string(got) != `{"cdiVersion":"0.6.0"}` {
			t.Errorf("umask %04o: spec file holds %q", tc.mask, got)
		}
	}
	// A directory that is not there is made; one that cannot be is an error that names
	// it, with no temporary file left behind.
	sub := filepath.Join(dir, "made", "here")
	if err := (&ahead{dir: sub}).writeAtomic(filepath.Join(sub, "s.json"), []byte("{}")); err != nil {
		t.Fatalf("missing directory: %v", err)
	}
	if err := (&ahead{dir: dir}).writeAtomic(filepath.Join(dir, "made"), []byte("{}")); err == nil {
		t.Error("rename over a non-empty directory: no error")
	}
	entries, _ := filepath.Glob(filepath.Join(dir, "spec.*.tmp"))
	if len(entries) != 0 {
		t.Errorf("temporary files left: %v", entries)
	}
}
