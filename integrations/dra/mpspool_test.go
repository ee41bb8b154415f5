package dra

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/uuid"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// mpsAgentConfig is an agent config whose nvidia-example plugin offers each simulated
// GPU as 4 MPS shares, its control daemons under a short directory of the test's.
func mpsAgentConfig(t testing.TB) string {
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
    sharing  = "mps"
    mps_dir  = %q
  }
}
`, filepath.Join(dir, "d"))), 0o644); err != nil {
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
