package ledger

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
)

// Admin accesses outlive the ledger; a damaged record is left out, named in the log,
// and the others stay; a Release of another owner's access by ID is refused.
func TestAdminAccessRecords(t *testing.T) {
	ctx := context.Background()
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	gpu := device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "H100"}
	a, err := l.GrantAccess(ctx, device.AdminAccess{OwnerID: "k8s-claim/mon/a/u1", Group: gpu, DeviceIDs: []string{"GPU-0", "GPU-1"}, CDIDevices: []string{"nvidia.com/gpu=GPU-0", "nvidia.com/gpu=GPU-1"}, Since: t0})
	if err != nil {
		t.Fatal(err)
	}
	b, err := l.GrantAccess(ctx, device.AdminAccess{OwnerID: "k8s-claim/mon/b/u2", Group: gpu, DeviceIDs: []string{"GPU-1"}, Since: t0})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.RevokeAccess(ctx, device.ReleaseRequest{ReservationID: b.ID, OwnerPrefixes: []string{"k8s-claim/mon/a/"}}); !errors.Is(err, device.ErrPermissionDenied) || !strings.Contains(err.Error(), b.ID) {
		t.Errorf("release of another owner's access by ID = %v, want permission denied naming it", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketAccess).Put([]byte(b.ID), []byte("garbage")) }); err != nil {
		t.Fatal(err)
	}
	db.Close()

	logs, logger := newLogCapture()
	l, err = Open(path, Options{Logger: logger})
	if err != nil {
		t.Fatalf("open with a damaged admin access record: %v", err)
	}
	defer l.Close()
	if got := l.Accesses(); len(got) != 1 || got[0].ID != a.ID || !slices.Equal(got[0].CDIDevices, a.CDIDevices) || !got[0].Since.Equal(t0) {
		t.Errorf("accesses after a reopen = %+v, want %s as granted", got, a.ID)
	}
	if by := l.AccessByDevice()["GPU-1"]; len(by) != 1 || by[0].ReservationID != a.ID {
		t.Errorf("GPU-1's accesses = %v, want %s alone", by, a.ID)
	}
	if !strings.Contains(logs.String(), b.ID) || !strings.Contains(logs.String(), "damaged admin access") {
		t.Errorf("the log does not name the damaged record %s:\n%s", b.ID, logs)
	}
	gone, err := l.RevokeAccess(ctx, device.ReleaseRequest{OwnerID: "k8s-claim/mon/a/u1"})
	if err != nil || len(gone) != 1 || gone[0].ID != a.ID || len(l.Accesses()) != 0 {
		t.Errorf("release of the owner = %v, %v; accesses left %v", gone, err, l.Accesses())
	}
}

// A device takes at most MaxAdminAccessPerDevice admin accesses: the next is refused,
// naming the device and the bound, and nothing is recorded; the same owner asking again
// still gets its own back, and a release makes room.
func TestAdminAccessBound(t *testing.T) {
	ctx := context.Background()
	l, err := Open(statePath(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	grant := func(owner string, ids ...string) (device.AdminAccess, error) {
		return l.GrantAccess(ctx, device.AdminAccess{OwnerID: owner, DeviceIDs: ids, Since: t0})
	}
	var first device.AdminAccess
	for i := range device.MaxAdminAccessPerDevice {
		a, err := grant(fmt.Sprintf("mon/%d", i), "GPU-0")
		if err != nil {
			t.Fatalf("access %d: %v", i, err)
		}
		if i == 0 {
			first = a
		}
	}
	_, err = grant("mon/extra", "GPU-1", "GPU-0")
	if !errors.Is(err, device.ErrTooManyAccesses) || !strings.Contains(err.Error(), "GPU-0") || !strings.Contains(err.Error(), fmt.Sprint(device.MaxAdminAccessPerDevice)) {
		t.Errorf("access past the bound = %v, want ErrTooManyAccesses naming GPU-0 and %d", err, device.MaxAdminAccessPerDevice)
	}
	if n := len(l.AccessByDevice()["GPU-1"]); n != 0 {
		t.Errorf("a refused access left %d on GPU-1", n)
	}
	if again, err := grant("mon/0", "GPU-0"); err != nil || again.ID != first.ID {
		t.Errorf("the first owner again at the bound = %s, %v; want %s back", again.ID, err, first.ID)
	}
	if _, err := l.RevokeAccess(ctx, device.ReleaseRequest{OwnerID: "mon/0"}); err != nil {
		t.Fatal(err)
	}
	if _, err := grant("mon/extra", "GPU-1", "GPU-0"); err != nil {
		t.Errorf("access after a release made room: %v", err)
	}
}
