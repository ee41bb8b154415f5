// Package ledger is devicehost's durable reservation ledger: every reservation the host
// has acknowledged, its release, the plugin cleanup still owed for it, cordons, admin
// accesses, the audit trail and plugins' reattach data, in one bbolt file under the
// state dir, its only truth. Each group-commit batch is one bbolt transaction, a change
// and its event in it; nothing is answered or shown before its commit is durable. Reads
// come from an in-memory index of the file's last commit; Open refuses a damaged or
// newer file with a *StateFileError and never repairs it.
//
// See docs/reservations.md.
package ledger

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger/store"
)

// DefaultFileName is the ledger file's name inside the state dir.
const DefaultFileName = "devicehost.db"

// DefaultLockTimeout is how long Open waits for another process to let go of the file.
const DefaultLockTimeout = time.Second

// Errors of this package, matched with errors.Is. Domain errors (a held device, an unknown
// reservation, a malformed request) wrap the sentinels of device instead.
var (
	// ErrCorrupt: the state file is not a bbolt file, fails its consistency check, or
	// holds a record that cannot be read. Returned by Open inside a *StateFileError.
	ErrCorrupt = store.ErrCorrupt
	// ErrSchemaVersion: the state file was written with a schema this build does not
	// know. Returned by Open inside a *StateFileError.
	ErrSchemaVersion = store.ErrSchemaVersion
	// ErrLocked: another process (another devicehost) has the state file open.
	// Returned by Open inside a *StateFileError.
	ErrLocked = store.ErrLocked
	// ErrClosed: the ledger was closed. It also matches device.ErrShuttingDown.
	ErrClosed = fmt.Errorf("ledger closed: %w", device.ErrShuttingDown)
	// ErrNotReleased: CleanupDone or Delete named a reservation that is still live.
	ErrNotReleased = errors.New("reservation not released")
	// ErrCleanupPending: Delete named a released reservation whose plugin cleanup has
	// not been recorded as done; deleting it would drop the cleanup.
	ErrCleanupPending = errors.New("reservation cleanup pending")
)

// errInternal marks a call that broke the ledger's contract: input that the host API's
// server validates (validate's rules, checked once there) or that the manager makes
// itself, arriving in a shape no stored record may have. The ledger asserts only such
// invariants, cheaply; it does not check requests rule by rule.
var errInternal = errors.New("internal")

// StateFileError is why Open refused a state file: what is wrong with it and what an
// operator can do about it (see store.StateFileError).
type StateFileError = store.StateFileError

// corruptError is the *StateFileError of a damaged file at path, left untouched.
func corruptError(path, problem string, err error) *StateFileError {
	return store.CorruptError(path, problem, err)
}

// Options configures Open. The zero value is ready to use.
type Options struct {
	// Logger receives one INFO line when the ledger is opened. Nil means no logging.
	Logger hclog.Logger
	// LockTimeout bounds how long Open waits for another process holding the file.
	// Zero means DefaultLockTimeout.
	LockTimeout time.Duration
	// Now stamps CreatedAt when a reservation comes without one, and ReleasedAt when
	// Release is given a zero time. Nil means time.Now.
	Now func() time.Time
	// OnCommit, when set, is called after every transaction the ledger commits (its
	// fsyncs done), with how long the transaction took, fsyncs included, and how many
	// writes shared it (group commit: up to store.MaxBatch callers' requests and as
	// many due deferred writes). A batch that wrote nothing (every request refused) is
	// not a commit. It is called on the goroutine that committed (a caller leading the
	// group commit, see store.Committer.Submit), so it must be quick and must not
	// block: every write waits for it.
	OnCommit func(took time.Duration, writes int)
	// MaxEvents bounds the audit trail's events (the oldest go first); zero means
	// DefaultMaxEvents, negative keeps none. MaxEventAge drops those older; zero means
	// DefaultMaxEventAge.
	MaxEvents   int
	MaxEventAge time.Duration
}

// Ledger is an open state file. All methods are safe for concurrent use. Values it
// returns are deep copies the caller may keep and modify; values passed in are copied
// before they are stored.
//
// Writes are group-committed by their callers (store.Committer): no goroutine runs
// while the ledger is idle. Writes (Reserve, Release, CleanupDone, Delete, SaveReattach,
// DeleteReattach) take a context: it bounds the wait for the request to be accepted
// (a bounded queue waits for a commit) and for a commit to take it up, and is checked
// once more just before the request is applied; a request that was taken up is not
// abandoned, the call returns when the commit is durable or has failed.
type Ledger struct {
	path string
	db   *bolt.DB
	now  func() time.Time
	log  hclog.Logger

	closeOnce sync.Once
	closeErr  error
	cm        *store.Committer[*txn] // the group commit (writer.go)

	// mu guards idx. Only the leader of the group commit mutates idx (under mu.Lock); it
	// may read idx without mu, since no one else writes it.
	mu  sync.RWMutex
	idx *index

	subMu sync.Mutex
	subs  map[*Feed]struct{} // told after each commit that changed released reservations (see subscribe)

	// cordonMu serialises Cordon and Uncordon, each a commit and then a new cordons
	// map; cordons is what Cordons returns (cordons.go).
	cordonMu sync.Mutex
	cordons  atomic.Pointer[map[string]device.Cordon]

	// accessMu serialises the changes of admin accesses, each a commit and then a new
	// accessView; access is what Accesses and AccessByDevice return (access.go).
	accessMu sync.Mutex
	access   atomic.Pointer[accessView]

	ev *eventLog // the audit trail (events.go)

	refusedMu     sync.Mutex
	refusedWindow time.Time // the second refusals are being counted in
	refusedIn     int       // refusals recorded in it
	refusedLost   int       // refusals not recorded since the last one that was
}

// Open opens the ledger at path (normally filepath.Join(stateDir, DefaultFileName)),
// creating the file and its directory (mode 0700) when missing, and loads every record,
// checking each one. A log left beside the file by devicehost c9e8f1f after a stop that
// was not clean is applied to the file first, once, then removed (store/migrate.go).
//
// Open returns a *StateFileError (matching ErrLocked, ErrCorrupt or ErrSchemaVersion)
// when the file is held by another process past opts.LockTimeout, is damaged (or such a
// log is), or was written by an unknown schema version; in each case the file is left
// as it was (but for a log's writes applied, when the file itself reads).
func Open(path string, opts Options) (*Ledger, error) {
	if opts.LockTimeout <= 0 {
		opts.LockTimeout = DefaultLockTimeout
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = hclog.NewNullLogger()
	}
	db, replayed, err := store.Open(path, store.Options{
		LockTimeout: opts.LockTimeout,
		Schema:      schemaVersion,
		Buckets:     [][]byte{bucketReservations, bucketReattach},
	})
	if err != nil {
		return nil, err
	}
	idx, err := load(db, path)
	if err != nil {
		_ = db.Close() // the load error is the one that matters; nothing was written
		return nil, err
	}
	maxEvents, maxAge := opts.MaxEvents, opts.MaxEventAge
	if maxEvents == 0 {
		maxEvents = DefaultMaxEvents
	}
	if maxAge <= 0 {
		maxAge = DefaultMaxEventAge
	}
	ev, err := loadEventLog(db, maxEvents, maxAge, opts.Now)
	if err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("read the events of %s: %w", path, err)
	}
	access, err := loadAccesses(db, path)
	if err != nil && !errors.Is(err, ErrCorrupt) {
		_ = db.Close()
		return nil, err
	}
	if err != nil {
		opts.Logger.Error("damaged admin access records: left out; their owners' Release still ends the others", "error", err.Error())
	}
	cordons, err := loadCordons(db, path)
	if err != nil && !errors.Is(err, ErrCorrupt) {
		_ = db.Close()
		return nil, err
	}
	if err != nil {
		// The devices stay cordoned (loadCordons): say why.
		opts.Logger.Error("damaged cordon records: their devices stay cordoned until uncordoned or cordoned again", "error", err.Error())
	}
	l := &Ledger{
		path: path,
		db:   db,
		now:  opts.Now,
		log:  opts.Logger,
		idx:  idx,
		ev:   ev,
		subs: make(map[*Feed]struct{}),
	}
	l.cm = l.newCommitter(db, opts.OnCommit)
	l.cordons.Store(&cordons)
	l.access.Store(newAccessView(access))
	c := idx.counts()
	l.log.Info("opened reservation ledger", "path", path, "reservations", c.Total,
		"live", c.Live, "released", c.Released, "cleanup_pending", c.CleanupPending)
	if replayed > 0 {
		l.log.Info("the writes only the log of an earlier devicehost held were applied to the state file, and the log removed",
			"log", path+store.LogSuffix, "records", replayed)
	}
	return l, nil
}

// Path returns the state file's path.
func (l *Ledger) Path() string { return l.path }

// Commits returns how many batches of writes the ledger has committed since Open, each
// one bbolt transaction. For benchmarks and metrics; safe for concurrent use.
func (l *Ledger) Commits() int64 { return l.cm.Commits() }

// Close refuses later writes with ErrClosed, waits until the requests accepted, and the
// deferred writes waiting, are committed, and closes the file.
// Reads keep answering from memory. Close is idempotent; stop any GC running on the
// ledger first.
func (l *Ledger) Close() error {
	l.closeOnce.Do(func() {
		l.cm.Close()
		if err := l.db.Close(); err != nil {
			l.closeErr = fmt.Errorf("close state file %s: %w", l.path, err)
		}
	})
	return l.closeErr
}

// notify tells the feeds of a commit that changed the reservations named by changed
// and left total in the ledger. Their IDs are theirs to drain at once; their wake-ups
// (the GC's goroutine) wait until the reply of ctx's call is sent (device.AfterReply):
// the caller does not wait for the GC to be woken to clean up after its Release.
func (l *Ledger) notify(ctx context.Context, changed []string, total int) {
	var wake []*Feed
	l.subMu.Lock()
	for f := range l.subs {
		if len(changed) == 0 && (f.over <= 0 || total <= f.over) {
			continue
		}
		f.mu.Lock()
		for _, id := range changed {
			f.ids[id] = struct{}{}
		}
		f.mu.Unlock()
		wake = append(wake, f)
	}
	l.subMu.Unlock()
	if len(wake) == 0 {
		return
	}
	device.AfterReply(ctx, func() {
		for _, f := range wake {
			select {
			case f.wake <- struct{}{}:
			default: // already woken; it will drain these IDs too
			}
		}
	})
}

// normTime drops the monotonic reading and the location, so a time read back from the
// file compares equal (==, reflect.DeepEqual) to the one that was stored.
func normTime(t time.Time) time.Time {
	if t.IsZero() {
		return time.Time{}
	}
	return t.Round(0).UTC()
}
