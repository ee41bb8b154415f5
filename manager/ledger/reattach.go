package ledger

import (
	"context"
	"fmt"
	"slices"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
)

// maxReattachSize bounds the reattach data kept per plugin.
const maxReattachSize = 64 << 10

// SaveReattach stores data, the go-plugin reattach configuration of a running plugin in
// whatever encoding the caller chose, under the plugin's name, replacing what was there,
// durably before it returns. The ledger treats data as opaque bytes (at most 64 KiB, a
// *device.FieldError otherwise). An empty plugin name, which cannot be a key, is an
// "internal:" error.
func (l *Ledger) SaveReattach(ctx context.Context, plugin string, data []byte) error {
	if plugin == "" {
		return fmt.Errorf("save reattach data: %w: no plugin name", errInternal)
	}
	if len(data) > maxReattachSize {
		return &device.FieldError{Field: "reattach_data",
			Rule: fmt.Sprintf("%d bytes, more than %d", len(data), maxReattachSize)}
	}
	data = slices.Clone(data)
	if _, err := l.submit(ctx, func(w *txn) (any, error) { return nil, w.putReattach(plugin, data) }); err != nil {
		return fmt.Errorf("save reattach data of plugin %q: %w", plugin, err)
	}
	return nil
}

// DeleteReattach forgets the reattach data of plugin, durably; none is not an error. An
// empty plugin name is an "internal:" error.
func (l *Ledger) DeleteReattach(ctx context.Context, plugin string) error {
	if plugin == "" {
		return fmt.Errorf("delete reattach data: %w: no plugin name", errInternal)
	}
	if _, err := l.submit(ctx, func(w *txn) (any, error) { return nil, w.deleteReattach(plugin) }); err != nil {
		return fmt.Errorf("delete reattach data of plugin %q: %w", plugin, err)
	}
	return nil
}

// LoadReattach returns the reattach data saved for plugin, and false when there is none.
// Data whose checksum does not match is an error wrapping ErrCorrupt that names the
// plugin; the caller should then start the plugin fresh and DeleteReattach it.
func (l *Ledger) LoadReattach(plugin string) ([]byte, bool, error) {
	var out []byte
	err := l.read(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketReattach).Get([]byte(plugin))
		if v == nil {
			return nil
		}
		payload, err := unseal(v)
		if err != nil {
			return fmt.Errorf("%v: %w", err, ErrCorrupt)
		}
		out = slices.Clone(payload) // v lives in the memory map only during the tx
		if out == nil {
			out = []byte{}
		}
		return nil
	})
	if err != nil {
		return nil, false, fmt.Errorf("load reattach data of plugin %q from %s: %w", plugin, l.path, err)
	}
	return out, out != nil, nil
}

// ReattachPlugins returns the names of the plugins with saved reattach data, sorted, so
// that a starting agent can find plugins it no longer runs.
func (l *Ledger) ReattachPlugins() ([]string, error) {
	var names []string
	err := l.read(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketReattach).ForEach(func(k, _ []byte) error {
			names = append(names, string(k))
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("list reattach data in %s: %w", l.path, err)
	}
	return names, nil
}
