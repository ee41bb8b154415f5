package dra

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/uuid"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// adminClaim is a claim allocated devices with admin access (DRAAdminAccess), in the
// store as r.claim's are.
func (r *rig) adminClaim(name string, devices ...string) *resourceapi.ResourceClaim {
	t := r.t
	t.Helper()
	admin := true
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "monitoring", Name: name, UID: uuid.NewUUID()}}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for _, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: "gpus", Driver: testDriver, Pool: testNode, Device: d, AdminAccess: &admin})
	}
	if err := r.kube.Tracker().Add(c); err != nil {
		t.Fatal(err)
	}
	return c
}

// cdiAgentConfig is an agent config whose nvidia-example plugin keeps a CDI spec in a
// directory of the test's, so its devices have CDI names (what admin access hands out).
func cdiAgentConfig(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	file := filepath.Join(dir, "agent.hcl")
	if err := os.WriteFile(file, []byte(fmt.Sprintf(`plugin "nvidia-example" {
  config {
    simulate     = "dgxh100"
    cdi_spec_dir = %q
  }
}
`, filepath.Join(dir, "cdi"))), 0o644); err != nil {
		t.Fatal(err)
	}
	return file
}

// A claim with admin access to a held GPU and a free one is prepared with each GPU's
// own CDI name and reserves nothing: the held GPU keeps its holder, the free one stays
// free for another claim, and the agent lists the access apart from holders; unprepare
// ends it and leaves the holders be.
func TestAdminAccessClaim(t *testing.T) {
	r := newRigArgs(t, "-config", cdiAgentConfig(t))
	r.startDriver(nil)
	k := r.kubelet()
	ids, _ := gpus(r.waitDevices("GPUs with CDI names", func(s *pb.FingerprintResponse) bool {
		ids, g := gpus(s)
		return len(ids) == 8 && len(g.GetDevices()[0].GetCdiDevices()) == 1
	}))
	r.waitSlices("8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	holder := r.claim("holder", DeviceName(ids[0]))
	if p := k.prepare(t, holder); p.GetError() != "" {
		t.Fatal(p.GetError())
	}

	mon := r.adminClaim("dcgm", DeviceName(ids[0]), DeviceName(ids[1]))
	p := k.prepare(t, mon)
	if p.GetError() != "" || len(p.GetDevices()) != 2 {
		t.Fatalf("prepare of the admin claim: %q %v", p.GetError(), p.GetDevices())
	}
	for i, d := range p.GetDevices() {
		if want := "nvidia.com/gpu=" + ids[i]; len(d.GetCdiDeviceIds()) == 0 || d.GetCdiDeviceIds()[0] != want {
			t.Errorf("admin device %s: CDI IDs %v, want %s first", d.GetDeviceName(), d.GetCdiDeviceIds(), want)
		}
	}
	ctx := context.Background()
	owner := claimRef{mon.Namespace, mon.Name, string(mon.UID)}.owner()
	if rs, err := r.c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: owner}); err != nil || len(rs) != 0 {
		t.Errorf("the admin claim's reservations: %v %v, want none", rs, err)
	}
	snap, err := r.c.Devices(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids[:2] {
		d := findDevice(snap, id)
		if len(d.GetAdminAccess()) != 1 || d.GetAdminAccess()[0].GetOwnerId() != owner {
			t.Errorf("%s admin access %v, want the claim's", id, d.GetAdminAccess())
		}
	}
	if h := findDevice(snap, ids[0]).GetHolder(); h == nil || h.GetOwnerId() != (claimRef{holder.Namespace, holder.Name, string(holder.UID)}).owner() {
		t.Errorf("%s holder %v, want the holder claim still", ids[0], h)
	}
	other := r.claim("other", DeviceName(ids[1]))
	if p := k.prepare(t, other); p.GetError() != "" {
		t.Errorf("a claim of a GPU under admin access refused: %s", p.GetError())
	}

	if e := k.unprepare(t, mon); e != "" {
		t.Fatal(e)
	}
	snap, _ = r.c.Devices(ctx)
	for _, id := range ids[:2] {
		if d := findDevice(snap, id); len(d.GetAdminAccess()) != 0 || d.GetHolder() == nil {
			t.Errorf("%s after the admin claim's unprepare: admin access %v, holder %v; want none and its holder", id, d.GetAdminAccess(), d.GetHolder())
		}
	}
	if _, err := os.Stat(filepath.Join(r.cdiDir, testDriver+"-claim-"+string(mon.UID)+".json")); !os.IsNotExist(err) {
		t.Errorf("the admin claim's CDI spec after its unprepare: %v, want none", err)
	}
}
