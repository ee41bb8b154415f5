package ledger

import (
	"context"
	"errors"
	"maps"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"
)

// TestDeviceOwners records device owners, replaces and forgets some, and reads them back
// after a reopen: ownership outlives the process.
func TestDeviceOwners(t *testing.T) {
	path := statePath(t)
	ctx := context.Background()
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := l.DeviceOwners(); err != nil || len(got) != 0 {
		t.Fatalf("DeviceOwners of a new file = %v, %v; want none", got, err)
	}
	if err := l.RecordDeviceOwners(ctx, map[string]string{"GPU-1": "nvidia", "GPU-2": "nvidia", "w0": "widgets"}, nil); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordDeviceOwners(ctx, map[string]string{"w0": "acme"}, []string{"GPU-2", "never-recorded"}); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordDeviceOwners(ctx, nil, nil); err != nil {
		t.Errorf("RecordDeviceOwners of nothing: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	l = openLedger(t, path)
	got, err := l.DeviceOwners()
	if want := map[string]string{"GPU-1": "nvidia", "w0": "acme"}; err != nil || !maps.Equal(got, want) {
		t.Errorf("DeviceOwners after a reopen = %v, %v; want %v", got, err, want)
	}

	// Device IDs come from validated fingerprints (validate.Fingerprint's rules); the
	// ledger asserts only what a record needs: a key and an owner.
	for name, bad := range map[string]map[string]string{
		"empty device ID": {"": "nvidia"},
		"empty plugin":    {"GPU-9": ""},
	} {
		if err := l.RecordDeviceOwners(ctx, bad, nil); !errors.Is(err, errInternal) {
			t.Errorf("%s: RecordDeviceOwners = %v, want an internal error", name, err)
		}
	}
	if err := l.RecordDeviceOwners(ctx, nil, []string{""}); !errors.Is(err, errInternal) {
		t.Errorf("forget of an empty ID: %v, want an internal error", err)
	}
}

// TestDeviceOwnersDamagedRecord: a record that fails its checksum is named in an error
// wrapping ErrCorrupt, and the readable ones are still returned.
func TestDeviceOwnersDamagedRecord(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.RecordDeviceOwners(context.Background(), map[string]string{"GPU-1": "nvidia", "GPU-2": "nvidia"}, nil); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	mutateFile(t, path, func(tx *bolt.Tx) error {
		return tx.Bucket(bucketOwners).Put([]byte("GPU-2"), []byte("\x00\x00\x00\x00impostor"))
	})

	l = openLedger(t, path)
	got, err := l.DeviceOwners()
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), `"GPU-2"`) {
		t.Errorf("DeviceOwners error = %v, want ErrCorrupt naming GPU-2", err)
	}
	if want := map[string]string{"GPU-1": "nvidia"}; !maps.Equal(got, want) {
		t.Errorf("DeviceOwners = %v, want the readable %v", got, want)
	}
}

func TestDeviceOwnersAfterClose(t *testing.T) {
	l, err := Open(statePath(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordDeviceOwners(context.Background(), map[string]string{"GPU-1": "nvidia"}, nil); !errors.Is(err, ErrClosed) {
		t.Errorf("RecordDeviceOwners after Close = %v, want ErrClosed", err)
	}
	if _, err := l.DeviceOwners(); !errors.Is(err, ErrClosed) {
		t.Errorf("DeviceOwners after Close = %v, want ErrClosed", err)
	}
}
