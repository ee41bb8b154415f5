//go:build unix

package cdi

import (
	"bufio"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// renameOpen: a file may be renamed while open, its descriptor closed later.
const renameOpen = true

// tempFile is a temporary spec file being written: its descriptor, not an *os.File.
// os.CreateTemp, Chmod, Close and os.Rename make 11 system calls for a spec (the
// descriptor offered to the network poller, which refuses a regular file, its flags
// read and set back twice, a chmod, an lstat before the rename); these make 4 (open,
// write, close, rename) and a chmod only where the umask would take bits of
// specFileMode. On a VM a system call costs 10 to 20 µs, and the DRA driver writes a
// spec per claim while the kubelet waits.
type tempFile struct {
	name string
	fd   int
}

// createTemp makes a new file tempPrefix, a random number, tempSuffix in dir, mode
// specFileMode.
func createTemp(dir string) (*tempFile, error) {
	for try := 0; ; try++ {
		name := filepath.Join(dir, tempPrefix+strconv.FormatUint(uint64(rand.Uint32()), 10)+tempSuffix)
		fd, err := openExcl(name)
		if errors.Is(err, syscall.EEXIST) && try < 10000 {
			continue
		}
		if err != nil {
			return nil, err // without the random name, so a failure reads the same each time
		}
		t := &tempFile{name: name, fd: fd}
		if umaskStrips() {
			if err := retryEINTR(func() error { return syscall.Fchmod(fd, specFileMode) }); err != nil {
				t.close()
				t.remove()
				return nil, err
			}
		}
		return t, nil
	}
}

func openExcl(name string) (fd int, err error) {
	err = retryEINTR(func() (err error) {
		fd, err = syscall.Open(name, syscall.O_WRONLY|syscall.O_CREAT|syscall.O_EXCL|syscall.O_CLOEXEC, specFileMode)
		return err
	})
	return fd, err
}

func (t *tempFile) write(data []byte) error {
	for len(data) > 0 {
		n, err := syscall.Write(t.fd, data)
		switch {
		case err == syscall.EINTR:
			continue
		case err != nil:
			return err
		case n <= 0:
			return io.ErrShortWrite
		}
		data = data[n:]
	}
	return nil
}

func (t *tempFile) close() error {
	fd := t.fd
	if fd < 0 {
		return nil
	}
	t.fd = -1
	return syscall.Close(fd) // not retried on EINTR: the descriptor is gone either way
}

func (t *tempFile) renameTo(path string) error {
	return retryEINTR(func() error { return syscall.Rename(t.name, path) })
}

func (t *tempFile) remove() { _ = syscall.Unlink(t.name) }

func retryEINTR(f func() error) error {
	for {
		if err := f(); err != syscall.EINTR {
			return err
		}
	}
}

// umaskStrips reports whether the process's umask takes bits of specFileMode, read
// once from /proc/self/status (the umask system call can only read it by changing it,
// which another thread creating a file at that moment would feel). Where it cannot be
// read, it answers true: a chmod too many costs a system call, one too few a spec
// file the runtime may not read.
var umaskStrips = sync.OnceValue(readUmaskStrips)

func readUmaskStrips() bool {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return true
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "Umask:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32)
			return err != nil || m&specFileMode != 0
		}
	}
	return true
}
