package dra

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/logtest"
	"github.com/devicehost/devicehost/tools/testwait"
)

// pubRig is a publisher on a fake API server, its informer running; the test calls
// sync itself.
type pubRig struct {
	t    *testing.T
	kube *fake.Clientset
	p    *publisher
	log  *logtest.Recorder
	// calls counts the API calls on ResourceSlices by verb (create, update, delete).
	calls map[string]*atomic.Int32
	// lists counts the lists of ResourceSlices with a field selector (the
	// publisher's: the test's own select nothing).
	lists atomic.Int32
}

func newPubRig(t *testing.T, kube *fake.Clientset) *pubRig {
	t.Helper()
	r := &pubRig{t: t, kube: kube, log: &logtest.Recorder{}, calls: map[string]*atomic.Int32{}}
	for _, verb := range []string{"create", "update", "delete"} {
		n := &atomic.Int32{}
		r.calls[verb] = n
		kube.PrependReactor(verb, "resourceslices", func(k8stesting.Action) (bool, runtime.Object, error) {
			n.Add(1)
			return false, nil, nil
		})
	}
	kube.PrependReactor("list", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if l, ok := a.(k8stesting.ListAction); ok && !l.GetListRestrictions().Fields.Empty() {
			r.lists.Add(1)
		}
		return false, nil, nil
	})
	r.p = newPublisher(kube, nil, resourceREST(t, kube), testDriver, testNode, hclog.New(&hclog.LoggerOptions{Output: r.log}))
	inf, err := r.p.informer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(run(context.Background(), inf))
	if !cache.WaitForCacheSync(t.Context().Done(), inf.HasSynced) {
		t.Fatal("informer not synced")
	}
	return r
}

// sync publishes v and returns the calls it made, by verb.
func (r *pubRig) sync(v *view) map[string]int32 {
	r.t.Helper()
	before := map[string]int32{}
	for verb, n := range r.calls {
		before[verb] = n.Load()
	}
	if _, err := r.p.sync(context.Background(), v); err != nil {
		r.t.Fatalf("sync: %v", err)
	}
	out := map[string]int32{}
	for verb, n := range r.calls {
		if d := n.Load() - before[verb]; d > 0 {
			out[verb] = d
		}
	}
	return out
}

// caughtUp waits until the informer has shown every write of the publisher, and
// forgets what it said meanwhile: a change after it is someone else's.
func (r *pubRig) caughtUp() {
	r.t.Helper()
	deadline := time.Now().Add(testwait.Timeout)
	for {
		r.p.mu.Lock()
		all := true
		for _, e := range r.p.sent {
			all = all && e.seen
		}
		r.p.mu.Unlock()
		if all {
			break
		}
		if time.Now().After(deadline) {
			r.t.Fatal("the informer has not shown the publisher's writes")
		}
		time.Sleep(5 * time.Millisecond)
	}
	select {
	case <-r.p.foreign:
	default:
	}
}

// waitForeign waits until the publisher is told of someone else's change (what).
func (r *pubRig) waitForeign(what string) {
	r.t.Helper()
	select {
	case <-r.p.foreign:
	case <-time.After(testwait.Timeout):
		r.t.Fatalf("%s: the publisher was not told", what)
	}
}

// ownDevices gives the slice written its own copy of its devices, so that a reactor
// may change them as the API server would, not the view's.
func ownDevices(s *resourceapi.ResourceSlice) {
	devs := make([]resourceapi.Device, len(s.Spec.Devices))
	for i := range devs {
		devs[i] = *s.Spec.Devices[i].DeepCopy()
	}
	s.Spec.Devices = devs
}

// stored is what the API server holds of the pool.
func (r *pubRig) stored() []resourceapi.ResourceSlice {
	r.t.Helper()
	list, err := r.kube.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		r.t.Fatal(err)
	}
	return list.Items
}

// checkPool fails unless the API server holds exactly v's slices, at one generation,
// each owned by the node; it returns that generation.
func (r *pubRig) checkPool(v *view) int64 {
	r.t.Helper()
	items := r.stored()
	if len(items) != len(v.slices) {
		r.t.Fatalf("%d slices stored, want %d", len(items), len(v.slices))
	}
	gen := items[0].Spec.Pool.Generation
	for _, s := range items {
		i, ok := sliceIndex(s.Name, sliceIndexMinDigits)
		if !ok || i >= len(v.slices) {
			r.t.Fatalf("slice %s: no index of the pool's %d slices in its name", s.Name, len(v.slices))
		}
		if s.Spec.Pool.Generation != gen || s.Spec.Pool.ResourceSliceCount != int64(len(v.slices)) {
			r.t.Errorf("slice %s: pool %+v, want generation %d of %d slices", s.Name, s.Spec.Pool, gen, len(v.slices))
		}
		if len(s.OwnerReferences) != 1 || s.OwnerReferences[0].Kind != "Node" || s.OwnerReferences[0].UID != "node-uid-1" {
			r.t.Errorf("slice %s: owners %v, want the node", s.Name, s.OwnerReferences)
		}
		if !slices.EqualFunc(s.Spec.Devices, v.slices[i].Devices, func(a, b resourceapi.Device) bool { return apiequality.Semantic.DeepEqual(a, b) }) ||
			!apiequality.Semantic.DeepEqual(s.Spec.SharedCounters, v.slices[i].SharedCounters) {
			r.t.Errorf("slice %s: not what the view's slice %d says", s.Name, i)
		}
	}
	return gen
}

func onDemandView(t *testing.T, gpus int, change func(*pb.FingerprintResponse)) *view {
	t.Helper()
	snap := onDemandSnapshot(gpus, 7)
	if change != nil {
		change(snap)
	}
	v, problems := buildView(snap, buildOptions{driver: testDriver, pool: testNode, pci: &pciAttributes{}})
	if len(problems) > 0 {
		t.Fatalf("build: %v", problems)
	}
	return v
}

// holdPartition holds one partition of GPU gpu from outside DRA: the partition, its
// GPU and the placements it blocks are tainted, all in that GPU's slice.
func holdPartition(gpu int) func(*pb.FingerprintResponse) {
	return func(s *pb.FingerprintResponse) {
		h := &pb.Holder{ReservationId: "res-1", OwnerId: "nomad/default/job/a/t"}
		for _, g := range s.Groups {
			for _, d := range g.Devices {
				switch {
				case d.Id == fmt.Sprintf("GPU-%d-mig-1g.10gb-0", gpu):
					d.Holder = h
				case d.Id == fmt.Sprintf("GPU-%d", gpu) || strings.HasPrefix(d.Id, fmt.Sprintf("GPU-%d-mig-3g", gpu)):
					d.BlockedBy = []*pb.Holder{h}
				}
			}
		}
	}
}

// A change of one GPU updates its one slice in place, at the pool's generation; a view
// the same as the last writes nothing; a pool of another shape (fewer GPUs, fewer
// slices) is written at the next generation and the slices left over are deleted.
func TestPublisherWritesOnlyWhatChanged(t *testing.T) {
	r := newPubRig(t, newKube())
	first := onDemandView(t, 8, nil)
	if got := r.sync(first); got["create"] != int32(len(first.slices)) || got["update"]+got["delete"] != 0 {
		t.Fatalf("first publish: calls %v, want %d creates", got, len(first.slices))
	}
	gen := r.checkPool(first)
	if got := r.sync(onDemandView(t, 8, nil)); len(got) != 0 {
		t.Errorf("the same view again: calls %v, want none", got)
	}
	held := onDemandView(t, 8, holdPartition(5))
	if got := r.sync(held); got["update"] != 1 || len(got) != 1 {
		t.Errorf("a partition of one GPU held: calls %v, want one update", got)
	}
	if g := r.checkPool(held); g != gen {
		t.Errorf("generation %d after one slice's update, want %d still", g, gen)
	}
	if got := r.sync(first); got["update"] != 1 || len(got) != 1 {
		t.Errorf("released: calls %v, want one update", got)
	}
	r.checkPool(first)

	smaller := onDemandView(t, 2, nil)
	if len(smaller.slices) >= len(first.slices) {
		t.Fatalf("2 GPUs give %d slices, 8 give %d: the test wants fewer", len(smaller.slices), len(first.slices))
	}
	got := r.sync(smaller)
	if got["update"] != int32(len(smaller.slices)) || got["delete"] != int32(len(first.slices)-len(smaller.slices)) || got["create"] != 0 {
		t.Errorf("fewer slices: calls %v, want %d updates and %d deletes", got, len(smaller.slices), len(first.slices)-len(smaller.slices))
	}
	if g := r.checkPool(smaller); g != gen+1 {
		t.Errorf("generation %d after the pool's shape changed, want %d", g, gen+1)
	}
	if got := r.sync(first); got["update"] != int32(len(smaller.slices)) || got["create"] != int32(len(first.slices)-len(smaller.slices)) {
		t.Errorf("more slices again: calls %v", got)
	}
	r.checkPool(first)
}

// The publisher's informer watches the slices' metadata: it reads whole slices only
// when the informer shows one it did not write as it is. Changes of the pool list
// nothing; a slice of this driver on this node of another pool is read once, left
// alone, and read again only once it changed.
func TestPublisherListsOnlyWhatItDidNotWrite(t *testing.T) {
	r := newPubRig(t, newKube())
	first, held := onDemandView(t, 8, nil), onDemandView(t, 8, holdPartition(3))
	r.sync(first)
	r.caughtUp()
	lists := func(what string, want int32, sync func()) {
		t.Helper()
		before := r.lists.Load()
		sync()
		if n := r.lists.Load() - before; n != want {
			t.Errorf("%s: the slices listed %d times, want %d", what, n, want)
		}
	}
	update := func(v *view) func() {
		return func() {
			t.Helper()
			if got := r.sync(v); got["update"] != 1 || len(got) != 1 {
				t.Errorf("a partition held or released: calls %v, want one update", got)
			}
		}
	}
	lists("a partition held", 0, update(held))
	lists("and released", 0, update(first))

	ctx := context.Background()
	other, err := r.kube.ResourceV1().ResourceSlices().Create(ctx, &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "another-pool"},
		Spec: resourceapi.ResourceSliceSpec{Driver: testDriver, NodeName: new(testNode),
			Pool: resourceapi.ResourcePool{Name: "another-pool", Generation: 1, ResourceSliceCount: 1}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	r.waitForeign("another pool's slice created")
	lists("a partition held, another pool's slice new", 1, update(held))
	lists("released, another pool's slice known", 0, update(first))
	other.Labels = map[string]string{"team": "gpu-ops"}
	if other, err = r.kube.ResourceV1().ResourceSlices().Update(ctx, other, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	r.waitForeign("another pool's slice changed")
	lists("another pool's slice changed", 1, func() {
		if got := r.sync(first); len(got) != 0 {
			t.Errorf("another pool's slice changed: calls %v, want none", got)
		}
	})
	got, err := r.kube.ResourceV1().ResourceSlices().Get(ctx, other.Name, metav1.GetOptions{})
	if err != nil || got.ResourceVersion != other.ResourceVersion {
		t.Errorf("another pool's slice after the syncs: %v, %v; want it as its owner left it (resourceVersion %s)", got, err, other.ResourceVersion)
	}
}

// A driver that starts where an earlier process published the pool (a restart, an
// upgrade) writes nothing if the slices say what it would write, and only the slice
// that differs otherwise.
func TestPublisherAdoptsThePoolItFinds(t *testing.T) {
	kube := newKube()
	v := onDemandView(t, 8, nil)
	newPubRig(t, kube).sync(v)
	again := newPubRig(t, kube)
	if got := again.sync(v); len(got) != 0 {
		t.Errorf("a new publisher, the same pool: calls %v, want none", got)
	}
	again.p.mu.Lock()
	adopted := len(again.p.sent)
	again.p.mu.Unlock()
	if adopted != len(v.slices) {
		t.Errorf("%d slices taken as the publisher's own, want all %d (else each sync encodes them again)", adopted, len(v.slices))
	}
	third := newPubRig(t, kube)
	held := onDemandView(t, 8, holdPartition(2))
	if got := third.sync(held); got["update"] != 1 || len(got) != 1 {
		t.Errorf("a new publisher, one GPU changed: calls %v, want one update", got)
	}
	third.checkPool(held)
}

// Someone else's edit of a slice (a device removed) or deletion of one is seen, and the
// next sync writes the pool's word again; a label someone put on a slice stays.
func TestPublisherMendsOthersChanges(t *testing.T) {
	r := newPubRig(t, newKube())
	v := onDemandView(t, 8, nil)
	r.sync(v)
	r.caughtUp()
	ctx := context.Background()
	items := r.stored()
	victim := items[len(items)-1]
	victim.Spec.Devices = victim.Spec.Devices[1:]
	victim.Labels = map[string]string{"team": "gpu-ops"}
	if _, err := r.kube.ResourceV1().ResourceSlices().Update(ctx, &victim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	r.waitForeign("a slice edited")
	if got := r.sync(v); got["update"] != 1 || len(got) != 1 {
		t.Errorf("after someone's edit: calls %v, want one update", got)
	}
	r.checkPool(v)
	mended, err := r.kube.ResourceV1().ResourceSlices().Get(ctx, victim.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if mended.Labels["team"] != "gpu-ops" {
		t.Errorf("labels %v after the mend, want someone's label kept", mended.Labels)
	}

	gen := r.checkPool(v)
	r.caughtUp()
	if err := r.kube.ResourceV1().ResourceSlices().Delete(ctx, items[0].Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	r.waitForeign("a slice deleted")
	got := r.sync(v)
	if got["create"] != 1 || got["update"] != int32(len(v.slices)-1) {
		t.Errorf("after someone's deletion: calls %v, want the missing slice created and the rest updated", got)
	}
	if g := r.checkPool(v); g != gen+1 {
		t.Errorf("generation %d after a slice was created again, want %d", g, gen+1)
	}
}

// A taint that stays keeps the time the API server gave it when the slice is written
// again for another device's change: a NoExecute toleration's seconds count from it.
func TestPublisherKeepsTaintTimes(t *testing.T) {
	kube := newKube()
	// Like the API server, the fake gives a taint without a time the time of the write.
	var writes atomic.Int64
	base := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	stamp := func(a k8stesting.Action) (bool, runtime.Object, error) {
		s, ok := a.(k8stesting.CreateAction).GetObject().(*resourceapi.ResourceSlice) // an update action is one too
		if ok {
			ownDevices(s)
			now := metav1.NewTime(base.Add(time.Duration(writes.Add(1)) * time.Minute))
			for i := range s.Spec.Devices {
				for j := range s.Spec.Devices[i].Taints {
					if s.Spec.Devices[i].Taints[j].TimeAdded == nil {
						s.Spec.Devices[i].Taints[j].TimeAdded = &now
					}
				}
			}
		}
		return false, nil, nil
	}
	kube.PrependReactor("create", "resourceslices", stamp)
	kube.PrependReactor("update", "resourceslices", stamp)
	r := newPubRig(t, kube)
	unhealthy := func(s *pb.FingerprintResponse) { s.Groups[0].Devices[3].Health = pb.Health_HEALTH_UNHEALTHY }
	r.sync(onDemandView(t, 8, unhealthy))
	name := DeviceName("GPU-3")
	first, ok := taintOf(poolDevices(r.stored()), name, testDriver+"/unhealthy")
	if !ok || first.TimeAdded == nil {
		t.Fatalf("GPU-3's unhealthy taint %+v (found %v), want one with a time", first, ok)
	}
	// Another device of GPU-3's slice changes: the slice is written again.
	both := func(s *pb.FingerprintResponse) {
		unhealthy(s)
		holdPartition(3)(s)
	}
	if got := r.sync(onDemandView(t, 8, both)); got["update"] != 1 {
		t.Fatalf("calls %v, want GPU-3's slice updated", got)
	}
	later, _ := taintOf(poolDevices(r.stored()), name, testDriver+"/unhealthy")
	if later.TimeAdded == nil || !later.TimeAdded.Equal(first.TimeAdded) {
		t.Errorf("the unhealthy taint's time %v after its slice was written again, want %v kept", later.TimeAdded, first.TimeAdded)
	}
	if held, _ := taintOf(poolDevices(r.stored()), name, testDriver+"/blocked"); held.TimeAdded == nil || held.TimeAdded.Equal(first.TimeAdded) {
		t.Errorf("the new taint's time %v, want the second write's", held.TimeAdded)
	}
}

// An update whose changed devices the API server does not keep as written is named in
// the log too, though the check encodes only the devices that changed since the last
// write; an update kept as written is not.
func TestPublisherSaysWhenAnUpdateDropsFields(t *testing.T) {
	kube := newKube()
	var drop atomic.Bool
	kube.PrependReactor("update", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if drop.Load() {
			s := a.(k8stesting.UpdateAction).GetObject().(*resourceapi.ResourceSlice)
			ownDevices(s)
			for i := range s.Spec.Devices {
				s.Spec.Devices[i].Taints = slices.DeleteFunc(s.Spec.Devices[i].Taints, func(t resourceapi.DeviceTaint) bool {
					return t.Key == testDriver+"/"+taintHeld
				})
			}
		}
		return false, nil, nil
	})
	r := newPubRig(t, kube)
	first := onDemandView(t, 2, nil)
	r.sync(first)
	if got := r.sync(onDemandView(t, 2, holdPartition(1))); got["update"] != 1 {
		t.Fatalf("a partition held: calls %v, want an update", got)
	}
	if r.log.String() != "" {
		t.Fatalf("an update kept as written: log\n%s\nwant nothing", r.log)
	}
	drop.Store(true)
	if got := r.sync(first); got["update"] != 1 {
		t.Fatalf("released: calls %v, want an update", got)
	}
	if r.log.String() != "" {
		t.Fatalf("an update that takes held taints off: log\n%s\nwant nothing (no device is held)", r.log)
	}
	if got := r.sync(onDemandView(t, 2, holdPartition(0))); got["update"] != 1 {
		t.Fatalf("another partition held: calls %v, want an update", got)
	}
	if !strings.Contains(r.log.String(), "fields dropped") {
		t.Errorf("the held partition's taint dropped: log does not say so:\n%s", r.log)
	}
}

// An API server that does not keep a field the driver writes (a feature gate off) is
// named in the log, and does not make the driver write the slice again and again.
func TestPublisherSaysWhenFieldsAreDropped(t *testing.T) {
	kube := newKube()
	kube.PrependReactor("create", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
		s := a.(k8stesting.CreateAction).GetObject().(*resourceapi.ResourceSlice)
		ownDevices(s)
		for i := range s.Spec.Devices {
			s.Spec.Devices[i].ConsumesCounters = nil
		}
		return false, nil, nil
	})
	r := newPubRig(t, kube)
	v := onDemandView(t, 2, nil)
	r.sync(v)
	if !strings.Contains(r.log.String(), "fields dropped") {
		t.Errorf("log does not say the API server dropped fields:\n%s", r.log)
	}
	if got := r.sync(v); len(got) != 0 {
		t.Errorf("the same view again: calls %v, want none", got)
	}
}
