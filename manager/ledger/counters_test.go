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

// A GPU that can be had whole or as seven one-slice partitions, as an on-demand MIG
// plugin declares it: one counter set, seven compute slices.
var gpu0 = device.CounterSetKey{Plugin: "nvidia-example", Name: "GPU-0"}

var gpuCaps = device.Capacity{gpu0: {"compute-slices": 7, "memory-slices": 8}}

// part is a request of owner for partition device dev, which uses one slice of each.
func part(owner, dev string) device.Reservation {
	r := res(owner, dev)
	r.Consumes = []device.Consumption{{Set: gpu0, Counters: map[string]int64{"compute-slices": 1, "memory-slices": 1}}}
	return r
}

// whole is a request of owner for the whole GPU, which uses all of both.
func whole(owner string) device.Reservation {
	r := res(owner, "GPU-0")
	r.Consumes = []device.Consumption{{Set: gpu0, Counters: map[string]int64{"compute-slices": 7, "memory-slices": 8}}}
	return r
}

// Seven partitions fit; an eighth and the whole GPU are refused, naming the counter,
// its figures and the reservations that use it; released, they free it again, and the
// whole GPU then fits.
func TestReserveWithinSharedCapacity(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	var parts []device.Reservation
	for i := range 7 {
		r, _, err := l.Reserve(ctx, part(fmt.Sprintf("job-%d", i), fmt.Sprintf("MIG-0-%d", i)), nil, gpuCaps)
		if err != nil {
			t.Fatalf("partition %d: %v", i, err)
		}
		parts = append(parts, r)
	}
	_, _, err := l.Reserve(ctx, part("job-7", "MIG-0-7"), nil, gpuCaps)
	var ce *device.CapacityError
	if !errors.As(err, &ce) || !errors.Is(err, device.ErrCapacityExceeded) {
		t.Fatalf("eighth partition: %v, want a capacity error", err)
	}
	if len(ce.Overruns) != 1 {
		t.Fatalf("overruns %+v, want compute-slices only (memory has 8)", ce.Overruns)
	}
	o := ce.Overruns[0]
	if o.Set != gpu0 || o.Counter != "compute-slices" || o.Capacity != 7 || o.Used != 7 || o.Requested != 1 || len(o.Users) != 7 {
		t.Errorf("overrun %+v, want compute-slices 7 of 7 used by 7, 1 requested", o)
	}
	for _, want := range []string{`counter "compute-slices" of set "GPU-0" (plugin "nvidia-example")`, "1 requested, 7 of 7 used by reservation res-", ", 4 more: shared capacity exceeded"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if _, err := l.Check("job-w", []string{"GPU-0"}, nil, nil, whole("job-w").Consumes, gpuCaps); !errors.As(err, &ce) || len(ce.Overruns) != 2 {
		t.Fatalf("Check of the whole GPU: %v, want both counters over", err)
	}
	if n := len(listAll(t, l)); n != 7 {
		t.Fatalf("%d reservations after the refusals, want 7", n)
	}
	u := l.Usage()[gpu0]
	if u.Used["compute-slices"] != 7 || len(u.Users["memory-slices"]) != 7 {
		t.Errorf("usage %+v, want 7 compute slices used by 7", u)
	}

	for _, r := range parts[:6] {
		release(t, l, r.ID, t0)
	}
	if _, _, err := l.Reserve(ctx, whole("job-w"), nil, gpuCaps); !errors.As(err, &ce) || len(ce.Overruns[0].Users) != 1 || ce.Overruns[0].Users[0].ReservationID != parts[6].ID {
		t.Fatalf("whole GPU beside one partition: %v, want refused naming %s alone", err, parts[6].ID)
	}
	release(t, l, parts[6].ID, t0)
	if _, _, err := l.Reserve(ctx, whole("job-w"), nil, gpuCaps); err != nil {
		t.Fatalf("whole GPU with every partition released: %v", err)
	}
	if u := l.Usage()[gpu0]; u.Used["memory-slices"] != 8 || len(u.Users["memory-slices"]) != 1 || u.Users["memory-slices"][0].OwnerID != "job-w" {
		t.Errorf("usage %+v, want the whole GPU's", u)
	}
}

// What a reservation uses outlives a restart: the file keeps it, and the reopened
// ledger refuses what would not fit.
func TestSharedCapacitySurvivesReopen(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{Now: tickingClock()})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, _, err := l.Reserve(ctx, whole("job-w"), nil, gpuCaps); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l = openLedger(t, path)
	rs := listAll(t, l)
	if len(rs) != 1 || !reflect.DeepEqual(rs[0].Consumes, whole("").Consumes) {
		t.Fatalf("after reopening: %+v, want the whole GPU's reservation with its use", rs)
	}
	if _, _, err := l.Reserve(ctx, part("job-1", "MIG-0-0"), nil, gpuCaps); !errors.Is(err, device.ErrCapacityExceeded) {
		t.Fatalf("a partition after reopening: %v, want refused", err)
	}
	// Released, the reservation keeps its use in the record (a listing shows it) but
	// no longer counts.
	release(t, l, rs[0].ID, t0)
	got, err := l.Get(rs[0].ID)
	if err != nil || !reflect.DeepEqual(got.Consumes, whole("").Consumes) {
		t.Errorf("released reservation %+v, %v: want its use kept", got, err)
	}
	if _, _, err := l.Reserve(ctx, part("job-1", "MIG-0-0"), nil, gpuCaps); err != nil {
		t.Fatalf("a partition after the release: %v", err)
	}
}

// A take-over frees what the victims used in the same write: the bridge re-allocating
// a GPU whose stale reservation held it whole is not refused for its own old use.
func TestTakeOverFreesCapacity(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	old, _, err := l.Reserve(ctx, whole("kubelet/old"), nil, gpuCaps)
	if err != nil {
		t.Fatal(err)
	}
	r := part("kubelet/new", "MIG-0-0")
	r.DeviceIDs = []string{"GPU-0"} // held by old: taken over
	got, _, err := l.Reserve(ctx, r, []string{"kubelet/"}, gpuCaps)
	if err != nil || len(got.TakenOver) != 1 || got.TakenOver[0] != old.ID {
		t.Fatalf("take-over: %+v, %v", got, err)
	}
	if u := l.Usage()[gpu0]; u.Used["compute-slices"] != 1 {
		t.Errorf("usage after the take-over %+v, want the new one's alone", u)
	}
}

// A set the plugin no longer reports has no capacity for new reservations.
func TestUnknownCounterSetHasNoCapacity(t *testing.T) {
	l := newLedger(t)
	_, _, err := l.Reserve(context.Background(), part("job", "MIG-0-0"), nil, nil)
	var ce *device.CapacityError
	if !errors.As(err, &ce) || ce.Overruns[0].Capacity != 0 {
		t.Fatalf("Reserve without the set's capacity: %v, want refused with capacity 0", err)
	}
}

// Of 64 concurrent Reserves for the last slices, exactly as many as fit win, every
// time, whatever the batching.
func TestConcurrentReservesForTheLastSlices(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	for i := range 5 {
		if _, _, err := l.Reserve(ctx, part(fmt.Sprintf("early-%d", i), fmt.Sprintf("MIG-0-%d", i)), nil, gpuCaps); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	won, refused := 0, 0
	for i := range 64 {
		wg.Go(func() {
			_, _, err := l.Reserve(ctx, part(fmt.Sprintf("racer-%d", i), fmt.Sprintf("MIG-racer-%d", i)), nil, gpuCaps)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				won++
			case errors.Is(err, device.ErrCapacityExceeded):
				refused++
			default:
				t.Errorf("racer %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	if won != 2 || refused != 62 {
		t.Fatalf("%d won and %d were refused, want 2 and 62", won, refused)
	}
	if u := l.Usage()[gpu0]; u.Used["compute-slices"] != 7 {
		t.Errorf("usage %+v, want 7 compute slices", u)
	}
}

// checkConsumes, which Open runs on every record it loads and Reserve before it writes
// one, refuses a use that breaks the invariants, saying which.
func TestCheckConsumes(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    []device.Consumption
		want string
	}{
		{"no set name", []device.Consumption{{Set: device.CounterSetKey{Plugin: "p"}}}, "without a name"},
		{"another plugin's set", []device.Consumption{{Set: device.CounterSetKey{Plugin: "q", Name: "s"}}}, `of plugin "q" in a reservation of plugin "p"`},
		{"a set twice", []device.Consumption{{Set: device.CounterSetKey{Plugin: "p", Name: "s"}}, {Set: device.CounterSetKey{Plugin: "p", Name: "s"}}}, "named twice"},
		{"groups out of order", []device.Consumption{{Set: device.CounterSetKey{Plugin: "p", Name: "s"}, Groups: []string{"mps", "a"}}}, "compatibility groups"},
		{"three groups", []device.Consumption{{Set: device.CounterSetKey{Plugin: "p", Name: "s"}, Groups: []string{"a", "b", "c"}}}, "at most 2"},
		{"an empty group", []device.Consumption{{Set: device.CounterSetKey{Plugin: "p", Name: "s"}, Groups: []string{""}}}, "compatibility groups"},
		{"a negative use", []device.Consumption{{Set: device.CounterSetKey{Plugin: "p", Name: "s"}, Counters: map[string]int64{"c": -1}}}, "uses -1"},
	} {
		if err := checkConsumes("p", tc.c); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}

// Usage is kept per counter set between writes: after every step of seeded random
// Reserves and Releases over two GPUs it equals a count from the live reservations, and
// an answer already handed out is not changed by the writes after it.
func TestUsageFollowsEveryWrite(t *testing.T) {
	gpu1 := device.CounterSetKey{Plugin: "nvidia-example", Name: "GPU-1"}
	caps := device.Capacity{gpu0: {"compute-slices": 7}, gpu1: {"compute-slices": 7}}
	for seed := range 4 {
		l := newLedger(t)
		ctx := context.Background()
		live := make(map[string]device.Reservation)
		var first map[device.CounterSetKey]device.CounterUse
		var firstCopy string
		for step := range 80 {
			if len(live) > 0 && (step*7+seed)%3 == 0 {
				var ids []string
				for id := range live {
					ids = append(ids, id)
				}
				slices.Sort(ids)
				id := ids[(step+seed)%len(ids)]
				release(t, l, id, t0)
				delete(live, id)
			} else {
				set := []device.CounterSetKey{gpu0, gpu1}[(step+seed)%2]
				r := res(fmt.Sprintf("job-%d-%d", seed, step), fmt.Sprintf("MIG-%s-%d", set.Name, step))
				r.Consumes = []device.Consumption{{Set: set, Counters: map[string]int64{"compute-slices": 1}}}
				if got, _, err := l.Reserve(ctx, r, nil, caps); err == nil {
					live[got.ID] = got
				}
			}
			want := make(map[device.CounterSetKey]device.CounterUse)
			for _, r := range live {
				for _, c := range r.Consumes {
					u, ok := want[c.Set]
					if !ok {
						u = device.CounterUse{Used: map[string]int64{}, Users: map[string][]device.Holder{}}
					}
					u.SetUsers = append(u.SetUsers, device.Holder{ReservationID: r.ID, OwnerID: r.OwnerID})
					want[c.Set] = u
					for n, v := range c.Counters {
						u.Used[n] += v
						u.Users[n] = append(u.Users[n], device.Holder{ReservationID: r.ID, OwnerID: r.OwnerID})
					}
				}
			}
			for _, u := range want {
				slices.SortFunc(u.SetUsers, func(a, b device.Holder) int { return strings.Compare(a.ReservationID, b.ReservationID) })
				for n := range u.Users {
					slices.SortFunc(u.Users[n], func(a, b device.Holder) int { return strings.Compare(a.ReservationID, b.ReservationID) })
				}
			}
			got := l.Usage()
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("seed %d, step %d: Usage %+v, want %+v", seed, step, got, want)
			}
			if first == nil && len(got) == 2 {
				first, firstCopy = got, fmt.Sprint(got)
			}
		}
		if first == nil || fmt.Sprint(first) != firstCopy {
			t.Errorf("seed %d: an earlier Usage answer changed under later writes: %v, was %s", seed, first, firstCopy)
		}
	}
}
