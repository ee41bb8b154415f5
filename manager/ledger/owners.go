package ledger

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"
)

// Device ownership: which plugin a device ID belongs to, so that another plugin reporting
// the same ID (an impostor, or a plugin started while the owner restarts) cannot take it,
// across restarts of the plugin and of the host.
//
//	owners/<device ID>    record envelope around the owning plugin's name
//
// The bucket is created by the first write, so a file written before it existed (same
// schema version) is read as having no owners, and an older devicehost that opens a file
// with it ignores it.
var bucketOwners = []byte("owners")

// RecordDeviceOwners records owners (device ID -> plugin name), replacing an earlier owner
// of the same ID, and forgets the owners of the IDs in forget, in one transaction,
// durably before it returns. Nothing to do writes nothing. The IDs are a validated
// fingerprint's (validate.Fingerprint) and the names the manager's own plugins'; an
// empty one, which cannot be a key nor name an owner, is an "internal:" error.
func (l *Ledger) RecordDeviceOwners(ctx context.Context, owners map[string]string, forget []string) error {
	if len(owners) == 0 && len(forget) == 0 {
		return nil
	}
	for id, plugin := range owners {
		if id == "" || plugin == "" {
			return fmt.Errorf("record device owners: %w: empty device ID or plugin name (%q: %q)", errInternal, id, plugin)
		}
	}
	if slices.Contains(forget, "") {
		return fmt.Errorf("record device owners: %w: empty device ID to forget", errInternal)
	}
	owners, forget = maps.Clone(owners), slices.Clone(forget)
	_, err := l.submit(ctx, func(w *txn) (any, error) {
		b, err := w.tx.CreateBucketIfNotExists(bucketOwners)
		if err != nil {
			return nil, &storageError{fmt.Errorf("owners bucket: %w", err)}
		}
		for id, plugin := range owners {
			if err := b.Put([]byte(id), seal([]byte(plugin))); err != nil {
				return nil, &storageError{fmt.Errorf("store owner of device %q: %w", id, err)}
			}
		}
		for _, id := range forget {
			if err := b.Delete([]byte(id)); err != nil {
				return nil, &storageError{fmt.Errorf("delete owner of device %q: %w", id, err)}
			}
		}
		w.dirty = true
		return nil, nil
	})
	if err != nil {
		return fmt.Errorf("record device owners: %w", err)
	}
	return nil
}

// DeviceOwners returns every recorded owner, by device ID. A record whose checksum does
// not match is left out and named in the returned error, which wraps ErrCorrupt; the
// readable records are returned with it, so that one damaged record costs the protection
// of one ID, not of all.
func (l *Ledger) DeviceOwners() (map[string]string, error) {
	out := make(map[string]string)
	var bad []error
	err := l.db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketOwners)
		if b == nil {
			return nil
		}
		return b.ForEach(func(k, v []byte) error {
			payload, err := unseal(v)
			if err == nil && len(payload) == 0 {
				err = errors.New("no plugin name")
			}
			if err != nil {
				bad = append(bad, fmt.Errorf("owner record of device %q: %v: %w", k, err, ErrCorrupt))
				return nil
			}
			out[string(k)] = string(payload) // copies: k and v live in the memory map only during the tx
			return nil
		})
	})
	if errors.Is(err, berrors.ErrDatabaseNotOpen) {
		err = ErrClosed
	}
	if err != nil {
		return nil, fmt.Errorf("read device owners from %s: %w", l.path, err)
	}
	if len(bad) > 0 {
		return out, fmt.Errorf("device owners in %s: %w", l.path, errors.Join(bad...))
	}
	return out, nil
}
