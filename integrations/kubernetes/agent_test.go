package kubernetes_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/server/servertest"
)

// fakeAgent is the agent the bridge's tests talk to: the real host API server
// (server.Server, so errors carry the real codes and details) on a device manager
// that keeps its inventory, health and reservations in memory, with the ledger's
// rules: a device held by another owner is a HeldError naming the holder, the same
// owner asking again for the same devices gets its reservation back.
type fakeAgent struct {
	addr endpoint.Address

	mu        sync.Mutex
	groups    []device.Group
	health    map[string]device.DeviceState
	res       []*device.Reservation // oldest first
	nextID    int
	reserves  int        // Reserve calls that made a reservation
	releases  int        // Release calls
	takeOvers [][]string // TakeOverOwnerPrefixes of each Reserve that had some
	watchers  map[chan device.Snapshot]bool
	seq       uint64

	srv *servertest.Agent
}

// h100 is the group of the fake agent's GPUs.
var h100 = device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3"}

// gpuID is the ID of the fake agent's GPU i.
func gpuID(i int) string { return fmt.Sprintf("GPU-%02d", i) }

// eightGPUs is a DGX-like group: GPUs 0-3 on NUMA node 0, 4-7 on node 1, bus IDs
// 0000:1X:00.0.
func eightGPUs() device.Group {
	g := device.Group{GroupKey: h100, Plugin: "nvidia-example"}
	for i := range 8 {
		g.Devices = append(g.Devices, device.DeviceInfo{ID: gpuID(i), Locality: device.Locality{
			PCIBusID: fmt.Sprintf("0000:%02x:00.0", 0x10+i), NUMANode: i / 4,
		}})
	}
	return g
}

// startAgent serves groups, every device healthy, on a socket in a fresh directory.
// Cleanup stops it.
func startAgent(t testing.TB, groups ...device.Group) *fakeAgent {
	t.Helper()
	a := &fakeAgent{
		addr:     endpoint.Address{Network: "unix", Path: filepath.Join(shortTempDir(t, "dhk"), "agent.sock")},
		groups:   groups,
		health:   map[string]device.DeviceState{},
		watchers: map[chan device.Snapshot]bool{},
	}
	for _, g := range groups {
		for _, d := range g.Devices {
			a.health[d.ID] = device.DeviceState{Health: device.HealthHealthy}
		}
	}
	a.start(t)
	t.Cleanup(a.stop)
	return a
}

// start serves the host API on a.addr.
func (a *fakeAgent) start(t testing.TB) {
	t.Helper()
	srv := servertest.Serve(t, a.addr.Path, server.Config{Manager: a.manager()})
	a.mu.Lock()
	a.srv = srv
	a.mu.Unlock()
}

// stop shuts the server down (its streams end: the bridge sees the agent gone). The
// state stays, as a restarted agent's ledger would.
func (a *fakeAgent) stop() {
	a.mu.Lock()
	srv := a.srv
	a.srv = nil
	a.mu.Unlock()
	if srv != nil {
		srv.Stop()
	}
}

func (a *fakeAgent) manager() *devicetest.Fake {
	return &devicetest.Fake{
		WatchFunc: a.watch,
		ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
			return a.reserve(req)
		},
		ReleaseFunc: func(_ context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
			return a.release(req)
		},
		ReservationsFunc: func(_ context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
			return a.reservations(f), nil
		},
		ReownFunc: func(_ context.Context, req device.ReownRequest) (device.Reservation, error) {
			return a.reown(req)
		},
	}
}

// watch hands out latest-value snapshots until ctx ends.
func (a *fakeAgent) watch(ctx context.Context) <-chan device.Snapshot {
	ch := make(chan device.Snapshot, 1)
	a.mu.Lock()
	defer a.mu.Unlock()
	a.watchers[ch] = true
	ch <- a.snapshotLocked()
	context.AfterFunc(ctx, func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		delete(a.watchers, ch)
		close(ch)
	})
	return ch
}

func (a *fakeAgent) snapshotLocked() device.Snapshot {
	a.seq++
	st := device.State{Devices: map[string]device.DeviceState{}}
	for id, s := range a.health {
		st.Devices[id] = s
	}
	for _, r := range a.res {
		if r.State != device.ReservationActive {
			continue
		}
		for _, id := range r.DeviceIDs {
			s := st.Devices[id]
			s.Holder = &device.Holder{ReservationID: r.ID, OwnerID: r.OwnerID}
			st.Devices[id] = s
		}
	}
	return device.Snapshot{Seq: a.seq, Time: time.Now(), Inventory: device.Inventory{Groups: slices.Clone(a.groups)}, State: st}
}

// publishLocked offers the current snapshot to every watcher, replacing one not yet
// taken.
func (a *fakeAgent) publishLocked() {
	snap := a.snapshotLocked()
	for ch := range a.watchers {
		select {
		case <-ch:
		default:
		}
		ch <- snap
	}
}

// setHealth changes a device's health and publishes it.
func (a *fakeAgent) setHealth(id string, h device.Health, reason string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.health[id] = device.DeviceState{Health: h, Reason: reason, Since: time.Now()}
	a.publishLocked()
}

// block makes device id blocked by the holders (shared capacity others use), keeping
// its health, and publishes it.
func (a *fakeAgent) block(id string, by ...device.Holder) {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.health[id]
	s.BlockedBy = by
	a.health[id] = s
	a.publishLocked()
}

// cordon sets device id's cordon (nil: none), keeping its health, and publishes it.
func (a *fakeAgent) cordon(id string, c *device.Cordon) {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.health[id]
	s.Cordon = c
	a.health[id] = s
	a.publishLocked()
}

func (a *fakeAgent) reserve(req device.ReserveRequest) (device.Reservation, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	inGroup := map[string]bool{}
	for _, g := range a.groups {
		if g.GroupKey == req.Group {
			for _, d := range g.Devices {
				inGroup[d.ID] = true
			}
		}
	}
	for _, id := range req.DeviceIDs {
		if !inGroup[id] {
			return device.Reservation{}, fmt.Errorf("devices %s are not in group %s: %w", id, req.Group, device.ErrUnknownDevice)
		}
		if st := a.health[id]; st.Health != device.HealthHealthy {
			return device.Reservation{}, fmt.Errorf("devices not healthy: %s (%s: %s): %w", id, st.Health, st.Reason, device.ErrUnhealthyDevice)
		}
	}
	takeOver := req.TakeOverOwnerPrefixes
	if len(takeOver) > 0 {
		a.takeOvers = append(a.takeOvers, slices.Clone(takeOver))
	}
	want := slices.Sorted(slices.Values(req.DeviceIDs))
	held := &device.HeldError{OwnerID: req.OwnerID}
	var victims []*device.Reservation
	for _, r := range a.res {
		if r.State != device.ReservationActive {
			continue
		}
		have := slices.Sorted(slices.Values(r.DeviceIDs))
		if r.OwnerID == req.OwnerID && slices.Equal(have, want) {
			return *r, nil
		}
		var overlap []string
		for _, id := range want {
			if slices.Contains(have, id) {
				overlap = append(overlap, id)
			}
		}
		switch {
		case len(overlap) == 0:
		case device.TakesOver(takeOver, r.OwnerID):
			victims = append(victims, r)
		default:
			held.Conflicts = append(held.Conflicts, device.Conflict{
				Holder: device.Holder{ReservationID: r.ID, OwnerID: r.OwnerID}, Overlap: overlap, Held: have,
			})
		}
	}
	if len(held.Conflicts) > 0 {
		return device.Reservation{}, held
	}
	var taken []string
	for _, v := range victims { // with the new reservation, under a.mu: one step
		v.State, v.ReleasedAt = device.ReservationReleased, time.Now()
		taken = append(taken, v.ID)
	}
	a.nextID++
	a.reserves++
	cdi := make([]string, len(req.DeviceIDs))
	for i, id := range req.DeviceIDs {
		cdi[i] = "nvidia.com/gpu=" + id
	}
	r := &device.Reservation{
		ID: fmt.Sprintf("res-%04d", a.nextID), OwnerID: req.OwnerID, Group: req.Group, Plugin: "nvidia-example",
		DeviceIDs: slices.Clone(req.DeviceIDs), State: device.ReservationActive, CreatedAt: time.Now(),
		Container: device.ContainerReservation{
			Envs:       map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(req.DeviceIDs, ",")},
			Mounts:     []device.Mount{{HostPath: "/usr/lib/nvidia", ContainerPath: "/usr/local/nvidia", ReadOnly: true}},
			Devices:    []device.DeviceSpec{{HostPath: "/dev/nvidiactl", ContainerPath: "/dev/nvidiactl", Permissions: "rw"}},
			CDIDevices: cdi,
		},
	}
	a.res = append(a.res, r)
	a.publishLocked()
	out := *r
	out.TakenOver = taken
	return out, nil
}

func (a *fakeAgent) release(req device.ReleaseRequest) (device.ReleaseResult, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.releases++
	var out device.ReleaseResult
	found := false
	for _, r := range a.res {
		if r.ID != req.ReservationID && (req.OwnerID == "" || r.OwnerID != req.OwnerID) {
			continue
		}
		found = true
		if r.State == device.ReservationReleased {
			out.AlreadyReleased = append(out.AlreadyReleased, r.ID)
			continue
		}
		r.State, r.ReleasedAt = device.ReservationReleased, time.Now()
		out.Released = append(out.Released, r.ID)
	}
	if !found && req.ReservationID != "" {
		return out, fmt.Errorf("reservation %q: %w", req.ReservationID, device.ErrNotFound)
	}
	a.publishLocked()
	return out, nil
}

func (a *fakeAgent) reown(req device.ReownRequest) (device.Reservation, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, r := range a.res {
		if r.ID != req.ReservationID {
			continue
		}
		switch {
		case r.OwnerID == req.NewOwnerID:
		case r.State != device.ReservationActive:
			return device.Reservation{}, &device.FieldError{Field: "reservation_id", Rule: "released"}
		case r.OwnerID != req.OwnerID:
			return device.Reservation{}, &device.FieldError{Field: "owner_id", Rule: "owned by " + r.OwnerID}
		default:
			r.OwnerID = req.NewOwnerID
			a.publishLocked()
		}
		return *r, nil
	}
	return device.Reservation{}, fmt.Errorf("reservation %q: %w", req.ReservationID, device.ErrNotFound)
}

func (a *fakeAgent) reservations(f device.ReservationFilter) []device.Reservation {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []device.Reservation
	for _, r := range a.res {
		if (f.OwnerID == "" || r.OwnerID == f.OwnerID) && (f.State == device.ReservationAny || r.State == f.State) &&
			(f.DeviceID == "" || slices.Contains(r.DeviceIDs, f.DeviceID)) {
			out = append(out, *r)
		}
	}
	return out
}

// active returns the active reservations.
func (a *fakeAgent) active() []device.Reservation {
	return a.reservations(device.ReservationFilter{State: device.ReservationActive})
}

// releaseCount returns how many Release calls the agent got.
func (a *fakeAgent) releaseCount() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.releases
}

// takeOverRequests returns the TakeOverOwnerPrefixes of each Reserve that had some.
func (a *fakeAgent) takeOverRequests() [][]string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.takeOvers)
}

// reserveCount returns how many reservations Reserve made.
func (a *fakeAgent) reserveCount() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.reserves
}

// shortTempDir makes a directory under the system's temp dir with a name short enough
// for socket paths, removed at cleanup.
func shortTempDir(t testing.TB, prefix string) string { return servertest.ShortTempDir(t, prefix) }
