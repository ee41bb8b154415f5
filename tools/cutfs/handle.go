package cutfs

import (
	"bytes"
	"context"
	"io"
	"os"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// fileHandle is an open file of the mount. Its descriptor f is used only with FS.mu
// held, and closed (at Release, a cut or an unmount) with it held exclusively.
type fileHandle struct {
	cfs    *FS
	k      key
	f      *os.File
	lf     *fs.LoopbackFile // f, for the loopback's attribute methods
	closed bool
}

var (
	_ fs.FileReader    = (*fileHandle)(nil)
	_ fs.FileWriter    = (*fileHandle)(nil)
	_ fs.FileWritever  = (*fileHandle)(nil)
	_ fs.FileFsyncer   = (*fileHandle)(nil)
	_ fs.FileFlusher   = (*fileHandle)(nil)
	_ fs.FileReleaser  = (*fileHandle)(nil)
	_ fs.FileGetattrer = (*fileHandle)(nil)
	_ fs.FileStatxer   = (*fileHandle)(nil)
	_ fs.FileLseeker   = (*fileHandle)(nil)
	_ fs.FileAllocater = (*fileHandle)(nil)
)

func (h *fileHandle) closeBacking() {
	if !h.closed {
		h.closed = true
		h.f.Close()
	}
}

// Read reads at once (not lazily, as the loopback does), while the descriptor is
// known to be open.
func (h *fileHandle) Read(ctx context.Context, buf []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	done, errno := h.cfs.enter(false)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	n, err := h.f.ReadAt(buf, off)
	if err != nil && err != io.EOF {
		return nil, fs.ToErrno(err)
	}
	return fuse.ReadResultData(buf[:n]), 0
}

func (h *fileHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	done, errno := h.cfs.enter(true)
	if errno != 0 {
		return 0, errno
	}
	defer done()
	if err := h.cfs.markDirty(h.k, h.f, off, off+int64(len(data)), true); err != nil {
		return 0, fs.ToErrno(err)
	}
	n, err := h.f.WriteAt(data, off)
	if err != nil {
		return uint32(n), fs.ToErrno(err)
	}
	return uint32(n), 0
}

func (h *fileHandle) Writev(ctx context.Context, data [][]byte, off int64) (uint32, syscall.Errno) {
	return h.Write(ctx, bytes.Join(data, nil), off)
}

// Fsync makes the file's data and size durable (with or without the datasync flag),
// or cuts the power if it is the armed sync.
func (h *fileHandle) Fsync(ctx context.Context, flags uint32) syscall.Errno {
	return h.cfs.syncRequest(func() { h.cfs.synced(h.k) })
}

func (h *fileHandle) Flush(ctx context.Context) syscall.Errno {
	done, errno := h.cfs.enter(false)
	if errno != 0 {
		return errno
	}
	done()
	return 0
}

// Release closes the descriptor, after a cut too.
func (h *fileHandle) Release(ctx context.Context) syscall.Errno {
	h.cfs.mu.Lock()
	defer h.cfs.mu.Unlock()
	h.closeBacking()
	delete(h.cfs.handles, h)
	return 0
}

func (h *fileHandle) Getattr(ctx context.Context, out *fuse.AttrOut) syscall.Errno {
	done, errno := h.cfs.enter(false)
	if errno != 0 {
		return errno
	}
	defer done()
	return h.lf.Getattr(ctx, out)
}

func (h *fileHandle) Statx(ctx context.Context, flags, mask uint32, out *fuse.StatxOut) syscall.Errno {
	done, errno := h.cfs.enter(false)
	if errno != 0 {
		return errno
	}
	defer done()
	return h.lf.Statx(ctx, flags, mask, out)
}

func (h *fileHandle) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	done, errno := h.cfs.enter(false)
	if errno != 0 {
		return 0, errno
	}
	defer done()
	return h.lf.Lseek(ctx, off, whence)
}

func (h *fileHandle) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	done, errno := h.cfs.enter(true)
	if errno != 0 {
		return errno
	}
	defer done()
	if err := h.cfs.markDirty(h.k, h.f, int64(off), int64(off+size), true); err != nil {
		return fs.ToErrno(err)
	}
	return h.lf.Allocate(ctx, off, size, mode)
}

// dirHandle is an open directory of the mount, the loopback's directory stream.
type dirHandle struct {
	cfs *FS
	k   key
	ds  fs.DirStream
}

var (
	_ fs.FileReaddirenter = (*dirHandle)(nil)
	_ fs.FileSeekdirer    = (*dirHandle)(nil)
	_ fs.FileReleasedirer = (*dirHandle)(nil)
	_ fs.FileFsyncdirer   = (*dirHandle)(nil)
)

func (h *dirHandle) closeBacking() { h.ds.Close() }

func (h *dirHandle) Readdirent(ctx context.Context) (*fuse.DirEntry, syscall.Errno) {
	done, errno := h.cfs.enter(false)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	return h.ds.(fs.FileReaddirenter).Readdirent(ctx)
}

func (h *dirHandle) Seekdir(ctx context.Context, off uint64) syscall.Errno {
	done, errno := h.cfs.enter(false)
	if errno != 0 {
		return errno
	}
	defer done()
	return h.ds.(fs.FileSeekdirer).Seekdir(ctx, off)
}

func (h *dirHandle) Releasedir(ctx context.Context, flags uint32) {
	h.cfs.mu.Lock()
	defer h.cfs.mu.Unlock()
	h.closeBacking()
	delete(h.cfs.handles, h)
}

// Fsyncdir makes the directory's entries durable, or cuts the power if it is the armed
// sync.
func (h *dirHandle) Fsyncdir(ctx context.Context, flags uint32) syscall.Errno {
	return h.cfs.syncRequest(func() { h.cfs.dirSynced(h.k) })
}
