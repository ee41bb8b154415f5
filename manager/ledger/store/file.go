// Package store is the ledger's storage layer, which knows nothing of reservations: the
// bbolt state file opened and checked (its lock, bbolt's consistency check, its schema
// version), the record envelope (a checksum before each payload), the one-time replay of
// the write-ahead log an earlier devicehost left beside the file, and the group commit
// that makes each batch of writes one bbolt transaction. manager/ledger is the domain on
// top of it.
package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"
)

// BucketMeta holds the file's schema version (KeySchemaVersion, 4 bytes big-endian).
var (
	BucketMeta       = []byte("meta")
	KeySchemaVersion = []byte("schema_version")
)

// maxCheckProblems is how many consistency problems Open names before summarising.
const maxCheckProblems = 3

// Options configures Open.
type Options struct {
	// LockTimeout bounds how long Open waits for another process holding the file.
	LockTimeout time.Duration
	// Schema is the schema version this build writes and reads; a file of another
	// version is refused (ErrSchemaVersion).
	Schema uint32
	// Buckets are made in a new file, beside BucketMeta, and must be in an existing one.
	Buckets [][]byte
}

// Open opens the state file at path (its directory made, mode 0700, when missing), runs
// bbolt's consistency check, applies the writes an earlier version's log beside it holds
// that it lacks (migrate.go), and checks its schema version and buckets, or initialises
// a new file (its directory entry synced, so that a power cut cannot lose it). It
// returns the open database and how many log records it applied.
//
// Open returns a *StateFileError (matching ErrLocked, ErrCorrupt or ErrSchemaVersion)
// when the file is held by another process past opts.LockTimeout, is damaged (or such a
// log is), or has another schema; the file is then left as it was (but for a log's
// writes applied, when the file itself reads) and closed.
func Open(path string, opts Options) (db *bolt.DB, replayed int, err error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, 0, fmt.Errorf("state dir of %s: %w", path, err)
	}
	if db, err = openBolt(path, opts.LockTimeout); err != nil {
		return nil, 0, err
	}
	if replayed, err = prepare(db, path, opts); err != nil {
		_ = db.Close() // the check's error is the one that matters
		return nil, 0, err
	}
	return db, replayed, nil
}

// prepare is Open's checks and set-up of the open db.
func prepare(db *bolt.DB, path string, opts Options) (replayed int, err error) {
	// A damaged file can make bbolt fault on its memory map or panic on a bad page;
	// either is a corrupt file, not a reason to crash.
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = CorruptError(path, fmt.Sprintf("bbolt cannot read it (%v)", r), nil)
		}
	}()
	if err := checkConsistency(db, path); err != nil {
		return 0, err
	}
	if replayed, err = replayLog(db, path, opts); err != nil {
		return 0, err
	}
	fresh := false
	err = db.View(func(tx *bolt.Tx) error {
		if k, _ := tx.Cursor().First(); k == nil {
			fresh = true
			return nil
		}
		return checkSchema(tx, path, opts)
	})
	if err != nil || !fresh {
		return replayed, err
	}
	err = db.Update(func(tx *bolt.Tx) error {
		meta, err := tx.CreateBucket(BucketMeta)
		if err != nil {
			return err
		}
		if err := meta.Put(KeySchemaVersion, binary.BigEndian.AppendUint32(nil, opts.Schema)); err != nil {
			return err
		}
		for _, b := range opts.Buckets {
			if _, err := tx.CreateBucket(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err == nil {
		err = SyncDir(filepath.Dir(path))
	}
	if err != nil {
		return 0, fmt.Errorf("initialise state file %s: %w", path, err)
	}
	return replayed, nil
}

// openBolt opens the bbolt file and turns bbolt's errors into ones that say what to do.
func openBolt(path string, timeout time.Duration) (db *bolt.DB, err error) {
	var file *os.File // kept to release the file and its lock should bbolt panic
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			if file != nil { // bbolt's memory map of it leaks: this path ends the agent
				unlockFile(file)
				_ = file.Close() // the panic is the error to report
			}
			db, err = nil, CorruptError(path, fmt.Sprintf("bbolt cannot read it (%v)", r), nil)
		}
	}()
	db, err = bolt.Open(path, 0o600, &bolt.Options{
		Timeout: timeout,
		OpenFile: func(name string, flag int, perm os.FileMode) (*os.File, error) {
			f, err := os.OpenFile(name, flag, perm)
			file = f
			return f, err
		},
	})
	switch {
	case err == nil:
		return db, nil
	case errors.Is(err, berrors.ErrTimeout):
		return nil, &StateFileError{
			Path:    path,
			Kind:    ErrLocked,
			Problem: fmt.Sprintf("locked by another process (waited %s)", timeout),
			Recovery: "the state dir is in use by another devicehost: stop that agent, " +
				"or give this one a different -state-dir",
			Err: err,
		}
	case errors.Is(err, berrors.ErrInvalid), errors.Is(err, berrors.ErrChecksum),
		errors.Is(err, berrors.ErrVersionMismatch),
		strings.HasPrefix(err.Error(), "file size too small"): // bbolt has no sentinel for this one
		return nil, CorruptError(path, fmt.Sprintf("not a readable bbolt database (%v)", err), err)
	default:
		return nil, fmt.Errorf("open state file %s: %w", path, err)
	}
}

// SyncDir makes the directory entries of dir durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

// checkConsistency runs bbolt's page-level check: every page reachable or free, no page
// twice, keys in order.
func checkConsistency(db *bolt.DB, path string) error {
	var problems []string
	n := 0
	err := db.View(func(tx *bolt.Tx) error {
		for e := range tx.Check() { // drained to the end: Check's goroutine closes it
			if n++; len(problems) < maxCheckProblems {
				problems = append(problems, e.Error())
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("check state file %s: %w", path, err)
	}
	if n == 0 {
		return nil
	}
	msg := "bbolt consistency check failed: " + strings.Join(problems, "; ")
	if n > len(problems) {
		msg += fmt.Sprintf(" (and %d more)", n-len(problems))
	}
	return CorruptError(path, msg, nil)
}

// checkSchema checks an existing file's schema version and buckets.
func checkSchema(tx *bolt.Tx, path string, opts Options) error {
	meta := tx.Bucket(BucketMeta)
	if meta == nil {
		return CorruptError(path, "no devicehost meta bucket: it is not a devicehost state file "+
			"(or its meta data is lost)", nil)
	}
	v := meta.Get(KeySchemaVersion)
	if len(v) != 4 {
		return CorruptError(path, fmt.Sprintf("schema version record is %d bytes, want 4", len(v)), nil)
	}
	switch got := binary.BigEndian.Uint32(v); {
	case got == opts.Schema:
	case got > opts.Schema:
		return &StateFileError{
			Path: path,
			Kind: ErrSchemaVersion,
			Problem: fmt.Sprintf("schema version %d is newer than this devicehost understands (%d)",
				got, opts.Schema),
			Recovery: "run a newer devicehost, or move the file aside to start with an empty " +
				"ledger (held devices will be forgotten)",
		}
	default:
		return &StateFileError{
			Path:    path,
			Kind:    ErrSchemaVersion,
			Problem: fmt.Sprintf("schema version %d is not one devicehost ever wrote (this one writes %d)", got, opts.Schema),
			Recovery: fmt.Sprintf("the file was left untouched: restore it from a backup, or move it aside "+
				"(mv %s %s.corrupt) to start with an empty ledger (held devices will be forgotten)", path, path),
		}
	}
	for _, b := range opts.Buckets {
		if tx.Bucket(b) == nil {
			return CorruptError(path, fmt.Sprintf("schema %d file without its %s bucket", opts.Schema, b), nil)
		}
	}
	return nil
}
