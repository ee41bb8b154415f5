package cutfs

import (
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// What the mount remembers between syncs. Everything here runs with FS.mu held
// exclusively, before the change it records is made to the backing files.

// blockSize is the unit of unsynced data: a cut keeps or drops whole blocks.
const blockSize = 4096

// key names an object (file, directory, symlink) of the backing file system; unlike a
// path it survives renames. An object the mount still needs is held open, so its inode
// number is not reused; a new object clears whatever was known under its key.
type key struct{ dev, ino uint64 }

func keyOf(st *unix.Stat_t) key { return key{dev: uint64(st.Dev), ino: uint64(st.Ino)} }

// fileData is the synced state of a file changed since its last fsync.
type fileData struct {
	size int64            // the size at the last fsync
	undo map[int64][]byte // dirty block -> its synced bytes (nil past the synced size)
}

// dirSnap is a directory's listing as of its last fsync, taken before its first change
// since.
type dirSnap struct{ entries map[string]entry }

// entry is one name in a directory listing.
type entry struct {
	key key
	dir bool
}

// markDirty records that bytes [lo, hi) of the file open as file, key k, are about to
// change: the first time a block changes after a sync, its synced content is saved.
// data is false when only the size changes (a truncate): blocks past the synced size
// then need no record, as the synced size alone puts them back.
func (f *FS) markDirty(k key, file *os.File, lo, hi int64, data bool) error {
	d := f.files[k]
	if d == nil {
		var st unix.Stat_t
		if err := unix.Fstat(int(file.Fd()), &st); err != nil {
			return err
		}
		d = &fileData{size: st.Size, undo: map[int64][]byte{}}
		f.files[k] = d
	}
	var rd *os.File // file, or a readable descriptor of it when file is write-only
	defer func() {
		if rd != nil && rd != file {
			rd.Close()
		}
	}()
	for b := max(lo, 0) / blockSize; b*blockSize < hi; b++ {
		if _, ok := d.undo[b]; ok {
			continue
		}
		start := b * blockSize
		n := min(blockSize, d.size-start)
		if n <= 0 {
			if !data {
				break
			}
			d.undo[b] = nil
			continue
		}
		if rd == nil {
			var err error
			if rd, err = readable(file); err != nil {
				return err
			}
		}
		// The block has not changed since the sync, so the file holds its synced bytes.
		buf := make([]byte, n)
		if _, err := rd.ReadAt(buf, start); err != nil && err != io.EOF {
			return err
		}
		d.undo[b] = buf
	}
	return nil
}

// readable returns file if it was opened for reading, or else a new read-only
// descriptor of the same file (which works for an unlinked file too).
func readable(file *os.File) (*os.File, error) {
	fl, err := unix.FcntlInt(file.Fd(), unix.F_GETFL, 0)
	if err != nil {
		return nil, err
	}
	if fl&unix.O_ACCMODE != unix.O_WRONLY {
		return file, nil
	}
	return os.Open(fmt.Sprintf("/proc/self/fd/%d", file.Fd()))
}

// synced records an fsync of file k: its data and size are durable.
func (f *FS) synced(k key) { delete(f.files, k) }

// noteDirChange records that an entry of the directory at path dir is about to change:
// the first change since the directory's last fsync snapshots its listing.
func (f *FS) noteDirChange(dir string) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return err
	}
	k := keyOf(&st)
	if f.dirs[k] != nil {
		return nil
	}
	entries, err := listDir(dir)
	if err != nil {
		return err
	}
	f.dirs[k] = &dirSnap{entries: entries}
	return nil
}

// dirSynced records an fsync of directory k: its listing is durable. Removed objects
// that no synced listing names any more are let go.
func (f *FS) dirSynced(k key) {
	delete(f.dirs, k)
	for again := true; again; {
		again = false
		for hk, h := range f.held {
			if !f.durablyNamed(hk) {
				h.Close()
				delete(f.held, hk)
				// A removed directory's listing may have been what named others.
				if f.dirs[hk] != nil {
					delete(f.dirs, hk)
					again = true
				}
			}
		}
	}
}

// durablyNamed says whether a snapshot names object k. An object with no live name
// that a synced directory still names is always in a snapshot: a directory without one
// lists exactly its live names.
func (f *FS) durablyNamed(k key) bool {
	for _, s := range f.dirs {
		for _, e := range s.entries {
			if e.key == k {
				return true
			}
		}
	}
	return false
}

// created records a new object at path p: whatever was known under its key belongs to
// a dead object whose inode number was reused.
func (f *FS) created(p string) {
	var st unix.Stat_t
	if unix.Lstat(p, &st) == nil {
		k := keyOf(&st)
		delete(f.files, k)
		delete(f.dirs, k)
	}
}

// removal is a name about to go away (unlink, rmdir, or the target of a rename).
type removal struct {
	f       *FS
	k       key
	durable bool // a snapshot names it
	last    bool // its last name
}

// beforeRemove prepares the removal of the name p; its parent's change must be noted
// first. When p is the last name of an object a snapshot names, the object is held
// open so that a cut can put it back. done must be called once the removal succeeded.
func (f *FS) beforeRemove(p string) (*removal, error) {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return nil, nil // the request fails on its own
	}
	r := &removal{f: f, k: keyOf(&st)}
	isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	if isDir {
		// Its listing as of its last sync (rmdir needs it empty now, not then).
		if err := f.noteDirChange(p); err != nil {
			return nil, err
		}
	}
	r.last = isDir || st.Nlink <= 1
	r.durable = f.durablyNamed(r.k)
	if !r.last || !r.durable || f.held[r.k] != nil {
		return r, nil
	}
	flags := unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
	case unix.S_IFDIR:
		flags |= unix.O_DIRECTORY
	default: // symlinks, devices, fifos, sockets: kept by an O_PATH descriptor
		flags = unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC
	}
	fd, err := unix.Open(p, flags, 0)
	if err != nil {
		return nil, err
	}
	f.held[r.k] = os.NewFile(uintptr(fd), p)
	return r, nil
}

// done forgets an object that lost its last name and that no sync named: a cut has no
// use for it.
func (r *removal) done() {
	if r == nil || !r.last || r.durable {
		return
	}
	delete(r.f.files, r.k)
	delete(r.f.dirs, r.k)
}

// listDir returns the names in the directory dir and what they name.
func listDir(dir string) (map[string]entry, error) {
	sts, err := readDir(dir)
	if err != nil {
		return nil, err
	}
	m := make(map[string]entry, len(sts))
	for name, st := range sts {
		m[name] = entry{key: keyOf(&st), dir: st.Mode&unix.S_IFMT == unix.S_IFDIR}
	}
	return m, nil
}
