package shim

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/device"
	"go.uber.org/goleak"

	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/integrations/nomad/nomadconfig"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/server/servertest"

	dev "github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/tools/testwait"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

var h100 = dev.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3"}

// socketPath returns a socket path in a fresh directory short enough for socket names.
func socketPath(t *testing.T) string { return servertest.SocketPath(t) }

// startAgent serves mgr at path until its Stop (called at cleanup at the latest).
func startAgent(t *testing.T, mgr dev.Manager, path string) *servertest.Agent {
	return servertest.Serve(t, path, server.Config{Manager: mgr})
}

// newShim returns a Plugin configured, through its schema as a Nomad client would, with
// config (a JSON object), and closed at cleanup. It follows no Nomad agent unless
// config says follow_allocations.
func newShim(t *testing.T, config map[string]any) *Plugin {
	t.Helper()
	p := New(nil)
	t.Cleanup(p.Close)
	if _, ok := config["follow_allocations"]; !ok {
		config["follow_allocations"] = false
	}
	if err := setConfig(p, config); err != nil {
		t.Fatal(err)
	}
	return p
}

// setConfig hands config to p the way a Nomad client does: decoded with the plugin's
// schema (defaults filled in), MessagePack-encoded.
func setConfig(p *Plugin, config map[string]any) error {
	raw, err := json.Marshal(config)
	if err != nil {
		return err
	}
	schema, err := p.ConfigSchema()
	if err != nil {
		return err
	}
	packed, err := nomadconfig.Encode(schema, raw)
	if err != nil {
		return err
	}
	return p.SetConfig(&base.Config{ApiVersion: device.ApiVersion010, PluginConfig: packed})
}

// snapshot is an inventory of the H100 group with the given healthy devices.
func snapshot(ids ...string) dev.Snapshot {
	g := dev.Group{GroupKey: h100, Plugin: "nvidia-example"}
	st := dev.State{Devices: map[string]dev.DeviceState{}}
	for i, id := range ids {
		g.Devices = append(g.Devices, dev.DeviceInfo{ID: id, Locality: dev.Locality{PCIBusID: fmt.Sprintf("00000000:%02x:00.0", i+1), NUMANode: -1}})
		st.Devices[id] = dev.DeviceState{Health: dev.HealthHealthy}
	}
	return dev.Snapshot{Time: time.Now(), Inventory: dev.Inventory{Groups: []dev.Group{g}}, State: st}
}

// snapshots is a Manager.Watch that delivers one snapshot to each watcher and holds
// the stream open, as the real manager does while nothing changes.
type snapshots struct{ snap dev.Snapshot }

func newSnapshots(snap dev.Snapshot) *snapshots { return &snapshots{snap: snap} }

func (s *snapshots) watch(context.Context) <-chan dev.Snapshot {
	ch := make(chan dev.Snapshot, 1)
	ch <- s.snap
	return ch
}

// fakeLedger is a Manager's Reserve and Release over an in-memory ledger with the
// agent's conflict rules: a device held by a live reservation of another owner is a
// *HeldError naming the holder, unless the Reserve takes that owner's devices over
// (then the holder is released with the new reservation, in one step).
type fakeLedger struct {
	mu       sync.Mutex
	seq      int
	active   map[string]dev.Reservation // by ID
	released []string                   // reservation IDs, in release order
	reserves []dev.ReserveRequest
	releases int               // Release calls
	reowns   int               // Reown calls
	inFlight map[string]string // device → owner of a Reserve "in flight"
	// overruns, when set, refuses every Reserve that no device refuses with a
	// *CapacityError naming them.
	overruns []dev.Overrun
}

func newFakeLedger() *fakeLedger {
	return &fakeLedger{active: map[string]dev.Reservation{}, inFlight: map[string]string{}}
}

// hold makes a live reservation of owner for ids and returns its ID.
func (l *fakeLedger) hold(owner string, ids ...string) string {
	r, err := l.reserve(context.Background(), dev.ReserveRequest{OwnerID: owner, Group: h100, DeviceIDs: ids})
	if err != nil {
		panic(err)
	}
	return r.ID
}

func (l *fakeLedger) reserve(_ context.Context, req dev.ReserveRequest) (dev.Reservation, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.reserves = append(l.reserves, req)
	takeOver := req.TakeOverOwnerPrefixes
	held := &dev.HeldError{OwnerID: req.OwnerID}
	var victims []string
	for _, r := range l.sortedActive() {
		var overlap []string
		for _, id := range req.DeviceIDs {
			if slices.Contains(r.DeviceIDs, id) {
				overlap = append(overlap, id)
			}
		}
		switch {
		case len(overlap) == 0:
		case dev.TakesOver(takeOver, r.OwnerID):
			victims = append(victims, r.ID)
		default:
			held.Conflicts = append(held.Conflicts, dev.Conflict{
				Holder: dev.Holder{ReservationID: r.ID, OwnerID: r.OwnerID}, Overlap: overlap, Held: r.DeviceIDs,
			})
		}
	}
	for _, id := range req.DeviceIDs {
		if owner, ok := l.inFlight[id]; ok {
			held.Conflicts = append(held.Conflicts, dev.Conflict{Holder: dev.Holder{OwnerID: owner}, Overlap: []string{id}, Held: []string{id}})
		}
	}
	if len(held.Conflicts) > 0 {
		return dev.Reservation{}, held
	}
	if len(l.overruns) > 0 {
		return dev.Reservation{}, &dev.CapacityError{OwnerID: req.OwnerID, Overruns: l.overruns}
	}
	l.seq++
	r := dev.Reservation{
		ID: fmt.Sprintf("res-%04d", l.seq), OwnerID: req.OwnerID, Group: req.Group, Plugin: "nvidia-example",
		DeviceIDs: slices.Clone(req.DeviceIDs), State: dev.ReservationActive, CreatedAt: time.Now(),
		Container: dev.ContainerReservation{
			Envs:       map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(req.DeviceIDs, ",")},
			Mounts:     []dev.Mount{{HostPath: "/usr/lib/libnvidia-ml.so.1", ContainerPath: "/usr/lib/libnvidia-ml.so.1", ReadOnly: true}},
			Devices:    []dev.DeviceSpec{{HostPath: "/dev/nvidia0", ContainerPath: "/dev/nvidia0", Permissions: "rw"}},
			CDIDevices: []string{"nvidia.com/gpu=" + req.DeviceIDs[0]},
		},
	}
	for _, id := range victims {
		delete(l.active, id)
		l.released = append(l.released, id)
	}
	l.active[r.ID] = r
	r.TakenOver = victims
	return r, nil
}

func (l *fakeLedger) sortedActive() []dev.Reservation {
	out := make([]dev.Reservation, 0, len(l.active))
	for _, r := range l.active {
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

func (l *fakeLedger) release(_ context.Context, req dev.ReleaseRequest) (dev.ReleaseResult, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.releases++
	if _, ok := l.active[req.ReservationID]; !ok {
		return dev.ReleaseResult{}, dev.ErrNotFound
	}
	delete(l.active, req.ReservationID)
	l.released = append(l.released, req.ReservationID)
	return dev.ReleaseResult{Released: []string{req.ReservationID}}, nil
}

func (l *fakeLedger) reservations(_ context.Context, f dev.ReservationFilter) ([]dev.Reservation, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []dev.Reservation
	for _, r := range l.sortedActive() {
		if (f.OwnerID == "" || r.OwnerID == f.OwnerID) && (f.DeviceID == "" || slices.Contains(r.DeviceIDs, f.DeviceID)) &&
			f.State != dev.ReservationReleased {
			out = append(out, r)
		}
	}
	return out, nil
}

// reown hands a live reservation to a new owner, if it has the owner the caller says.
func (l *fakeLedger) reown(_ context.Context, req dev.ReownRequest) (dev.Reservation, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.reowns++
	r, ok := l.active[req.ReservationID]
	switch {
	case !ok && slices.Contains(l.released, req.ReservationID):
		return dev.Reservation{}, fmt.Errorf("%w: reservation %s is released", dev.ErrInvalidRequest, req.ReservationID)
	case !ok:
		return dev.Reservation{}, dev.ErrNotFound
	case r.OwnerID == req.NewOwnerID:
		return r, nil
	case r.OwnerID != req.OwnerID:
		return dev.Reservation{}, fmt.Errorf("%w: owner_id: reservation %s is of owner %q", dev.ErrInvalidRequest, r.ID, r.OwnerID)
	}
	r.OwnerID = req.NewOwnerID
	l.active[r.ID] = r
	return r, nil
}

// state returns the active reservations and the released IDs.
func (l *fakeLedger) state() ([]dev.Reservation, []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sortedActive(), slices.Clone(l.released)
}

// fake is a Manager with snaps as its inventory and l as its ledger.
func fake(snaps *snapshots, l *fakeLedger) *devicetest.Fake {
	return &devicetest.Fake{WatchFunc: snaps.watch, ReserveFunc: l.reserve, ReleaseFunc: l.release,
		ReservationsFunc: l.reservations, ReownFunc: l.reown}
}

// nextFingerprint returns the next message of ch, failing the test if none comes.
func nextFingerprint(t *testing.T, ch <-chan *device.FingerprintResponse) *device.FingerprintResponse {
	t.Helper()
	select {
	case m, ok := <-ch:
		if !ok {
			t.Fatal("fingerprint channel closed")
		}
		return m
	case <-time.After(testwait.Timeout):
		t.Fatal("no fingerprint message")
	}
	panic("unreachable")
}

// waitFingerprint reads ch until a message satisfies ok.
func waitFingerprint(t *testing.T, what string, ch <-chan *device.FingerprintResponse, ok func(*device.FingerprintResponse) bool) *device.FingerprintResponse {
	t.Helper()
	deadline := time.After(testwait.Timeout)
	for {
		select {
		case m, open := <-ch:
			if !open {
				t.Fatalf("fingerprint channel closed waiting for %s", what)
			}
			if ok(m) {
				return m
			}
		case <-deadline:
			t.Fatalf("no fingerprint with %s", what)
		}
	}
}
