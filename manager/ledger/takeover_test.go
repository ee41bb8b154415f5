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
	"time"

	"github.com/devicehost/devicehost/device"
)

// takeOverSetup makes A (nomad/a: GPU-1, GPU-2), B (nomad/b: GPU-3) and C (job/c:
// GPU-4), live, in that order.
func takeOverSetup(t *testing.T, l *Ledger) map[string]device.Reservation {
	t.Helper()
	return map[string]device.Reservation{
		"A": reserve(t, l, "nomad/a", "GPU-1", "GPU-2"),
		"B": reserve(t, l, "nomad/b", "GPU-3"),
		"C": reserve(t, l, "job/c", "GPU-4"),
	}
}

func TestTakeOverRules(t *testing.T) {
	tests := []struct {
		name         string
		owner        string
		devs         []string
		takeOver     []string
		wantTaken    []string // setup names taken over, when the Reserve makes a new reservation
		wantExisting string   // setup name returned as a retry
		wantHolders  []string // setup names the refusal names (and only those)
	}{{
		name: "one holder", owner: "nomad/new", devs: []string{"GPU-2"}, takeOver: []string{"nomad/"},
		wantTaken: []string{"A"},
	}, {
		name: "two holders", owner: "nomad/new", devs: []string{"GPU-3", "GPU-1"}, takeOver: []string{"nomad/"},
		wantTaken: []string{"A", "B"},
	}, {
		name: "free devices take nothing over", owner: "nomad/new", devs: []string{"GPU-8", "GPU-9"}, takeOver: []string{"nomad/"},
	}, {
		name: "one of several prefixes", owner: "x", devs: []string{"GPU-4", "GPU-3"}, takeOver: []string{"k8s/", "job/", "nomad/"},
		wantTaken: []string{"B", "C"},
	}, {
		name: "a holder of another owner refuses, named alone", owner: "nomad/new", devs: []string{"GPU-3", "GPU-4"}, takeOver: []string{"nomad/"},
		wantHolders: []string{"C"},
	}, {
		name: "a prefix matches the start only", owner: "nomad/new", devs: []string{"GPU-1", "GPU-2"}, takeOver: []string{"mad/", "a/", "nomad/a/"},
		wantHolders: []string{"A"},
	}, {
		name: "without prefixes the holders refuse", owner: "nomad/new", devs: []string{"GPU-1", "GPU-2", "GPU-3"},
		wantHolders: []string{"A", "B"},
	}, {
		name: "a retry gets its reservation back and takes nothing over", owner: "nomad/a", devs: []string{"GPU-2", "GPU-1"}, takeOver: []string{"nomad/"},
		wantExisting: "A",
	}, {
		// The caller asked for every owner under the prefix, its own earlier
		// reservation of other devices included.
		name: "the owner's own reservation of another set", owner: "nomad/a", devs: []string{"GPU-1"}, takeOver: []string{"nomad/"},
		wantTaken: []string{"A"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := statePath(t)
			l := openLedger(t, path)
			setup := takeOverSetup(t, l)
			before, commits := listAll(t, l), l.Commits()

			checked, checkErr := l.Check(tt.owner, tt.devs, tt.takeOver, nil, nil, nil)
			got, existing, err := l.Reserve(context.Background(), res(tt.owner, tt.devs...), tt.takeOver, nil)

			if tt.wantHolders != nil {
				var want []device.Conflict
				for _, name := range tt.wantHolders {
					h := setup[name]
					var overlap []string
					for _, d := range h.DeviceIDs {
						if slices.Contains(tt.devs, d) {
							overlap = append(overlap, d)
						}
					}
					want = append(want, device.Conflict{Holder: device.Holder{ReservationID: h.ID, OwnerID: h.OwnerID}, Overlap: overlap, Held: h.DeviceIDs})
				}
				slices.SortFunc(want, func(a, b device.Conflict) int { return strings.Compare(a.Holder.ReservationID, b.Holder.ReservationID) })
				for _, e := range []struct {
					what string
					err  error
				}{{"Check", checkErr}, {"Reserve", err}} {
					var ce *device.HeldError
					if !errors.As(e.err, &ce) || !errors.Is(e.err, device.ErrDeviceHeld) || !reflect.DeepEqual(ce.Conflicts, want) {
						t.Errorf("%s: err = %v, want a HeldError naming exactly %+v", e.what, e.err, want)
					}
				}
				if after := listAll(t, l); !reflect.DeepEqual(after, before) || l.Commits() != commits {
					t.Errorf("a refused take-over wrote: %d commits, ledger\n%+v\nwas\n%+v", l.Commits()-commits, after, before)
				}
				return
			}
			if err != nil || checkErr != nil {
				t.Fatalf("Check: %v; Reserve: %v", checkErr, err)
			}
			if tt.wantExisting != "" {
				want := setup[tt.wantExisting]
				if !existing || got.ID != want.ID || got.TakenOver != nil || checked == nil || checked.ID != want.ID {
					t.Errorf("retry: got %s existing %v taken over %v, checked %v; want %s back, nothing taken over", got.ID, existing, got.TakenOver, checked, want.ID)
				}
				if l.Commits() != commits || !reflect.DeepEqual(listAll(t, l), before) {
					t.Errorf("a retry wrote")
				}
				return
			}
			var wantTaken []string
			for _, name := range tt.wantTaken {
				wantTaken = append(wantTaken, setup[name].ID)
			}
			slices.Sort(wantTaken)
			if existing || checked != nil || !slices.Equal(got.TakenOver, wantTaken) {
				t.Errorf("got existing %v, checked %v, taken over %v; want a new reservation that took over %v", existing, checked, got.TakenOver, wantTaken)
			}
			if n := l.Commits() - commits; n != 1 {
				t.Errorf("the take-over took %d commits, want 1", n)
			}
			check := func(l *Ledger) {
				t.Helper()
				holders := l.Holders()
				for _, d := range tt.devs {
					if holders[d].ReservationID != got.ID {
						t.Errorf("%s held by %+v, want the new reservation %s", d, holders[d], got.ID)
					}
				}
				for name, r := range setup {
					now, err := l.Get(r.ID)
					switch taken := slices.Contains(tt.wantTaken, name); {
					case err != nil:
						t.Errorf("%s (%s): %v", name, r.ID, err)
					case taken && (now.State != device.ReservationReleased || !now.CleanupPending || !now.ReleasedAt.Equal(got.CreatedAt)):
						t.Errorf("taken-over %s: %+v; want released at the new one's creation (%v), cleanup pending", name, now, got.CreatedAt)
					case taken:
						for _, d := range r.DeviceIDs {
							if h, held := holders[d]; held && h.ReservationID == r.ID {
								t.Errorf("taken-over %s still holds %s", name, d)
							}
						}
					case !taken && !reflect.DeepEqual(now, r):
						t.Errorf("%s changed: %+v, was %+v", name, now, r)
					}
				}
				stored, err := l.Get(got.ID)
				want := got
				want.TakenOver = nil
				if err != nil || !reflect.DeepEqual(stored, want) {
					t.Errorf("stored new reservation %+v, %v; want %+v (TakenOver is never stored)", stored, err, want)
				}
			}
			check(l)
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			check(openLedger(t, path)) // durable, in one piece
		})
	}
}

// The take-over prefix rules are validate's (checked at the server); what the ledger
// relies on is device.TakesOver: an empty prefix, which would match every owner,
// matches none, so even a request that never met validate cannot take over everyone.
func TestTakeOverEmptyPrefixTakesNothing(t *testing.T) {
	l := newLedger(t)
	a := reserve(t, l, "nomad/a", "GPU-1")
	for _, prefixes := range [][]string{{""}, {"", ""}} {
		_, _, err := l.Reserve(context.Background(), res("x", "GPU-1"), prefixes, nil)
		var held *device.HeldError
		if !errors.As(err, &held) || len(held.Conflicts) != 1 || held.Conflicts[0].Holder.ReservationID != a.ID {
			t.Errorf("prefixes %q: err = %v, want a HeldError naming %s", prefixes, err, a.ID)
		}
		if _, err := l.Check("x", []string{"GPU-1"}, prefixes, nil, nil, nil); !errors.Is(err, device.ErrDeviceHeld) {
			t.Errorf("Check with prefixes %q: err = %v, want ErrDeviceHeld", prefixes, err)
		}
	}
	if h := l.Holders()["GPU-1"]; h.ReservationID != a.ID {
		t.Errorf("GPU-1 held by %+v after refused take-overs, want %s", h, a.ID)
	}
}

// A take-over whose commit fails changes nothing: the holder keeps its devices, live,
// in memory and in the file, and the new reservation is not there.
func TestTakeOverFailedCommitChangesNothing(t *testing.T) {
	path := statePath(t)
	l := openLedger(t, path)
	a := reserve(t, l, "nomad/a", "GPU-1")
	before := listAll(t, l)
	if err := l.db.Close(); err != nil { // every transaction fails from now on
		t.Fatal(err)
	}
	_, _, err := l.Reserve(context.Background(), res("nomad/b", "GPU-1"), []string{"nomad/"}, nil)
	if err == nil || errors.Is(err, device.ErrDeviceHeld) {
		t.Fatalf("take-over on a closed file: err = %v, want the storage error", err)
	}
	if after := listAll(t, l); !reflect.DeepEqual(after, before) || l.Holders()["GPU-1"].ReservationID != a.ID {
		t.Errorf("after a failed take-over the ledger lists %+v, holders %+v; want it unchanged: %+v", after, l.Holders(), before)
	}
	l2, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if got, err := l2.Get(a.ID); err != nil || got.State != device.ReservationActive || l2.Counts().Total != 1 {
		t.Errorf("the file after a failed take-over: %+v, %v, %+v; want only %s, live", got, err, l2.Counts(), a.ID)
	}
}

// A take-over whose batch fails (another request's storage error) is retried on its
// own and takes over once: one release, one new reservation, as if the failed batch
// never ran.
func TestTakeOverInAFailedBatchIsRetriedWhole(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	a := reserve(t, l, "nomad/a", "GPU-1")
	rec := res("nomad/b", "GPU-1")
	rec.State, rec.CreatedAt = device.ReservationActive, t0
	// Both queue behind a held batch, so that they share the next one.
	entered, unblock := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		_, err := l.submit(ctx, func(*txn) (any, error) { close(entered); <-unblock; return nil, nil })
		held <- err
	}()
	<-entered
	type answer struct {
		val any
		err error
	}
	takeDone, failDone := make(chan answer, 1), make(chan answer, 1)
	go func() {
		v, err := l.submit(ctx, reserveRun(rec, []string{"nomad/"}, nil, ""))
		takeDone <- answer{v, err}
	}()
	for l.cm.Queued() < 1 {
		time.Sleep(50 * time.Microsecond) // polling a condition that will hold
	}
	go func() {
		v, err := l.submit(ctx, func(*txn) (any, error) {
			return nil, &storageError{Err: errors.New("disk on fire")}
		})
		failDone <- answer{v, err}
	}()
	for l.cm.Queued() < 2 {
		time.Sleep(50 * time.Microsecond)
	}
	close(unblock)
	if err := <-held; err != nil {
		t.Fatal(err)
	}
	if resp := <-failDone; resp.err == nil {
		t.Fatal("the failing request succeeded")
	}
	resp := <-takeDone
	if resp.err != nil {
		t.Fatalf("take-over batched with a failing request: %v", resp.err)
	}
	got := resp.val.(reserveResult)
	if !slices.Equal(got.takenOver, []string{a.ID}) || l.Holders()["GPU-1"].ReservationID != got.r.ID {
		t.Errorf("take-over got %+v, GPU-1 held by %+v; want %s taken over by the new one", got, l.Holders()["GPU-1"], a.ID)
	}
	if c := l.Counts(); c.Live != 1 || c.Released != 1 || c.Total != 2 {
		t.Errorf("counts %+v, want one live and one released", c)
	}
	if n := l.Commits(); n != 2 {
		t.Errorf("%d commits, want 2: the setup and the take-over alone (the held batch wrote nothing)", n)
	}
}

// Concurrent take-overs of one device, with plain Reserves of another owner among
// them, end with the device held once: every take-over that succeeded took over
// exactly the reservation live before it (each one once), and no reservation is
// lost or released without one replacing it.
func TestTakeOverRace(t *testing.T) {
	for round := range 20 {
		l := newLedger(t)
		const n = 24
		var wg sync.WaitGroup
		start := make(chan struct{})
		got := make([]device.Reservation, n)
		errs := make([]error, n)
		for i := range n {
			wg.Go(func() {
				<-start
				owner, prefixes := fmt.Sprintf("nomad/%d", i), []string{"nomad/"}
				if i%6 == 5 {
					owner, prefixes = fmt.Sprintf("job-%d", i), nil
				}
				got[i], _, errs[i] = l.Reserve(context.Background(), res(owner, "GPU-0"), prefixes, nil)
			})
		}
		close(start)
		wg.Wait()

		made := map[string]bool{}
		taken := map[string]int{}
		for i, err := range errs {
			if err != nil {
				if !errors.Is(err, device.ErrDeviceHeld) {
					t.Fatalf("round %d, caller %d: %v", round, i, err)
				}
				continue
			}
			made[got[i].ID] = true
			for _, id := range got[i].TakenOver {
				taken[id]++
			}
		}
		live := l.Holders()["GPU-0"].ReservationID
		for _, r := range listAll(t, l) {
			switch {
			case !made[r.ID]:
				t.Errorf("round %d: %s in the ledger, but no caller was told of it", round, r.ID)
			case r.ID == live && (r.State != device.ReservationActive || taken[r.ID] != 0):
				t.Errorf("round %d: the holder %s is %v, taken over %d times", round, r.ID, r.State, taken[r.ID])
			case r.ID != live && (r.State != device.ReservationReleased || taken[r.ID] != 1):
				t.Errorf("round %d: %s is %v and was taken over %d times; want released by exactly one take-over", round, r.ID, r.State, taken[r.ID])
			}
		}
		if c := l.Counts(); c.Live != 1 || c.Total != len(made) {
			t.Errorf("round %d: counts %+v, want 1 live of %d made", round, c, len(made))
		}
	}
}
