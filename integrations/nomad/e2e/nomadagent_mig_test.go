package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/nomad/shim"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// nodeDevice is what the test reads of a device instance in Nomad's node status.
type nodeDevice struct {
	ID                string
	Healthy           bool
	HealthDescription string
}

// nodeDevices returns the node's device groups in Nomad's node status, by
// "vendor/type/name".
func (n *nomadHTTP) nodeDevices(id string) (map[string][]nodeDevice, error) {
	var node struct {
		NodeResources struct {
			Devices []struct {
				Vendor, Type, Name string
				Instances          []nodeDevice
			}
		}
	}
	if err := n.get("/v1/node/"+id, &node); err != nil {
		return nil, err
	}
	out := make(map[string][]nodeDevice, len(node.NodeResources.Devices))
	for _, g := range node.NodeResources.Devices {
		out[g.Vendor+"/"+g.Type+"/"+g.Name] = g.Instances
	}
	return out, nil
}

// waitActiveReservation waits until owner has exactly one active reservation at the
// agent c, and returns it.
func waitActiveReservation(t *testing.T, c *client.Client, owner string) *pb.Reservation {
	t.Helper()
	var r *pb.Reservation
	testwait.WaitFor(t, "a reservation of "+owner, func() bool {
		rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: owner, State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
		if err == nil && len(rs) == 1 {
			r = rs[0]
		}
		return r != nil
	})
	return r
}

// A real Nomad v1.6.3 agent with nomad-device-devicehost against `devicehost agent
// -dev` in on-demand MIG mode: the node has the nvidia/mig/1g.10gb group of 56 devices
// beside 8 GPUs; a raw_exec job asking for `device "nvidia/mig/1g.10gb"` runs, its task
// sees a MIG UUID in NVIDIA_VISIBLE_DEVICES, its reservation is named after the task;
// the GPU whose partition it holds is unhealthy in Nomad's node status, the reason
// naming that task; once the job is stopped the partition is released and the GPU is
// healthy again.
func TestNomadAgentMIG(t *testing.T) {
	nomadBin := nomadBinary(t)
	const grace = 2 * time.Second
	bins := build(t)
	address, c := startMIGAgent(t, bins[agentName])
	tmp := tempDir(t, "dhnam")
	ports := freePorts(t, 3)
	nomadAddr := "127.0.0.1:" + ports[0]
	cfg := writeNomadConfig(t, tmp, ports, bins[shim.BinaryName], address, nomadAddr, grace, nomadOptions{})
	startAgent(t, nomadBin, tmp, "agent", "-config", cfg, "-log-level", "debug") // its output is logged if the test fails
	n := &nomadHTTP{t: t, addr: "http://" + nomadAddr}
	defer n.stopAll()
	nodeID := n.waitNodeWithGPUs(8)
	const migGroup = "nvidia/mig/" + mig1g10
	testwait.WaitFor(t, "56 healthy "+migGroup+" devices in Nomad's node status", func() bool {
		devs, err := n.nodeDevices(nodeID)
		healthy := 0
		for _, d := range devs[migGroup] {
			if d.Healthy {
				healthy++
			}
		}
		return err == nil && healthy == 56
	})

	out := filepath.Join(tmp, "visible")
	allocID := n.runBatchJob(nomadBin, tmp, "mig", fmt.Sprintf(`echo "$NVIDIA_VISIBLE_DEVICES" > %[1]s.tmp && mv %[1]s.tmp %[1]s && exec sleep 3600`, out), migGroup, 1)

	// The task sees its MIG device.
	var visible string
	testwait.WaitFor(t, "the task's NVIDIA_VISIBLE_DEVICES", func() bool {
		b, err := os.ReadFile(out)
		visible = strings.TrimSpace(string(b))
		return err == nil
	})
	if !strings.HasPrefix(visible, "MIG-") || strings.Contains(visible, ",") {
		t.Fatalf("the task's NVIDIA_VISIBLE_DEVICES=%q; want one MIG UUID", visible)
	}
	owner := shim.AllocOwner("default", "mig", allocID, "train")
	r := waitActiveReservation(t, c, owner)
	part := r.GetDeviceIds()[0]
	gpu, _, ok := strings.Cut(part, "-mig-")
	if len(r.GetDeviceIds()) != 1 || !ok || r.GetType() != "mig" || r.GetName() != mig1g10 {
		t.Fatalf("the task's reservation %v; want one %s partition", r, migGroup)
	}
	if got := r.GetReservation().GetEnvs()["NVIDIA_VISIBLE_DEVICES"]; got != visible {
		t.Errorf("the agent's reservation gives NVIDIA_VISIBLE_DEVICES=%q, the task saw %q", got, visible)
	}
	t.Logf("task %s on %s: NVIDIA_VISIBLE_DEVICES=%s", owner, part, visible)

	// Its GPU is unhealthy in Nomad's node status, naming the task.
	gpuGroup := "nvidia/gpu/" + h100
	gpuIn := func() nodeDevice {
		devs, err := n.nodeDevices(nodeID)
		if err != nil {
			return nodeDevice{}
		}
		for _, d := range devs[gpuGroup] {
			if d.ID == gpu {
				return d
			}
		}
		return nodeDevice{}
	}
	var held nodeDevice
	testwait.WaitFor(t, gpu+" unhealthy in Nomad's node status, naming "+owner, func() bool {
		held = gpuIn()
		return held.ID != "" && !held.Healthy && strings.Contains(held.HealthDescription, fmt.Sprintf("%q", owner))
	})
	t.Logf("nomad node status: %s healthy=%v %q", gpu, held.Healthy, held.HealthDescription)
	devs, err := n.nodeDevices(nodeID)
	if err != nil {
		t.Fatal(err)
	}
	unhealthy := 0
	for _, d := range devs[gpuGroup] {
		if !d.Healthy {
			unhealthy++
		}
	}
	if unhealthy != 1 {
		t.Errorf("%d unhealthy GPUs in Nomad's node status with one partition held, want 1: %+v", unhealthy, devs[gpuGroup])
	}

	// The job stops: released after the grace, the GPU healthy again.
	n.deleteJob("mig")
	testwait.WaitFor(t, "the release of "+r.GetReservationId(), func() bool {
		rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: owner})
		return err == nil && len(rs) == 1 && rs[0].GetState() == pb.ReservationState_RESERVATION_STATE_RELEASED
	})
	testwait.WaitFor(t, gpu+" healthy again in Nomad's node status", func() bool { return gpuIn().Healthy })
}
