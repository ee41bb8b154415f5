package dra

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stesting "k8s.io/client-go/testing"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// PublishPool, the fleet bench's hook, writes the pool a driver on that node would:
// the recorded DGX H100's 8 GPUs and its on-demand MIG recording's placements with
// their counter sets, under the node's name; a fingerprint that is no protojson is
// refused naming it.
func TestPublishPool(t *testing.T) {
	for _, c := range []struct {
		file       string
		devices    int
		counterSet bool
	}{
		{"dgxh100.json", 8, false},
		{"dgxh100-mig-on-demand.json", 232, true},
	} {
		t.Run(c.file, func(t *testing.T) {
			fp, err := os.ReadFile(filepath.Join("cmd", "devicehost-fleet", "fingerprints", c.file))
			if err != nil {
				t.Fatal(err)
			}
			kube := newKube()
			writes, problems, err := PublishPool(context.Background(), kube, resourceREST(t, kube), testDriver, testNode, fp, nil)
			if err != nil || writes == 0 {
				t.Fatalf("PublishPool = %d writes, %v (problems %v)", writes, err, problems)
			}
			slices, err := kube.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			devices, sets := 0, 0
			for _, s := range slices.Items {
				if s.Spec.Driver != testDriver || s.Spec.Pool.Name != testNode || s.Spec.NodeName == nil || *s.Spec.NodeName != testNode {
					t.Errorf("slice %s: driver %s, pool %s, node %v; want %s, %s, %s", s.Name, s.Spec.Driver, s.Spec.Pool.Name, s.Spec.NodeName, testDriver, testNode, testNode)
				}
				devices += len(s.Spec.Devices)
				sets += len(s.Spec.SharedCounters)
			}
			if devices != c.devices || (sets > 0) != c.counterSet {
				t.Errorf("%d slices with %d devices and %d counter sets; want %d devices, counter sets %v", len(slices.Items), devices, sets, c.devices, c.counterSet)
			}
		})
	}
	if _, _, err := PublishPool(context.Background(), newKube(), nil, testDriver, testNode, []byte("{not json"), nil); err == nil {
		t.Error("PublishPool took a fingerprint that is no protojson")
	}
}

// RunPool, the fleet bench's hook for the driver's writes, publishes the first snapshot,
// writes nothing for a holder that is a claim of the driver's (the scheduler's
// allocation says it), updates the slice in place for a holder outside DRA (a held
// taint) and for its release, publishes again a slice someone else deleted, and
// returns once its snapshots end.
func TestRunPool(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("cmd", "devicehost-fleet", "fingerprints", "dgxh100.json"))
	if err != nil {
		t.Fatal(err)
	}
	base := &pb.FingerprintResponse{}
	if err := protojson.Unmarshal(raw, base); err != nil {
		t.Fatal(err)
	}
	gpu := base.GetGroups()[0].GetDevices()
	held := func(owners map[int]string) *pb.FingerprintResponse {
		s := proto.Clone(base).(*pb.FingerprintResponse)
		for i, owner := range owners {
			s.GetGroups()[0].GetDevices()[i].Holder = &pb.Holder{ReservationId: "r" + owner, OwnerId: owner}
		}
		return s
	}
	const claimOwner, nomadOwner = ClaimOwnerPrefix + "fleet/claim-1/uid-1", "nomad/alloc-1"
	heldTaint := func(devs []resourceapi.Device, i int) bool {
		_, ok := taintOf(devs, DeviceName(gpu[i].GetId()), testDriver+"/"+taintHeld)
		return ok
	}

	kube := newKube()
	r := &rig{t: t, kube: kube}
	writes := func() (n int) {
		for _, a := range kube.Actions() {
			if a.GetResource().Resource == "resourceslices" && slices.Contains([]string{"create", "update", "delete"}, a.GetVerb()) {
				n++
			}
		}
		return n
	}
	snaps := make(chan *pb.FingerprintResponse)
	done := make(chan error, 1)
	go func() {
		done <- RunPool(context.Background(), kube, nil, resourceREST(t, kube), testDriver, testNode, snaps, nil)
	}()
	send := func(s *pb.FingerprintResponse) {
		t.Helper()
		select {
		case snaps <- s:
		case err := <-done:
			t.Fatalf("RunPool returned %v before its snapshots ended", err)
		}
	}

	send(base)
	r.waitSlices("the 8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	if w := writes(); w != 1 {
		t.Errorf("%d writes to publish the pool of one slice; want 1", w)
	}
	send(held(map[int]string{0: claimOwner}))
	send(held(map[int]string{0: claimOwner, 1: nomadOwner}))
	devs := r.waitSlices("GPU 1 held outside DRA", func(d []resourceapi.Device) bool { return heldTaint(d, 1) })
	if heldTaint(devs, 0) {
		t.Error("GPU 0, held by a claim, published with a held taint")
	}
	send(held(map[int]string{0: claimOwner}))
	r.waitSlices("GPU 1 released", func(d []resourceapi.Device) bool { return len(d) == 8 && !heldTaint(d, 1) })
	if w := writes(); w != 3 {
		t.Errorf("%d writes after a claim's holder and an outside holder came and went; want 3 (the create, two updates)", w)
	}

	list, err := kube.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	if err != nil || len(list.Items) != 1 {
		t.Fatalf("slices: %d, %v; want 1", len(list.Items), err)
	}
	kube.ClearActions()
	if err := kube.ResourceV1().ResourceSlices().Delete(context.Background(), list.Items[0].Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	r.waitSlices("the pool published again after its deletion", func(d []resourceapi.Device) bool { return len(d) == 8 })
	creates := 0
	for _, a := range kube.Actions() {
		if _, ok := a.(k8stesting.CreateAction); ok && a.GetResource().Resource == "resourceslices" {
			creates++
		}
	}
	if creates != 1 {
		t.Errorf("%d slices created after someone else deleted the pool's one; want 1", creates)
	}

	close(snaps)
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("RunPool = %v after its snapshots ended; want nil", err)
		}
	case <-time.After(testwait.Timeout):
		t.Fatal("RunPool still running after its snapshots ended")
	}
}

// The hooks publish a simulated node's devices with their pciBusID and never a pcieRoot
// from this host's /sys, even where this host has a device at the recorded bus ID (the
// driver's own lookup finds its root there).
func TestPublishPoolNoHostPCIeRoot(t *testing.T) {
	const bus = "0000:00:00.0" // the host bridge, on most x86 machines
	if !localPCI(bus).rootOK {
		t.Skipf("this host has no PCIe root for %s in /sys", bus)
	}
	snap := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{{Vendor: "nvidia", Type: "gpu", Name: "H100", Plugin: "nvidia-example",
		Devices: []*pb.Device{{Id: "GPU-1", Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{PciBusId: bus, NumaNode: 0}}}}}}
	fp, err := protojson.Marshal(snap)
	if err != nil {
		t.Fatal(err)
	}
	kube := newKube()
	if _, problems, err := PublishPool(context.Background(), kube, resourceREST(t, kube), testDriver, testNode, fp, nil); err != nil {
		t.Fatalf("PublishPool: %v (problems %v)", err, problems)
	}
	devs := (&rig{t: t, kube: kube}).waitSlices("the GPU", func(d []resourceapi.Device) bool { return len(d) == 1 })
	attrs := devs[0].Attributes
	if _, ok := attrs["resource.kubernetes.io/pciBusID"]; !ok {
		t.Errorf("attributes %v: no pciBusID", attrs)
	}
	if root, ok := attrs["resource.kubernetes.io/pcieRoot"]; ok && root.StringValue != nil {
		t.Errorf("pcieRoot %s published from this host's /sys for a simulated device", *root.StringValue)
	} else if ok {
		t.Errorf("a pcieRoot published from this host's /sys for a simulated device: %+v", root)
	}
}

// localPCI is the driver's own lookup of bus in this host's /sys.
func localPCI(bus string) pciLookup { return (&pciAttributes{}).lookup(bus) }
