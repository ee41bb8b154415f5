package ledger

import (
	"context"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
)

func TestPackedKeepsEveryField(t *testing.T) {
	full := res("k8s/ns/pod/ctr", "GPU-0", "GPU-1")
	full.Container.Envs["B"] = "two"
	full.Container.Mounts = append(full.Container.Mounts, device.Mount{HostPath: "/h", ContainerPath: "/c"})
	full.CreatedAt = time.Date(2026, 3, 1, 12, 0, 0, 123456789, time.UTC)
	full.ReleasedAt = full.CreatedAt.Add(90 * time.Minute)
	full.CleanupPending = true
	full.OwnerLabels = device.OwnerLabels{Pod: "trainer-0,trainer-1", Namespace: "ml"}
	full.Consumes = []device.Consumption{
		{Set: device.CounterSetKey{Plugin: full.Plugin, Name: "GPU-0"}, Counters: map[string]int64{"memory-slice-0": 1, "compute-slices": 7}},
		{Set: device.CounterSetKey{Plugin: full.Plugin, Name: "GPU-1"}, Counters: map[string]int64{}},
	}

	empty := full
	empty.Container = device.ContainerReservation{
		Envs: map[string]string{}, Mounts: []device.Mount{}, Devices: []device.DeviceSpec{}, CDIDevices: []string{},
	}
	empty.CleanupPending = false
	empty.Consumes = []device.Consumption{}

	odd := full // values a careless plugin or caller could have stored
	odd.OwnerID = strings.Repeat("é", 200)
	odd.Container = device.ContainerReservation{Envs: map[string]string{"": ""}}
	odd.CreatedAt = time.Date(1970, 1, 1, 0, 0, 0, 1, time.UTC)
	odd.ReleasedAt = time.Date(1969, 12, 31, 23, 59, 59, 999999999, time.UTC) // negative Unix time

	zeroTimes := full
	zeroTimes.CreatedAt, zeroTimes.ReleasedAt = time.Time{}, time.Time{}

	tests := []struct {
		name string
		r    device.Reservation
	}{
		{"every field set", full},
		{"empty, not nil, container lists", empty},
		{"nil container lists", func() device.Reservation { r := full; r.Container = device.ContainerReservation{}; return r }()},
		{"odd values", odd},
		{"zero times", zeroTimes},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := tt.r
			r.ID, r.State = "res-0123456789abcdef", device.ReservationReleased
			r.TakenOver = nil // never stored
			p := pack(&r)
			got := p.unpack(r.ID)
			if !reflect.DeepEqual(*got, r) {
				t.Errorf("unpack(pack(r)) =\n%#v\nwant\n%#v", *got, r)
			}
			if got.CreatedAt != r.CreatedAt || got.ReleasedAt != r.ReleasedAt {
				t.Errorf("times %v, %v; want %v, %v (==)", got.CreatedAt, got.ReleasedAt, r.CreatedAt, r.ReleasedAt)
			}
			if p.owner() != r.OwnerID || p.cleanupPending() != r.CleanupPending {
				t.Errorf("owner %q, cleanupPending %v; want %q, %v", p.owner(), p.cleanupPending(), r.OwnerID, r.CleanupPending)
			}
			for _, d := range r.DeviceIDs {
				if !p.hasDevice(d) {
					t.Errorf("hasDevice(%q) = false", d)
				}
			}
			if p.hasDevice("GPU-9") || p.hasDevice(r.OwnerID) {
				t.Error("hasDevice is true for a device it was not for")
			}
		})
	}
}

func TestReleasedReservationsReadBackAsTheCallersOwn(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	r := reserve(t, l, "owner-a", "GPU-0", "GPU-1")
	if _, _, err := l.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}, time.Time{}); err != nil {
		t.Fatal(err)
	}
	want, err := l.Get(r.ID)
	if err != nil {
		t.Fatal(err)
	}
	if want.State != device.ReservationReleased || !want.CleanupPending || want.ReleasedAt.IsZero() {
		t.Fatalf("released reservation reads back as %+v", want)
	}
	want = clone(&want)
	// Whatever a caller does to what it got does not show in the next read.
	mess := func(r *device.Reservation) {
		r.DeviceIDs[0] = "changed"
		r.Container.Envs["X"] = "y"
		r.Container.Mounts[0].HostPath = "/changed"
		r.Container.Devices[0].Permissions = "m"
		r.Container.CDIDevices[0] = "changed"
	}
	got, _ := l.Get(r.ID)
	mess(&got)
	listed, err := l.List(ctx, device.ReservationFilter{State: device.ReservationReleased})
	if err != nil || len(listed) != 1 {
		t.Fatalf("List released = %v, %v", listed, err)
	}
	mess(&listed[0])
	byOwner, _ := l.List(ctx, device.ReservationFilter{OwnerID: "owner-a"})
	mess(&byOwner[0])
	pending := l.PendingCleanups()
	mess(&pending[0])
	for _, read := range []func() device.Reservation{
		func() device.Reservation { g, _ := l.Get(r.ID); return g },
		func() device.Reservation {
			rs, _ := l.List(ctx, device.ReservationFilter{DeviceID: "GPU-1"})
			return rs[0]
		},
		func() device.Reservation { return l.PendingCleanups()[0] },
	} {
		if got := read(); !reflect.DeepEqual(got, want) {
			t.Errorf("read after callers changed their copies:\n%+v\nwant\n%+v", got, want)
		}
	}
}

func TestOwnerIndexCollisionsDoNotLeak(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	a := reserve(t, l, "owner-a", "GPU-0")
	b := reserve(t, l, "owner-b", "GPU-1")
	released := reserve(t, l, "owner-c", "GPU-2")
	if _, _, err := l.Release(ctx, device.ReleaseRequest{ReservationID: released.ID}, time.Time{}); err != nil {
		t.Fatal(err)
	}
	// Make owner-a's and owner-c's reservations look like owner-b's in the owner index,
	// as if their owners' hashes were the same.
	l.mu.Lock()
	kb := l.idx.ownerKey("owner-b")
	ids := l.idx.owners[kb]
	ids.add(a.ID)
	ids.add(released.ID)
	l.idx.owners[kb] = ids
	l.mu.Unlock()

	listed, err := l.List(ctx, device.ReservationFilter{OwnerID: "owner-b"})
	if err != nil {
		t.Fatal(err)
	}
	if len(listed) != 1 || listed[0].ID != b.ID {
		t.Errorf("List of owner-b = %v, want only %s", listedIDs(listed), b.ID)
	}
	rel, already, err := l.Release(ctx, device.ReleaseRequest{OwnerID: "owner-b"}, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	if len(rel) != 1 || rel[0].ID != b.ID || len(already) != 0 {
		t.Errorf("Release of owner-b released %v, already %v; want only %s", listedIDs(rel), listedIDs(already), b.ID)
	}
	if got, _ := l.Get(a.ID); got.State != device.ReservationActive {
		t.Errorf("owner-a's reservation is %v after owner-b's release, want active", got.State)
	}
}

func listedIDs(rs []device.Reservation) []string {
	var ids []string
	for _, r := range rs {
		ids = append(ids, r.ID)
	}
	slices.Sort(ids)
	return ids
}
