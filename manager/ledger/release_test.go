package ledger

import (
	"context"
	"errors"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
)

func TestRelease(t *testing.T) {
	t1, t2 := t0.Add(time.Minute), t0.Add(2*time.Minute)
	tests := []struct {
		name string
		req  device.ReleaseRequest
		// want lists the setup reservations returned ("a1", "a2", "a0" released at t1
		// before the call, "b1"), in order; each is released at t1 if it was "a0", else t2.
		want     []string
		wantErr  error
		wantLive []string // setup reservations still live afterwards
	}{
		{"by ID", device.ReleaseRequest{ReservationID: "{a1}"}, []string{"a1"}, nil, []string{"a2", "b1"}},
		{"by ID, released before", device.ReleaseRequest{ReservationID: "{a0}"}, []string{"a0"}, nil, []string{"a1", "a2", "b1"}},
		{"by owner: every reservation, oldest first", device.ReleaseRequest{OwnerID: "alloc-a"}, []string{"a0", "a1", "a2"}, nil, []string{"b1"}},
		{"by owner without reservations", device.ReleaseRequest{OwnerID: "alloc-z"}, []string{}, nil, []string{"a1", "a2", "b1"}},
		{"unknown ID", device.ReleaseRequest{ReservationID: "res-nope"}, nil, device.ErrNotFound, []string{"a1", "a2", "b1"}},
		// A caller whose grants cover some owners only (server.Allow).
		{"by ID of an owner the caller may release for", device.ReleaseRequest{ReservationID: "{a1}", OwnerPrefixes: []string{"x/", "alloc-a"}}, []string{"a1"}, nil, []string{"a2", "b1"}},
		{"by ID of another owner", device.ReleaseRequest{ReservationID: "{a1}", OwnerPrefixes: []string{"alloc-b"}}, nil, device.ErrPermissionDenied, []string{"a1", "a2", "b1"}},
		{"by ID of another owner, released before", device.ReleaseRequest{ReservationID: "{a0}", OwnerPrefixes: []string{}}, nil, device.ErrPermissionDenied, []string{"a1", "a2", "b1"}},
		{"by owner, not the caller's", device.ReleaseRequest{OwnerID: "alloc-a", OwnerPrefixes: []string{"alloc-b"}}, nil, device.ErrPermissionDenied, []string{"a1", "a2", "b1"}},
		// validate.ReleaseRequest refuses these at the server; the ledger asserts it.
		{"neither field", device.ReleaseRequest{}, nil, errInternal, []string{"a1", "a2", "b1"}},
		{"both fields", device.ReleaseRequest{ReservationID: "{a1}", OwnerID: "alloc-a"}, nil, errInternal, []string{"a1", "a2", "b1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := statePath(t)
			l, err := Open(path, Options{})
			if err != nil {
				t.Fatal(err)
			}
			setup := map[string]device.Reservation{}
			for _, s := range []struct{ key, owner, dev string }{
				{"a0", "alloc-a", "GPU-0"}, {"a1", "alloc-a", "GPU-1"}, {"a2", "alloc-a", "GPU-2"}, {"b1", "alloc-b", "GPU-3"},
			} {
				r := res(s.owner, s.dev)
				r.CreatedAt = t0.Add(time.Duration(len(setup)) * time.Second)
				got, _, err := l.Reserve(context.Background(), r, nil, nil)
				if err != nil {
					t.Fatal(err)
				}
				setup[s.key] = got
			}
			setup["a0"] = release(t, l, setup["a0"].ID, t1)
			req := tt.req
			for k, r := range setup {
				if req.ReservationID == "{"+k+"}" {
					req.ReservationID = r.ID
				}
			}

			gotReleased, gotAlready, err := l.Release(context.Background(), req, t2)
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("Release(%+v): err = %v, want %v", req, err, tt.wantErr)
			}
			// Those live before the call are released by it (at t2); a0 was released
			// before and comes back apart, unchanged.
			var want, wantReleased, wantAlready []device.Reservation
			for _, k := range tt.want {
				w := setup[k]
				if w.State == device.ReservationActive {
					w.State, w.ReleasedAt, w.CleanupPending = device.ReservationReleased, t2, true
					wantReleased = append(wantReleased, w)
				} else {
					wantAlready = append(wantAlready, w)
				}
				want = append(want, w)
			}
			if !reflect.DeepEqual(gotReleased, wantReleased) || !reflect.DeepEqual(gotAlready, wantAlready) {
				t.Errorf("Release(%+v) =\nreleased %+v\nalready  %+v\nwant\nreleased %+v\nalready  %+v",
					req, gotReleased, gotAlready, wantReleased, wantAlready)
			}

			// Durable, and the released devices are free.
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			l = openLedger(t, path)
			for _, r := range want {
				if stored, err := l.Get(r.ID); err != nil || !reflect.DeepEqual(stored, r) {
					t.Errorf("after reopen Get(%s) = %+v, %v; want %+v", r.ID, stored, err, r)
				}
			}
			wantHolders := map[string]device.Holder{}
			for _, k := range tt.wantLive {
				r := setup[k]
				wantHolders[r.DeviceIDs[0]] = device.Holder{ReservationID: r.ID, OwnerID: r.OwnerID}
			}
			if h := l.Holders(); !reflect.DeepEqual(h, wantHolders) {
				t.Errorf("after reopen Holders = %v, want %v", h, wantHolders)
			}
		})
	}
}

func TestCleanupDoneAndDelete(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	live := reserve(t, l, "a", "GPU-1")
	pending := release(t, l, reserve(t, l, "b", "GPU-2").ID, t0)
	cleaned := release(t, l, reserve(t, l, "c", "GPU-3").ID, t0)

	if got := ids(l.PendingCleanups()); !reflect.DeepEqual(got, []string{pending.ID, cleaned.ID}) &&
		!reflect.DeepEqual(got, []string{cleaned.ID, pending.ID}) {
		t.Errorf("PendingCleanups = %v, want both released", got)
	}
	steps := []struct {
		name    string
		do      func() error
		wantErr error
	}{
		{"CleanupDone of a live one", func() error { return l.CleanupDone(ctx, live.ID) }, ErrNotReleased},
		{"CleanupDone of an unknown one", func() error { return l.CleanupDone(ctx, "res-nope") }, device.ErrNotFound},
		{"CleanupDone", func() error { return l.CleanupDone(ctx, cleaned.ID) }, nil},
		{"CleanupDone again", func() error { return l.CleanupDone(ctx, cleaned.ID) }, nil},
		{"Delete of a pending cleanup", func() error { return l.Delete(ctx, cleaned.ID, pending.ID) }, ErrCleanupPending},
		{"Delete of a live one", func() error { return l.Delete(ctx, cleaned.ID, live.ID) }, ErrNotReleased},
	}
	for _, s := range steps {
		if err := s.do(); !errors.Is(err, s.wantErr) || (err == nil) != (s.wantErr == nil) {
			t.Errorf("%s: err = %v, want %v", s.name, err, s.wantErr)
		}
	}
	// The refused Deletes deleted nothing, not even the deletable one.
	if got := l.Counts(); got != (Counts{Total: 3, Live: 1, Released: 2, CleanupPending: 1}) {
		t.Errorf("Counts = %+v after refused Deletes", got)
	}
	if got := ids(l.PendingCleanups()); !reflect.DeepEqual(got, []string{pending.ID}) {
		t.Errorf("PendingCleanups = %v, want [%s]", got, pending.ID)
	}
	if err := l.Delete(ctx, cleaned.ID, "res-already-gone"); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, err := l.Get(cleaned.ID); !errors.Is(err, device.ErrNotFound) {
		t.Errorf("Get of a deleted reservation: err = %v, want ErrNotFound", err)
	}
	if got := l.Counts(); got != (Counts{Total: 2, Live: 1, Released: 1, CleanupPending: 1}) {
		t.Errorf("Counts = %+v after Delete", got)
	}
}

func TestList(t *testing.T) {
	l := newLedger(t)
	a1 := reserve(t, l, "alloc-a", "GPU-1", "GPU-2")
	b1 := reserve(t, l, "alloc-b", "GPU-3")
	a2 := release(t, l, reserve(t, l, "alloc-a", "GPU-9").ID, t0)
	b2 := release(t, l, reserve(t, l, "alloc-b", "GPU-9", "GPU-8").ID, t0)
	c1 := reserve(t, l, "alloc-c", "GPU-9")
	tests := []struct {
		name string
		f    device.ReservationFilter
		want []device.Reservation
	}{
		{"all", device.ReservationFilter{}, []device.Reservation{a1, b1, a2, b2, c1}},
		{"by owner", device.ReservationFilter{OwnerID: "alloc-a"}, []device.Reservation{a1, a2}},
		{"by device, every holder it had", device.ReservationFilter{DeviceID: "GPU-9"}, []device.Reservation{a2, b2, c1}},
		{"by device and state", device.ReservationFilter{DeviceID: "GPU-9", State: device.ReservationActive}, []device.Reservation{c1}},
		{"active", device.ReservationFilter{State: device.ReservationActive}, []device.Reservation{a1, b1, c1}},
		{"released", device.ReservationFilter{State: device.ReservationReleased}, []device.Reservation{a2, b2}},
		{"owner and state", device.ReservationFilter{OwnerID: "alloc-b", State: device.ReservationReleased}, []device.Reservation{b2}},
		{"no match", device.ReservationFilter{OwnerID: "alloc-z"}, []device.Reservation{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := l.List(context.Background(), tt.f)
			if err != nil || !reflect.DeepEqual(ids(got), ids(tt.want)) {
				t.Errorf("List(%+v) = %v, %v; want %v", tt.f, ids(got), err, ids(tt.want))
			}
		})
	}
	if _, err := l.List(context.Background(), device.ReservationFilter{State: 9}); !errors.Is(err, errInternal) {
		t.Errorf("List with state 9: err = %v, want an internal error (validate.ReservationFilter refuses it at the server)", err)
	}
}

// An owner ending in "/" lists every owner under it, live and released: a Nomad job's
// reservations by "nomad/default/train/", and not another job's whose name starts alike.
func TestListByOwnerPrefix(t *testing.T) {
	l := newLedger(t)
	a := reserve(t, l, "nomad/default/train/alloc-1/main", "GPU-0")
	b := reserve(t, l, "nomad/default/train/alloc-2/main", "GPU-1")
	reserve(t, l, "nomad/default/train-2/alloc-3/main", "GPU-2")
	reserve(t, l, "k8s/default/pod/c", "GPU-3")
	release(t, l, b.ID, t0)
	for _, tc := range []struct {
		f    device.ReservationFilter
		want []string
	}{
		{device.ReservationFilter{OwnerID: "nomad/default/train/"}, []string{a.ID, b.ID}},
		{device.ReservationFilter{OwnerID: "nomad/default/train/", State: device.ReservationActive}, []string{a.ID}},
		{device.ReservationFilter{OwnerID: "nomad/default/train/", State: device.ReservationReleased}, []string{b.ID}},
		{device.ReservationFilter{OwnerID: "nomad/default/train/", DeviceID: "GPU-1"}, []string{b.ID}},
		{device.ReservationFilter{OwnerID: "nomad/default/train"}, nil}, // no slash: the exact owner
	} {
		rs, err := l.List(context.Background(), tc.f)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, r := range rs {
			got = append(got, r.ID)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("List(%+v) = %v, want %v", tc.f, got, tc.want)
		}
	}
}
