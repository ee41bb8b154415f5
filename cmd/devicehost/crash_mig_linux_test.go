package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// simInstance is one MIG instance of the simulated machine, as the nvidia-example
// plugin keeps them in its sim_state_file (the machine's state outlives the plugin, as
// hardware's does).
type simInstance struct {
	device string // the on-demand device ID of its placement (1g.10gb only here)
	uuid   string // its MIG UUID; "" while it has no compute instance
}

// simInstances reads the simulated machine's MIG instances from path.
func simInstances(t *testing.T, path string) map[string]simInstance {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("simulated machine state: %v", err)
	}
	var st struct {
		GPUs []struct {
			UUID string `json:"uuid"`
			GIs  []struct {
				Start uint32 `json:"start"`
				CIs   []struct {
					UUID string `json:"uuid"`
				} `json:"compute_instances"`
			} `json:"gpu_instances"`
		} `json:"gpus"`
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatalf("simulated machine state %s: %v", path, err)
	}
	out := map[string]simInstance{}
	for _, g := range st.GPUs {
		for _, gi := range g.GIs {
			inst := simInstance{device: fmt.Sprintf("%s-mig-1g.10gb-%d", g.UUID, gi.Start)}
			if len(gi.CIs) > 0 {
				inst.uuid = gi.CIs[0].UUID
			}
			out[inst.device] = inst
		}
	}
	return out
}

// migGroups waits for the on-demand MIG inventory and returns the 1g.10gb group with
// its devices by GPU (placement order).
func migGroups(t *testing.T, ctx context.Context, c pb.DeviceHostClient) (*pb.DeviceGroup, map[string][]string) {
	t.Helper()
	fp := currentFingerprint(t, ctx, c, "56 healthy 1g.10gb partitions", func(fp *pb.FingerprintResponse) bool {
		for _, g := range fp.GetGroups() {
			if g.GetType() == "mig" && g.GetName() == "1g.10gb" {
				return len(devicesWithHealth(&pb.FingerprintResponse{Groups: []*pb.DeviceGroup{g}}, pb.Health_HEALTH_HEALTHY)) == 56
			}
		}
		return false
	})
	for _, g := range fp.GetGroups() {
		if g.GetType() == "mig" && g.GetName() == "1g.10gb" {
			byGPU := map[string][]string{}
			for _, d := range g.GetDevices() {
				gpu := d.GetId()[:strings.Index(d.GetId(), "-mig-")]
				byGPU[gpu] = append(byGPU[gpu], d.GetId())
			}
			for _, ids := range byGPU {
				slices.Sort(ids)
			}
			return g, byGPU
		}
	}
	panic("unreachable")
}

// liveAfterCleanups waits until the agent owes no plugin cleanup (the GC has destroyed
// what released reservations held) and returns its live reservations by device.
func liveAfterCleanups(t *testing.T, ctx context.Context, c pb.DeviceHostClient) map[string]*pb.Reservation {
	t.Helper()
	for {
		list, err := c.ListReservations(ctx, &pb.ListReservationsRequest{})
		if err != nil {
			t.Fatalf("ListReservations: %v", err)
		}
		live := map[string]*pb.Reservation{}
		pending := 0
		for _, r := range list.GetReservations() {
			if r.GetCleanupPending() {
				pending++
			}
			if r.GetState() == pb.ReservationState_RESERVATION_STATE_ACTIVE {
				for _, d := range r.GetDeviceIds() {
					live[d] = r
				}
			}
		}
		if pending == 0 {
			return live
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d plugin cleanups still owed: %v", pending, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// An agent SIGKILLed 20 times under a load of partition Reserves and Releases never
// loses an acknowledged partition's instance and never leaves an instance behind: after
// each restart (the plugin reconciled with the ledger, the GC done), the simulated
// machine's instances are exactly the live reservations' partitions, and each
// acknowledged live one keeps the MIG UUID its Reserve answered.
func TestAgentSIGKILLUnderPartitionLoadLeavesNoInstanceBehind(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	simPath := filepath.Join(tempDir(t, "dhsim"), "sim.json")
	setup := newAgentSetup(t, fmt.Sprintf(`
plugin "nvidia-example" {
  config {
    simulate       = "dgxh100"
    mig            = "on-demand"
    sim_state_file = %q
  }
}
`, simPath))

	type acked struct{ id, uuid string }
	keepers := map[string]acked{} // device -> the live reservation acknowledged for it
	var loadAcked sync.Map        // device -> acked: a load Reserve answered, its Release not
	var unknown sync.Map          // device -> acked: its Release was cut off by the kill
	const kills = 20
	for cycle := 0; cycle <= kills; cycle++ {
		agent := setup.start(t)
		c := agent.client(t, ctx)
		group, byGPU := migGroups(t, ctx, c)
		gpus := slices.Sorted(func(yield func(string) bool) {
			for g := range byGPU {
				if !yield(g) {
					return
				}
			}
		})

		// The check: instances are exactly the live partitions.
		live := liveAfterCleanups(t, ctx, c)
		inst := simInstances(t, simPath)
		for dev, r := range live {
			in, ok := inst[dev]
			if !ok {
				t.Errorf("cycle %d: live reservation %s of %s has no instance", cycle, r.GetReservationId(), dev)
				continue
			}
			if want := "MIG-"; !strings.HasPrefix(in.uuid, want) {
				t.Errorf("cycle %d: instance of %s has no compute instance (uuid %q)", cycle, dev, in.uuid)
			}
		}
		for dev := range inst {
			if live[dev] == nil {
				t.Errorf("cycle %d: instance at %s held by no live reservation", cycle, dev)
			}
		}
		for dev, k := range keepers {
			r := live[dev]
			switch {
			case r == nil || r.GetReservationId() != k.id:
				t.Errorf("cycle %d: acknowledged reservation %s of %s not live", cycle, k.id, dev)
			case inst[dev].uuid != k.uuid:
				t.Errorf("cycle %d: %s's instance is %s, its Reserve answered %s", cycle, dev, inst[dev].uuid, k.uuid)
			}
		}
		unknown.Range(func(k, v any) bool { // the cut-off Release either committed or not
			if r := live[k.(string)]; r != nil && r.GetReservationId() == v.(acked).id {
				loadAcked.Store(k, v)
			}
			unknown.Delete(k)
			return true
		})
		loadAcked.Range(func(k, v any) bool {
			if r := live[k.(string)]; r == nil || r.GetReservationId() != v.(acked).id {
				t.Errorf("cycle %d: acknowledged load reservation %s of %s not live", cycle, v.(acked).id, k)
			}
			return true
		})
		if t.Failed() || cycle == kills {
			if err := agent.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			if err := agent.Wait(ctx); err != nil {
				t.Errorf("agent exit after SIGTERM: %v", err)
			}
			break
		}

		// A keeper per cycle on GPUs 0-2 (placement cycle%7 of GPU cycle%3, while free).
		dev := byGPU[gpus[cycle%3]][cycle%7]
		if live[dev] == nil {
			resp, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: fmt.Sprintf("keep-%d", cycle), Vendor: group.GetVendor(), Type: group.GetType(), Name: group.GetName(), DeviceIds: []string{dev}})
			if err != nil {
				t.Fatalf("cycle %d: keeper Reserve of %s: %v", cycle, dev, err)
			}
			keepers[dev] = acked{resp.GetReservationId(), resp.GetReservation().GetEnvs()["NVIDIA_VISIBLE_DEVICES"]}
		}

		// The load: one worker per GPU 3-7, reserving and releasing its placements in turn,
		// until the kill cuts it off.
		var acks atomic.Int64
		progress := make(chan struct{}, 1)
		var wg sync.WaitGroup
		lctx, stop := context.WithCancel(ctx)
		for w, gpu := range gpus[3:] {
			wg.Go(func() {
				for i := 0; lctx.Err() == nil; i++ {
					dev := byGPU[gpu][i%7]
					if _, held := loadAcked.Load(dev); !held {
						resp, err := c.Reserve(lctx, &pb.ReserveRequest{OwnerId: fmt.Sprintf("load-%d-%d-%d", cycle, w, i), Vendor: group.GetVendor(), Type: group.GetType(), Name: group.GetName(), DeviceIds: []string{dev}})
						if status.Code(err) == codes.FailedPrecondition {
							// Held by an earlier cycle's Reserve that the kill cut off after
							// its commit (the ledger has it, the test does not): the next
							// device. Returning here let those pile up over the cycles until
							// no worker made a Reserve.
							continue
						}
						if err != nil {
							return // the kill
						}
						loadAcked.Store(dev, acked{resp.GetReservationId(), resp.GetReservation().GetEnvs()["NVIDIA_VISIBLE_DEVICES"]})
						acks.Add(1)
						select {
						case progress <- struct{}{}:
						default:
						}
					}
					v, _ := loadAcked.Load(dev)
					if _, err := c.Release(lctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: v.(acked).id}}); err != nil {
						loadAcked.Delete(dev)
						unknown.Store(dev, v)
						return
					}
					loadAcked.Delete(dev)
				}
			})
		}
		for acks.Load() < 10 {
			select {
			case <-progress:
			case <-ctx.Done():
				t.Fatalf("cycle %d: the load made %d Reserves: %v", cycle, acks.Load(), ctx.Err())
			}
		}
		pid := childPID(t, agent.Cmd.Process.Pid, "plugin", devPluginName)
		plugin := watchProcess(t, pid)
		agent.kill(t, ctx)
		stop()
		wg.Wait()
		if !plugin.exited(10 * time.Second) {
			t.Fatalf("cycle %d: plugin %d of the killed agent still running", cycle, pid)
		}
	}
	t.Logf("%d SIGKILLs; %d keepers live with their instances", kills, len(keepers))
}
