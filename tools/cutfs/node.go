package cutfs

import (
	"context"
	"os"
	"path/filepath"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// node is a file or directory of the mount: go-fuse's loopback node, with every
// request checked against the power and every change recorded before it is made.
type node struct {
	*fs.LoopbackNode
	cfs *FS
}

var (
	_ fs.NodeWrapChilder    = (*node)(nil)
	_ fs.NodeStatfser       = (*node)(nil)
	_ fs.NodeLookuper       = (*node)(nil)
	_ fs.NodeMknoder        = (*node)(nil)
	_ fs.NodeMkdirer        = (*node)(nil)
	_ fs.NodeRmdirer        = (*node)(nil)
	_ fs.NodeUnlinker       = (*node)(nil)
	_ fs.NodeRenamer        = (*node)(nil)
	_ fs.NodeCreater        = (*node)(nil)
	_ fs.NodeSymlinker      = (*node)(nil)
	_ fs.NodeLinker         = (*node)(nil)
	_ fs.NodeReadlinker     = (*node)(nil)
	_ fs.NodeOpener         = (*node)(nil)
	_ fs.NodeOpendirHandler = (*node)(nil)
	_ fs.NodeReaddirer      = (*node)(nil)
	_ fs.NodeGetattrer      = (*node)(nil)
	_ fs.NodeSetattrer      = (*node)(nil)
	_ fs.NodeGetxattrer     = (*node)(nil)
	_ fs.NodeSetxattrer     = (*node)(nil)
	_ fs.NodeRemovexattrer  = (*node)(nil)
	_ fs.NodeListxattrer    = (*node)(nil)
	_ fs.NodeCopyFileRanger = (*node)(nil)
	_ fs.NodeTmpfiler       = (*node)(nil)
	_ fs.NodeStatxer        = (*node)(nil)
)

// WrapChild makes every node the loopback creates one of ours.
func (n *node) WrapChild(ctx context.Context, ops fs.InodeEmbedder) fs.InodeEmbedder {
	return &node{LoopbackNode: ops.(*fs.LoopbackNode), cfs: n.cfs}
}

// path is the node's path in the backing directory.
func (n *node) path() string {
	return filepath.Join(n.RootData.Path, n.Path(n.Root()))
}

// inner is the loopback's handle under one of ours, for the loopback's methods.
func inner(f fs.FileHandle) fs.FileHandle {
	if h, ok := f.(*fileHandle); ok {
		return h.lf
	}
	return f
}

// Requests that change nothing.

func (n *node) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return errno
	}
	defer done()
	return n.LoopbackNode.Statfs(ctx, out)
}

func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	return n.LoopbackNode.Lookup(ctx, name, out)
}

func (n *node) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	return n.LoopbackNode.Readlink(ctx)
}

func (n *node) Readdir(ctx context.Context) (fs.DirStream, syscall.Errno) {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	return n.LoopbackNode.Readdir(ctx)
}

func (n *node) Getattr(ctx context.Context, f fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return errno
	}
	defer done()
	return n.LoopbackNode.Getattr(ctx, inner(f), out)
}

func (n *node) Statx(ctx context.Context, f fs.FileHandle, flags, mask uint32, out *fuse.StatxOut) syscall.Errno {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return errno
	}
	defer done()
	return n.LoopbackNode.Statx(ctx, inner(f), flags, mask, out)
}

func (n *node) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return 0, errno
	}
	defer done()
	return n.LoopbackNode.Getxattr(ctx, attr, dest)
}

func (n *node) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return 0, errno
	}
	defer done()
	return n.LoopbackNode.Listxattr(ctx, dest)
}

// Opening.

func (n *node) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return nil, 0, errno
	}
	defer done()
	if flags&syscall.O_TRUNC != 0 {
		if err := n.cfs.truncatePath(n.path(), 0); err != nil {
			return nil, 0, fs.ToErrno(err)
		}
	}
	fh, fuseFlags, errno := n.LoopbackNode.Open(ctx, flags)
	if errno != 0 {
		return nil, 0, errno
	}
	h, err := n.cfs.adopt(ctx, fh)
	if err != nil {
		return nil, 0, fs.ToErrno(err)
	}
	return h, fuseFlags, 0
}

func (n *node) OpendirHandle(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return nil, 0, errno
	}
	defer done()
	fd, err := unix.Open(n.path(), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, fs.ToErrno(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, 0, fs.ToErrno(err)
	}
	ds, errno := fs.NewLoopbackDirStreamFd(fd)
	if errno != 0 {
		unix.Close(fd)
		return nil, 0, errno
	}
	h := &dirHandle{cfs: n.cfs, k: keyOf(&st), ds: ds}
	n.cfs.handles[h] = struct{}{}
	return h, 0, 0
}

// Requests that change a directory.

func (n *node) Create(ctx context.Context, name string, flags, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	defer done()
	dir := n.path()
	p := filepath.Join(dir, name)
	var st unix.Stat_t
	existed := unix.Lstat(p, &st) == nil
	var err error
	switch {
	case !existed:
		err = n.cfs.noteDirChange(dir)
	case flags&syscall.O_TRUNC != 0:
		err = n.cfs.truncatePath(p, 0)
	}
	if err != nil {
		return nil, nil, 0, fs.ToErrno(err)
	}
	ino, fh, fuseFlags, errno := n.LoopbackNode.Create(ctx, name, flags, mode, out)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	if !existed {
		n.cfs.created(p)
	}
	h, err := n.cfs.adopt(ctx, fh)
	if err != nil {
		return nil, nil, 0, fs.ToErrno(err)
	}
	return ino, h, fuseFlags, 0
}

// newEntry runs make, which adds the entry name to the directory n, as a change of n
// that creates a new object.
func (n *node) newEntry(name string, make func() (*fs.Inode, syscall.Errno)) (*fs.Inode, syscall.Errno) {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	dir := n.path()
	if err := n.cfs.noteDirChange(dir); err != nil {
		return nil, fs.ToErrno(err)
	}
	ino, errno := make()
	if errno == 0 {
		n.cfs.created(filepath.Join(dir, name))
	}
	return ino, errno
}

func (n *node) Mknod(ctx context.Context, name string, mode, rdev uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return n.newEntry(name, func() (*fs.Inode, syscall.Errno) {
		return n.LoopbackNode.Mknod(ctx, name, mode, rdev, out)
	})
}

func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return n.newEntry(name, func() (*fs.Inode, syscall.Errno) {
		return n.LoopbackNode.Mkdir(ctx, name, mode, out)
	})
}

func (n *node) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return n.newEntry(name, func() (*fs.Inode, syscall.Errno) {
		return n.LoopbackNode.Symlink(ctx, target, name, out)
	})
}

func (n *node) Link(ctx context.Context, target fs.InodeEmbedder, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	if err := n.cfs.noteDirChange(n.path()); err != nil {
		return nil, fs.ToErrno(err)
	}
	return n.LoopbackNode.Link(ctx, target, name, out)
}

func (n *node) Unlink(ctx context.Context, name string) syscall.Errno {
	return n.remove(name, func() syscall.Errno { return n.LoopbackNode.Unlink(ctx, name) })
}

func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno {
	return n.remove(name, func() syscall.Errno { return n.LoopbackNode.Rmdir(ctx, name) })
}

// remove runs rm, which removes the entry name from the directory n.
func (n *node) remove(name string, rm func() syscall.Errno) syscall.Errno {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return errno
	}
	defer done()
	dir := n.path()
	if err := n.cfs.noteDirChange(dir); err != nil {
		return fs.ToErrno(err)
	}
	r, err := n.cfs.beforeRemove(filepath.Join(dir, name))
	if err != nil {
		return fs.ToErrno(err)
	}
	errno = rm()
	if errno == 0 {
		r.done()
	}
	return errno
}

func (n *node) Rename(ctx context.Context, name string, newParent fs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return errno
	}
	defer done()
	np, ok := newParent.(*node)
	if !ok {
		return syscall.EXDEV
	}
	dir, newDir := n.path(), np.path()
	if err := n.cfs.noteDirChange(dir); err != nil {
		return fs.ToErrno(err)
	}
	if err := n.cfs.noteDirChange(newDir); err != nil {
		return fs.ToErrno(err)
	}
	var r *removal
	if flags&unix.RENAME_EXCHANGE == 0 {
		var err error
		if r, err = n.cfs.beforeRemove(filepath.Join(newDir, newName)); err != nil {
			return fs.ToErrno(err)
		}
	}
	errno = n.LoopbackNode.Rename(ctx, name, newParent, newName, flags)
	if errno == 0 {
		r.done()
	}
	return errno
}

// Requests that change a file.

func (n *node) Setattr(ctx context.Context, f fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return errno
	}
	defer done()
	if size, ok := in.GetSize(); ok {
		var err error
		if h, ok := f.(*fileHandle); ok {
			err = n.cfs.truncate(h.k, h.f, int64(size))
		} else {
			err = n.cfs.truncatePath(n.path(), int64(size))
		}
		if err != nil {
			return fs.ToErrno(err)
		}
	}
	return n.LoopbackNode.Setattr(ctx, inner(f), in, out)
}

func (n *node) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return errno
	}
	defer done()
	return n.LoopbackNode.Setxattr(ctx, attr, data, flags)
}

func (n *node) Removexattr(ctx context.Context, attr string) syscall.Errno {
	done, errno := n.cfs.enter(true)
	if errno != 0 {
		return errno
	}
	defer done()
	return n.LoopbackNode.Removexattr(ctx, attr)
}

// Requests the mount refuses: the kernel falls back to reads and writes for
// copy_file_range; O_TMPFILE fails.

func (n *node) CopyFileRange(ctx context.Context, fhIn fs.FileHandle, offIn uint64, out *fs.Inode, fhOut fs.FileHandle, offOut uint64, length uint64, flags uint64) (uint32, syscall.Errno) {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return 0, errno
	}
	done()
	return 0, syscall.ENOSYS
}

func (n *node) Tmpfile(ctx context.Context, flags, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	done, errno := n.cfs.enter(false)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	done()
	return nil, nil, 0, syscall.EOPNOTSUPP
}

// truncate records that file k, open as file, is about to get the given size.
func (f *FS) truncate(k key, file *os.File, size int64) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(file.Fd()), &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil
	}
	return f.markDirty(k, file, min(st.Size, size), max(st.Size, size), false)
}

// truncatePath is truncate for the file at path p.
func (f *FS) truncatePath(p string, size int64) error {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil // the request fails on its own, or truncates nothing of ours
	}
	file, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer file.Close()
	return f.truncate(keyOf(&st), file, size)
}

// adopt turns the loopback's new handle into one of ours, owning a duplicate of its
// descriptor (the loopback does not show its *os.File).
func (f *FS) adopt(ctx context.Context, fh fs.FileHandle) (*fileHandle, error) {
	lf := fh.(*fs.LoopbackFile)
	defer lf.Release(ctx)
	fd, ok := lf.PassthroughFd()
	if !ok {
		return nil, syscall.EBADF
	}
	nfd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	file := os.NewFile(uintptr(nfd), "cutfs")
	var st unix.Stat_t
	if err := unix.Fstat(nfd, &st); err != nil {
		file.Close()
		return nil, err
	}
	h := &fileHandle{cfs: f, k: keyOf(&st), f: file, lf: fs.NewLoopbackFileFromOS(file)}
	f.handles[h] = struct{}{}
	return h, nil
}
