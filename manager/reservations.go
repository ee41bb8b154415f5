package manager

import (
	"context"
	"maps"
	"slices"
	"time"

	"github.com/devicehost/devicehost/manager/device"
	"github.com/devicehost/devicehost/manager/ledger"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// reservationStore is what the manager asks of its reservation ledger. The ledger
// (manager/ledger) is its one implementation, and the one place the conflict rules live
// (ledger.Check and ledger.Reserve decide alike, atomically with the write for Reserve);
// the interface is only the seam a test wraps to hold a Reserve between its steps
// (gatedStore in manager_test.go).
type reservationStore interface {
	Check(ownerID string, deviceIDs, takeOver []string) (*device.Reservation, error)
	Reserve(ctx context.Context, r device.Reservation, takeOver []string) (res device.Reservation, existing bool, err error)
	Release(ctx context.Context, req device.ReleaseRequest, now time.Time) (released, already []device.Reservation, err error)
	Reown(ctx context.Context, req device.ReownRequest) (device.Reservation, error)
	List(ctx context.Context, f device.ReservationFilter) ([]device.Reservation, error)
	Holders() map[string]device.Holder
}

var _ reservationStore = (*ledger.Ledger)(nil)

// fromContainerReservation converts a reservation that validate.Reservation accepted.
func fromContainerReservation(res *pb.ContainerReservation) device.ContainerReservation {
	out := device.ContainerReservation{
		Envs:       maps.Clone(res.GetEnvs()),
		CDIDevices: slices.Clone(res.GetCdiDevices()),
	}
	if out.Envs == nil {
		out.Envs = map[string]string{}
	}
	for _, m := range res.GetMounts() {
		out.Mounts = append(out.Mounts, device.Mount{HostPath: m.GetHostPath(), ContainerPath: m.GetContainerPath(), ReadOnly: m.GetReadOnly()})
	}
	for _, d := range res.GetDevices() {
		out.Devices = append(out.Devices, device.DeviceSpec{HostPath: d.GetHostPath(), ContainerPath: d.GetContainerPath(), Permissions: d.GetPermissions()})
	}
	return out
}
