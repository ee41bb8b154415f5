// Package cutfs is a FUSE file system for tests that simulates a power cut. It shows a
// backing directory at a mount point (a loopback, on go-fuse), passes every write
// through to the backing files at once, and remembers what no fsync has covered yet:
// file blocks written or truncated since the file's last fsync or fdatasync, and
// directory entries created, removed or renamed since the directory's last fsync. Cut
// turns the power off: from then on every operation on the mount fails with EIO, and
// the backing directory is rewritten to what a disk would hold after the cut. Mount the
// backing directory again to start "after the power came back".
//
// The model is the strict POSIX one: fsync of a file makes its data and size durable,
// not its name; a name (create, unlink, rename, mkdir, rmdir, link) becomes durable
// only with an fsync of the directory holding it. A rename is one change in each of
// its two directories.
//
// Known limits: file locks (flock, fcntl) are kept by the kernel, per mount, and are not
// passed to the backing files; writes through a writable shared mmap reach the file
// system only when the kernel writes the pages back; pages the kernel already holds
// (a mapping, the page cache) can still be read after a cut; xattrs, modes, owners and
// times are not rolled back, and directories put back at a cut lose their xattrs;
// O_TMPFILE and copy_file_range are not supported (the kernel copies by reading and
// writing instead). A program that maps files of the mount must not run in the process
// that serves it (a page fault waiting on the server can deadlock the Go runtime):
// run it as a child process, as this package's tests do with bbolt.
package cutfs

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Mode says what a cut does with the data no fsync has covered.
type Mode int

const (
	// DropUnsynced discards every unsynced byte: each file goes back to the content and
	// size of its last fsync.
	DropUnsynced Mode = iota
	// KeepRandom keeps a random half of the unsynced blocks, as a disk that reorders
	// writes may: each unsynced block is kept with probability 1/2 (its new content) or
	// dropped (its synced content, or zeros where the synced file did not reach), and a
	// file whose size changed keeps its new size or its synced one, again with
	// probability 1/2. Directory entries are never kept at random: an unsynced change
	// is always undone.
	KeepRandom
)

func (m Mode) String() string {
	switch m {
	case DropUnsynced:
		return "DropUnsynced"
	case KeepRandom:
		return "KeepRandom"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Options configure a mount.
type Options struct {
	// Debug logs every FUSE request and reply (go-fuse's debug log).
	Debug bool
}

// CutStats says what a cut threw away.
type CutStats struct {
	// DroppedBlocks counts the unsynced data blocks that went back to their synced
	// content (or vanished with their file or past the file's final size).
	DroppedBlocks int
	// KeptBlocks counts the unsynced data blocks that survived (KeepRandom only).
	KeptBlocks int
	// UndoneDirChanges counts the directory entries that differed from their synced
	// state and were put back: a rename undone is two, one in each directory.
	UndoneDirChanges int
}

var (
	// ErrCut is returned by Cut and CutAtSync once the power is off.
	ErrCut = errors.New("cutfs: the power is already cut")
	// ErrUnmounted is returned by Cut and CutAtSync after Unmount.
	ErrUnmounted = errors.New("cutfs: not mounted")
	// ErrNotCut is returned by CutResult before a cut.
	ErrNotCut = errors.New("cutfs: the power was not cut")
)

// FS is one mount. All its methods are safe for concurrent use, including from the
// program that uses the mount; none of them may be called from inside a FUSE request
// of the same mount (no caller outside this package can be inside one).
type FS struct {
	backing    string
	mountpoint string
	server     *fuse.Server
	served     chan struct{} // closed when the server's loop has ended
	cutDone    chan struct{} // closed by the cut
	syncs      atomic.Int64

	// mu is held by every FUSE request while it runs (shared for reads, exclusive for
	// anything that changes the backing files or the fields below) and by Cut.
	mu       sync.RWMutex
	dead     bool // cut or unmounted: every request fails with EIO
	cut      bool
	cutStats CutStats
	cutErr   error
	armAt    int64 // the sync number that cuts the power, 0 for none
	armMode  Mode
	armRng   *rand.Rand
	files    map[key]*fileData // files written since their last fsync
	dirs     map[key]*dirSnap  // directories changed since their last fsync
	held     map[key]*os.File  // removed objects that a synced directory still names
	handles  map[closer]struct{}

	umu       sync.Mutex // serializes Unmount
	unmounted bool       // written with umu and mu held, read with either
}

// closer is an open file or directory handle, closed at a cut or an unmount.
type closer interface{ closeBacking() }

// Mount shows the directory backing at mountpoint and starts serving it; everything in
// backing counts as durable. mountpoint must exist and must not lie inside backing. As
// root it mounts with mount(2) (no fusermount binary needed); otherwise it needs
// fusermount. Call Unmount to stop, with or without a cut.
func Mount(backing, mountpoint string, opts Options) (*FS, error) {
	backing, err := filepath.Abs(backing)
	if err != nil {
		return nil, err
	}
	loop, err := fs.NewLoopbackRoot(backing)
	if err != nil {
		return nil, err
	}
	f := &FS{
		backing:    backing,
		mountpoint: mountpoint,
		served:     make(chan struct{}),
		cutDone:    make(chan struct{}),
		files:      map[key]*fileData{},
		dirs:       map[key]*dirSnap{},
		held:       map[key]*os.File{},
		handles:    map[closer]struct{}{},
	}
	root := &node{LoopbackNode: loop.(*fs.LoopbackNode), cfs: f}
	// No kernel caching of names or attributes: each lookup and stat reaches the file
	// system, so they see the cut at once.
	var zero time.Duration
	o := &fs.Options{
		EntryTimeout:    &zero,
		AttrTimeout:     &zero,
		NegativeTimeout: &zero,
		MountOptions: fuse.MountOptions{
			FsName:            "cutfs",
			Name:              "cutfs",
			Debug:             opts.Debug,
			DirectMountStrict: os.Geteuid() == 0,
		},
	}
	server, err := fuse.NewServer(fs.NewNodeFS(root, o), mountpoint, &o.MountOptions)
	if err != nil {
		return nil, fmt.Errorf("cutfs: mount %s: %w", mountpoint, err)
	}
	f.server = server
	go func() {
		server.Serve()
		close(f.served)
	}()
	if err := server.WaitMount(); err != nil {
		_ = f.Unmount()
		return nil, fmt.Errorf("cutfs: mount %s: %w", mountpoint, err)
	}
	return f, nil
}

// Syncs returns how many fsync, fdatasync and directory fsync requests the mount has
// served so far (the one that trips a CutAtSync included).
func (f *FS) Syncs() int { return int(f.syncs.Load()) }

// Cut turns the power off now: requests that have not started fail with EIO from
// here on (it waits for those running to end), and the backing directory is rewritten
// as mode says. rng draws KeepRandom's choices and must then be non-nil; Cut does not
// keep it. The program using the mount is not stopped: it keeps getting EIO.
func (f *FS) Cut(mode Mode, rng *rand.Rand) (CutStats, error) {
	if err := checkMode(mode, rng); err != nil {
		return CutStats{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.unmounted {
		return CutStats{}, ErrUnmounted
	}
	if f.cut {
		return CutStats{}, ErrCut
	}
	f.cutLocked(mode, rng)
	return f.cutStats, f.cutErr
}

// CutAtSync arms a cut inside the n-th sync request of the mount (counted as Syncs
// counts, from the mount on): that request does not make anything durable, the cut
// runs in it as Cut would, and it fails with EIO. n must be beyond Syncs(). rng is used
// in the request's goroutine when it comes, and must not be used by anyone else until
// CutDone is closed. A later call replaces the armed cut.
func (f *FS) CutAtSync(n int, mode Mode, rng *rand.Rand) error {
	if err := checkMode(mode, rng); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.unmounted:
		return ErrUnmounted
	case f.cut:
		return ErrCut
	case int64(n) <= f.syncs.Load():
		return fmt.Errorf("cutfs: sync %d has already happened (%d so far)", n, f.syncs.Load())
	}
	f.armAt, f.armMode, f.armRng = int64(n), mode, rng
	return nil
}

// CutDone is closed when the power has been cut, by Cut or CutAtSync, and the backing
// directory rewritten.
func (f *FS) CutDone() <-chan struct{} { return f.cutDone }

// CutResult returns what the cut did, or ErrNotCut before one.
func (f *FS) CutResult() (CutStats, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if !f.cut {
		return CutStats{}, ErrNotCut
	}
	return f.cutStats, f.cutErr
}

// Unmount unmounts and waits for the server's goroutines to end. Files still open on
// the mount do not stop it: the mount is then detached and its connection aborted, and
// they fail from then on. Without a cut it is a clean shutdown: the backing directory
// keeps everything written. It is idempotent; after it, Cut returns ErrUnmounted.
func (f *FS) Unmount() error {
	f.umu.Lock()
	defer f.umu.Unlock()
	if f.unmounted {
		return nil
	}
	if err := f.detach(); err != nil {
		return fmt.Errorf("cutfs: unmount %s: %w", f.mountpoint, err)
	}
	<-f.served
	f.mu.Lock()
	defer f.mu.Unlock()
	f.dead = true
	f.unmounted = true
	f.closeAll()
	f.forget()
	return nil
}

// detach takes the mount away. As root, a busy mount is aborted (MNT_FORCE makes the
// kernel end the FUSE connection, so the server's loop ends) and detached.
func (f *FS) detach() error {
	if os.Geteuid() != 0 {
		return f.server.Unmount()
	}
	err := unix.Unmount(f.mountpoint, 0)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(f.mountpoint, unix.MNT_FORCE|unix.MNT_DETACH)
	}
	return err
}

func checkMode(mode Mode, rng *rand.Rand) error {
	switch {
	case mode != DropUnsynced && mode != KeepRandom:
		return fmt.Errorf("cutfs: unknown mode %v", mode)
	case mode == KeepRandom && rng == nil:
		return errors.New("cutfs: KeepRandom needs a rng")
	}
	return nil
}

// enter starts a FUSE request: it holds mu (exclusively if write) until done is called,
// or fails with EIO once the power is off.
func (f *FS) enter(write bool) (done func(), errno syscall.Errno) {
	if write {
		f.mu.Lock()
		if f.dead {
			f.mu.Unlock()
			return nil, syscall.EIO
		}
		return f.mu.Unlock, 0
	}
	f.mu.RLock()
	if f.dead {
		f.mu.RUnlock()
		return nil, syscall.EIO
	}
	return f.mu.RUnlock, 0
}

// syncPoint counts a sync request; mu is held exclusively. It returns EIO when this
// sync is the armed one, after cutting the power in place: the request's own goroutine
// syncRequest serves a sync request: the armed cut when it is this one's turn, else
// apply, which makes what the request covers durable.
func (f *FS) syncRequest(apply func()) syscall.Errno {
	done, errno := f.enter(true)
	if errno != 0 {
		return errno
	}
	defer done()
	if errno := f.syncPoint(); errno != 0 {
		return errno
	}
	apply()
	return 0
}

// does the cut, so it waits for nobody.
func (f *FS) syncPoint() syscall.Errno {
	n := f.syncs.Add(1)
	if f.armAt > 0 && n == f.armAt {
		f.cutLocked(f.armMode, f.armRng)
		return syscall.EIO
	}
	return 0
}

// cutLocked cuts the power; mu is held exclusively.
func (f *FS) cutLocked(mode Mode, rng *rand.Rand) {
	f.dead = true
	f.cut = true
	f.armAt, f.armRng = 0, nil
	f.closeAll()
	f.cutStats, f.cutErr = f.restore(mode, rng)
	f.forget()
	close(f.cutDone)
}

// closeAll closes the backing descriptors of all open handles; mu is held
// exclusively. After a cut or an abort the kernel may never release them.
func (f *FS) closeAll() {
	for h := range f.handles {
		h.closeBacking()
		delete(f.handles, h)
	}
}

// forget drops everything remembered since the syncs; mu is held exclusively.
func (f *FS) forget() {
	for _, h := range f.held {
		h.Close()
	}
	f.files, f.dirs, f.held = map[key]*fileData{}, map[key]*dirSnap{}, map[key]*os.File{}
}
