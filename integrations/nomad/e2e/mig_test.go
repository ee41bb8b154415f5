package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/nomad/structs"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/nomad/nomadapi/nomadtest"
	"github.com/devicehost/devicehost/integrations/nomad/shim"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// migAgentConfig turns on on-demand MIG on `agent -dev`'s simulated DGX H100: every GPU
// whole (nvidia/gpu) and every MIG profile at every placement (nvidia/mig/<profile>).
// placeholderOwner matches the owner the shim asks with before Nomad names the task:
// OwnerPrefix and a random word, one segment (a task's owner has five).
var placeholderOwner = regexp.MustCompile(`owner "nomad/[^/"]*"`)

const migAgentConfig = `plugin "nvidia-example" {
  config {
    simulate = "dgxh100"
    mig      = "on-demand"
  }
}
`

const (
	mig1g10 = "1g.10gb"
	mig1g20 = "1g.20gb"
)

// startMIGAgent starts `devicehost agent -dev` with on-demand MIG and returns its
// address and a client of it.
func startMIGAgent(t *testing.T, bin string) (string, *client.Client) {
	t.Helper()
	tmp := tempDir(t, "dhnmig")
	cfg := filepath.Join(tmp, "agent.hcl")
	writeFile(t, cfg, migAgentConfig)
	address := "unix://" + filepath.Join(tmp, "dh.sock")
	startAgent(t, bin, tmp, "agent", "-dev", "-listen", address, "-config", cfg, "-log-json")
	return address, dial(t, address)
}

// groupIn returns the device group vendor/typ/name of devs, or nil.
func groupIn(devs []*structs.NodeDeviceResource, vendor, typ, name string) *structs.NodeDeviceResource {
	for _, d := range devs {
		if d.Vendor == vendor && d.Type == typ && d.Name == name {
			return d
		}
	}
	return nil
}

// instanceIn returns the device id of g, or nil.
func instanceIn(g *structs.NodeDeviceResource, id string) *structs.NodeDevice {
	if g == nil {
		return nil
	}
	for _, d := range g.Instances {
		if d.ID == id {
			return d
		}
	}
	return nil
}

// partitionsOf returns the IDs of g's devices that are placements of gpu, sorted.
func partitionsOf(g *structs.NodeDeviceResource, gpu string) []string {
	var out []string
	for _, d := range g.Instances {
		if strings.HasPrefix(d.ID, gpu+"-mig-") {
			out = append(out, d.ID)
		}
	}
	slices.Sort(out)
	return out
}

// allHealthy accepts an update whose group vendor/typ/name has count devices, all
// healthy.
func allHealthy(vendor, typ, name string, count int) func([]*structs.NodeDeviceResource) bool {
	return func(devs []*structs.NodeDeviceResource) bool {
		g := groupIn(devs, vendor, typ, name)
		if g == nil || len(g.Instances) != count {
			return false
		}
		for _, d := range g.Instances {
			if !d.Healthy {
				return false
			}
		}
		return true
	}
}

// migAlloc is an allocation of job whose task "main" holds devices of the MIG profile
// group nvidia/mig/<profile>, as Nomad's scheduler places it.
func migAlloc(job, profile string, devices ...string) *structs.Allocation {
	a := nomadtest.Alloc("default", job, "main", profile, devices...)
	d := a.AllocatedResources.Tasks["main"].Devices[0]
	d.Type = "mig"
	return a
}

// waitOwner waits until the agent's live reservation of device has owner, and returns
// it.
func waitOwner(t *testing.T, c *client.Client, device, owner string) *pb.Reservation {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	var last []*pb.Reservation
	for {
		rs, err := c.Reservations(ctx, &pb.ListReservationsRequest{DeviceId: device, State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
		if err != nil {
			t.Fatalf("the reservation of %s, waiting for owner %s: %v; last: %v", device, owner, err, last)
		}
		if len(rs) == 1 && rs[0].GetOwnerId() == owner {
			return rs[0]
		}
		last = rs
		select {
		case <-ctx.Done():
			t.Fatalf("the reservation of %s never got owner %s; last: %v", device, owner, last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// With on-demand MIG on `agent -dev`'s simulated DGX H100, Nomad's own client device
// manager, through nomad-device-devicehost, sees each MIG profile as a device group of
// its own (nvidia/mig/1g.10gb: 56 devices with the profile's attributes) beside
// nvidia/gpu; seven 1g.10gb allocations on one GPU get seven distinct MIG UUIDs and are
// named after their tasks by the shim following the Nomad stand-in; that GPU and its
// other placements then show unhealthy, the reason naming the blocking reservation and
// its Nomad task; an eighth partition and the whole GPU are refused naming the counter
// and the holders, and the refusals release nothing (take-over applies to the devices
// asked for, never to shared capacity); once the allocations complete the shim
// releases them after release_grace, the GPU is healthy again, and reserves whole.
func TestNomadShimMIGOnDemand(t *testing.T) {
	bins := build(t)
	address, c := startMIGAgent(t, bins[agentName])
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	nomad := nomadtest.New(t, nil)
	n := startNomadDevicesWith(t, bins[shim.BinaryName], map[string]any{
		"address": address, "nomad_address": nomad.URL(), "release_grace": "1s",
	}, hclog.Debug)

	// Fingerprint: a group per profile, with its attributes, beside the whole GPUs.
	node := n.node.wait(t, "8 healthy H100s and 56 healthy 1g.10gb partitions", func(devs []*structs.NodeDeviceResource) bool {
		return allHealthy("nvidia", "gpu", h100, 8)(devs) && allHealthy("nvidia", "mig", mig1g10, 56)(devs)
	})
	parts := groupIn(node, "nvidia", "mig", mig1g10)
	if mem := parts.Attributes["memory"]; mem == nil || mem.Int == nil || mem.Unit != "MiB" || *mem.Int < 9000 || *mem.Int > 10240 {
		t.Errorf("1g.10gb memory attribute %v; want about 10 GB in MiB", mem)
	}
	if s := parts.Attributes["compute_slices"]; s == nil || s.Int == nil || *s.Int != 1 {
		t.Errorf("1g.10gb compute_slices attribute %v; want 1", s)
	}
	if m := parts.Attributes["gpu_model"]; m == nil || m.String == nil || *m.String != h100 {
		t.Errorf("1g.10gb gpu_model attribute %v; want %q", m, h100)
	}
	if g := groupIn(node, "nvidia", "mig", mig1g20); g == nil || len(g.Instances) != 56 {
		t.Errorf("nvidia/mig/%s: %v; want 56 devices (7 placements on each of 8 GPUs)", mig1g20, g)
	}
	gpus := groupIn(node, "nvidia", "gpu", h100)
	ids := make([]string, 0, len(gpus.Instances))
	for _, d := range gpus.Instances {
		ids = append(ids, d.ID)
	}
	slices.Sort(ids)
	gpu, other := ids[0], ids[1]
	mine := partitionsOf(parts, gpu)
	if len(mine) != 7 {
		t.Fatalf("%d 1g.10gb placements of %s, want 7: %v", len(mine), gpu, mine)
	}
	bigger := partitionsOf(groupIn(node, "nvidia", "mig", mig1g20), gpu)
	if len(bigger) == 0 {
		t.Fatalf("no 1g.20gb placement of %s", gpu)
	}

	// Seven 1g.10gb allocations on one GPU: seven MIG UUIDs, each reservation named
	// after its task.
	seen := map[string]string{}
	allocs := make([]string, 0, 7)
	owners := make([]string, 0, 7)
	for i, p := range mine {
		job := fmt.Sprintf("mig-%d", i)
		id := nomad.Place(migAlloc(job, mig1g10, p))
		res, err := n.reserveIn("nvidia", "mig", mig1g10, p)
		if err != nil {
			t.Fatalf("Reserve of %s: %v", p, err)
		}
		uuid := res.Envs["NVIDIA_VISIBLE_DEVICES"]
		if !strings.HasPrefix(uuid, "MIG-") || seen[uuid] != "" {
			t.Errorf("Reserve of %s: NVIDIA_VISIBLE_DEVICES=%q; want a MIG UUID of its own (seen: %v)", p, uuid, seen)
		}
		seen[uuid] = p
		nomad.SetClientStatus(id, structs.AllocClientStatusRunning)
		owner := shim.AllocOwner("default", job, id, "main")
		waitOwner(t, c, p, owner)
		allocs, owners = append(allocs, id), append(owners, owner)
	}
	t.Logf("seven 1g.10gb of %s: %v", gpu, seen)

	// The whole GPU and its other placements are unhealthy in Nomad, naming a blocker;
	// another GPU's are not.
	node = n.node.wait(t, gpu+" and its 1g.20gb placements unhealthy, naming a Nomad task", func(devs []*structs.NodeDeviceResource) bool {
		blocked := func(d *structs.NodeDevice) bool {
			return d != nil && !d.Healthy && strings.Contains(d.HealthDescription, "cannot be reserved now") &&
				slices.ContainsFunc(owners, func(o string) bool { return strings.Contains(d.HealthDescription, fmt.Sprintf("%q", o)) })
		}
		if !blocked(instanceIn(groupIn(devs, "nvidia", "gpu", h100), gpu)) {
			return false
		}
		for _, p := range bigger {
			if !blocked(instanceIn(groupIn(devs, "nvidia", "mig", mig1g20), p)) {
				return false
			}
		}
		return true
	})
	whole := instanceIn(groupIn(node, "nvidia", "gpu", h100), gpu)
	t.Logf("%s in Nomad: healthy %v, %q", gpu, whole.Healthy, whole.HealthDescription)
	if !strings.Contains(whole.HealthDescription, "and 6 more") {
		t.Errorf("%s's reason %q; want it to count the 6 other partitions", gpu, whole.HealthDescription)
	}
	if d := instanceIn(groupIn(node, "nvidia", "gpu", h100), other); d == nil || !d.Healthy {
		t.Errorf("%s, none of whose partitions is held: %+v; want healthy", other, d)
	}
	for _, p := range mine {
		if d := instanceIn(groupIn(node, "nvidia", "mig", mig1g10), p); d == nil || !d.Healthy {
			t.Errorf("held partition %s: %+v; want healthy (it is its allocation's)", p, d)
		}
	}

	// An eighth partition of that GPU and the whole GPU: refused, naming the counter
	// and the holders.
	holders := func(err error) bool {
		n := 0
		for _, o := range owners {
			if strings.Contains(err.Error(), fmt.Sprintf("%q", o)) {
				n++
			}
		}
		// Nomad's plugin client wraps the shim's error once ("rpc error: ..."); the agent's
		// status is not wrapped in it again, and the shim's placeholder owner for the
		// refused Reserve ("nomad/<random>", no holder: holders are nomad/<ns>/<job>/...)
		// is not named.
		return n >= 3 && strings.Count(err.Error(), "rpc error") == 1 && !placeholderOwner.MatchString(err.Error())
	}
	_, err := n.reserveIn("nvidia", "mig", mig1g20, bigger[0])
	t.Logf("eighth partition (%s): %v", bigger[0], err)
	if !errContains(err, bigger[0], `counter "compute-slices"`, "7 of 7 used", "capacity") || !holders(err) {
		t.Errorf("Reserve of a 1g.20gb of %s beside its seven 1g.10gb: %v; want refused naming the counter and the Nomad tasks holding it", gpu, err)
	}
	_, err = n.reserve(gpu)
	t.Logf("whole GPU (%s): %v", gpu, err)
	if !errContains(err, gpu, `counter "compute-slices"`, "7 requested, 7 of 7 used") || !holders(err) {
		t.Errorf("Reserve of the whole %s beside its seven 1g.10gb: %v; want refused naming the counter and the Nomad tasks holding it", gpu, err)
	}
	live, err := c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: "nomad/default/", State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil || len(live) != 7 {
		t.Fatalf("live Nomad reservations after the refusals: %v, %v; want the seven partitions' (nothing taken over)", live, err)
	}

	// The allocations complete: released after the grace, the GPU healthy again.
	for _, id := range allocs {
		nomad.SetClientStatus(id, structs.AllocClientStatusComplete)
	}
	n.node.wait(t, "8 healthy H100s once the partitions' allocations completed", allHealthy("nvidia", "gpu", h100, 8))
	for i, p := range mine {
		rs, err := c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: owners[i]})
		if err != nil || len(rs) != 1 || rs[0].GetState() != pb.ReservationState_RESERVATION_STATE_RELEASED {
			t.Errorf("the reservation of %s by %s: %v, %v; want it released", p, owners[i], rs, err)
		}
	}
	res, err := n.reserve(gpu)
	if err != nil {
		t.Fatalf("Reserve of the whole %s once its partitions were released: %v", gpu, err)
	}
	if got := res.Envs["NVIDIA_VISIBLE_DEVICES"]; got != gpu {
		t.Errorf("NVIDIA_VISIBLE_DEVICES=%q, want %s", got, gpu)
	}
	// Now its partitions are the blocked ones.
	n.node.wait(t, "the 1g.10gb of "+gpu+" unhealthy while it is held whole", func(devs []*structs.NodeDeviceResource) bool {
		for _, p := range mine {
			if d := instanceIn(groupIn(devs, "nvidia", "mig", mig1g10), p); d == nil || d.Healthy || !strings.Contains(d.HealthDescription, "cannot be reserved now") {
				return false
			}
		}
		return true
	})
}
