package manager

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"

	"github.com/devicehost/devicehost/device"
)

// forEachStateDir runs fn on a manager without a state dir (its ledger in a temporary
// directory) and on one with a state dir.
func forEachStateDir(t *testing.T, fn func(t *testing.T, cfg Config, logs *logRecorder)) {
	for _, durable := range []bool{false, true} {
		t.Run(map[bool]string{false: "temporary", true: "state-dir"}[durable], func(t *testing.T) {
			cfg, logs := testConfig(t)
			if durable {
				cfg.StateDir = t.TempDir()
			}
			fn(t, cfg, logs)
		})
	}
}

// takeOver reserves ids of acme/gpu/A1 for owner, taking over "nomad/" owners.
func takeOver(m *Manager, owner string, ids ...string) (device.Reservation, error) {
	return m.Reserve(context.Background(), device.ReserveRequest{OwnerID: owner, Group: acmeA1, DeviceIDs: ids, TakeOverOwnerPrefixes: []string{"nomad/"}})
}

func TestReserveTakesOver(t *testing.T) {
	forEachStateDir(t, func(t *testing.T, cfg Config, logs *logRecorder) {
		alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1", "a2"))
		m, _ := startInprocManager(t, cfg, alpha)
		waitReady(t, m)
		old := reserve(t, m, "nomad/old", "a0", "a1")
		other := reserve(t, m, "job-7", "a2")
		calls := alpha.reserveCalls()

		// A holder of another owner refuses, named, without the plugin being asked.
		_, err := takeOver(m, "nomad/new", "a1", "a2")
		var held *device.HeldError
		if !errors.As(err, &held) || len(held.Conflicts) != 1 || held.Conflicts[0].Holder.ReservationID != other.ID {
			t.Fatalf("take-over over job-7's a2 = %v, want a HeldError naming only %s", err, other.ID)
		}
		if got := alpha.reserveCalls(); got != calls {
			t.Errorf("plugin asked %d times for a refused take-over", got-calls)
		}
		if r, _ := reservation(t, m, old.ID); r.State != device.ReservationActive {
			t.Errorf("%s after a refused take-over: %+v, want it live", old.ID, r)
		}

		got, err := takeOver(m, "nomad/new", "a1")
		if err != nil || !slices.Equal(got.TakenOver, []string{old.ID}) {
			t.Fatalf("take-over = %+v, %v; want %s taken over", got, err, old.ID)
		}
		if r, _ := reservation(t, m, old.ID); r.State != device.ReservationReleased || !r.ReleasedAt.Equal(got.CreatedAt) {
			t.Errorf("%s after the take-over: %+v, want released at %v", old.ID, r, got.CreatedAt)
		}
		st := m.State().Devices
		if h := st["a1"].Holder; h == nil || h.ReservationID != got.ID {
			t.Errorf("a1 held by %+v, want %s", h, got.ID)
		}
		if h := st["a0"].Holder; h != nil {
			t.Errorf("a0 held by %+v, want free: its reservation was taken over", h)
		}
		logs.waitLine(t, "reservation taken over", "reservation_id="+old.ID, "new_reservation_id="+got.ID)

		// A retry gets the reservation back, takes nothing over, asks no plugin.
		calls = alpha.reserveCalls()
		again, err := takeOver(m, "nomad/new", "a1")
		if err != nil || again.ID != got.ID || again.TakenOver != nil || alpha.reserveCalls() != calls {
			t.Errorf("retry = %+v, %v (%d plugin calls); want %s, nothing taken over, no call", again, err, alpha.reserveCalls()-calls, got.ID)
		}
		// The GC owes the plugin its cleanup, as after a Release.
		alpha.waitReleased(t, old.ID)
		waitReservation(t, m, old.ID, "cleaned up", cleanedUp)
	})
}

// While the plugin answers a take-over, the old reservation still holds its devices and
// no other Reserve gets them; if the plugin fails, nothing is released.
func TestTakeOverHoldsUntilItsWrite(t *testing.T) {
	forEachStateDir(t, func(t *testing.T, cfg Config, _ *logRecorder) {
		alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
		m, _ := startInprocManager(t, cfg, alpha)
		waitReady(t, m)
		old := reserve(t, m, "nomad/old", "a0")

		asked, answer := make(chan struct{}), make(chan error)
		alpha.set(func(f *fakeDevices) {
			f.reserve = func(_ context.Context, ids []string) (*pb.ContainerReservation, error) {
				asked <- struct{}{}
				if err := <-answer; err != nil {
					return nil, err
				}
				return &pb.ContainerReservation{Envs: map[string]string{"FAKE_VISIBLE_DEVICES": strings.Join(ids, ",")}}, nil
			}
		})
		for _, pluginErr := range []error{errors.New("driver says no"), nil} {
			done := make(chan error, 1)
			var got device.Reservation
			go func() {
				var err error
				got, err = takeOver(m, "nomad/new", "a0", "a1")
				done <- err
			}()
			<-asked
			if h := m.State().Devices["a0"].Holder; h == nil || h.ReservationID != old.ID {
				t.Errorf("a0 held by %+v while the plugin answers the take-over, want still %s", h, old.ID)
			}
			_, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "job-7", Group: acmeA1, DeviceIDs: []string{"a0"}})
			if !errors.Is(err, device.ErrDeviceHeld) {
				t.Errorf("Reserve of a0 by job-7 during the take-over = %v, want ErrDeviceHeld", err)
			}
			_, err = takeOver(m, "nomad/other", "a1")
			if want := `a1 being reserved for owner "nomad/new"`; err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("a second take-over of a1 during the first = %v, want %q", err, want)
			}
			answer <- pluginErr
			err = <-done
			r, _ := reservation(t, m, old.ID)
			if pluginErr != nil {
				if err == nil || r.State != device.ReservationActive || m.State().Devices["a0"].Holder.ReservationID != old.ID {
					t.Errorf("after the plugin failed: take-over err %v, %s %+v; want an error and %[2]s live, holding a0", err, old.ID, r)
				}
				continue
			}
			if err != nil || !slices.Equal(got.TakenOver, []string{old.ID}) || r.State != device.ReservationReleased {
				t.Errorf("take-over = %+v, %v; %s %+v; want it taken over", got, err, old.ID, r)
			}
		}
	})
}

// Reserves, take-overs and Releases racing on four devices never end with a device
// held twice or free while the ledger says it is held, never release a reservation
// that no Release or take-over released, and each take-over releases exactly what it
// reports.
func TestReserveRacingTakeOver(t *testing.T) {
	forEachStateDir(t, func(t *testing.T, cfg Config, _ *logRecorder) {
		devs := []string{"a0", "a1", "a2", "a3"}
		alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", devs...))
		m, _ := startInprocManager(t, cfg, alpha)
		waitReady(t, m)
		ctx := context.Background()

		var mu sync.Mutex
		made := map[string]device.Reservation{} // every reservation a caller was told of
		releasedBy := map[string]int{}          // reservation ID -> Releases and take-overs that said they released it
		var wg sync.WaitGroup
		for w := range 8 {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(w), 1))
				for i := range 100 {
					ids := slices.Clone(devs)
					rng.Shuffle(len(ids), func(a, b int) { ids[a], ids[b] = ids[b], ids[a] })
					ids = ids[:1+rng.IntN(2)]
					req := device.ReserveRequest{OwnerID: fmt.Sprintf("nomad/%d-%d", w, i), Group: acmeA1, DeviceIDs: ids,
						TakeOverOwnerPrefixes: []string{"nomad/"}}
					switch rng.IntN(4) {
					case 0: // another runtime's Reserve
						req.OwnerID, req.TakeOverOwnerPrefixes = fmt.Sprintf("job/%d-%d", w, i), nil
					case 1: // that runtime ends an allocation
						res, err := m.Release(ctx, device.ReleaseRequest{OwnerID: fmt.Sprintf("job/%d-%d", w, i-1)})
						if err != nil {
							t.Errorf("Release: %v", err)
							return
						}
						mu.Lock()
						for _, id := range res.Released {
							releasedBy[id]++
						}
						mu.Unlock()
						continue
					}
					r, err := m.Reserve(ctx, req)
					if err != nil {
						if !errors.Is(err, device.ErrDeviceHeld) {
							t.Errorf("Reserve %+v: %v", req, err)
						}
						continue
					}
					mu.Lock()
					made[r.ID] = r
					for _, id := range r.TakenOver {
						releasedBy[id]++
					}
					mu.Unlock()
				}
			})
		}
		wg.Wait()

		all, err := m.Reservations(ctx, device.ReservationFilter{})
		if err != nil {
			t.Fatal(err)
		}
		heldBy := map[string]string{}
		for _, r := range all {
			mr, ok := made[r.ID]
			switch {
			case !ok:
				t.Errorf("%s is in the ledger, but no caller was told of it", r.ID)
			case r.State == device.ReservationActive && releasedBy[r.ID] != 0:
				t.Errorf("%s is live, but was reported released %d times", r.ID, releasedBy[r.ID])
			case r.State == device.ReservationReleased && releasedBy[r.ID] != 1:
				t.Errorf("%s is released, but reported released %d times: lost, or released twice", r.ID, releasedBy[r.ID])
			case r.State == device.ReservationReleased && !strings.HasPrefix(r.OwnerID, "nomad/") && !strings.HasPrefix(r.OwnerID, "job/"):
				t.Errorf("%s of %s released", r.ID, r.OwnerID)
			case !slices.Equal(r.DeviceIDs, mr.DeviceIDs):
				t.Errorf("%s holds %v, was made for %v", r.ID, r.DeviceIDs, mr.DeviceIDs)
			}
			if r.State != device.ReservationActive {
				continue
			}
			for _, d := range r.DeviceIDs {
				if other, twice := heldBy[d]; twice {
					t.Errorf("%s held by both %s and %s", d, other, r.ID)
				}
				heldBy[d] = r.ID
			}
		}
		taken := 0
		for _, n := range releasedBy {
			taken += n
		}
		t.Logf("%d Reserves succeeded; %d reservations released by Release or take-over", len(made), taken)
		for d, st := range m.State().Devices {
			got := ""
			if st.Holder != nil {
				got = st.Holder.ReservationID
			}
			if got != heldBy[d] {
				t.Errorf("%s: the manager's snapshot says holder %q, the store %q", d, got, heldBy[d])
			}
		}

		// Once the race is over, one take-over of every device from both runtimes takes
		// over exactly the reservations left live.
		var live []string
		for _, id := range heldBy {
			live = append(live, id)
		}
		slices.Sort(live)
		live = slices.Compact(live)
		final, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "sweep", Group: acmeA1, DeviceIDs: devs, TakeOverOwnerPrefixes: []string{"nomad/", "job/"}})
		if err != nil || !slices.Equal(final.TakenOver, live) {
			t.Errorf("final take-over of every device = %v taken over, %v; want the live %v", final.TakenOver, err, live)
		}
	})
}
