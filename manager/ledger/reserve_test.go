package ledger

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/devicehost/devicehost/device"
)

func TestConflictRules(t *testing.T) {
	type conflict struct {
		holder  string // "A" or "B": which setup reservation
		overlap []string
	}
	tests := []struct {
		name         string
		owner        string
		devs         []string
		wantExisting string // "A" or "B": the setup reservation returned as existing
		wantNew      bool
		wantConflict []conflict
		wantInError  []string
	}{{
		name:         "held by another owner names the holder",
		owner:        "alloc-c",
		devs:         []string{"GPU-3"},
		wantConflict: []conflict{{"B", []string{"GPU-3"}}},
		wantInError:  []string{"GPU-3 held by reservation {B} of owner \"alloc-b\""},
	}, {
		name:         "partly held by another owner names the overlap",
		owner:        "alloc-c",
		devs:         []string{"GPU-9", "GPU-3"},
		wantConflict: []conflict{{"B", []string{"GPU-3"}}},
		wantInError:  []string{"GPU-3 held by reservation {B}"},
	}, {
		name:         "same owner, same devices is a retry",
		owner:        "alloc-a",
		devs:         []string{"GPU-1", "GPU-2"},
		wantExisting: "A",
	}, {
		name:         "same owner, same devices in another order is a retry",
		owner:        "alloc-a",
		devs:         []string{"GPU-2", "GPU-1"},
		wantExisting: "A",
	}, {
		name:         "same owner, fewer devices is a partial overlap",
		owner:        "alloc-a",
		devs:         []string{"GPU-1"},
		wantConflict: []conflict{{"A", []string{"GPU-1"}}},
		wantInError:  []string{"GPU-1 overlap reservation {A} of the same owner, which holds GPU-1, GPU-2"},
	}, {
		name:         "same owner, more devices is a partial overlap",
		owner:        "alloc-a",
		devs:         []string{"GPU-5", "GPU-2", "GPU-1"},
		wantConflict: []conflict{{"A", []string{"GPU-1", "GPU-2"}}},
		wantInError:  []string{"GPU-1, GPU-2 overlap reservation {A} of the same owner"},
	}, {
		name:         "another owner's devices ask for the same set as a holder",
		owner:        "alloc-b",
		devs:         []string{"GPU-1", "GPU-2"},
		wantConflict: []conflict{{"A", []string{"GPU-1", "GPU-2"}}},
		wantInError:  []string{"GPU-1, GPU-2 held by reservation {A} of owner \"alloc-a\""},
	}, {
		name:         "spanning two holders names both",
		owner:        "alloc-a",
		devs:         []string{"GPU-1", "GPU-2", "GPU-3"},
		wantConflict: []conflict{{"A", []string{"GPU-1", "GPU-2"}}, {"B", []string{"GPU-3"}}},
		wantInError:  []string{"{A} of the same owner", "GPU-3 held by reservation {B}"},
	}, {
		name:    "free devices",
		owner:   "alloc-c",
		devs:    []string{"GPU-7", "GPU-8"},
		wantNew: true,
	}, {
		name:    "a released reservation's devices are free",
		owner:   "alloc-c",
		devs:    []string{"GPU-4"},
		wantNew: true,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := newLedger(t)
			setup := map[string]device.Reservation{
				"A": reserve(t, l, "alloc-a", "GPU-1", "GPU-2"),
				"B": reserve(t, l, "alloc-b", "GPU-3"),
			}
			gone := reserve(t, l, "alloc-d", "GPU-4")
			release(t, l, gone.ID, t0)
			expand := func(s string) string {
				for k, r := range setup {
					s = strings.ReplaceAll(s, "{"+k+"}", r.ID)
				}
				return s
			}
			var wantConflicts []device.Conflict
			for _, c := range tt.wantConflict {
				h := setup[c.holder]
				wantConflicts = append(wantConflicts, device.Conflict{
					Holder:  device.Holder{ReservationID: h.ID, OwnerID: h.OwnerID},
					Overlap: c.overlap,
					Held:    h.DeviceIDs,
				})
			}
			slices.SortFunc(wantConflicts, func(a, b device.Conflict) int {
				return strings.Compare(a.Holder.ReservationID, b.Holder.ReservationID)
			})
			before := listAll(t, l)

			checked, checkErr := l.Check(tt.owner, tt.devs, nil, nil, nil, nil)
			got, existing, err := l.Reserve(context.Background(), res(tt.owner, tt.devs...), nil, nil)

			for _, e := range []struct {
				what string
				err  error
			}{{"Check", checkErr}, {"Reserve", err}} {
				var ce *device.HeldError
				switch {
				case wantConflicts == nil && e.err != nil:
					t.Errorf("%s: unexpected error %v", e.what, e.err)
				case wantConflicts == nil:
				case !errors.Is(e.err, device.ErrDeviceHeld) || !errors.As(e.err, &ce):
					t.Errorf("%s: err = %v, want a *device.HeldError matching ErrDeviceHeld", e.what, e.err)
				default:
					if !reflect.DeepEqual(ce.Conflicts, wantConflicts) {
						t.Errorf("%s: conflicts = %+v, want %+v", e.what, ce.Conflicts, wantConflicts)
					}
					for _, s := range tt.wantInError {
						if !strings.Contains(e.err.Error(), expand(s)) {
							t.Errorf("%s: error %q does not contain %q", e.what, e.err, expand(s))
						}
					}
				}
			}
			after := listAll(t, l)
			switch {
			case tt.wantExisting != "":
				want := setup[tt.wantExisting]
				if checked == nil || !reflect.DeepEqual(*checked, want) {
					t.Errorf("Check = %+v, want the existing reservation %+v", checked, want)
				}
				if !existing || !reflect.DeepEqual(got, want) {
					t.Errorf("Reserve = %+v, existing %v; want the existing reservation %+v", got, existing, want)
				}
				if !reflect.DeepEqual(after, before) {
					t.Errorf("a retried Reserve changed the ledger: %v, was %v", ids(after), ids(before))
				}
			case tt.wantNew:
				if checked != nil || existing || got.ID == "" || got.State != device.ReservationActive {
					t.Errorf("Check = %v; Reserve = %+v, existing %v; want a new live reservation", checked, got, existing)
				}
				if len(after) != len(before)+1 {
					t.Errorf("after a new Reserve the ledger lists %d, want %d", len(after), len(before)+1)
				}
			default:
				if !reflect.DeepEqual(after, before) {
					t.Errorf("a refused Reserve changed the ledger: %v, was %v", ids(after), ids(before))
				}
			}
		})
	}
}

// The request rules (lengths, UTF-8, printable...) are validate's, checked once at the
// server (validate's TestReserveRequest). The ledger asserts only what a stored record
// must be, so that no write leaves a record Open would refuse; and a reservation ID in
// use is refused as a field of the request.
func TestReserveRefusesMalformedRecords(t *testing.T) {
	l := newLedger(t)
	taken := reserve(t, l, "a", "GPU-1")
	many := make([]string, 20) // long enough for checkRecord's map
	for i := range many {
		many[i] = fmt.Sprint("GPU-x", i)
	}
	many[19] = many[3]
	tests := []struct {
		name    string
		r       device.Reservation
		wantErr error
		wantMsg string
	}{
		{"no owner", device.Reservation{DeviceIDs: []string{"GPU-2"}}, errInternal, "reserve: internal: no owner ID"},
		{"no devices", device.Reservation{OwnerID: "o"}, errInternal, "reserve: internal: no device IDs"},
		{"empty device ID", device.Reservation{OwnerID: "o", DeviceIDs: []string{"GPU-2", ""}}, errInternal, "reserve: internal: device ID 1 is empty"},
		{"device twice", device.Reservation{OwnerID: "o", DeviceIDs: []string{"GPU-2", "GPU-3", "GPU-2"}}, errInternal, `reserve: internal: device ID "GPU-2" named twice (0 and 2)`},
		{"device twice in a long list", device.Reservation{OwnerID: "o", DeviceIDs: many}, errInternal, `reserve: internal: device ID "GPU-x3" named twice (3 and 19)`},
		{"reservation ID in use", device.Reservation{ID: taken.ID, OwnerID: "o", DeviceIDs: []string{"GPU-2"}}, device.ErrInvalidRequest,
			fmt.Sprintf("reserve: invalid request: reservation_id: %q is already used by another reservation", taken.ID)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := l.Reserve(context.Background(), tt.r, nil, nil)
			if !errors.Is(err, tt.wantErr) || err.Error() != tt.wantMsg {
				t.Errorf("Reserve(%+v): err = %v, want %q", tt.r, err, tt.wantMsg)
			}
		})
	}
	if got := l.Counts().Total; got != 1 {
		t.Errorf("after refused requests the ledger holds %d, want 1", got)
	}
}

func TestReserveKeepsCallerID(t *testing.T) {
	l := newLedger(t)
	r := res("a", "GPU-1")
	r.ID, r.CreatedAt = NewID(), t0
	got, _, err := l.Reserve(context.Background(), r, nil, nil)
	if err != nil || got.ID != r.ID {
		t.Fatalf("Reserve with ID %s = %s, %v", r.ID, got.ID, err)
	}
	want := r
	want.State = device.ReservationActive
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Reserve = %+v, want %+v", got, want)
	}
	if !strings.HasPrefix(r.ID, "res-") || len(r.ID) != len("res-")+16 {
		t.Errorf("NewID() = %q, want res- and 16 hex digits", r.ID)
	}
}

// TestReserveRaceOneWinner: of many owners racing for one device, exactly one wins and
// every loser is told who holds it.
func TestReserveRaceOneWinner(t *testing.T) {
	l := newLedger(t)
	const n = 32
	var (
		wg      sync.WaitGroup
		start   = make(chan struct{})
		results = make([]error, n)
		got     = make([]device.Reservation, n)
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			got[i], _, results[i] = l.Reserve(context.Background(), res(fmt.Sprint("owner-", i), "GPU-0", fmt.Sprint("GPU-own-", i)), nil, nil)
		}()
	}
	close(start)
	wg.Wait()

	var winner device.Reservation
	wins := 0
	for i, err := range results {
		if err == nil {
			wins++
			winner = got[i]
		}
	}
	if wins != 1 {
		t.Fatalf("%d Reserves of GPU-0 succeeded, want exactly 1", wins)
	}
	for i, err := range results {
		if err == nil {
			continue
		}
		want := fmt.Sprintf("GPU-0 held by reservation %s of owner %q", winner.ID, winner.OwnerID)
		if !errors.Is(err, device.ErrDeviceHeld) || !strings.Contains(err.Error(), want) {
			t.Errorf("loser %d: err = %v, want ErrDeviceHeld containing %q", i, err, want)
		}
	}
	if rs := listAll(t, l); len(rs) != 1 || rs[0].ID != winner.ID {
		t.Errorf("ledger lists %v, want only the winner %s", ids(rs), winner.ID)
	}
	if h := l.Holders()["GPU-own-"+strings.TrimPrefix(winner.OwnerID, "owner-")]; h.ReservationID != winner.ID {
		t.Errorf("the winner's other device is held by %+v, want %s", h, winner.ID)
	}
}

// TestReserveRaceSameOwner: concurrent retries of one request create one reservation.
func TestReserveRaceSameOwner(t *testing.T) {
	l := newLedger(t)
	const n = 16
	var (
		wg       sync.WaitGroup
		start    = make(chan struct{})
		got      = make([]device.Reservation, n)
		existing = make([]bool, n)
		errs     = make([]error, n)
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			got[i], existing[i], errs[i] = l.Reserve(context.Background(), res("alloc-1", "GPU-1", "GPU-2"), nil, nil)
		}()
	}
	close(start)
	wg.Wait()
	fresh := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("retry %d: %v", i, errs[i])
		}
		if got[i].ID != got[0].ID {
			t.Errorf("retry %d got reservation %s, retry 0 got %s", i, got[i].ID, got[0].ID)
		}
		if !existing[i] {
			fresh++
		}
	}
	if fresh != 1 {
		t.Errorf("%d Reserves reported a new reservation, want 1", fresh)
	}
	if rs := listAll(t, l); len(rs) != 1 {
		t.Errorf("ledger lists %d reservations, want 1", len(rs))
	}
}

// TestConcurrentReservesAllDurableAndShareCommits: many callers on different devices all
// succeed, all survive a reopen, and they took fewer commits than reservations.
func TestConcurrentReservesAllDurableAndShareCommits(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	const callers, each = 32, 8
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		acked = make(map[string]string) // reservation ID -> device
	)
	for c := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				dev := fmt.Sprintf("GPU-%d-%d", c, i)
				r, _, err := l.Reserve(context.Background(), res(fmt.Sprint("owner-", c), dev), nil, nil)
				if err != nil {
					t.Errorf("Reserve %s: %v", dev, err)
					return
				}
				mu.Lock()
				acked[r.ID] = dev
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	commits := l.Commits()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if len(acked) != callers*each {
		t.Fatalf("%d reservations acknowledged, want %d", len(acked), callers*each)
	}
	t.Logf("%d reservations in %d commits", len(acked), commits)
	if commits >= int64(len(acked)) {
		t.Errorf("%d reservations took %d commits; concurrent Reserves should share commits", len(acked), commits)
	}

	l = openLedger(t, path)
	holders := l.Holders()
	for id, dev := range acked {
		if h := holders[dev]; h.ReservationID != id {
			t.Errorf("after reopen %s is held by %+v, want %s", dev, h, id)
		}
	}
	if got := l.Counts(); got.Live != callers*each || got.Total != callers*each {
		t.Errorf("after reopen Counts = %+v, want %d live", got, callers*each)
	}
}

// TestBatchStorageFailureIsolated: a request that fails in storage fails alone; the
// requests committed with it in the same batch still succeed.
func TestBatchStorageFailureIsolated(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	// Hold the leader inside a batch so the following requests queue up together.
	entered, unblock := make(chan struct{}), make(chan struct{})
	blockerDone := make(chan error, 1)
	go func() {
		_, err := l.submit(ctx, func(*txn) (any, error) {
			close(entered)
			<-unblock
			return nil, nil
		})
		blockerDone <- err
	}()
	<-entered

	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i == 3 {
				_, errs[i] = l.submit(ctx, func(w *txn) (any, error) {
					return nil, &storageError{Err: errors.New("disk on fire")}
				})
				return
			}
			_, _, errs[i] = l.Reserve(ctx, res(fmt.Sprint("o", i), fmt.Sprint("GPU-", i)), nil, nil)
		}()
	}
	close(unblock)
	wg.Wait()
	if err := <-blockerDone; err != nil {
		t.Fatalf("blocking request: %v", err)
	}
	for i, err := range errs {
		switch {
		case i == 3 && (err == nil || !strings.Contains(err.Error(), "disk on fire")):
			t.Errorf("failing request: err = %v, want the storage error", err)
		case i != 3 && err != nil:
			t.Errorf("request %d batched with a failing one: %v", i, err)
		}
	}
	if got := l.Counts().Live; got != 7 {
		t.Errorf("%d live reservations, want 7", got)
	}
}

func TestReserveCanceledContextWritesNothing(t *testing.T) {
	l := newLedger(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, err := l.Reserve(ctx, res("a", "GPU-1"), nil, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("Reserve with a canceled context: err = %v, want context.Canceled", err)
	}
	if got := l.Counts().Total; got != 0 {
		t.Errorf("ledger holds %d after a canceled Reserve, want 0", got)
	}
}

func TestReturnedValuesAreCopies(t *testing.T) {
	l := newLedger(t)
	in := res("a", "GPU-1", "GPU-2")
	got, _, err := l.Reserve(context.Background(), in, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := l.Get(got.ID)
	in.DeviceIDs[0] = "changed-in"
	in.Container.Envs["X"] = "changed-in"
	got.DeviceIDs[1] = "changed-out"
	got.Container.Mounts[0].HostPath = "/changed-out"
	listed := listAll(t, l)
	listed[0].Container.CDIDevices[0] = "changed-list"
	if now, _ := l.Get(got.ID); !reflect.DeepEqual(now, want) {
		t.Errorf("stored reservation changed through a caller's copy: %+v, want %+v", now, want)
	}
}
