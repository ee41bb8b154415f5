package manager

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// withCDI returns g with each device naming its CDI name kind=<ID>, as a plugin that
// keeps a CDI spec reports them.
func withCDI(g *pb.DeviceGroup, kind string) *pb.DeviceGroup {
	for _, d := range g.Devices {
		d.CdiDevices = []string{kind + "=" + d.Id}
	}
	return g
}

// An admin access hands out the devices' CDI names without holding them: the plugin is
// not asked, the device stays free or held as it was, a Reserve of it is not refused,
// a cordon does not refuse the access; the device lists the access apart from its
// holder; it outlives a restart; its owner's Release ends it and nothing else.
func TestAdminAccess(t *testing.T) {
	forEachStateDir(t, func(t *testing.T, cfg Config, _ *logRecorder) {
		ctx := context.Background()
		alpha := newFakeDevices("alpha", withCDI(group("acme", "gpu", "A1", "a0", "a1", "a2"), "acme.com/gpu"))
		m, _ := startInprocManager(t, cfg, alpha)
		waitReady(t, m)
		held := reserve(t, m, "job-1", "a0")
		if _, err := m.Cordon(ctx, device.CordonRequest{DeviceID: "a2", Reason: "test: ECC"}); err != nil {
			t.Fatal(err)
		}
		calls := alpha.reserveCalls()

		acc, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "k8s-claim/mon/dcgm/u1", Group: acmeA1, DeviceIDs: []string{"a0", "a1", "a2"}, AdminAccess: true})
		if err != nil {
			t.Fatalf("admin access to a held, a free and a cordoned device: %v", err)
		}
		if want := []string{"acme.com/gpu=a0", "acme.com/gpu=a1", "acme.com/gpu=a2"}; !slices.Equal(acc.Container.CDIDevices, want) || len(acc.ID) != 20 || acc.ID[:4] != "acc-" {
			t.Errorf("admin access = %s %v, want an acc- ID and %v", acc.ID, acc.Container.CDIDevices, want)
		}
		if got := alpha.reserveCalls(); got != calls {
			t.Errorf("the plugin was asked %d times for an admin access", got-calls)
		}
		again, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "k8s-claim/mon/dcgm/u1", Group: acmeA1, DeviceIDs: []string{"a2", "a1", "a0"}, AdminAccess: true})
		if err != nil || again.ID != acc.ID {
			t.Errorf("the same admin access again = %s, %v; want %s back", again.ID, err, acc.ID)
		}
		other := reserve(t, m, "job-2", "a1")
		snap := m.Snapshot()
		for id, want := range map[string]string{"a0": held.ID, "a1": other.ID, "a2": ""} {
			st := snap.State.Devices[id]
			if got := ""; st.Holder != nil {
				got = st.Holder.ReservationID
				if got != want {
					t.Errorf("%s held by %s, want %q", id, got, want)
				}
			} else if want != "" {
				t.Errorf("%s free, want held by %s", id, want)
			}
			if len(st.AdminAccess) != 1 || st.AdminAccess[0] != (device.Holder{ReservationID: acc.ID, OwnerID: "k8s-claim/mon/dcgm/u1"}) {
				t.Errorf("%s admin access = %v, want %s", id, st.AdminAccess, acc.ID)
			}
		}
		if rs, _ := m.Reservations(ctx, device.ReservationFilter{OwnerID: "k8s-claim/mon/dcgm/u1"}); len(rs) != 0 {
			t.Errorf("the admin access is listed as reservations unasked: %v", rs)
		}
		rs, _ := m.Reservations(ctx, device.ReservationFilter{OwnerID: "k8s-claim/", DeviceID: "a1", IncludeAdminAccess: true})
		if len(rs) != 1 || rs[0].ID != acc.ID || !rs[0].AdminAccess || rs[0].State != device.ReservationActive {
			t.Errorf("reservations of k8s-claim/ on a1 with admin accesses = %+v, want %s marked as one", rs, acc.ID)
		}

		if cfg.StateDir != "" {
			shutdown(t, m)
			m, _ = startInprocManager(t, cfg, newFakeDevices("alpha", withCDI(group("acme", "gpu", "A1", "a0", "a1", "a2"), "acme.com/gpu")))
			waitReady(t, m)
			if st := m.Snapshot().State.Devices["a1"]; len(st.AdminAccess) != 1 || st.AdminAccess[0].ReservationID != acc.ID {
				t.Errorf("a1's admin access after a restart = %v, want %s", st.AdminAccess, acc.ID)
			}
		}

		res := release(t, m, device.ReleaseRequest{OwnerID: "k8s-claim/mon/dcgm/u1"})
		if !slices.Equal(res.Released, []string{acc.ID}) {
			t.Errorf("Release of the owner = %v, want %s", res.Released, acc.ID)
		}
		snap = m.Snapshot()
		for _, id := range []string{"a0", "a1", "a2"} {
			if st := snap.State.Devices[id]; len(st.AdminAccess) != 0 {
				t.Errorf("%s admin access after the release = %v", id, st.AdminAccess)
			}
		}
		if st := snap.State.Devices["a1"]; st.Holder == nil || st.Holder.ReservationID != other.ID {
			t.Errorf("a1 after the admin access ended: holder %v, want %s still", st.Holder, other.ID)
		}
		if _, err := m.Release(ctx, device.ReleaseRequest{ReservationID: acc.ID}); !errors.Is(err, device.ErrNotFound) {
			t.Errorf("Release of the ended access by ID = %v, want not found", err)
		}
	})
}

// A device whose plugin reports no CDI names cannot be given by admin access, and the
// error names it; an unknown device is refused as for a Reserve.
func TestAdminAccessNeedsCDINames(t *testing.T) {
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0")))
	waitReady(t, m)
	_, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "mon", Group: acmeA1, DeviceIDs: []string{"a0"}, AdminAccess: true})
	if !errors.Is(err, device.ErrNoCDIDevices) || !strings.Contains(err.Error(), "a0") || !strings.Contains(err.Error(), `plugin "alpha"`) {
		t.Errorf("admin access without CDI names = %v, want ErrNoCDIDevices naming a0 and its plugin", err)
	}
	_, err = m.Reserve(context.Background(), device.ReserveRequest{OwnerID: "mon", Group: acmeA1, DeviceIDs: []string{"zz"}, AdminAccess: true})
	if !errors.Is(err, device.ErrUnknownDevice) {
		t.Errorf("admin access to an unknown device = %v, want ErrUnknownDevice", err)
	}
	if snap := m.Snapshot(); len(snap.State.Devices["a0"].AdminAccess) != 0 {
		t.Errorf("a refused admin access was recorded: %v", snap.State.Devices["a0"].AdminAccess)
	}
}
