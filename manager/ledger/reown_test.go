package ledger

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
)

// Reown changes the owner, and only the owner, durably: after a reopen the reservation
// is listed under its new owner, still holds its devices, and the old owner has none.
func TestReown(t *testing.T) {
	ctx := context.Background()
	path := statePath(t)
	l, err := Open(path, Options{Now: tickingClock()})
	if err != nil {
		t.Fatal(err)
	}
	r := reserve(t, l, "kubelet/nvidia.com/gpu/0123456789abcdef", "GPU-0", "GPU-1")
	other := reserve(t, l, "job-42", "GPU-2")

	got, err := l.Reown(ctx, device.ReownRequest{ReservationID: r.ID, OwnerID: r.OwnerID, NewOwnerID: "k8s/ml/trainer-0/main"})
	if err != nil {
		t.Fatalf("Reown: %v", err)
	}
	want := r
	want.OwnerID = "k8s/ml/trainer-0/main"
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Reown returned\n%+v\nwant\n%+v", got, want)
	}
	// A retry of the same call: done already, nothing to do.
	if again, err := l.Reown(ctx, device.ReownRequest{ReservationID: r.ID, OwnerID: r.OwnerID, NewOwnerID: "k8s/ml/trainer-0/main"}); err != nil || !reflect.DeepEqual(again, want) {
		t.Errorf("retried Reown = %+v, %v; want %+v", again, err, want)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	l = openLedger(t, path)
	if rs, err := l.List(ctx, device.ReservationFilter{OwnerID: "k8s/ml/trainer-0/main"}); err != nil || len(rs) != 1 || !reflect.DeepEqual(rs[0], want) {
		t.Errorf("after reopen, List(new owner) = %+v, %v; want %+v", rs, err, want)
	}
	if rs, _ := l.List(ctx, device.ReservationFilter{OwnerID: r.OwnerID}); len(rs) != 0 {
		t.Errorf("after reopen, List(old owner) = %+v, want none", rs)
	}
	if h := l.Holders()["GPU-1"]; h != (device.Holder{ReservationID: r.ID, OwnerID: "k8s/ml/trainer-0/main"}) {
		t.Errorf("holder of GPU-1 = %+v, want %s of the new owner", h, r.ID)
	}
	// Releasing by the new owner releases it.
	if rel, _, err := l.Release(ctx, device.ReleaseRequest{OwnerID: "k8s/ml/trainer-0/main"}, t0); err != nil || len(rel) != 1 || rel[0].ID != r.ID {
		t.Errorf("Release(new owner) = %+v, %v; want %s", rel, err, r.ID)
	}

	for _, tc := range []struct {
		name    string
		req     device.ReownRequest
		wantErr error
		msg     string
	}{
		{"unknown", device.ReownRequest{ReservationID: "res-nope", OwnerID: "a", NewOwnerID: "b"}, device.ErrNotFound, `reservation "res-nope"`},
		{"another owner's", device.ReownRequest{ReservationID: other.ID, OwnerID: "kubelet/x", NewOwnerID: "k8s/a/b/c"}, device.ErrInvalidRequest, `owner_id: reservation ` + other.ID + ` is owned by "job-42", not "kubelet/x"`},
		{"released", device.ReownRequest{ReservationID: r.ID, OwnerID: "k8s/ml/trainer-0/main", NewOwnerID: "k8s/ml/trainer-1/main"}, device.ErrInvalidRequest, "reservation_id: reservation " + r.ID + " is released"},
	} {
		_, err := l.Reown(ctx, tc.req)
		if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: Reown = %v, want %v containing %q", tc.name, err, tc.wantErr, tc.msg)
		}
	}
	if rs, _ := l.List(ctx, device.ReservationFilter{OwnerID: "job-42"}); len(rs) != 1 || rs[0].ID != other.ID {
		t.Errorf("job-42's reservation after a refused Reown: %+v", rs)
	}
}
