package shim

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	nstructs "github.com/hashicorp/nomad/nomad/structs"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// MIG partitions come to Nomad as a device group per profile (nvidia/mig/1g.10gb),
// and a device blocked by shared capacity another reservation uses is unhealthy with
// that reservation named; once free, healthy again.
func TestGroupsToNomadPartitions(t *testing.T) {
	holder := &pb.Holder{ReservationId: "res-1", OwnerId: "nomad/default/train/a/t"}
	snap := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{
		{Vendor: "nvidia", Type: "gpu", Name: "H100", Devices: []*pb.Device{
			{Id: "GPU-0", Health: pb.Health_HEALTH_HEALTHY, BlockedBy: []*pb.Holder{holder, {ReservationId: "res-2", OwnerId: "x"}}},
		}},
		{Vendor: "nvidia", Type: "mig", Name: "1g.10gb", Devices: []*pb.Device{
			{Id: "GPU-0-mig-1g.10gb-0", Health: pb.Health_HEALTH_HEALTHY, Holder: holder},
			{Id: "GPU-0-mig-1g.10gb-1", Health: pb.Health_HEALTH_HEALTHY},
		}},
	}}
	groups := groupsToNomad(snap)
	if len(groups) != 2 || groups[1].Type != "mig" || groups[1].Name != "1g.10gb" {
		t.Fatalf("groups %+v, want nvidia/gpu/H100 and nvidia/mig/1g.10gb", groups)
	}
	whole := groups[0].Devices[0]
	if whole.Healthy || !strings.Contains(whole.HealthDesc, `reservation res-1 of owner "nomad/default/train/a/t" and 1 more`) {
		t.Errorf("blocked GPU: healthy %v, %q; want unhealthy naming its blocker", whole.Healthy, whole.HealthDesc)
	}
	for _, d := range groups[1].Devices {
		if !d.Healthy {
			t.Errorf("partition %s unhealthy (%q), want healthy", d.ID, d.HealthDesc)
		}
	}
	snap.Groups[0].Devices[0].BlockedBy = nil
	if d := groupsToNomad(snap)[0].Devices[0]; !d.Healthy {
		t.Errorf("GPU with its blockers gone: unhealthy %q", d.HealthDesc)
	}
}

// MPS shares become one Nomad group per GPU they divide, so that Nomad's scheduler,
// which takes a request's instances from one group, gives a task shares of one GPU.
func TestGroupsToNomadSplitsMPSSharesByGPU(t *testing.T) {
	share := func(gpu string, k int) *pb.Device {
		return &pb.Device{Id: fmt.Sprintf("%s::mps::%d", gpu, k), Health: pb.Health_HEALTH_HEALTHY,
			Consumes: []*pb.CounterConsumption{{CounterSet: gpu, Counters: map[string]int64{"mps-compute-percent": 50}}}}
	}
	snap := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{
		{Vendor: "nvidia", Type: "gpu", Name: "H100", Devices: []*pb.Device{{Id: "GPU-0", Health: pb.Health_HEALTH_HEALTHY}}},
		{Vendor: "nvidia", Type: "gpu.mps", Name: "H100", Devices: []*pb.Device{share("GPU-0", 0), share("GPU-1", 0), share("GPU-0", 1), share("GPU-1", 1)}},
	}}
	groups := groupsToNomad(snap)
	got := map[string][]string{}
	for _, g := range groups {
		for _, d := range g.Devices {
			got[g.Type+"/"+g.Name] = append(got[g.Type+"/"+g.Name], d.ID)
		}
	}
	want := map[string][]string{
		"gpu/H100":           {"GPU-0"},
		"gpu.mps/H100 GPU-0": {"GPU-0::mps::0", "GPU-0::mps::1"},
		"gpu.mps/H100 GPU-1": {"GPU-1::mps::0", "GPU-1::mps::1"},
	}
	if !maps.EqualFunc(got, want, slices.Equal) {
		t.Errorf("Nomad groups %v, want %v", got, want)
	}
}

// Shares of an on-demand MIG placement draw on part of their GPU's counter set, so no
// Nomad group can hold the shares of one placement only: they are left out, and the
// shares of a static MIG device (all of its own set) are offered.
func TestGroupsToNomadLeavesOutSharesOfPlacements(t *testing.T) {
	snap := &pb.FingerprintResponse{
		CounterSets: []*pb.CounterSet{
			{Plugin: "nvidia", Name: "GPU-0", Capacity: map[string]int64{"memory-slice-0": 2, "memory-slice-1": 2, "compute-slices": 14}},
			{Plugin: "nvidia", Name: "MIG-1", Capacity: map[string]int64{"mps-compute-percent": 100, "mps-memory-mib": 40000}},
		},
		Groups: []*pb.DeviceGroup{{Vendor: "nvidia", Type: "mig", Name: "1g.10gb.mps", Plugin: "nvidia", Devices: []*pb.Device{
			{Id: "GPU-0-mig-1g.10gb-0::mps::0", Health: pb.Health_HEALTH_HEALTHY,
				Consumes: []*pb.CounterConsumption{{CounterSet: "GPU-0", Counters: map[string]int64{"memory-slice-0": 1, "compute-slices": 1}}}},
			{Id: "MIG-1::mps::0", Health: pb.Health_HEALTH_HEALTHY,
				Consumes: []*pb.CounterConsumption{{CounterSet: "MIG-1", Counters: map[string]int64{"mps-compute-percent": 50, "mps-memory-mib": 20000}}}},
		}}},
	}
	groups := groupsToNomad(snap)
	if len(groups) != 1 || groups[0].Name != "1g.10gb.mps MIG-1" || len(groups[0].Devices) != 1 || groups[0].Devices[0].ID != "MIG-1::mps::0" {
		t.Errorf("Nomad groups %+v, want only the static MIG device's share, in its own group", groups)
	}
}

// A cordoned device is unhealthy to Nomad whatever its health, with the reason and who
// cordoned it, so the scheduler places no new allocation on it; healthy once uncordoned.
func TestCordonedDeviceUnhealthyToNomad(t *testing.T) {
	snap := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{
		{Vendor: "nvidia", Type: "gpu", Name: "H100", Devices: []*pb.Device{
			{Id: "GPU-0", Health: pb.Health_HEALTH_HEALTHY, Cordon: &pb.Cordon{Reason: "ECC storm", By: `listener "main" uid=0,gid=0,pid=7`}},
			{Id: "GPU-1", Health: pb.Health_HEALTH_HEALTHY},
		}},
	}}
	devs := groupsToNomad(snap)[0].Devices
	if devs[0].Healthy || devs[0].HealthDesc != `cordoned by listener "main" uid=0,gid=0,pid=7: ECC storm` {
		t.Errorf("cordoned GPU: healthy %v, %q", devs[0].Healthy, devs[0].HealthDesc)
	}
	if !devs[1].Healthy {
		t.Errorf("GPU-1 unhealthy: %q", devs[1].HealthDesc)
	}
	snap.Groups[0].Devices[0].Cordon = nil
	if d := groupsToNomad(snap)[0].Devices[0]; !d.Healthy {
		t.Errorf("uncordoned GPU: unhealthy %q", d.HealthDesc)
	}
}

// A kubelet device plugin's resource hosted under devicehost (vendor: its domain) and a
// host device (vendor hostdev) come to Nomad as groups a job's `device "DOMAIN/NAME"`
// and `device "hostdev/fuse"` select, by Nomad's own parsing of the name.
func TestGroupsToNomadHostedAndHostDevices(t *testing.T) {
	snap := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{
		{Vendor: "devic.es", Type: "fuse", Name: "fuse", Devices: []*pb.Device{{Id: "5db9268e", Health: pb.Health_HEALTH_HEALTHY}}},
		{Vendor: "hostdev", Type: "fuse", Name: "fuse", Devices: []*pb.Device{{Id: "fuse-0", Health: pb.Health_HEALTH_HEALTHY}}},
	}}
	groups := groupsToNomad(snap)
	if len(groups) != 2 {
		t.Fatalf("groups %+v, want 2", groups)
	}
	for i, asked := range []string{"devic.es/fuse", "hostdev/fuse"} {
		g := groups[i]
		if err := g.Validate(); err != nil {
			t.Errorf("group %s/%s/%s: Nomad refuses it: %v", g.Vendor, g.Type, g.Name, err)
		}
		req := &nstructs.RequestedDevice{Name: asked, Count: 1}
		if !(&nstructs.DeviceIdTuple{Vendor: g.Vendor, Type: g.Type, Name: g.Name}).Matches(req.ID()) {
			t.Errorf("device %q does not select group %s/%s/%s", asked, g.Vendor, g.Type, g.Name)
		}
	}
}
