package ledger

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
)

// Cordons: devices an operator took out of service (device.Manager.Cordon). A cordon
// outlives the host, and a Reserve checks it in the same transaction as the holders, so
// no Reserve committed after a Cordon can hold the device.
//
//	cordons/<device ID>    record envelope around cordonRecord's JSON
//
// The bucket is created by the first cordon, so a file without it (same schema version)
// has none, and an older devicehost that opens a file with it ignores it.
var bucketCordons = []byte("cordons")

// cordonRecord is a cordon as stored.
type cordonRecord struct {
	Reason string    `json:"reason"`
	By     string    `json:"by"`
	Since  time.Time `json:"since"`
	Drain  bool      `json:"drain,omitempty"`
}

// Cordon records c for device id, replacing an earlier cordon of it, durably before it
// returns, and returns it as recorded (its time as the file keeps it). An empty id or
// reason is an "internal:" error (the server validates both).
func (l *Ledger) Cordon(ctx context.Context, id string, c device.Cordon) (device.Cordon, error) {
	if id == "" || c.Reason == "" {
		return device.Cordon{}, fmt.Errorf("cordon: %w: empty device ID or reason (%q: %q)", errInternal, id, c.Reason)
	}
	c.Since = normTime(c.Since)
	payload, err := json.Marshal(cordonRecord{Reason: c.Reason, By: c.By, Since: c.Since, Drain: c.Drain})
	if err != nil {
		return device.Cordon{}, fmt.Errorf("cordon: %w", err)
	}
	l.cordonMu.Lock()
	defer l.cordonMu.Unlock()
	_, err = l.submit(ctx, func(w *txn) (any, error) {
		if err := w.put(bucketCordons, []byte(id), seal(payload)); err != nil {
			return nil, &storageError{Err: fmt.Errorf("store cordon of device %q: %w", id, err)}
		}
		detail := c.Reason
		if c.Drain {
			detail = "drain: " + detail
		}
		return nil, w.event(device.Event{Kind: device.EventCordon, By: cmp.Or(device.CallerOf(ctx), c.By), Devices: []string{id}, Detail: detail})
	})
	if err != nil {
		return device.Cordon{}, fmt.Errorf("cordon device %q: %w", id, err)
	}
	next := maps.Clone(*l.cordons.Load())
	next[id] = c
	l.cordons.Store(&next)
	return c, nil
}

// Uncordon deletes device id's cordon, durably before it returns, and returns it; nil
// when there was none (nothing is written).
func (l *Ledger) Uncordon(ctx context.Context, id string) (*device.Cordon, error) {
	l.cordonMu.Lock()
	defer l.cordonMu.Unlock()
	was, ok := (*l.cordons.Load())[id]
	if !ok {
		return nil, nil
	}
	_, err := l.submit(ctx, func(w *txn) (any, error) {
		if w.tx.Bucket(bucketCordons) == nil {
			return nil, nil
		}
		if err := w.del(bucketCordons, []byte(id)); err != nil {
			return nil, &storageError{Err: fmt.Errorf("delete cordon of device %q: %w", id, err)}
		}
		return nil, w.event(device.Event{Kind: device.EventUncordon, By: device.CallerOf(ctx), Devices: []string{id}, Detail: "was: " + was.Reason})
	})
	if err != nil {
		return nil, fmt.Errorf("uncordon device %q: %w", id, err)
	}
	next := maps.Clone(*l.cordons.Load())
	delete(next, id)
	l.cordons.Store(&next)
	return &was, nil
}

// Cordons returns the cordoned devices' cordons, by device ID: an immutable map, nil
// or empty when none. Safe to call with any lock held (the inventory calls it under
// its own), and cheap: it reads no file.
func (l *Ledger) Cordons() map[string]device.Cordon { return *l.cordons.Load() }

// loadCordons reads every cordon of db. A record that cannot be read keeps its device
// cordoned, with a reason that says so (a damaged record must not put a device back in
// service), and is named in the error, which wraps ErrCorrupt.
func loadCordons(db *bolt.DB, path string) (map[string]device.Cordon, error) {
	out := make(map[string]device.Cordon)
	var bad []error
	err := db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketCordons)
		if b == nil {
			return nil
		}
		return b.ForEach(func(k, v []byte) error {
			var rec cordonRecord
			payload, err := unseal(v)
			if err == nil {
				err = json.Unmarshal(payload, &rec)
			}
			if err == nil && rec.Reason == "" {
				err = errors.New("no reason")
			}
			if err != nil {
				bad = append(bad, fmt.Errorf("cordon record of device %q: %v: %w", k, err, ErrCorrupt))
				rec = cordonRecord{Reason: "its cordon record in the state file is damaged: uncordon it, or cordon it again", By: "the ledger"}
			}
			out[string(k)] = device.Cordon{Reason: rec.Reason, By: rec.By, Since: rec.Since, Drain: rec.Drain}
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("read cordons from %s: %w", path, err)
	}
	if len(bad) > 0 {
		return out, fmt.Errorf("cordons in %s: %w", path, errors.Join(bad...))
	}
	return out, nil
}

// checkCordons refuses a new holder of a cordoned device among ids, from the batch's
// view of the file (a Cordon earlier in the same batch counts).
func checkCordons(w *txn, ids []string) error {
	b := w.tx.Bucket(bucketCordons)
	if b == nil {
		return nil
	}
	for _, id := range ids {
		v := b.Get([]byte(id))
		if v == nil {
			continue
		}
		var rec cordonRecord
		payload, err := unseal(v)
		if err == nil {
			err = json.Unmarshal(payload, &rec)
		}
		if err != nil {
			rec = cordonRecord{Reason: "its cordon record in the state file is damaged: uncordon it, or cordon it again", By: "the ledger"}
		}
		return &device.CordonedError{DeviceID: id, Cordon: device.Cordon{Reason: rec.Reason, By: rec.By, Since: rec.Since, Drain: rec.Drain}}
	}
	return nil
}
