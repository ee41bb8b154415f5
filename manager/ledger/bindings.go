package ledger

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	bolt "go.etcd.io/bbolt"
)

// Device bindings: which plugin a device ID is bound to (the first that reported it), so
// that another plugin reporting the same ID (an impostor, or a plugin started while the
// bound one restarts) cannot take it, across restarts of the plugin and of the host.
// (Not a reservation's owner, which is the allocation holding a device.)
//
//	owners/<device ID>    record envelope around the bound plugin's name
//
// The bucket is named "owners", the name state files carry for it, so that they open as
// they are. It is created by the first write, so a file without it (same schema version)
// is read as having no bindings, and an older devicehost that opens a file with it
// ignores it.
var bucketBindings = []byte("owners")

// RecordDeviceBindings records bindings (device ID -> plugin name), replacing an earlier
// binding of the same ID, and forgets the bindings of the IDs in forget, in one
// transaction, durably before it returns. Nothing to do writes nothing. The IDs are a
// validated fingerprint's (validate.Fingerprint) and the names the manager's own
// plugins'; an empty one, which cannot be a key nor name a plugin, is an "internal:"
// error.
func (l *Ledger) RecordDeviceBindings(ctx context.Context, bindings map[string]string, forget []string) error {
	if len(bindings) == 0 && len(forget) == 0 {
		return nil
	}
	for id, plugin := range bindings {
		if id == "" || plugin == "" {
			return fmt.Errorf("record device bindings: %w: empty device ID or plugin name (%q: %q)", errInternal, id, plugin)
		}
	}
	if slices.Contains(forget, "") {
		return fmt.Errorf("record device bindings: %w: empty device ID to forget", errInternal)
	}
	bindings, forget = maps.Clone(bindings), slices.Clone(forget)
	_, err := l.submit(ctx, func(w *txn) (any, error) {
		for id, plugin := range bindings {
			if err := w.put(bucketBindings, []byte(id), seal([]byte(plugin))); err != nil {
				return nil, &storageError{Err: fmt.Errorf("store binding of device %q: %w", id, err)}
			}
		}
		for _, id := range forget {
			if err := w.del(bucketBindings, []byte(id)); err != nil {
				return nil, &storageError{Err: fmt.Errorf("delete binding of device %q: %w", id, err)}
			}
		}
		return nil, nil
	})
	if err != nil {
		return fmt.Errorf("record device bindings: %w", err)
	}
	return nil
}

// DeviceBindings returns every recorded binding (the plugin's name), by device ID. A record whose checksum does
// not match is left out and named in the returned error, which wraps ErrCorrupt; the
// readable records are returned with it, so that one damaged record costs the protection
// of one ID, not of all.
func (l *Ledger) DeviceBindings() (map[string]string, error) {
	out := make(map[string]string)
	var bad []error
	err := l.read(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketBindings)
		if b == nil {
			return nil
		}
		return b.ForEach(func(k, v []byte) error {
			payload, err := unseal(v)
			if err == nil && len(payload) == 0 {
				err = errors.New("no plugin name")
			}
			if err != nil {
				bad = append(bad, fmt.Errorf("binding record of device %q: %v: %w", k, err, ErrCorrupt))
				return nil
			}
			out[string(k)] = string(payload) // copies: k and v live in the memory map only during the tx
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("read device bindings from %s: %w", l.path, err)
	}
	if len(bad) > 0 {
		return out, fmt.Errorf("device bindings in %s: %w", l.path, errors.Join(bad...))
	}
	return out, nil
}
