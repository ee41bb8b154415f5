package cutfs

import (
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// The cut: the backing directory is rewritten to what the disk holds after it. All of
// it runs with FS.mu held exclusively, after every handle was closed.

// restore puts the directories back to their synced listings (when any changed), then
// each changed file back to its synced data (or, for KeepRandom, partly so).
func (f *FS) restore(mode Mode, rng *rand.Rand) (CutStats, error) {
	var stats CutStats
	t, err := walk(f.backing)
	if err != nil {
		return stats, err
	}
	paths := map[key]string{} // where each object is after the directories are back
	if len(f.dirs) > 0 {
		stats.UndoneDirChanges = f.countDirChanges(t)
		if paths, err = f.rebuild(t); err != nil {
			return stats, err
		}
	} else {
		for k, o := range t.objs {
			paths[k] = filepath.Join(f.backing, o.rel)
		}
	}
	type dirty struct {
		path string
		d    *fileData
	}
	var files []dirty
	for k, d := range f.files {
		if p, ok := paths[k]; ok {
			files = append(files, dirty{p, d})
		} else {
			stats.DroppedBlocks += len(d.undo) // the file is gone
		}
	}
	// A fixed order, so that a seeded rng makes the same choices.
	slices.SortFunc(files, func(a, b dirty) int { return strings.Compare(a.path, b.path) })
	for _, fd := range files {
		if err := rollback(fd.path, fd.d, mode, rng, &stats); err != nil {
			return stats, err
		}
	}
	return stats, nil
}

// rollback puts the file at path p back to its synced state d.
func rollback(p string, d *fileData, mode Mode, rng *rand.Rand, stats *CutStats) error {
	file, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer file.Close()
	fi, err := file.Stat()
	if err != nil {
		return err
	}
	blocks := make([]int64, 0, len(d.undo))
	for b := range d.undo {
		blocks = append(blocks, b)
	}
	slices.Sort(blocks)
	size := d.size
	keep := make([]bool, len(blocks))
	if mode == KeepRandom {
		if fi.Size() != d.size && rng.IntN(2) == 1 {
			size = fi.Size()
		}
		for i := range keep {
			keep[i] = rng.IntN(2) == 1
		}
	}
	if err := file.Truncate(size); err != nil {
		return err
	}
	for i, b := range blocks {
		start := b * blockSize
		switch {
		case start >= size:
			stats.DroppedBlocks++
		case keep[i]:
			stats.KeptBlocks++
		default:
			stats.DroppedBlocks++
			// The synced bytes, then zeros where the synced file did not reach.
			buf := make([]byte, min(blockSize, size-start))
			copy(buf, d.undo[b])
			if _, err := file.WriteAt(buf, start); err != nil {
				return err
			}
		}
	}
	return nil
}

// tree is the backing directory as the cut found it.
type tree struct {
	root  key
	objs  map[key]liveObj          // every object below the root, by its first path
	lists map[key]map[string]entry // every directory's listing, the root's included
}

type liveObj struct {
	rel string // path relative to the root
	st  unix.Stat_t
}

func walk(root string) (*tree, error) {
	var st unix.Stat_t
	if err := unix.Lstat(root, &st); err != nil {
		return nil, err
	}
	t := &tree{root: keyOf(&st), objs: map[key]liveObj{}, lists: map[key]map[string]entry{}}
	return t, t.walkDir(root, "", t.root)
}

func (t *tree) walkDir(abs, rel string, k key) error {
	sts, err := readDir(abs)
	if err != nil {
		return err
	}
	list := make(map[string]entry, len(sts))
	t.lists[k] = list
	for name, st := range sts {
		ck := keyOf(&st)
		isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
		list[name] = entry{key: ck, dir: isDir}
		if _, seen := t.objs[ck]; seen {
			continue // another name of a file
		}
		crel := filepath.Join(rel, name)
		t.objs[ck] = liveObj{rel: crel, st: st}
		if isDir {
			if err := t.walkDir(filepath.Join(abs, name), crel, ck); err != nil {
				return err
			}
		}
	}
	return nil
}

// countDirChanges counts the names that differ between the snapshots and the live
// listings.
func (f *FS) countDirChanges(t *tree) int {
	n := 0
	for k, s := range f.dirs {
		live := t.lists[k]
		for name, e := range s.entries {
			if l, ok := live[name]; !ok || l != e {
				n++
			}
		}
		for name := range live {
			if _, ok := s.entries[name]; !ok {
				n++
			}
		}
	}
	return n
}

// rebuilder builds the synced tree: the live tree is moved aside, into old, and the
// synced tree is made anew at the root from the synced listings, moving each file (or
// linking, or copying it from its held descriptor) into place. Directories are made
// anew, with the old one's mode, owner and times. What is left in old is then removed.
type rebuilder struct {
	f      *FS
	t      *tree
	old    string
	placed map[key]string // object -> its first new path
	dirs   map[key]bool   // directories made
}

func (f *FS) rebuild(t *tree) (map[key]string, error) {
	rootList := f.durableList(t, t.root)
	old := ".cutfs-cut"
	for i := 1; ; i++ {
		_, live := t.lists[t.root][old]
		_, synced := rootList[old]
		if !live && !synced {
			break
		}
		old = fmt.Sprintf(".cutfs-cut%d", i)
	}
	old = filepath.Join(f.backing, old)
	if err := unix.Mkdir(old, 0o700); err != nil {
		return nil, err
	}
	for name := range t.lists[t.root] {
		if err := unix.Rename(filepath.Join(f.backing, name), filepath.Join(old, name)); err != nil {
			return nil, err
		}
	}
	r := &rebuilder{f: f, t: t, old: old, placed: map[key]string{}, dirs: map[key]bool{}}
	if err := r.fill(f.backing, t.root); err != nil {
		return nil, err
	}
	return r.placed, os.RemoveAll(old)
}

// durableList is directory k's synced listing.
func (f *FS) durableList(t *tree, k key) map[string]entry {
	if s := f.dirs[k]; s != nil {
		return s.entries
	}
	return t.lists[k]
}

// fill makes directory k's synced entries in the directory dst.
func (r *rebuilder) fill(dst string, k key) error {
	list := r.f.durableList(r.t, k)
	names := make([]string, 0, len(list))
	for name := range list {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		e, p := list[name], filepath.Join(dst, name)
		if e.dir {
			if r.dirs[e.key] {
				continue // named by two synced directories (a half-synced rename): keep one
			}
			r.dirs[e.key] = true
			if err := unix.Mkdir(p, 0o700); err != nil {
				return err
			}
			if err := r.fill(p, e.key); err != nil {
				return err
			}
			if st, ok := r.stat(e.key); ok {
				if err := setMeta(p, &st); err != nil {
					return err
				}
			}
			continue
		}
		var err error
		if q, ok := r.placed[e.key]; ok {
			err = unix.Link(q, p)
		} else if o, ok := r.t.objs[e.key]; ok {
			err = unix.Rename(filepath.Join(r.old, o.rel), p)
		} else if h := r.f.held[e.key]; h != nil {
			err = recreate(p, h)
		} else {
			err = fmt.Errorf("cutfs: %s: the synced object is lost", p)
		}
		if err != nil {
			return err
		}
		if _, ok := r.placed[e.key]; !ok {
			r.placed[e.key] = p
		}
	}
	return nil
}

// stat returns what the cut knows of object k: live, or held.
func (r *rebuilder) stat(k key) (unix.Stat_t, bool) {
	if o, ok := r.t.objs[k]; ok {
		return o.st, true
	}
	var st unix.Stat_t
	if h := r.f.held[k]; h != nil && unix.Fstat(int(h.Fd()), &st) == nil {
		return st, true
	}
	return st, false
}

// recreate makes a copy at p of the removed object held open as h.
func recreate(p string, h *os.File) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(h.Fd()), &st); err != nil {
		return err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		out, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		_, err = io.Copy(out, io.NewSectionReader(h, 0, st.Size))
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	case unix.S_IFLNK:
		buf := make([]byte, unix.PathMax)
		n, err := unix.Readlinkat(int(h.Fd()), "", buf)
		if err != nil {
			return err
		}
		if err := unix.Symlink(string(buf[:n]), p); err != nil {
			return err
		}
	default:
		if err := unix.Mknod(p, st.Mode, int(st.Rdev)); err != nil {
			return err
		}
	}
	return setMeta(p, &st)
}

// setMeta gives the object at p the owner, mode and times in st.
func setMeta(p string, st *unix.Stat_t) error {
	if err := unix.Lchown(p, int(st.Uid), int(st.Gid)); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		if err := unix.Chmod(p, st.Mode&0o7777); err != nil {
			return err
		}
	}
	ts := []unix.Timespec{unix.Timespec(st.Atim), unix.Timespec(st.Mtim)}
	return unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW)
}

// readDir returns the names in the directory dir and their lstat.
func readDir(dir string) (map[string]unix.Stat_t, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return nil, err
	}
	m := make(map[string]unix.Stat_t, len(names))
	for _, name := range names {
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(dir, name), &st); err != nil {
			return nil, err
		}
		m[name] = st
	}
	return m, nil
}
