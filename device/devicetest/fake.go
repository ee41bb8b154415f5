// Package devicetest provides Fake, a function-field device.Manager: the least an
// alternative manager (a simulator, a test double) has to implement.
package devicetest

import (
	"context"
	"time"

	"github.com/devicehost/devicehost/device"
)

// Fake implements device.Manager by calling its function fields. A nil field answers
// with a zero value (a closed channel for the Watch methods and for Ready; for
// Snapshot, the answers of Inventory and State), so a test sets just the fields it
// exercises.
type Fake struct {
	InventoryFunc    func() device.Inventory
	StateFunc        func() device.State
	SnapshotFunc     func() device.Snapshot
	LatestStatsFunc  func() device.StatsSnapshot
	WatchFunc        func(ctx context.Context) <-chan device.Snapshot
	WatchStatsFunc   func(ctx context.Context, interval time.Duration) <-chan device.StatsSnapshot
	ReserveFunc      func(ctx context.Context, req device.ReserveRequest) (device.Reservation, error)
	ReleaseFunc      func(ctx context.Context, req device.ReleaseRequest) (device.ReleaseResult, error)
	ReservationsFunc func(ctx context.Context, f device.ReservationFilter) ([]device.Reservation, error)
	ReownFunc        func(ctx context.Context, req device.ReownRequest) (device.Reservation, error)
	CordonFunc       func(ctx context.Context, req device.CordonRequest) (device.Cordon, error)
	UncordonFunc     func(ctx context.Context, deviceID string) (*device.Cordon, error)
	EventsFunc       func(ctx context.Context, f device.EventFilter) (device.EventsResult, error)
	EventsAfterFunc  func(seq uint64) <-chan struct{}
	ReadyFunc        func() <-chan struct{}
	ShutdownFunc     func(ctx context.Context) error
}

var _ device.Manager = (*Fake)(nil)

// Inventory calls InventoryFunc.
func (f *Fake) Inventory() device.Inventory {
	if f.InventoryFunc == nil {
		return device.Inventory{}
	}
	return f.InventoryFunc()
}

// State calls StateFunc.
func (f *Fake) State() device.State {
	if f.StateFunc == nil {
		return device.State{}
	}
	return f.StateFunc()
}

// Snapshot calls SnapshotFunc; without one it returns Inventory and State together.
func (f *Fake) Snapshot() device.Snapshot {
	if f.SnapshotFunc == nil {
		return device.Snapshot{Inventory: f.Inventory(), State: f.State()}
	}
	return f.SnapshotFunc()
}

// LatestStats calls LatestStatsFunc; without one it returns no stats.
func (f *Fake) LatestStats() device.StatsSnapshot {
	if f.LatestStatsFunc == nil {
		return device.StatsSnapshot{}
	}
	return f.LatestStatsFunc()
}

// Watch calls WatchFunc; without one it returns a closed channel.
func (f *Fake) Watch(ctx context.Context) <-chan device.Snapshot {
	if f.WatchFunc == nil {
		ch := make(chan device.Snapshot)
		close(ch)
		return ch
	}
	return f.WatchFunc(ctx)
}

// WatchStats calls WatchStatsFunc; without one it returns a closed channel.
func (f *Fake) WatchStats(ctx context.Context, interval time.Duration) <-chan device.StatsSnapshot {
	if f.WatchStatsFunc == nil {
		ch := make(chan device.StatsSnapshot)
		close(ch)
		return ch
	}
	return f.WatchStatsFunc(ctx, interval)
}

// Reserve calls ReserveFunc.
func (f *Fake) Reserve(ctx context.Context, req device.ReserveRequest) (device.Reservation, error) {
	if f.ReserveFunc == nil {
		return device.Reservation{}, device.ErrUnknownDevice
	}
	return f.ReserveFunc(ctx, req)
}

// Release calls ReleaseFunc.
func (f *Fake) Release(ctx context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
	if f.ReleaseFunc == nil {
		return device.ReleaseResult{}, device.ErrNotFound
	}
	return f.ReleaseFunc(ctx, req)
}

// Reservations calls ReservationsFunc.
func (f *Fake) Reservations(ctx context.Context, filter device.ReservationFilter) ([]device.Reservation, error) {
	if f.ReservationsFunc == nil {
		return nil, nil
	}
	return f.ReservationsFunc(ctx, filter)
}

// Reown calls ReownFunc; without one it answers device.ErrNotFound.
func (f *Fake) Reown(ctx context.Context, req device.ReownRequest) (device.Reservation, error) {
	if f.ReownFunc == nil {
		return device.Reservation{}, device.ErrNotFound
	}
	return f.ReownFunc(ctx, req)
}

// Ready calls ReadyFunc; without one it returns a closed channel (ready at once).
func (f *Fake) Ready() <-chan struct{} {
	if f.ReadyFunc == nil {
		ch := make(chan struct{})
		close(ch)
		return ch
	}
	return f.ReadyFunc()
}

// Shutdown calls ShutdownFunc.
func (f *Fake) Shutdown(ctx context.Context) error {
	if f.ShutdownFunc == nil {
		return nil
	}
	return f.ShutdownFunc(ctx)
}

// Cordon calls CordonFunc; without one it answers device.ErrUnknownDevice.
func (f *Fake) Cordon(ctx context.Context, req device.CordonRequest) (device.Cordon, error) {
	if f.CordonFunc == nil {
		return device.Cordon{}, device.ErrUnknownDevice
	}
	return f.CordonFunc(ctx, req)
}

// Uncordon calls UncordonFunc; without one it answers nil, nil (not cordoned).
func (f *Fake) Uncordon(ctx context.Context, deviceID string) (*device.Cordon, error) {
	if f.UncordonFunc == nil {
		return nil, nil
	}
	return f.UncordonFunc(ctx, deviceID)
}

// Events calls EventsFunc; without one the trail is empty.
func (f *Fake) Events(ctx context.Context, filter device.EventFilter) (device.EventsResult, error) {
	if f.EventsFunc == nil {
		return device.EventsResult{Through: filter.After}, nil
	}
	return f.EventsFunc(ctx, filter)
}

// EventsAfter calls EventsAfterFunc; without one no event ever comes (a channel never
// closed).
func (f *Fake) EventsAfter(seq uint64) <-chan struct{} {
	if f.EventsAfterFunc == nil {
		return make(chan struct{})
	}
	return f.EventsAfterFunc(seq)
}
