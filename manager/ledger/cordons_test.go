package ledger

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
)

// A cordon keeps the holder, refuses any new one (in the Reserve's own transaction),
// outlives a reopen, and is gone after Uncordon.
func TestCordonRefusesNewHoldersOnly(t *testing.T) {
	ctx := context.Background()
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	held, _, err := l.Reserve(ctx, res("job-1", "GPU-0"), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := device.Cordon{Reason: "ECC storm", By: `listener "main" uid=0,gid=0,pid=1`, Since: t0}
	if got, err := l.Cordon(ctx, "GPU-0", c); err != nil || !reflect.DeepEqual(got, c) {
		t.Fatalf("Cordon = %+v, %v", got, err)
	}
	if _, err := l.Cordon(ctx, "GPU-1", device.Cordon{Reason: "firmware", Since: t0, Drain: true}); err != nil {
		t.Fatal(err)
	}
	// The holder keeps it: its own Reserve, asked again, is answered with it.
	if again, existing, err := l.Reserve(ctx, res("job-1", "GPU-0"), nil, nil); err != nil || !existing || again.ID != held.ID {
		t.Errorf("the holder's Reserve again = %v, %v, %v; want its reservation", again.ID, existing, err)
	}
	// Nobody else gets a cordoned device, nor takes it over.
	for _, tt := range []struct {
		r        device.Reservation
		takeOver []string
		dev      string
	}{
		{res("job-2", "GPU-1"), nil, "GPU-1"},
		{res("job-2", "GPU-2", "GPU-1"), nil, "GPU-1"},
		{res("job-3", "GPU-0"), []string{"job-"}, "GPU-0"},
	} {
		_, _, err := l.Reserve(ctx, tt.r, tt.takeOver, nil)
		var ce *device.CordonedError
		if !errors.As(err, &ce) || ce.DeviceID != tt.dev || !errors.Is(err, device.ErrDeviceCordoned) {
			t.Errorf("Reserve %v for %s: %v, want a *CordonedError for %s", tt.r.DeviceIDs, tt.r.OwnerID, err, tt.dev)
		}
	}
	if live := liveOwners(t, l); !reflect.DeepEqual(live, []string{"job-1"}) {
		t.Errorf("live owners after the refusals: %v, want job-1 alone (a take-over must not release it)", live)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	l, err = Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	want := map[string]device.Cordon{"GPU-0": c, "GPU-1": {Reason: "firmware", Since: t0, Drain: true}}
	if got := l.Cordons(); !reflect.DeepEqual(got, want) {
		t.Errorf("Cordons after reopen = %+v, want %+v", got, want)
	}
	if _, _, err := l.Reserve(ctx, res("job-2", "GPU-1"), nil, nil); !errors.Is(err, device.ErrDeviceCordoned) {
		t.Errorf("Reserve of a cordoned device after reopen: %v", err)
	}
	was, err := l.Uncordon(ctx, "GPU-1")
	if err != nil || was == nil || was.Reason != "firmware" {
		t.Fatalf("Uncordon = %+v, %v", was, err)
	}
	if was, err := l.Uncordon(ctx, "GPU-1"); err != nil || was != nil {
		t.Errorf("Uncordon again = %+v, %v; want nil, nil", was, err)
	}
	if _, _, err := l.Reserve(ctx, res("job-2", "GPU-1"), nil, nil); err != nil {
		t.Errorf("Reserve after Uncordon: %v", err)
	}
	if got := l.Cordons(); len(got) != 1 {
		t.Errorf("Cordons = %+v, want GPU-0's alone", got)
	}
}

func liveOwners(t *testing.T, l *Ledger) []string {
	t.Helper()
	rs, err := l.List(context.Background(), device.ReservationFilter{State: device.ReservationActive})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range rs {
		out = append(out, r.OwnerID)
	}
	return out
}

// A damaged cordon record keeps its device cordoned, with a reason that says so.
func TestDamagedCordonKeepsTheDeviceCordoned(t *testing.T) {
	ctx := context.Background()
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Cordon(ctx, "GPU-0", device.Cordon{Reason: "ECC storm", Since: t0}); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketCordons).Put([]byte("GPU-0"), []byte("garbage")) }); err != nil {
		t.Fatal(err)
	}
	db.Close()
	l, err = Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if c, ok := l.Cordons()["GPU-0"]; !ok || !strings.Contains(c.Reason, "damaged") {
		t.Errorf("GPU-0 after its record was damaged: %+v, %v; want it cordoned, saying so", c, ok)
	}
	if _, _, err := l.Reserve(ctx, res("job-2", "GPU-0"), nil, nil); !errors.Is(err, device.ErrDeviceCordoned) || !strings.Contains(err.Error(), "damaged") {
		t.Errorf("Reserve of a device with a damaged cordon: %v", err)
	}
}
