package dra

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/uuid"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// holdersClaim is a claim allocated n holders of a consumable device, as the scheduler
// allocates one (a share ID per allocation).
func (r *rig) holdersClaim(name, dev string, n int) *resourceapi.ResourceClaim {
	t := r.t
	t.Helper()
	share := uuid.NewUUID()
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: uuid.NewUUID()}}
	c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
		Request: "fuse", Driver: testDriver, Pool: testNode, Device: dev, ShareID: &share,
		ConsumedCapacity: map[resourceapi.QualifiedName]resource.Quantity{client.HoldersCounter: *resource.NewQuantity(int64(n), resource.DecimalSI)},
	}}}}
	if err := r.kube.Tracker().Add(c); err != nil {
		t.Fatal(err)
	}
	return c
}

// A host device offered count times (the hostdev plugin on the machine's /dev/fuse,
// count 3) is one consumable device of 3 holders: each claim takes one copy at the
// agent by default, or as many holders as it consumes; a claim past the count is
// refused naming what is free; unprepare gives the copies back.
func TestHoldersAsConsumableCapacity(t *testing.T) {
	if fi, err := os.Stat("/dev/fuse"); err != nil || fi.Mode()&fs.ModeCharDevice == 0 {
		t.Skip("no /dev/fuse character device here")
	}
	file := filepath.Join(t.TempDir(), "agent.hcl")
	if err := os.WriteFile(file, []byte(`plugin "hostdev" {
  config {
    cdi_spec_dir = ""
    device "fuse" {
      paths = ["/dev/fuse"]
      count = 3
    }
  }
}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	r := newRigArgs(t, "-config", file)
	r.startDriver(nil)
	k := r.kubelet()
	devs := r.waitSlices("the fuse device pooled", func(d []resourceapi.Device) bool {
		for _, dv := range d {
			if id := dv.Attributes["id"].StringValue; id != nil && *id == "fuse::holders" {
				return true
			}
		}
		return false
	})
	var pooled resourceapi.Device
	var fuse []string
	for _, dv := range devs {
		switch typ := *dv.Attributes["type"].StringValue; {
		case *dv.Attributes["id"].StringValue == "fuse::holders":
			pooled = dv
		case typ == "fuse":
			fuse = append(fuse, *dv.Attributes["id"].StringValue)
		}
	}
	if len(fuse) > 0 {
		t.Errorf("copies %v published beside the pooled device", fuse)
	}
	if a := pooled.AllowMultipleAllocations; a == nil || !*a {
		t.Errorf("pooled fuse device: allowMultipleAllocations %v, want true", a)
	}
	holders := pooled.Capacity[client.HoldersCounter]
	if holders.Value.Value() != 3 || holders.RequestPolicy == nil || holders.RequestPolicy.Default.Value() != 1 || holders.RequestPolicy.ValidRange.Step.Value() != 1 {
		t.Errorf("pooled fuse device capacity %+v, want 3 holders, one per claim by default, in steps of one", pooled.Capacity)
	}

	ctx := context.Background()
	held := map[string]string{}
	var claims []*resourceapi.ResourceClaim
	for i := range 3 {
		c := r.holdersClaim(fmt.Sprintf("c%d", i), pooled.Name, 1)
		if p := k.prepare(t, c); p.GetError() != "" || len(p.GetDevices()) != 1 {
			t.Fatalf("prepare of claim %d of one holder: %q %v", i, p.GetError(), p.GetDevices())
		}
		claims = append(claims, c)
		rs, err := r.c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: claimRef{c.Namespace, c.Name, string(c.UID)}.owner(), State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
		if err != nil || len(rs) != 1 || len(rs[0].GetDeviceIds()) != 1 {
			t.Fatalf("claim %d's reservations %v %v; want one copy", i, rs, err)
		}
		id := rs[0].GetDeviceIds()[0]
		if other, dup := held[id]; dup || !strings.HasPrefix(id, "fuse-") {
			t.Errorf("claim %d holds %s (also claim %s's: %v)", i, id, other, dup)
		}
		held[id] = c.Name
		if nodes := rs[0].GetReservation().GetDevices(); len(nodes) != 1 || nodes[0].GetHostPath() != "/dev/fuse" {
			t.Errorf("claim %d's reservation gives %v, want /dev/fuse", i, nodes)
		}
	}
	fourth := r.holdersClaim("c3", pooled.Name, 1)
	if p := k.prepare(t, fourth); !strings.Contains(p.GetError(), "1 shares of fuse asked for; 0 are free at the agent") {
		t.Errorf("prepare of a fourth claim: %q, want a refusal saying none is free", p.GetError())
	}
	for _, c := range claims[:2] {
		if e := k.unprepare(t, c); e != "" {
			t.Fatal(e)
		}
	}
	two := r.holdersClaim("two", pooled.Name, 2)
	if p := k.prepare(t, two); p.GetError() != "" {
		t.Fatalf("prepare of a claim of two holders once two are free: %s", p.GetError())
	}
	rs, _ := r.c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: claimRef{two.Namespace, two.Name, string(two.UID)}.owner(), State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if len(rs) != 1 || len(rs[0].GetDeviceIds()) != 2 || slices.Contains(rs[0].GetDeviceIds(), firstHeldBy(held, claims[2].Name)) {
		t.Errorf("claim of two holders: %v; want two copies the third claim does not hold", rs)
	}
}

// firstHeldBy is the device held maps to claim.
func firstHeldBy(held map[string]string, claim string) string {
	for id, c := range held {
		if c == claim {
			return id
		}
	}
	return ""
}
