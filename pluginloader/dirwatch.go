package pluginloader

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/textline"
)

// This file watches the plugin dir. The rule for acting on a change, per file name:
//
//   - A binary that Discover accepts (executable, passes the trust check) is handed on
//     (DirWatchConfig.Apply) once it has settled: its ctime, which every write, truncate,
//     chmod, chown and rename moves, is at least DirWatchConfig.Settle old, and no
//     process has it open for writing (where that can be told: see beingWritten). Until
//     then nothing happens: a binary still being copied is not run, and a plugin whose
//     binary is being replaced keeps running the old one.
//   - A settled binary with other content than the one handed on before (another inode,
//     size or mtime: `mv` or `install` of a new file, a rewrite) is handed on again, with
//     another FileState: its plugin is to be restarted on it. A change of mode or owner
//     alone is handed on with a FileState of the same content (FileState.SameContent):
//     nothing is to restart, but a plugin that failed for good may get another try.
//   - A name gone (or refused by the trust check) for the settle period is left out of
//     what is handed on: its plugin is to stop. One that comes back sooner, like a file
//     `install` or `cp --remove-destination` unlinks and writes again, counts as replaced.
//
// The dir is listed again dirDebounce after each event (events in between are
// coalesced) and whenever a settle period ends. When it cannot be watched (inotify
// limits, the dir removed or replaced), it is listed every DirWatchConfig.Rescan instead,
// and watched again as soon as that works; while watched, it is also listed every
// watchedRescan, which catches what inotify does not see (a symlink's target changing).

const (
	// dirDebounce is how long the watcher waits after an event before listing the dir,
	// so that a burst of events (a copy's writes) costs one listing.
	dirDebounce = 50 * time.Millisecond
	// watchedRescan is how often a watched plugin dir is listed anyway.
	watchedRescan = 30 * time.Second
)

// fileID identifies a file's content: a new inode, size or mtime is another binary.
type fileID struct {
	dev, ino uint64
	size     int64
	mtime    int64 // ns
}

// FileState is a plugin binary as the plugin dir watcher saw it: its content's identity,
// plus what changes with any write or metadata change. Two FileStates are equal when
// nothing about the file changed; see SameContent.
type FileState struct {
	id    fileID
	ctime int64 // ns
	mode  uint32
}

// SameContent reports whether s and o are the same file content (same inode, size and
// mtime), whatever happened to its mode or owner.
func (s FileState) SameContent(o FileState) bool { return s.id == o.id }

// DirBinary is a settled binary of the plugin dir, and the file it was when it settled.
type DirBinary struct {
	Binary
	File FileState
}

// dirEntry is one name of the plugin dir as the watcher follows it.
type dirEntry struct {
	live       *DirBinary // the settled binary its plugin runs; nil until one settled
	present    bool       // the last listing found an accepted binary under this name
	seen       FileState  // that binary, when present
	seenAt     time.Time  // when the listings began to find seen (or the name absent)
	waitLogged FileState  // the state a "still open for writing" line was logged for
}

// DirWatchConfig configures WatchDir.
type DirWatchConfig struct {
	// Settle is how long a binary must have been left alone before it is handed on, and
	// how long a name must stay gone before it is left out. Zero acts at once.
	Settle time.Duration
	// Rescan is how often the dir is listed while it cannot be watched. It must be
	// positive.
	Rescan time.Duration
	// Log gets the watcher's log lines (problems with the dir, each logged once). Nil
	// discards them.
	Log hclog.Logger
	// Apply is given the settled binaries, by plugin name, every time that set changes.
	// It is called on Run's goroutine.
	Apply func(map[string]DirBinary)

	watchErr error // set by tests only: every watch attempt fails with it
}

// DirWatch follows a plugin dir and hands its settled binaries to DirWatchConfig.Apply.
// Run owns everything but Poke, which may be called from any goroutine; Start and Close
// are for the goroutine that made it, before and instead of Run.
type DirWatch struct {
	dir      string // absolute
	settle   time.Duration
	rescan   time.Duration
	log      hclog.Logger
	apply    func(map[string]DirBinary)
	watchErr error
	pokeCh   chan struct{} // asks run for a listing now; buffer of one

	w           *fsnotify.Watcher // nil while not watching
	watchedDir  fileID            // the dir's inode when the watch began
	entries     map[string]*dirEntry
	listErr     string // the last listing error logged (refusals included)
	watchFailed string // the last watch error logged; "" while watching
}

// WatchDir returns the watcher of dir (absolute) and starts watching it, so that a
// change made while the caller lists the dir for the first time (Discover) is seen.
// Call Start, then Run; or Close if it is not to run. A dir that is not there, at first
// or later, is listed every Rescan until it is; a caller for whom that is an error
// checks before.
func WatchDir(dir string, cfg DirWatchConfig) *DirWatch {
	log := cfg.Log
	if log == nil {
		log = hclog.NewNullLogger()
	}
	d := &DirWatch{
		dir:      dir,
		settle:   cfg.Settle,
		rescan:   cfg.Rescan,
		log:      log,
		apply:    cfg.Apply,
		watchErr: cfg.watchErr,
		pokeCh:   make(chan struct{}, 1),
		entries:  make(map[string]*dirEntry),
	}
	d.startWatch()
	return d
}

// refusedKey marks refused binaries in DirWatch.listErr.
const refusedKey = "refused"

// Start records the binaries the caller starts with (found by its Discover, whose
// refusals it logged: refused is that error's text, so that it is not logged again), as
// settled. It returns them, by name.
func (d *DirWatch) Start(bins []Binary, refused string) map[string]DirBinary {
	if refused != "" {
		d.listErr = refusedKey + refused
	}
	now := time.Now()
	for _, b := range bins {
		st, err := statFile(b.Path)
		if err != nil {
			continue // gone already: the first listing sees that
		}
		d.entries[b.Name] = &dirEntry{live: &DirBinary{Binary: b, File: st}, present: true, seen: st, seenAt: now}
	}
	return d.liveSet()
}

// Poke asks for a listing of the dir now ("look again"). It never blocks.
func (d *DirWatch) Poke() {
	select {
	case d.pokeCh <- struct{}{}:
	default:
	}
}

// Close stops watching. Run closes when it returns; Close is for a watcher never run.
func (d *DirWatch) Close() {
	if d.w != nil {
		_ = d.w.Close()
		d.w = nil
	}
}

// period is how long until the next listing when nothing happens.
func (d *DirWatch) period() time.Duration {
	if d.w == nil {
		return d.rescan
	}
	return watchedRescan
}

// Run follows the dir, calling Apply on each change of the settled binaries, until ctx
// ends.
func (d *DirWatch) Run(ctx context.Context) {
	defer d.Close()
	due := time.Now().Add(d.period())
	timer := time.NewTimer(time.Until(due))
	defer timer.Stop()
	schedule := func(at time.Time) {
		if at.Before(due) {
			due = at
			timer.Reset(max(time.Until(at), 0))
		}
	}
	for {
		var events <-chan fsnotify.Event
		var errs <-chan error
		if d.w != nil {
			events, errs = d.w.Events, d.w.Errors
		}
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-events:
			switch {
			case !ok:
				d.lost("the watch ended")
			case filepath.Clean(ev.Name) == d.dir && ev.Has(fsnotify.Remove|fsnotify.Rename):
				d.lost("the plugin dir was removed or renamed")
			}
			schedule(time.Now().Add(dirDebounce))
		case err, ok := <-errs:
			switch {
			case !ok:
				d.lost("the watch ended")
			case errors.Is(err, fsnotify.ErrEventOverflow):
				d.log.Warn("plugin dir events were lost (inotify queue overflow); listing it again", "plugin_dir", d.dir)
			default:
				d.log.Warn("plugin dir watch error; listing it again", "plugin_dir", d.dir, "error", err)
			}
			schedule(time.Now())
		case <-d.pokeCh:
			schedule(time.Now())
		case <-timer.C:
			due = d.scan(time.Now())
			timer.Reset(max(time.Until(due), 0))
		}
	}
}

// lost stops watching after the watch broke; the dir is then listed every rescan until
// it can be watched again.
func (d *DirWatch) lost(why string) {
	d.Close()
	d.watchFailed = why
	d.log.Warn("plugin dir no longer watched; listing it periodically until it can be watched again",
		"plugin_dir", d.dir, "reason", why, "every", d.rescan)
}

// startWatch tries to watch the dir; a failure is logged once per distinct error.
func (d *DirWatch) startWatch() {
	w, err := d.newWatcher()
	if err == nil {
		if err = w.Add(d.dir); err != nil {
			_ = w.Close()
		}
	}
	if err != nil {
		if msg := err.Error(); msg != d.watchFailed {
			d.watchFailed = msg
			d.log.Warn("cannot watch the plugin dir; listing it periodically instead", "plugin_dir", d.dir, "error", err, "every", d.rescan)
		}
		return
	}
	if d.watchFailed != "" {
		d.log.Info("watching the plugin dir again", "plugin_dir", d.dir)
		d.watchFailed = ""
	}
	d.w = w
	d.watchedDir = d.dirID()
}

// dirID is the plugin dir's device and inode (zero when it cannot be told).
func (d *DirWatch) dirID() fileID {
	st, err := statFile(d.dir)
	if err != nil {
		return fileID{}
	}
	return fileID{dev: st.id.dev, ino: st.id.ino}
}

func (d *DirWatch) newWatcher() (*fsnotify.Watcher, error) {
	if d.watchErr != nil {
		return nil, d.watchErr
	}
	return fsnotify.NewWatcher()
}

// list returns the binaries Discover accepts now. A dir that is gone is empty (its
// plugins are stopped); one that cannot be read or fails the trust check is an error,
// and what runs is left as it is. Each distinct problem is logged once.
func (d *DirWatch) list() ([]Binary, bool) {
	report := func(key, msg string, err error) {
		text := ""
		if err != nil {
			text = textline.Line(err.Error(), 0)
		}
		if key+text != d.listErr {
			d.listErr = key + text
			d.log.Error(msg, "plugin_dir", d.dir, "error", text)
		}
	}
	if _, err := os.Stat(d.dir); errors.Is(err, fs.ErrNotExist) {
		report("gone", "plugin dir is gone; the plugins from it are stopped", err)
		return nil, true
	}
	if _, err := CheckDir(d.dir); err != nil {
		report("dir", "plugin dir refused; the plugins from it keep running, and none is started until it is fixed", err)
		return nil, false
	}
	bins, err := Discover(d.dir, nil)
	switch {
	case err != nil && len(bins) == 0 && !errors.Is(err, ErrInsecurePath):
		report("dir", "plugin dir cannot be listed; the plugins from it keep running", err)
		return nil, false
	case err != nil:
		report(refusedKey, "plugins refused and not run", err)
	default:
		d.listErr = ""
	}
	return bins, true
}

// scan lists the dir, applies the settled changes, and returns when it should be
// listed again.
func (d *DirWatch) scan(now time.Time) time.Time {
	if d.w != nil && d.dirID() != d.watchedDir {
		// Replaced by another dir (a rename over it): the watch follows the old one.
		d.lost("the plugin dir was replaced")
	}
	if d.w == nil {
		d.startWatch() // before listing: nothing changed after the listing is missed
	}
	next := now.Add(d.period())
	bins, ok := d.list()
	if !ok {
		return next
	}
	soonest := func(t time.Time) {
		if t.Before(next) {
			next = t
		}
	}
	changed := false
	found := make(map[string]bool, len(bins))
	for _, b := range bins {
		st, err := statFile(b.Path)
		if err != nil {
			continue // gone since the listing: absent
		}
		found[b.Name] = true
		e := d.entries[b.Name]
		if e == nil {
			e = &dirEntry{}
			d.entries[b.Name] = e
		}
		if !e.present || e.seen != st {
			e.present, e.seen, e.seenAt = true, st, now
		}
		if e.live != nil && e.live.File == st && e.live.Path == b.Path {
			continue
		}
		quietSince := time.Unix(0, st.ctime)
		if quietSince.After(now) { // a clock step: count from when it was first seen
			quietSince = e.seenAt
		}
		if settled := quietSince.Add(d.settle); settled.After(now) {
			soonest(settled)
			continue
		}
		if writing, _ := beingWritten(b.Path); writing {
			if e.waitLogged != st {
				e.waitLogged = st
				d.log.Info("plugin binary still open for writing; waiting until it is closed", "plugin", b.Name, "path", b.Path)
			}
			soonest(now.Add(d.settle))
			continue
		}
		e.live = &DirBinary{Binary: b, File: st}
		changed = true
	}
	for name, e := range d.entries {
		if found[name] {
			continue
		}
		if e.present {
			e.present, e.seen, e.seenAt = false, FileState{}, now
			if e.live != nil {
				d.log.Debug("plugin binary gone; its plugin is stopped unless it is back within the settle period",
					"plugin", name, "settle", d.settle)
			}
		}
		if e.live == nil {
			delete(d.entries, name)
			continue
		}
		if gone := e.seenAt.Add(d.settle); gone.After(now) {
			soonest(gone)
			continue
		}
		delete(d.entries, name)
		changed = true
	}
	if changed {
		d.apply(d.liveSet())
	}
	return next
}

// liveSet is the settled binaries, by plugin name.
func (d *DirWatch) liveSet() map[string]DirBinary {
	out := make(map[string]DirBinary, len(d.entries))
	for name, e := range d.entries {
		if e.live != nil {
			out[name] = *e.live
		}
	}
	return out
}
