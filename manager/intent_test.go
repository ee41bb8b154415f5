package manager

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// leaveIntents writes into the state file of cfg what devicehost 189008b..c9e8f1f left
// after a stop between Reserves' replies and the writes of their answers: intents of plugin alpha's acme/gpu/A1 devices,
// owner -> device, and returns their IDs in the same order.
func leaveIntents(t *testing.T, cfg Config, owners, devs []string) []string {
	t.Helper()
	l, err := ledger.Open(filepath.Join(cfg.StateDir, ledger.DefaultFileName), ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for i, owner := range owners {
		r, _, err := l.Intend(context.Background(), device.Reservation{
			ID: ledger.NewID(), OwnerID: owner, Group: acmeA1, Plugin: "alpha", DeviceIDs: []string{devs[i]},
		}, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, r.ID)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return out
}

// waitIntents waits until the manager's ledger holds no intent.
func waitNoIntents(t *testing.T, m *Manager) {
	t.Helper()
	deadline := time.Now().Add(testwait.Timeout)
	for {
		all := m.ledger.Intents()
		if len(all) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("intents still there: %v", all)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestIntentsLeftByAStopAreAnsweredOnceThePluginIsUp: the devices of Reserves whose
// answers a stop kept out of the state file stay held through the restart (the plugin's
// Reconcile is told of them); once the plugin is up it is asked again, and each becomes
// a whole reservation, or, refused, frees its devices.
func TestIntentsLeftByAStopAreAnsweredOnceThePluginIsUp(t *testing.T) {
	cfg, logs := durableConfig(t)
	left := leaveIntents(t, cfg, []string{"o1", "o2"}, []string{"a0", "a1"})
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1", "a2"))
	alpha.set(func(f *fakeDevices) {
		f.reserve = func(_ context.Context, ids []string) (*pb.ContainerReservation, error) {
			if slices.Contains(ids, "a1") {
				return nil, status.Error(codes.FailedPrecondition, "a1 is gone")
			}
			return &pb.ContainerReservation{Envs: map[string]string{"FAKE_VISIBLE_DEVICES": strings.Join(ids, ",")}}, nil
		}
	})
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	waitNoIntents(t, m)

	r, ok := reservation(t, m, left[0])
	if !ok || r.OwnerID != "o1" || r.Container.Envs["FAKE_VISIBLE_DEVICES"] != "a0" || r.Container.Envs[device.ReservationEnv] != left[0] {
		t.Errorf("reservation %s = %+v (listed %v), want o1's, with the plugin's answer and its ID", left[0], r, ok)
	}
	if _, ok := reservation(t, m, left[1]); ok {
		t.Errorf("%s, refused by the plugin, still listed", left[1])
	}
	logs.waitLine(t, "withdrawn", left[1])
	if calls := alpha.reconcileCalls(); len(calls) == 0 || len(calls[0]) != 2 {
		t.Errorf("Reconcile calls = %v, want the first to hand over both intents", calls)
	}
	if _, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "o3", Group: acmeA1, DeviceIDs: []string{"a0"}}); !errors.Is(err, device.ErrDeviceHeld) {
		t.Errorf("Reserve of a0 by another owner = %v, want it held", err)
	}
	alpha.set(func(f *fakeDevices) { f.reserve = nil })
	reserve(t, m, "o3", "a1") // freed
}

// TestRetriedReserveAnswersAnIntentWithoutItsAnswer: its owner asking again for an
// intent without its answer gets the reservation whole, the plugin asked once.
func TestRetriedReserveAnswersAnIntentWithoutItsAnswer(t *testing.T) {
	cfg, _ := durableConfig(t)
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	// Made after the manager started, so left to its owner's Reserve alone.
	in, _, err := m.ledger.Intend(context.Background(), device.Reservation{
		ID: "res-left", OwnerID: "o1", Group: acmeA1, Plugin: "alpha", DeviceIDs: []string{"a0"},
	}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := reserve(t, m, "o1", "a0")
	if r.ID != in.ID || r.Container.Envs["FAKE_VISIBLE_DEVICES"] != "a0" || r.Container.Envs[device.ReservationEnv] != in.ID || alpha.reserveCalls() != 1 {
		t.Errorf("retried Reserve = %+v after %d plugin calls, want %s with the plugin's answer after one", r, alpha.reserveCalls(), in.ID)
	}
	if all := m.ledger.Intents(); len(all) != 0 {
		t.Errorf("intents = %v, want none", all)
	}
	if got, ok := reservation(t, m, in.ID); !ok || got.Container.Envs["FAKE_VISIBLE_DEVICES"] != "a0" {
		t.Errorf("listed %+v (%v), want the answer", got, ok)
	}
}

// TestReserveRefusedByThePluginLeavesNothing: a Reserve the plugin refuses leaves no
// reservation and no intent, the device free, and its refusal in the trail.
func TestReserveRefusedByThePluginLeavesNothing(t *testing.T) {
	cfg, _ := durableConfig(t)
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	alpha.set(func(f *fakeDevices) {
		f.reserve = func(context.Context, []string) (*pb.ContainerReservation, error) {
			return nil, status.Error(codes.FailedPrecondition, "not today")
		}
	})
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	ctx := context.Background()
	if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "o1", Group: acmeA1, DeviceIDs: []string{"a0"}}); !errors.Is(err, device.ErrPluginResponse) {
		t.Fatalf("Reserve = %v, want the plugin's refusal", err)
	}
	if all := m.ledger.Intents(); len(all) != 0 {
		t.Errorf("intents = %v, want none", all)
	}
	if rs, err := m.Reservations(ctx, device.ReservationFilter{}); err != nil || len(rs) != 0 {
		t.Errorf("reservations = %v, %v; want none", rs, err)
	}
	ev, err := m.Events(ctx, device.EventFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(ev.Events) != 1 || ev.Events[0].Kind != device.EventRefused || ev.Events[0].Call != "reserve" || ev.Events[0].Owner != "o1" {
		t.Errorf("events after a refused Reserve = %+v, want its refusal alone", ev.Events)
	}
	if h := m.reg.Snapshot().State.Devices["a0"].Holder; h != nil {
		t.Errorf("a0 held by %+v", h)
	}
	alpha.set(func(f *fakeDevices) { f.reserve = nil })
	reserve(t, m, "o2", "a0")
}

// TestCleanupLeavesOutDevicesANewerReservationHolds: a released reservation's cleanup,
// owed while one of its devices was reserved again, does not make the plugin clean up
// that device (its state is the newer reservation's now), only the others.
func TestCleanupLeavesOutDevicesANewerReservationHolds(t *testing.T) {
	cfg, logs := durableConfig(t)
	cfg.gcRetryMin = 20 * time.Millisecond
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	r1 := reserve(t, m, "o1", "a0", "a1")

	cleaned := make(chan []string, 1)
	var refuse atomic.Bool
	refuse.Store(true)
	alpha.set(func(f *fakeDevices) {
		f.release = func(_ context.Context, id string, ids []string) error {
			if refuse.Load() {
				return status.Error(codes.Unavailable, "not now")
			}
			if id == r1.ID {
				cleaned <- slices.Clone(ids)
			}
			return nil
		}
	})
	release(t, m, device.ReleaseRequest{ReservationID: r1.ID})
	logs.waitLine(t, "reservation cleanup failed; will retry", "reservation_id="+r1.ID)

	r2 := reserve(t, m, "o2", "a0") // while r1's cleanup is owed
	refuse.Store(false)
	select {
	case ids := <-cleaned:
		if !slices.Equal(ids, []string{"a1"}) {
			t.Errorf("plugin asked to clean up %v after %s, want only a1 (a0 is %s's)", ids, r1.ID, r2.ID)
		}
	case <-time.After(testwait.Timeout):
		t.Fatal("r1's cleanup never ran")
	}
	waitReservation(t, m, r1.ID, "cleaned up", cleanedUp)
	logs.waitLine(t, "leaves out devices a newer reservation holds", r1.ID)
	if got, ok := reservation(t, m, r2.ID); !ok || got.State != device.ReservationActive {
		t.Errorf("%s = %+v (listed %v), want live", r2.ID, got, ok)
	}
}

// TestReserveWaitsForTheCleanupOfItsDevices: a Reserve of a device whose plugin cleanup
// is in flight waits for it to end before the plugin is asked: the plugin never
// prepares a device for its new holder while it cleans up after the old one.
func TestReserveWaitsForTheCleanupOfItsDevices(t *testing.T) {
	cfg, _ := durableConfig(t)
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	r1 := reserve(t, m, "o1", "a0")

	inCleanup, reserveAsked, mayEnd := make(chan struct{}), make(chan struct{}), make(chan struct{})
	end := sync.OnceFunc(func() { close(mayEnd) })
	t.Cleanup(end) // before the manager's shutdown, should the test fail first
	var cleanupDone, overlapped atomic.Bool
	alpha.set(func(f *fakeDevices) {
		f.release = func(_ context.Context, id string, _ []string) error {
			if id == r1.ID {
				close(inCleanup)
				// The cleanup lasts until the test has seen the Reserve of a0 wait
				// for it, or until a host that does not wait asks the plugin.
				select {
				case <-reserveAsked:
				case <-mayEnd:
				}
				cleanupDone.Store(true)
			}
			return nil
		}
		f.reserve = func(_ context.Context, ids []string) (*pb.ContainerReservation, error) {
			overlapped.Store(!cleanupDone.Load())
			close(reserveAsked)
			return &pb.ContainerReservation{Envs: map[string]string{"FAKE_VISIBLE_DEVICES": strings.Join(ids, ",")}}, nil
		}
	})
	release(t, m, device.ReleaseRequest{ReservationID: r1.ID})
	select {
	case <-inCleanup:
	case <-time.After(testwait.Timeout):
		t.Fatal("r1's cleanup never ran")
	}
	reserved := make(chan error, 1)
	go func() {
		_, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "o2", Group: acmeA1, DeviceIDs: []string{"a0"}})
		reserved <- err
	}()
	// The barrier: the Reserve is blocked waiting for the cleanup (or the plugin was
	// asked, which fails the test below), not some time has passed.
	testwait.WaitFor(t, "the Reserve of a0 waiting for r1's cleanup, or the plugin asked", func() bool {
		select {
		case <-reserveAsked:
			return true
		default:
			return blockedIn("manager.(*Manager).claimAfterCleanups")
		}
	})
	end()
	select {
	case err := <-reserved:
		if err != nil {
			t.Fatalf("Reserve(o2, a0): %v", err)
		}
	case <-time.After(testwait.Timeout):
		t.Fatal("the Reserve of a0 still waits after r1's cleanup ended")
	}
	if overlapped.Load() {
		t.Error("the plugin was asked to reserve a0 while it was cleaning up after r1")
	}
}

// TestCleanupsOfOneDeviceRunOneAtATime: two released reservations of the same device
// whose cleanups are both owed, retried together, get them one after the other, neither
// refused for the other.
func TestCleanupsOfOneDeviceRunOneAtATime(t *testing.T) {
	cfg, logs := durableConfig(t)
	cfg.gcRetryMin = time.Hour // retried only when the test says so, both at once
	cfg.GCParallelDestroys = 4
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)

	var refuse atomic.Bool
	var running, most atomic.Int32
	second, mayEnd := make(chan struct{}), make(chan struct{})
	end := sync.OnceFunc(func() { close(mayEnd) })
	t.Cleanup(end) // before the manager's shutdown, should the test fail first
	refuse.Store(true)
	alpha.set(func(f *fakeDevices) {
		f.release = func(context.Context, string, []string) error {
			if refuse.Load() {
				return status.Error(codes.Unavailable, "not now")
			}
			n := running.Add(1)
			defer running.Add(-1)
			if n > most.Load() {
				most.Store(n)
			}
			if n == 1 {
				// The first cleanup lasts until the test has seen the second wait
				// for it, or until a host that does not wait lets the second in.
				select {
				case <-second:
				case <-mayEnd:
				}
			} else {
				close(second)
			}
			return nil
		}
	})
	var ids []string
	for _, owner := range []string{"o1", "o2"} {
		r := reserve(t, m, owner, "a0")
		release(t, m, device.ReleaseRequest{ReservationID: r.ID})
		logs.waitLine(t, "reservation cleanup failed; will retry", "reservation_id="+r.ID)
		ids = append(ids, r.ID)
	}
	refuse.Store(false)
	m.gc.RetryNow()
	// The barrier: one cleanup is blocked waiting for the other (or both ran at once,
	// which fails the test below), not some time has passed.
	testwait.WaitFor(t, "a cleanup of a0 waiting for the other, or both in the plugin", func() bool {
		select {
		case <-second:
			return true
		default:
			return blockedIn("manager.(*Manager).claimForCleanup")
		}
	})
	end()
	for _, id := range ids {
		waitReservation(t, m, id, "cleaned up", cleanedUp)
	}
	if got := most.Load(); got != 1 {
		t.Errorf("%d cleanups of a0 at once, want 1", got)
	}
	if lines := logs.lines("another cleanup"); len(lines) > 0 {
		t.Errorf("a cleanup refused for the other: %q", lines)
	}
}
