package ledger

import (
	"context"
	"errors"
	"maps"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"
)

// TestDeviceBindings records device bindings, replaces and forgets some, and reads them
// back after a reopen: bindings outlive the process.
func TestDeviceBindings(t *testing.T) {
	path := statePath(t)
	ctx := context.Background()
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := l.DeviceBindings(); err != nil || len(got) != 0 {
		t.Fatalf("DeviceBindings of a new file = %v, %v; want none", got, err)
	}
	if err := l.RecordDeviceBindings(ctx, map[string]string{"GPU-1": "nvidia", "GPU-2": "nvidia", "w0": "widgets"}, nil); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordDeviceBindings(ctx, map[string]string{"w0": "acme"}, []string{"GPU-2", "never-recorded"}); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordDeviceBindings(ctx, nil, nil); err != nil {
		t.Errorf("RecordDeviceBindings of nothing: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	l = openLedger(t, path)
	got, err := l.DeviceBindings()
	if want := map[string]string{"GPU-1": "nvidia", "w0": "acme"}; err != nil || !maps.Equal(got, want) {
		t.Errorf("DeviceBindings after a reopen = %v, %v; want %v", got, err, want)
	}

	// Device IDs come from validated fingerprints (validate.Fingerprint's rules); the
	// ledger asserts only what a record needs: a key and a plugin name.
	for name, bad := range map[string]map[string]string{
		"empty device ID": {"": "nvidia"},
		"empty plugin":    {"GPU-9": ""},
	} {
		if err := l.RecordDeviceBindings(ctx, bad, nil); !errors.Is(err, errInternal) {
			t.Errorf("%s: RecordDeviceBindings = %v, want an internal error", name, err)
		}
	}
	if err := l.RecordDeviceBindings(ctx, nil, []string{""}); !errors.Is(err, errInternal) {
		t.Errorf("forget of an empty ID: %v, want an internal error", err)
	}
}

// TestDeviceBindingsDamagedRecord: a record that fails its checksum is named in an error
// wrapping ErrCorrupt, and the readable ones are still returned.
func TestDeviceBindingsDamagedRecord(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.RecordDeviceBindings(context.Background(), map[string]string{"GPU-1": "nvidia", "GPU-2": "nvidia"}, nil); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	mutateFile(t, path, func(tx *bolt.Tx) error {
		// The on-disk name, spelled out: state files of earlier versions must still open.
		return tx.Bucket([]byte("owners")).Put([]byte("GPU-2"), []byte("\x00\x00\x00\x00impostor"))
	})

	l = openLedger(t, path)
	got, err := l.DeviceBindings()
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), `"GPU-2"`) {
		t.Errorf("DeviceBindings error = %v, want ErrCorrupt naming GPU-2", err)
	}
	if want := map[string]string{"GPU-1": "nvidia"}; !maps.Equal(got, want) {
		t.Errorf("DeviceBindings = %v, want the readable %v", got, want)
	}
}

func TestDeviceBindingsAfterClose(t *testing.T) {
	l, err := Open(statePath(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordDeviceBindings(context.Background(), map[string]string{"GPU-1": "nvidia"}, nil); !errors.Is(err, ErrClosed) {
		t.Errorf("RecordDeviceBindings after Close = %v, want ErrClosed", err)
	}
	if _, err := l.DeviceBindings(); !errors.Is(err, ErrClosed) {
		t.Errorf("DeviceBindings after Close = %v, want ErrClosed", err)
	}
}
