package client_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
)

// A runtime reserves a GPU for its job and watches the inventory change; a second job
// asking for the same GPU learns who holds it.
func Example() {
	address, stop := startExampleAgent() // a running agent, e.g. unix:///run/devicehost/devicehost.sock
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	c, err := client.Dial(ctx, address)
	if err != nil {
		log.Fatal(err) // e.g. "cannot reach agent at unix:///...: ... no such file or directory"
	}
	defer c.Close()

	// The first update is the whole inventory, the next ones come on every change. The
	// watch reconnects by itself if the agent restarts (an update with Err set says so).
	updates := c.WatchDevices(ctx)
	printDevices((<-updates).Snapshot)

	gpu := &pb.ReserveRequest{OwnerId: "job-42", Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: []string{"GPU-0"}}
	res, err := c.Reserve(ctx, gpu)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("reserved %s for job-42: NVIDIA_VISIBLE_DEVICES=%s\n",
		res.GetReservationId(), res.GetReservation().GetEnvs()["NVIDIA_VISIBLE_DEVICES"])

	gpu.OwnerId = "job-43"
	_, err = c.Reserve(ctx, gpu)
	if held, ok := client.HeldError(err); ok {
		fmt.Println("job-43 refused:", held.Holders()) // each holder: held.Conflicts
	}

	u := <-updates
	if u.Disconnected() {
		log.Fatal(u.Err)
	}
	printDevices(u.Snapshot)

	rel, err := c.ReleaseOwner(ctx, "job-42")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("released", rel.GetReleasedReservationIds())
	// Output:
	// GPU-0 healthy free
	// GPU-1 healthy free
	// reserved res-1 for job-42: NVIDIA_VISIBLE_DEVICES=GPU-0
	// job-43 refused: GPU-0 held by reservation res-1 of owner "job-42"
	// GPU-0 healthy held by job-42 (res-1)
	// GPU-1 healthy free
	// released [res-1]
}

func printDevices(fp *pb.FingerprintResponse) {
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			holder := "free"
			if h := d.GetHolder(); h != nil {
				holder = fmt.Sprintf("held by %s (%s)", h.GetOwnerId(), h.GetReservationId())
			}
			fmt.Println(d.GetId(), map[pb.Health]string{pb.Health_HEALTH_HEALTHY: "healthy"}[d.GetHealth()], holder)
		}
	}
}

// startExampleAgent serves the host API, as `devicehost agent` does, on a small
// in-memory device manager with two H100s, and returns its address and how to stop it.
func startExampleAgent() (address string, stop func()) {
	dir, err := os.MkdirTemp("", "dhexample")
	if err != nil {
		log.Fatal(err)
	}
	addr := endpoint.Address{Network: "unix", Path: filepath.Join(dir, "devicehost.sock")}
	lis, err := endpoint.Listen(addr, endpoint.TLS{})
	if err != nil {
		log.Fatal(err)
	}
	m := &exampleManager{holders: map[string]device.Holder{}}
	srv, err := server.New(server.Config{Manager: &devicetest.Fake{
		WatchFunc:   m.watch,
		ReserveFunc: m.reserve,
		ReleaseFunc: m.release,
	}, ServerOptions: lis.ServerOptions()})
	if err != nil {
		log.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	return addr.String(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		<-served
		os.RemoveAll(dir)
	}
}

// exampleManager holds GPU-0 and GPU-1 and who holds them; each change reaches every
// watcher as a new snapshot.
type exampleManager struct {
	mu       sync.Mutex
	holders  map[string]device.Holder
	watchers []chan device.Snapshot
}

func (m *exampleManager) snapshotLocked() device.Snapshot {
	st := device.State{Devices: map[string]device.DeviceState{}}
	for _, id := range []string{"GPU-0", "GPU-1"} {
		ds := device.DeviceState{Health: device.HealthHealthy}
		if h, ok := m.holders[id]; ok {
			ds.Holder = &h
		}
		st.Devices[id] = ds
	}
	return device.Snapshot{State: st, Inventory: device.Inventory{Groups: []device.Group{{
		GroupKey: device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "H100"}, Plugin: "nvidia",
		Devices: []device.DeviceInfo{{ID: "GPU-0"}, {ID: "GPU-1"}},
	}}}}
}

func (m *exampleManager) watch(context.Context) <-chan device.Snapshot {
	m.mu.Lock()
	defer m.mu.Unlock()
	ch := make(chan device.Snapshot, 1)
	ch <- m.snapshotLocked()
	m.watchers = append(m.watchers, ch)
	return ch
}

func (m *exampleManager) changedLocked() {
	snap := m.snapshotLocked()
	for _, ch := range m.watchers {
		select {
		case <-ch: // replace what the watcher has not read
		default:
		}
		ch <- snap
	}
}

func (m *exampleManager) reserve(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, id := range req.DeviceIDs {
		if h, ok := m.holders[id]; ok {
			return device.Reservation{}, &device.HeldError{OwnerID: req.OwnerID, Conflicts: []device.Conflict{
				{Holder: h, Overlap: []string{id}, Held: []string{id}},
			}}
		}
	}
	id := fmt.Sprintf("res-%d", len(m.holders)+1)
	for _, d := range req.DeviceIDs {
		m.holders[d] = device.Holder{ReservationID: id, OwnerID: req.OwnerID}
	}
	m.changedLocked()
	return device.Reservation{ID: id, Container: device.ContainerReservation{
		Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": req.DeviceIDs[0]},
	}}, nil
}

func (m *exampleManager) release(_ context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var res device.ReleaseResult
	for d, h := range m.holders {
		if h.OwnerID == req.OwnerID {
			delete(m.holders, d)
			res.Released = append(res.Released, h.ReservationID)
		}
	}
	m.changedLocked()
	return res, nil
}
