package ledger

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
)

// modeCaps is one GPU offered every way at once, as the nvidia-example plugin offers
// it: MIG placements (compute and memory slices), 4 time-sliced replicas (group
// "time-slicing") and 4 MPS shares (group "mps").
var modeCaps = device.Capacity{gpu0: {"compute-slices": 7, "memory-slices": 8, "time-slices": 4, "mps-memory": 4, "mps-compute": 4}}

// modeUse is a request of owner for one device of the GPU in mode: "whole" (all of
// every counter, no group), "mig" (a slice of each, no group), "ts" (a time slice,
// group "time-slicing") or "mps" (a share, group "mps").
func modeUse(owner, mode string, n int) device.Reservation {
	r := res(owner, fmt.Sprintf("GPU-0-%s-%d", mode, n))
	c := device.Consumption{Set: gpu0}
	switch mode {
	case "whole":
		c.Counters = maps.Clone(modeCaps[gpu0])
	case "mig":
		c.Counters = map[string]int64{"compute-slices": 1, "memory-slices": 1}
	case "ts":
		c.Counters, c.Groups = map[string]int64{"time-slices": 1}, []string{"time-slicing"}
	case "mps":
		c.Counters, c.Groups = map[string]int64{"mps-memory": 1, "mps-compute": 1}, []string{"mps"}
	}
	r.Consumes = []device.Consumption{c}
	return r
}

// Every pair of modes on one GPU, the first held when the second is asked: the same
// sharing mode shares it (MIG placements, time slices, MPS shares), two modes never
// do, and the whole GPU shares with nothing. A refusal says how the GPU is held, by
// whom, and how the request would hold it. Released, the GPU takes the other mode.
func TestModesOnOneGPU(t *testing.T) {
	modes := []string{"whole", "mig", "ts", "mps"}
	shares := map[string]bool{"mig": true, "ts": true, "mps": true}
	held := map[string]string{"whole": "unshared", "mig": "unshared", "ts": `shared as "time-slicing"`, "mps": `shared as "mps"`}
	ctx := context.Background()
	for _, first := range modes {
		for _, second := range modes {
			t.Run(first+"/"+second, func(t *testing.T) {
				l := newLedger(t)
				a, _, err := l.Reserve(ctx, modeUse("job-a", first, 0), nil, modeCaps)
				if err != nil {
					t.Fatalf("first holder (%s): %v", first, err)
				}
				_, _, err = l.Reserve(ctx, modeUse("job-b", second, 1), nil, modeCaps)
				if first == second && shares[first] {
					if err != nil {
						t.Fatalf("%s beside %s: %v, want both held", second, first, err)
					}
					if u := l.Usage()[gpu0]; len(u.SetUsers) != 2 {
						t.Errorf("usage %+v, want two users of the set", u)
					}
					return
				}
				var ce *device.CapacityError
				if !errors.As(err, &ce) || !errors.Is(err, device.ErrCapacityExceeded) {
					t.Fatalf("%s beside %s: %v, want refused", second, first, err)
				}
				if held[first] != held[second] {
					want := fmt.Sprintf(`counter set "GPU-0" (plugin "nvidia-example") is held %s by reservation %s of owner "job-a"; the request's devices would hold it %s`,
						held[first], a.ID, held[second])
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q\ndoes not say %q", err, want)
					}
					if o := ce.Overruns[0]; o.Counter != "" || len(o.Users) != 1 || o.Users[0].ReservationID != a.ID {
						t.Errorf("first overrun %+v, want the set's group conflict naming %s", o, a.ID)
					}
				}
				if n := len(listAll(t, l)); n != 1 {
					t.Fatalf("%d reservations after the refusal, want 1", n)
				}
				release(t, l, a.ID, t0)
				if _, _, err := l.Reserve(ctx, modeUse("job-b", second, 1), nil, modeCaps); err != nil {
					t.Fatalf("%s once %s is released: %v", second, first, err)
				}
			})
		}
	}
}

// A GPU stays in its mode while any holder of that mode is left, through a reopen of
// the ledger (the groups are stored with each reservation), and takes another mode
// once the last one goes. A take-over of the only holder lets the new owner choose.
func TestModeHeldUntilLastHolderGoes(t *testing.T) {
	path := statePath(t)
	l := openLedger(t, path)
	ctx := context.Background()
	ts1, _, err := l.Reserve(ctx, modeUse("job-1", "ts", 1), nil, modeCaps)
	if err != nil {
		t.Fatal(err)
	}
	ts2, _, err := l.Reserve(ctx, modeUse("job-2", "ts", 2), nil, modeCaps)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l = openLedger(t, path)
	if rs := listAll(t, l); len(rs) != 2 || !reflect.DeepEqual(rs[0].Consumes[0].Groups, []string{"time-slicing"}) {
		t.Fatalf("after reopening: %+v, want both time-sliced holders with their group", rs)
	}
	if u := l.Usage()[gpu0]; !reflect.DeepEqual(u.Groups, []string{"time-slicing"}) || len(u.SetUsers) != 2 {
		t.Errorf("usage after reopening %+v, want the set held as time-slicing by 2", u)
	}
	release(t, l, ts1.ID, t0)
	_, _, err = l.Reserve(ctx, modeUse("job-3", "mps", 3), nil, modeCaps)
	if !errors.Is(err, device.ErrCapacityExceeded) || !strings.Contains(err.Error(), ts2.ID) || strings.Contains(err.Error(), ts1.ID) {
		t.Fatalf("MPS with one time-sliced holder left: %v, want refused naming %s alone", err, ts2.ID)
	}
	// The bridge re-allocating ts2's device to a new pod as an MPS share takes it over.
	r := modeUse("kubelet/new", "mps", 3)
	r.DeviceIDs = ts2.DeviceIDs
	if _, _, err := l.Reserve(ctx, r, []string{"job-2"}, modeCaps); err != nil {
		t.Fatalf("MPS taking over the last time-sliced holder: %v", err)
	}
	if u := l.Usage()[gpu0]; !reflect.DeepEqual(u.Groups, []string{"mps"}) {
		t.Errorf("usage %+v, want the set held as mps", u)
	}
}

// A use in two groups shares with either; the set then serves what all its users
// have in common. Checked through Check too, which the manager runs before asking the
// plugin.
func TestUseInTwoGroups(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	both := modeUse("job-1", "ts", 1)
	both.Consumes[0].Groups = []string{"a", "b"}
	if _, _, err := l.Reserve(ctx, both, nil, modeCaps); err != nil {
		t.Fatal(err)
	}
	onlyB := modeUse("job-2", "ts", 2)
	onlyB.Consumes[0].Groups = []string{"b"}
	if _, _, err := l.Reserve(ctx, onlyB, nil, modeCaps); err != nil {
		t.Fatalf("a use in b beside one in a and b: %v", err)
	}
	if u := l.Usage()[gpu0]; !reflect.DeepEqual(u.Groups, []string{"b"}) {
		t.Errorf("usage groups %q, want [b]", u.Groups)
	}
	onlyA := modeUse("job-3", "ts", 3)
	onlyA.Consumes[0].Groups = []string{"a"}
	_, err := l.Check("job-3", onlyA.DeviceIDs, nil, nil, onlyA.Consumes, modeCaps)
	if !errors.Is(err, device.ErrCapacityExceeded) || !strings.Contains(err.Error(), `is held shared as "b" by reservation`) || !strings.Contains(err.Error(), `, reservation res-`) {
		t.Fatalf("Check of a use in a alone: %v, want refused naming both holders", err)
	}
}
