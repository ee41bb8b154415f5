package ledger

import (
	"context"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/internal/steps"
	"github.com/devicehost/devicehost/manager/ledger/store"
)

// The ledger's writes go through the storage layer's group commit (store.Committer):
// each batch of requests is one bbolt transaction, its requests' run funcs called in
// order with the batch's txn, committed before any of them is answered.

// storageError marks an error from bbolt itself inside a batch: it aborts the whole
// transaction, while any other error a request returns refuses only that request.
type storageError = store.StorageError

// newCommitter is the ledger's group commit over db.
func (l *Ledger) newCommitter(db *bolt.DB, onCommit func(took time.Duration, writes int)) *store.Committer[*txn] {
	return store.NewCommitter(db, l.path, store.CommitConfig[*txn]{
		Begin: func(tx *bolt.Tx) *txn {
			// Only the leader writes l.idx, so reading it unlocked is safe.
			return &txn{tx: tx, ov: newOverlay(l.idx), ev: l.ev}
		},
		End: func(w *txn) (bool, error) {
			if err := w.pruneEvents(); err != nil {
				return false, err
			}
			return w.dirty, nil
		},
		Committed:  l.committed,
		OnCommit:   onCommit,
		AfterReply: device.AfterReply,
		Closed:     ErrClosed,
	})
}

// committed makes a durable batch's changes the ledger's: its events the trail's, its
// reservations the index's ("ledger: index", a region in trace's task), and tells the
// change feeds, whose wake-ups wait for the reply of ctx's call.
func (l *Ledger) committed(ctx, trace context.Context, w *txn) {
	ov := w.ov
	l.applyEvents(ov.ev)
	if len(ov.recs) == 0 {
		return
	}
	region := steps.Start(trace, "ledger: index")
	told := ov.feedChanges()
	l.mu.Lock()
	l.idx.apply(ov)
	total := l.idx.counts().Total
	l.mu.Unlock()
	l.notify(ctx, told, total)
	region.End()
}

// submit queues run and waits for its durable result (store.Committer.Submit).
func (l *Ledger) submit(ctx context.Context, run func(w *txn) (any, error)) (any, error) {
	return l.cm.Submit(ctx, run)
}

// submitDeferred queues run as a deferred write (store.Committer.SubmitDeferred): for
// bookkeeping whose loss in a crash is harmless because it is redone (the GC's
// cleanup-done marks and deletions), committed within after it was queued, riding with
// the others due on one commit. The change feeds are not told of its changes.
func (l *Ledger) submitDeferred(within time.Duration, run func(w *txn) (any, error), notify func(error)) {
	l.cm.SubmitDeferred(within, func(w *txn) (any, error) {
		w.deferred = true
		defer func() { w.deferred = false }()
		return run(w)
	}, notify)
}

// txn is what a request's run func sees: the batch's view of the reservations (the
// index plus the batch's earlier changes) and the bbolt transaction. A run func must
// make every decision before its first write, so a refused request leaves nothing
// behind; errors from the write helpers are storageErrors, which abort the batch.
type txn struct {
	tx *bolt.Tx
	ov *overlay
	ev *eventLog // the trail events are written to (event)
	// deferred says the request running is a deferred write, whose changes the change
	// feeds are not told of (overlay.feedChanges).
	deferred bool
	// dirty says the batch wrote something: a batch that did not is rolled back, no
	// commit (and no fsync) made for it.
	dirty bool
}

// put sets key of bucket (made when missing) to val in the transaction. put keeps key
// and val until the commit: the caller must not change them.
func (w *txn) put(bucket, key, val []byte) error {
	b, err := w.tx.CreateBucketIfNotExists(bucket)
	if err == nil {
		err = b.Put(key, val)
	}
	if err != nil {
		return err
	}
	w.dirty = true
	return nil
}

// del deletes key of bucket in the transaction; a bucket not there has nothing to
// delete. del keeps key until the commit.
func (w *txn) del(bucket, key []byte) error {
	b := w.tx.Bucket(bucket)
	if b == nil {
		return nil
	}
	if err := b.Delete(key); err != nil {
		return err
	}
	w.dirty = true
	return nil
}

// changed notes id as changed by the request running, for the change feeds.
func (w *txn) changed(id string) {
	if !w.deferred {
		w.ov.told[id] = struct{}{}
	}
}

func (w *txn) get(id string) *device.Reservation { return w.ov.get(id) }
func (w *txn) holder(dev string) string          { return w.ov.holder(dev) }
func (w *txn) usedOf(k counterKey) int64         { return w.ov.usedOf(k) }
func (w *txn) usersOf(k counterKey) []string     { return w.ov.usersOf(k) }
func (w *txn) setUsersOf(set device.CounterSetKey) map[string][]string {
	return w.ov.setUsersOf(set)
}

// putReservation stores r (never modified afterwards) in the file and the batch view.
func (w *txn) putReservation(r *device.Reservation) error {
	v, err := encodeReservation(r)
	if err != nil {
		return &storageError{Err: err}
	}
	if err := w.put(bucketReservations, []byte(r.ID), v); err != nil {
		return &storageError{Err: fmt.Errorf("store reservation %q: %w", r.ID, err)}
	}
	// The reservation's record supersedes its intent, whatever the write (its answer,
	// its release, a take-over): both go in the same commit.
	if w.ov.isIntent(r.ID) {
		if err := w.deleteIntentKey(r.ID); err != nil {
			return err
		}
	}
	w.ov.put(r)
	w.changed(r.ID)
	return nil
}

func (w *txn) deleteReservation(id string) error {
	if w.ov.isIntent(id) {
		if err := w.deleteIntentKey(id); err != nil {
			return err
		}
	}
	if err := w.del(bucketReservations, []byte(id)); err != nil {
		return &storageError{Err: fmt.Errorf("delete reservation %q: %w", id, err)}
	}
	w.ov.drop(id)
	w.changed(id)
	return nil
}

func (w *txn) putReattach(plugin string, data []byte) error {
	if err := w.put(bucketReattach, []byte(plugin), seal(data)); err != nil {
		return &storageError{Err: fmt.Errorf("store reattach data of plugin %q: %w", plugin, err)}
	}
	return nil
}

func (w *txn) deleteReattach(plugin string) error {
	if err := w.del(bucketReattach, []byte(plugin)); err != nil {
		return &storageError{Err: fmt.Errorf("delete reattach data of plugin %q: %w", plugin, err)}
	}
	return nil
}

// read runs fn in a read-only transaction of the state file: the state of the last
// commit, which holds every write acknowledged (a write is answered only once its
// commit is durable). It waits for no writer. fn must not write.
func (l *Ledger) read(fn func(tx *bolt.Tx) error) error {
	err := l.db.View(fn)
	if errors.Is(err, berrors.ErrDatabaseNotOpen) {
		return ErrClosed
	}
	return err
}
