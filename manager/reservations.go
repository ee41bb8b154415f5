package manager

import (
	"context"
	"time"

	"github.com/devicehost/devicehost/manager/device"
	"github.com/devicehost/devicehost/manager/ledger"
)

// reservationStore is what the manager asks of its reservation ledger. The ledger
// (manager/ledger) is its one implementation, and the one place the conflict rules live
// (ledger.Check and ledger.Reserve decide alike, atomically with the write for Reserve);
// the interface is only the seam a test wraps to hold a Reserve between its steps
// (gatedStore in manager_test.go).
type reservationStore interface {
	Check(ownerID string, deviceIDs, takeOver []string, consumes []device.Consumption, caps device.Capacity) (*device.Reservation, error)
	Reserve(ctx context.Context, r device.Reservation, takeOver []string, caps device.Capacity) (res device.Reservation, existing bool, err error)
	Release(ctx context.Context, req device.ReleaseRequest, now time.Time) (released, already []device.Reservation, err error)
	Reown(ctx context.Context, req device.ReownRequest) (device.Reservation, error)
	List(ctx context.Context, f device.ReservationFilter) ([]device.Reservation, error)
	Holders() map[string]device.Holder
}

var _ reservationStore = (*ledger.Ledger)(nil)
