package dra

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/uuid"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// mpsAgentConfig is an agent config whose nvidia-example plugin offers each simulated
// GPU as 4 MPS shares, its control daemons under a short directory of the test's.
func mpsAgentConfig(t testing.TB) string {
	t.Helper()
	return mpsAgentConfigWith(t, "")
}

// mpsAgentConfigWith is mpsAgentConfig with more lines in the plugin's config block.
func mpsAgentConfigWith(t testing.TB, more string) string {
	t.Helper()
	return sharingAgentConfig(t, `"mps"`, more)
}

// sharingAgentConfig is mpsAgentConfigWith with sharing = sharing (HCL).
func sharingAgentConfig(t testing.TB, sharing, more string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mps")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	file := filepath.Join(dir, "agent.hcl")
	if err := os.WriteFile(file, []byte(fmt.Sprintf(`plugin "nvidia-example" {
  config {
    simulate = "dgxh100"
    replicas = 4
    sharing  = %s
    mps_dir  = %q
%s
  }
}
`, sharing, filepath.Join(dir, "d"), more)), 0o644); err != nil {
		t.Fatal(err)
	}
	return file
}

// consumingClaim is a claim allocated memory of a consumable device, as the scheduler
// allocates one (a share ID per allocation).
func (r *rig) consumingClaim(name, dev, memory string) *resourceapi.ResourceClaim {
	t := r.t
	t.Helper()
	share := uuid.NewUUID()
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: uuid.NewUUID()}}
	c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
		Request: "share", Driver: testDriver, Pool: testNode, Device: dev, ShareID: &share,
		ConsumedCapacity: map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse(memory)},
	}}}}
	if err := r.kube.Tracker().Add(c); err != nil {
		t.Fatal(err)
	}
	return c
}

// MPS shares pooled as consumable devices: the driver publishes one per GPU, shareable
// and in steps of one share; a claim consuming two shares' memory gets two shares of
// that GPU at the agent and the MPS environment of two in its CDI spec, another claim
// of the same device one share more, a prepare asked again the same shares; unprepare
// frees them.
func TestMPSSharesAsConsumableCapacity(t *testing.T) {
	t.Setenv("GORACE", "atexit_sleep_ms=0") // the simulated MPS daemon's control clients
	r := newRigArgs(t, "-config", mpsAgentConfig(t))
	r.startDriver(nil)
	k := r.kubelet()
	devs := r.waitSlices("8 GPUs and 8 pooled MPS devices", func(d []resourceapi.Device) bool {
		n := 0
		for _, dv := range d {
			if a := dv.AllowMultipleAllocations; a != nil && *a {
				n++
			}
		}
		return len(d) == 16 && n == 8
	})
	var pooled resourceapi.Device
	for _, dv := range devs {
		if dv.AllowMultipleAllocations != nil && strings.HasSuffix(*dv.Attributes["id"].StringValue, "::mps") {
			pooled = dv
			break
		}
	}
	gpu := *pooled.Attributes["parent"].StringValue
	share := pooled.Capacity["memory"].RequestPolicy.ValidRange.Step
	two := share.DeepCopy()
	two.Add(*share)

	ctx := context.Background()
	a := r.consumingClaim("a", pooled.Name, two.String())
	p := k.prepare(t, a)
	if p.GetError() != "" || len(p.GetDevices()) != 1 {
		t.Fatalf("prepare of a claim of two shares' memory: %q %v", p.GetError(), p.GetDevices())
	}
	ownerA := claimRef{a.Namespace, a.Name, string(a.UID)}.owner()
	rs, err := r.c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: ownerA, State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil || len(rs) != 1 || len(rs[0].GetDeviceIds()) != 2 {
		t.Fatalf("claim a's reservations %v %v; want one of two shares", rs, err)
	}
	for _, id := range rs[0].GetDeviceIds() {
		if !strings.HasPrefix(id, gpu+"::mps::") {
			t.Errorf("claim a holds %s; want shares of %s", id, gpu)
		}
	}
	env := rs[0].GetReservation().GetEnvs()
	if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" || env["CUDA_MPS_PIPE_DIRECTORY"] == "" {
		t.Errorf("claim a's environment %v; want two shares' limits and the daemon's pipe", env)
	}
	spec, err := os.ReadFile(filepath.Join(r.cdiDir, testDriver+"-claim-"+string(a.UID)+".json"))
	if err != nil || !strings.Contains(string(spec), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50") || !strings.Contains(string(spec), env["CUDA_MPS_PIPE_DIRECTORY"]) {
		t.Errorf("claim a's CDI spec (%v): %s; want its MPS environment and the pipe mount", err, spec)
	}
	if again := k.prepare(t, a); again.GetError() != "" {
		t.Fatalf("prepare asked again: %s", again.GetError())
	}
	if again, _ := r.c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: ownerA, State: pb.ReservationState_RESERVATION_STATE_ACTIVE}); len(again) != 1 || again[0].GetReservationId() != rs[0].GetReservationId() {
		t.Errorf("after prepare again: %v; want the same one reservation %s", again, rs[0].GetReservationId())
	}

	b := r.consumingClaim("b", pooled.Name, share.String())
	if p := k.prepare(t, b); p.GetError() != "" {
		t.Fatalf("prepare of a second claim of one share: %s", p.GetError())
	}
	rb, _ := r.c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: claimRef{b.Namespace, b.Name, string(b.UID)}.owner(), State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if len(rb) != 1 || len(rb[0].GetDeviceIds()) != 1 || slices.Contains(rs[0].GetDeviceIds(), rb[0].GetDeviceIds()[0]) {
		t.Errorf("claim b's reservations %v; want one share a does not hold", rb)
	}
	for _, c := range []*resourceapi.ResourceClaim{a, b} {
		if e := k.unprepare(t, c); e != "" {
			t.Fatal(e)
		}
	}
	snap, _ := r.c.Devices(ctx)
	for _, g := range snap.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetHolder() != nil {
				t.Errorf("%s held by %s after both unprepares", d.GetId(), d.GetHolder().GetOwnerId())
			}
		}
	}
}

// Static MIG devices' MPS shares pooled as a GPU's are: with GPU 0 split into a 3g.40gb
// and a 2g.20gb MIG device, each MIG device is published once more as a shareable
// device of type mig.mps, so that a claim of whole MIG devices (type mig) never gets a
// share and one of shares never a whole device. It is named by its MIG profile as its
// MIG device is, its parent that MIG device, its memory the MIG device's in steps of
// one share, and it consumes the MIG device's counter set whole. A claim of two shares'
// memory gets two shares of that MIG device at the agent with two shares' MPS limits,
// its status names the MIG device and its profile, and unprepare frees the shares.
func TestStaticMIGSharesAsConsumableCapacity(t *testing.T) {
	t.Setenv("GORACE", "atexit_sleep_ms=0") // the simulated MPS daemon's control clients
	r := newRigArgs(t, "-config", mpsAgentConfigWith(t, `    mig_layout = { "0" = ["3g.40gb", "2g.20gb"] }`))
	r.startDriver(nil)
	k := r.kubelet()
	// Untainted: a share is unhealthy until its MPS daemon is up, and Prepare takes
	// healthy shares only.
	devs := r.waitSlices("7 GPUs, 2 MIG devices and 9 pooled MPS devices, untainted", func(d []resourceapi.Device) bool {
		n := 0
		for _, dv := range d {
			if len(dv.Taints) > 0 {
				return false
			}
			if a := dv.AllowMultipleAllocations; a != nil && *a {
				n++
			}
		}
		return len(d) == 18 && n == 9
	})
	attr := func(d resourceapi.Device, name resourceapi.QualifiedName) string {
		if a := d.Attributes[name]; a.StringValue != nil {
			return *a.StringValue
		}
		return ""
	}
	byType := make(map[string][]resourceapi.Device)
	for _, d := range devs {
		byType[attr(d, "type")] = append(byType[attr(d, "type")], d)
	}
	for _, d := range byType["mig"] {
		if d.AllowMultipleAllocations != nil {
			t.Errorf("device %s (%s, %s) of type mig is shareable; want only whole MIG devices of type mig", d.Name, attr(d, "id"), attr(d, "productName"))
		}
	}
	if len(byType["mig"]) != 2 || len(byType["mig.mps"]) != 2 {
		t.Fatalf("%d devices of type mig, %d of type mig.mps; want 2 of each: the MIG devices, and their shares pooled", len(byType["mig"]), len(byType["mig.mps"]))
	}
	var mig, pooled resourceapi.Device
	for _, d := range byType["mig"] {
		if attr(d, "productName") == "3g.40gb" {
			mig = d
		}
	}
	for _, d := range byType["mig.mps"] {
		if attr(d, "productName") == "3g.40gb" {
			pooled = d
		}
	}
	if mig.Name == "" || pooled.Name == "" {
		t.Fatalf("3g.40gb: MIG device %q, pooled shares %q; want both", mig.Name, pooled.Name)
	}
	migUUID := attr(mig, "uuid")
	for _, a := range []resourceapi.QualifiedName{"gpuModel", "resource.kubernetes.io/pciBusID"} {
		if attr(pooled, a) == "" || attr(pooled, a) != attr(mig, a) {
			t.Errorf("pooled shares' %s %q; want their MIG device's, %q", a, attr(pooled, a), attr(mig, a))
		}
	}
	if attr(pooled, "parent") != migUUID {
		t.Errorf("pooled shares' parent %q; want their MIG device, %s", attr(pooled, "parent"), migUUID)
	}
	mem := pooled.Capacity["memory"]
	if pooled.AllowMultipleAllocations == nil || !*pooled.AllowMultipleAllocations || mem.RequestPolicy == nil || mem.RequestPolicy.ValidRange == nil ||
		mem.Value.Cmp(resource.MustParse("40Gi")) != 0 || mem.RequestPolicy.ValidRange.Step.Cmp(resource.MustParse("10Gi")) != 0 || len(pooled.Capacity) != 1 {
		t.Errorf("pooled shares: multiple allocations %v, capacity %+v; want memory alone, consumable 40Gi in steps of 10Gi", pooled.AllowMultipleAllocations, pooled.Capacity)
	}
	// The MIG device whole and its shares take the same counters: the scheduler gives
	// it one way or the other, never both.
	if len(mig.ConsumesCounters) != 1 || !apiequality.Semantic.DeepEqual(pooled.ConsumesCounters, mig.ConsumesCounters) {
		t.Errorf("pooled shares consume %+v; want what their MIG device consumes, %+v", pooled.ConsumesCounters, mig.ConsumesCounters)
	}

	ctx := context.Background()
	c := r.consumingClaim("a", pooled.Name, "20Gi")
	if p := k.prepare(t, c); p.GetError() != "" || len(p.GetDevices()) != 1 {
		t.Fatalf("prepare of a claim of two shares' memory: %q %v", p.GetError(), p.GetDevices())
	}
	owner := claimRef{c.Namespace, c.Name, string(c.UID)}.owner()
	rs, err := r.c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: owner, State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil || len(rs) != 1 || len(rs[0].GetDeviceIds()) != 2 {
		t.Fatalf("the claim's reservations %v %v; want one of two shares", rs, err)
	}
	for _, id := range rs[0].GetDeviceIds() {
		if !strings.HasPrefix(id, migUUID+"::mps::") {
			t.Errorf("the claim holds %s; want shares of %s", id, migUUID)
		}
	}
	env := rs[0].GetReservation().GetEnvs()
	if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" || env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] != "0=20480M" || env["CUDA_MPS_PIPE_DIRECTORY"] == "" {
		t.Errorf("the claim's environment %v; want two shares' limits of the 3g.40gb device and its daemon's pipe", env)
	}
	want := deviceStatusData{UUID: migUUID, Type: "mig.mps", MIGProfile: "3g.40gb"}
	var got deviceStatusData
	for deadline := time.Now().Add(testwait.Timeout); ; time.Sleep(10 * time.Millisecond) { // the status is written after the answer
		cl, err := r.kube.ResourceV1().ResourceClaims(c.Namespace).Get(ctx, c.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if ds := cl.Status.Devices; len(ds) == 1 && ds[0].Data != nil {
			got = deviceStatusData{}
			if err := json.Unmarshal(ds[0].Data.Raw, &got); err != nil {
				t.Fatal(err)
			}
			got.CDIDeviceIDs = nil
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the claim's device status: none written in %v", testwait.Timeout)
		}
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("the claim's device status %+v; want %+v", got, want)
	}

	if e := k.unprepare(t, c); e != "" {
		t.Fatal(e)
	}
	snap, err := r.c.Devices(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range snap.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetHolder() != nil {
				t.Errorf("%s held by %s after the unprepare", d.GetId(), d.GetHolder().GetOwnerId())
			}
		}
	}
}

// The MPS shares of on-demand MIG placements are not published: each draws on its
// placement's slices of the GPU's counter set, not on a set of a device of its own, so
// no pooled device could stand for them, and published one by one a claim could get
// shares of two placements. Neither the shares nor a pooled device of them appear in
// the slices, and a whole GPU's shares beside them are pooled as before.
func TestOnDemandMIGSharesAreNotPublished(t *testing.T) {
	gpuSet := &pb.CounterSet{Plugin: "nvidia", Name: "GPU-1", Capacity: map[string]int64{"memory-slice-0": 2, "memory-slice-1": 2, "compute-slices": 14}}
	placementShare := func(k int) *pb.Device {
		return &pb.Device{Id: fmt.Sprintf("GPU-1-mig-1g.10gb-0::mps::%d", k), Health: pb.Health_HEALTH_HEALTHY,
			Consumes: []*pb.CounterConsumption{{CounterSet: "GPU-1", Counters: map[string]int64{"memory-slice-0": 1, "compute-slices": 1}}}}
	}
	mem := func(mib int64) map[string]*pb.Value {
		return map[string]*pb.Value{"memory": {Kind: &pb.Value_IntValue{IntValue: mib}, Unit: "MiB"}}
	}
	snap := &pb.FingerprintResponse{
		CounterSets: []*pb.CounterSet{gpuSet, {Plugin: "nvidia", Name: "GPU-2", Capacity: map[string]int64{"mps-compute-percent": 100, "mps-memory-mib": 81920}}},
		Groups: []*pb.DeviceGroup{
			{Vendor: "nvidia", Type: "mig", Name: "1g.10gb.mps", Plugin: "nvidia", Attributes: mem(5120), Devices: []*pb.Device{placementShare(0), placementShare(1)}},
			{Vendor: "nvidia", Type: "gpu.mps", Name: "NVIDIA H100 80GB HBM3", Plugin: "nvidia", Attributes: mem(40960),
				Devices: []*pb.Device{migShare("GPU-2", 0, 2, 81920), migShare("GPU-2", 1, 2, 81920)}},
		},
	}
	v, problems := buildView(snap, buildOptions{driver: DefaultDriverName, pool: testNode})
	if len(problems) > 0 {
		t.Fatalf("building the view: %v", problems)
	}
	var names []string
	for _, sl := range v.slices {
		for _, d := range sl.Devices {
			names = append(names, d.Name)
		}
	}
	if len(names) != 1 || names[0] != DeviceName("GPU-2::mps") {
		t.Errorf("published devices %v; want the whole GPU's pooled shares alone, %s", names, DeviceName("GPU-2::mps"))
	}
}

// A GPU offered time-sliced and in MPS shares (sharing = ["time-slicing", "mps"]): the
// slices carry each mode's compatibility group on its devices' counter consumption
// (replicas "time-slicing", the pooled MPS device "mps", the whole GPU none), which
// keeps the scheduler from putting both modes on one GPU; where the API server drops
// them (its feature gate off), the agent refuses such a Prepare, naming the mode that
// holds the GPU, and the claim's prepare error says so, also after a restart of the
// driver with the first mode's claim prepared.
func TestSharingModesCarryCompatibilityGroups(t *testing.T) {
	t.Setenv("GORACE", "atexit_sleep_ms=0") // the simulated MPS daemon's control clients
	r := newRigArgs(t, "-config", sharingAgentConfig(t, `["time-slicing", "mps"]`, ""))
	first := r.startDriver(nil)
	k := r.kubelet()
	devs := r.waitSlices("8 GPUs, 32 replicas and 8 pooled MPS devices", func(d []resourceapi.Device) bool { return len(d) == 48 })
	var replica, pooled resourceapi.Device
	byKind := make(map[string]int)
	for _, dv := range devs {
		id := *dv.Attributes["id"].StringValue
		var groups []string
		for _, c := range dv.ConsumesCounters {
			groups = append(groups, c.CompatibilityGroups...)
		}
		var kind, want string
		switch {
		case strings.HasSuffix(id, "::mps"):
			kind, want, pooled = "pooled", "mps", dv
		case strings.Contains(id, "::"):
			kind, want = "replica", "time-slicing"
			if strings.HasSuffix(id, "::0") && replica.Name == "" {
				replica = dv
			}
		default:
			kind = "gpu"
		}
		byKind[kind]++
		if want == "" && len(groups) > 0 || want != "" && !slices.Equal(groups, []string{want}) {
			t.Errorf("%s %s consumes in groups %q, want %q", kind, id, groups, want)
		}
	}
	if byKind["gpu"] != 8 || byKind["replica"] != 32 || byKind["pooled"] != 8 {
		t.Fatalf("devices by kind %v, want 8 GPUs, 32 replicas, 8 pooled", byKind)
	}
	// Both on one GPU, as a scheduler without the feature gate could allocate them.
	gpu := *replica.Attributes["parent"].StringValue
	for _, dv := range devs {
		if strings.HasSuffix(*dv.Attributes["id"].StringValue, "::mps") && *dv.Attributes["parent"].StringValue == gpu {
			pooled = dv
		}
	}
	a := r.claim("ts", replica.Name)
	if p := k.prepare(t, a); p.GetError() != "" {
		t.Fatalf("prepare of a replica: %s", p.GetError())
	}
	share := pooled.Capacity["memory"].RequestPolicy.ValidRange.Step
	b := r.consumingClaim("mps", pooled.Name, share.String())
	p := k.prepare(t, b)
	if !strings.Contains(p.GetError(), `is held shared as "time-slicing"`) || !strings.Contains(p.GetError(), `would hold it shared as "mps"`) {
		t.Errorf("prepare of an MPS share of a time-sliced GPU: %q, want refused naming both modes", p.GetError())
	}
	// A restarted driver with the replica's claim prepared: the kubelet asking again
	// gets the same reservation, and the MPS claim is still refused.
	ownerA := claimRef{a.Namespace, a.Name, string(a.UID)}.owner()
	before, _ := r.c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: ownerA, State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	first.stop(t)
	r.startDriver(nil)
	k = r.kubelet()
	if p := k.prepare(t, a); p.GetError() != "" {
		t.Fatalf("prepare of the replica asked again of the restarted driver: %s", p.GetError())
	}
	after, _ := r.c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: ownerA, State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if len(before) != 1 || len(after) != 1 || before[0].GetReservationId() != after[0].GetReservationId() {
		t.Errorf("the replica's reservations %v before the driver's restart, %v after; want the same one", before, after)
	}
	if p := k.prepare(t, b); !strings.Contains(p.GetError(), `is held shared as "time-slicing"`) {
		t.Errorf("after the driver's restart, prepare of an MPS share of the time-sliced GPU: %q, want refused", p.GetError())
	}
	if e := k.unprepare(t, a); e != "" {
		t.Fatal(e)
	}
	if p := k.prepare(t, b); p.GetError() != "" {
		t.Fatalf("prepare of the MPS share once the replica is unprepared: %s", p.GetError())
	}
	if e := k.unprepare(t, b); e != "" {
		t.Fatal(e)
	}
}
