package manager

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/tools/testwait"
)

// TestFakeManagerContract drives every method of device.Manager on devicetest.Fake: the
// least an alternative manager (a simulator, a test double for the server) implements.
// Each row sets the one function the method calls and checks that the call and its
// answer pass through; the zero row checks the Fake's documented answers without them.
func TestFakeManagerContract(t *testing.T) {
	inv := device.Inventory{Groups: []device.Group{{GroupKey: device.GroupKey{Vendor: "v", Type: "t", Name: "n"}, Plugin: "p",
		Devices: []device.DeviceInfo{{ID: "d0", Locality: device.Locality{NUMANode: -1}}}}}}
	state := device.State{Devices: map[string]device.DeviceState{"d0": {Health: device.HealthHealthy}}}
	res := device.Reservation{ID: "r1", OwnerID: "o1", DeviceIDs: []string{"d0"}}
	snapCh := make(chan device.Snapshot, 1)
	snapCh <- device.Snapshot{Seq: 1, Inventory: inv, State: state}
	statsCh := make(chan device.StatsSnapshot, 1)
	statsCh <- device.StatsSnapshot{Groups: []device.GroupStats{{Plugin: "p"}}}
	ready := make(chan struct{})
	close(ready)
	errStop := errors.New("stop refused")

	tests := []struct {
		name  string
		fake  *devicetest.Fake
		drive func(ctx context.Context, m device.Manager) error // nil error means as expected
	}{
		{"Inventory", &devicetest.Fake{InventoryFunc: func() device.Inventory { return inv }},
			func(_ context.Context, m device.Manager) error {
				return expect(m.Inventory().Groups[0].Devices[0].ID == "d0", "inventory not passed through")
			}},
		{"State", &devicetest.Fake{StateFunc: func() device.State { return state }},
			func(_ context.Context, m device.Manager) error {
				return expect(m.State().Devices["d0"].Health == device.HealthHealthy, "state not passed through")
			}},
		{"Snapshot", &devicetest.Fake{SnapshotFunc: func() device.Snapshot { return device.Snapshot{Seq: 2, Inventory: inv, State: state} }},
			func(_ context.Context, m device.Manager) error {
				return expect(m.Snapshot().Seq == 2, "snapshot not passed through")
			}},
		{"Snapshot from Inventory and State", &devicetest.Fake{
			InventoryFunc: func() device.Inventory { return inv },
			StateFunc:     func() device.State { return state },
		},
			func(_ context.Context, m device.Manager) error {
				snap := m.Snapshot()
				return expect(snap.Inventory.Groups[0].Devices[0].ID == "d0" && snap.State.Devices["d0"].Health == device.HealthHealthy,
					"snapshot is not Inventory and State together")
			}},
		{"LatestStats", &devicetest.Fake{LatestStatsFunc: func() device.StatsSnapshot {
			return device.StatsSnapshot{Groups: []device.GroupStats{{Plugin: "p"}}}
		}},
			func(_ context.Context, m device.Manager) error {
				return expect(m.LatestStats().Groups[0].Plugin == "p", "latest stats not passed through")
			}},
		{"Watch", &devicetest.Fake{WatchFunc: func(context.Context) <-chan device.Snapshot { return snapCh }},
			func(ctx context.Context, m device.Manager) error {
				return expect((<-m.Watch(ctx)).Seq == 1, "snapshot not passed through")
			}},
		{"WatchStats", &devicetest.Fake{WatchStatsFunc: func(_ context.Context, iv time.Duration) <-chan device.StatsSnapshot {
			if iv != time.Second {
				return nil
			}
			return statsCh
		}},
			func(ctx context.Context, m device.Manager) error {
				return expect((<-m.WatchStats(ctx, time.Second)).Groups[0].Plugin == "p", "stats or interval not passed through")
			}},
		{"Reown", &devicetest.Fake{ReownFunc: func(_ context.Context, req device.ReownRequest) (device.Reservation, error) {
			if req.ReservationID != "r1" || req.OwnerID != "o1" || req.NewOwnerID != "o2" {
				return device.Reservation{}, device.ErrInvalidRequest
			}
			r := res
			r.OwnerID = req.NewOwnerID
			return r, nil
		}},
			func(ctx context.Context, m device.Manager) error {
				r, err := m.Reown(ctx, device.ReownRequest{ReservationID: "r1", OwnerID: "o1", NewOwnerID: "o2"})
				return errors.Join(err, expect(r.OwnerID == "o2", "reown not passed through"))
			}},
		{"Reserve", &devicetest.Fake{ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
			if req.OwnerID != "o1" {
				return device.Reservation{}, device.ErrInvalidRequest
			}
			return res, nil
		}},
			func(ctx context.Context, m device.Manager) error {
				got, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "o1", DeviceIDs: []string{"d0"}})
				return errors.Join(err, expect(got.ID == "r1", "reservation not passed through"))
			}},
		{"Release", &devicetest.Fake{ReleaseFunc: func(_ context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
			return device.ReleaseResult{Released: []string{req.ReservationID}, AlreadyReleased: []string{"r0"}}, nil
		}},
			func(ctx context.Context, m device.Manager) error {
				got, err := m.Release(ctx, device.ReleaseRequest{ReservationID: "r1"})
				return errors.Join(err, expect(len(got.Released) == 1 && got.Released[0] == "r1" &&
					len(got.AlreadyReleased) == 1 && got.AlreadyReleased[0] == "r0", "release not passed through"))
			}},
		{"Reservations", &devicetest.Fake{ReservationsFunc: func(_ context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
			if f.OwnerID != "o1" {
				return nil, nil
			}
			return []device.Reservation{res}, nil
		}},
			func(ctx context.Context, m device.Manager) error {
				got, err := m.Reservations(ctx, device.ReservationFilter{OwnerID: "o1"})
				return errors.Join(err, expect(len(got) == 1, "filter or list not passed through"))
			}},
		{"Ready", &devicetest.Fake{ReadyFunc: func() <-chan struct{} { return ready }},
			func(ctx context.Context, m device.Manager) error {
				select {
				case <-m.Ready():
					return nil
				case <-ctx.Done():
					return errors.New("ready channel not passed through")
				}
			}},
		{"Shutdown", &devicetest.Fake{ShutdownFunc: func(context.Context) error { return errStop }},
			func(ctx context.Context, m device.Manager) error {
				return expect(errors.Is(m.Shutdown(ctx), errStop), "shutdown error not passed through")
			}},
		{"zero Fake", &devicetest.Fake{},
			func(ctx context.Context, m device.Manager) error {
				_, watchOpen := <-m.Watch(ctx)
				_, statsOpen := <-m.WatchStats(ctx, 0)
				_, reserveErr := m.Reserve(ctx, device.ReserveRequest{})
				_, releaseErr := m.Release(ctx, device.ReleaseRequest{})
				_, reownErr := m.Reown(ctx, device.ReownRequest{})
				<-m.Ready()
				return errors.Join(
					expect(len(m.Inventory().Groups) == 0 && m.State().Devices == nil, "zero inventory and state"),
					expect(len(m.Snapshot().Inventory.Groups) == 0 && len(m.LatestStats().Groups) == 0, "zero snapshot and stats"),
					expect(!watchOpen && !statsOpen, "closed watch channels"),
					expect(errors.Is(reserveErr, device.ErrUnknownDevice), "Reserve answers ErrUnknownDevice"),
					expect(errors.Is(releaseErr, device.ErrNotFound), "Release answers ErrNotFound"),
					expect(errors.Is(reownErr, device.ErrNotFound), "Reown answers ErrNotFound"),
					m.Shutdown(ctx))
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
			defer cancel()
			var m device.Manager = tc.fake
			if err := tc.drive(ctx, m); err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
		})
	}
}

func expect(ok bool, what string) error {
	if ok {
		return nil
	}
	return errors.New(what)
}
