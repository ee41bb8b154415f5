package kubernetes_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	prapi "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/integrations/kubernetes"
	"github.com/devicehost/devicehost/integrations/kubernetes/kubelettest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

const grace = 500 * time.Millisecond

func withGrace(c *kubernetes.Config) { c.ReleaseGrace = grace }

// passDoneAfter waits until the bridge has finished a release pass that began at or
// after t: the pass that answered List call n is done once call n+1 arrives.
func (h *harness) passDoneAfter(t *testing.T, ctx context.Context, at time.Time) {
	t.Helper()
	n, err := h.pods.WaitListAfter(ctx, at)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.pods.WaitLists(ctx, n+1); err != nil {
		t.Fatal(err)
	}
}

// waitReleased waits, pass by pass, until reservation id is released, and returns
// when the pass that released it was seen done.
func (h *harness) waitReleased(t *testing.T, ctx context.Context, id string) time.Time {
	t.Helper()
	for {
		n := h.pods.Lists()
		if err := h.pods.WaitLists(ctx, n+1); err != nil {
			t.Fatalf("waiting for %s to be released: %v", id, err)
		}
		rs := h.agent.reservations(device.ReservationFilter{})
		for _, r := range rs {
			if r.ID == id && r.State == device.ReservationReleased {
				return r.ReleasedAt
			}
		}
	}
}

// A reservation whose pod PodResources reports stays, however long; once the pod is
// gone from PodResources the reservation is released after the grace period, and its
// devices are free at the agent.
func TestReleasesWhenPodIsGone(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent, withGrace)
	c := h.healthyPlugin(t, ctx)

	if _, err := allocate(ctx, c, gpuID(0), gpuID(1)); err != nil {
		t.Fatal(err)
	}
	allocated := time.Now()
	res := agent.active()[0]
	h.pods.SetPods(kubelettest.Pod("ml", "trainer-0", "main", gpuResource, gpuID(0), gpuID(1)))

	// Twice the grace period with the pod there: still held, and handed to the pod's
	// container, so the agent's ledger says which pod it serves.
	h.passDoneAfter(t, ctx, allocated.Add(2*grace))
	if rs := agent.active(); len(rs) != 1 || rs[0].ID != res.ID || rs[0].OwnerID != "k8s/ml/trainer-0/main" {
		t.Fatalf("active reservations while the pod holds the GPUs: %+v, want %s owned by k8s/ml/trainer-0/main", rs, res.ID)
	}
	if !strings.Contains(h.logs.String(), "reservation serves a pod: reservation="+res.ID+" pod=k8s/ml/trainer-0/main") {
		t.Errorf("no log line recording the pod of %s", res.ID)
	}
	// The kubelet still sees the GPUs as its own: healthy.
	h.waitGPUs(t, ctx, "8 healthy GPUs with two held by the pod", kubelettest.AllHealth(8, dpapi.Healthy))

	gone := time.Now() // before the pod leaves: the bridge cannot see it gone earlier
	h.pods.SetPods()
	released := h.waitReleased(t, ctx, res.ID)
	if d := released.Sub(gone); d < grace {
		t.Errorf("released %v after the pod was gone, before the grace period of %v", d, grace)
	}
	t.Logf("released %v after the pod left PodResources (grace %v, passes every 20ms)", released.Sub(gone), grace)
	if _, err := h.client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-1", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{gpuID(0)}}); err != nil {
		t.Errorf("Reserve of a released GPU by another owner: %v", err)
	}
}

// An allocation whose pod never shows up in PodResources (the kubelet failed the pod
// after Allocate) is released after the grace period.
func TestReleasesAllocationWithoutPod(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent, withGrace)
	c := h.healthyPlugin(t, ctx)

	// Read before the call: the bridge may start the grace period anywhere inside it,
	// and under load the call's return can come tens of milliseconds after that.
	allocated := time.Now()
	if _, err := allocate(ctx, c, gpuID(4)); err != nil {
		t.Fatal(err)
	}
	res := agent.active()[0]
	released := h.waitReleased(t, ctx, res.ID)
	if d := released.Sub(allocated); d < grace {
		t.Errorf("released %v after Allocate, before the grace period of %v", d, grace)
	}
}

// While PodResources cannot be read (a kubelet restarting) nothing is released, and
// the bridge says so once; when it answers again the usual rule applies.
func TestReleasesNothingWhilePodResourcesFails(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent, withGrace)
	c := h.healthyPlugin(t, ctx)

	h.pods.SetFailing(errors.New("kubelet restarting"))
	if _, err := allocate(ctx, c, gpuID(2)); err != nil {
		t.Fatal(err)
	}
	allocated := time.Now()
	res := agent.active()[0]
	h.passDoneAfter(t, ctx, allocated.Add(3*grace))
	if rs := agent.active(); len(rs) != 1 {
		t.Fatalf("active reservations while PodResources fails: %+v, want %s kept", rs, res.ID)
	}
	if n := strings.Count(h.logs.String(), "cannot list PodResources"); n != 1 {
		t.Errorf("%d log lines about PodResources failing, want 1", n)
	}
	h.pods.SetFailing(nil)
	h.waitReleased(t, ctx, res.ID)
}

// Reservations of other owners are none of the bridge's business; reservations the
// bridge made before it restarted are.
func TestReleasesOnlyItsOwn(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	first := startBridge(t, agent, func(c *kubernetes.Config) { c.ReleaseGrace = time.Hour })
	c := first.healthyPlugin(t, ctx)
	if _, err := allocate(ctx, c, gpuID(3)); err != nil {
		t.Fatal(err)
	}
	ours := agent.active()[0]
	theirs, err := first.client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-42", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{gpuID(7)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := first.stop(); err != nil {
		t.Fatal(err)
	}

	second := startBridge(t, agent, withGrace)
	second.waitReleased(t, ctx, ours.ID)
	second.passDoneAfter(t, ctx, time.Now().Add(grace))
	rs := agent.active()
	if len(rs) != 1 || rs[0].ID != theirs.GetReservationId() {
		t.Errorf("active reservations: %+v, want job-42's %s only", rs, theirs.GetReservationId())
	}
}

// The kubelet allocating the same devices again before any pod held them (its pod
// failed admission, the next pod gets the same devices) gets the same reservation
// back, and its grace period starts again: the new pod has ReleaseGrace to show up in
// PodResources, however long the devices had gone unheld before.
func TestAllocateAgainRestartsTheGracePeriod(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	clock := newFakeClock()
	h := startBridgeWith(t, agent, func(b *kubernetes.Bridge) { kubernetes.SetClock(b, clock.Now) }, withGrace)
	c := h.healthyPlugin(t, ctx)
	pass := func() { // one whole release pass after this point
		t.Helper()
		if err := h.pods.WaitLists(ctx, h.pods.Lists()+2); err != nil {
			t.Fatal(err)
		}
	}

	if _, err := allocate(ctx, c, gpuID(0), gpuID(1)); err != nil { // for pod a, which never shows up
		t.Fatal(err)
	}
	res := agent.active()[0]
	pass()
	clock.Advance(grace * 9 / 10)
	pass()
	if _, err := allocate(ctx, c, gpuID(1), gpuID(0)); err != nil { // for pod b
		t.Fatal(err)
	}
	if rs := agent.active(); len(rs) != 1 || rs[0].ID != res.ID {
		t.Fatalf("active reservations after allocating the same GPUs again: %+v, want %s", rs, res.ID)
	}
	clock.Advance(grace / 2) // 1.4 grace since the first Allocate, 0.5 since the second
	pass()
	if rs := agent.active(); len(rs) != 1 {
		t.Fatalf("%s released %v after it was allocated again, before pod b could show up", res.ID, grace/2)
	}
	clock.Advance(grace / 2)
	h.waitReleased(t, ctx, res.ID)
}

// A reservation handed to a pod that is gone, whose devices the kubelet allocates
// again (to another pod), is released and a new one made: the new pod's reservation is
// not the old pod's.
func TestAllocateAfterPodGoneMakesNewReservation(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent, func(c *kubernetes.Config) { c.ReleaseGrace = time.Hour })
	c := h.healthyPlugin(t, ctx)

	if _, err := allocate(ctx, c, gpuID(0), gpuID(1)); err != nil {
		t.Fatal(err)
	}
	old := agent.active()[0]
	h.pods.SetPods(kubelettest.Pod("ml", "a", "main", gpuResource, gpuID(0), gpuID(1)))
	for {
		if err := h.pods.WaitLists(ctx, h.pods.Lists()+1); err != nil {
			t.Fatal(err)
		}
		if rs := agent.active(); len(rs) == 1 && rs[0].OwnerID == "k8s/ml/a/main" {
			break
		}
	}
	h.pods.SetPods()
	if _, err := allocate(ctx, c, gpuID(0), gpuID(1)); err != nil {
		t.Fatal(err)
	}
	rs := agent.active()
	if len(rs) != 1 || rs[0].ID == old.ID || !strings.HasPrefix(rs[0].OwnerID, "kubelet/nvidia.com/gpu/") {
		t.Errorf("active reservations: %+v, want a new one owned by kubelet/nvidia.com/gpu/..., %s (pod a's) released", rs, old.ID)
	}
	// Taken over in one Reserve, with a prefix for pod a's containers only.
	if got, want := agent.takeOverRequests(), [][]string{{"k8s/ml/a/"}}; !reflect.DeepEqual(got, want) || agent.releaseCount() != 0 {
		t.Errorf("take-over prefixes asked %q and %d Release calls; want %q and none", got, agent.releaseCount(), want)
	}
}

// podHoldsGPUs allocates GPUs 0 and 1 and has PodResources report them held by pod
// ml/a, until the bridge has handed the reservation to it; it returns the reservation.
func podHoldsGPUs(t *testing.T, ctx context.Context, h *harness, c dpapi.DevicePluginClient) device.Reservation {
	t.Helper()
	if _, err := allocate(ctx, c, gpuID(0), gpuID(1)); err != nil {
		t.Fatal(err)
	}
	h.pods.SetPods(kubelettest.Pod("ml", "a", "main", gpuResource, gpuID(0), gpuID(1)))
	for {
		if err := h.pods.WaitLists(ctx, h.pods.Lists()+1); err != nil {
			t.Fatal(err)
		}
		if rs := h.agent.active(); len(rs) == 1 && rs[0].OwnerID == "k8s/ml/a/main" {
			return rs[0]
		}
	}
}

// A device of a reservation whose container the kubelet's PodResources still reports
// is never taken over, even if the kubelet allocates it: the Allocate fails naming the
// holder and the container, and the reservation stays. So does one whose pod cannot
// be checked because PodResources fails.
func TestAllocateNeverTakesOverWhatAPodHolds(t *testing.T) {
	for _, failing := range []bool{false, true} {
		t.Run(map[bool]string{false: "pod reported", true: "PodResources failing"}[failing], func(t *testing.T) {
			ctx := testContext(t)
			agent := startAgent(t, eightGPUs())
			h := startBridge(t, agent, func(c *kubernetes.Config) { c.ReleaseGrace = time.Hour })
			c := h.healthyPlugin(t, ctx)
			held := podHoldsGPUs(t, ctx, h, c)
			want := []string{gpuID(1) + " held by reservation " + held.ID + ` of owner "k8s/ml/a/main"`, "not taken over",
				"container k8s/ml/a/main still holds " + gpuID(0)}
			if failing {
				h.pods.SetFailing(errors.New("kubelet restarting"))
				want[2] = "PodResources: kubelet restarting"
			}

			_, err := allocate(ctx, c, gpuID(1), gpuID(2))
			for _, w := range want {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("Allocate of a GPU pod a holds: %v; want an error containing %q", err, w)
				}
			}
			if rs := agent.active(); len(rs) != 1 || rs[0].ID != held.ID {
				t.Errorf("active reservations: %+v, want only pod a's %s", rs, held.ID)
			}
			if got := agent.takeOverRequests(); len(got) != 0 || agent.releaseCount() != 0 {
				t.Errorf("take-overs asked %q, %d Release calls; want none", got, agent.releaseCount())
			}
		})
	}
}

// Stale reservations of more pods than the agent takes prefixes for in one Reserve are
// taken over with the bridge's two roots, still in one Reserve.
func TestAllocateTakesOverManyPods(t *testing.T) {
	ctx := testContext(t)
	const n = device.MaxTakeOverPrefixes + 2 // more prefixes than the agent takes in one Reserve
	g := device.Group{GroupKey: h100, Plugin: "nvidia-example"}
	for i := range n {
		g.Devices = append(g.Devices, device.DeviceInfo{ID: gpuID(i), Locality: device.Locality{NUMANode: -1}})
	}
	agent := startAgent(t, g)
	h := startBridge(t, agent, func(c *kubernetes.Config) { c.ReleaseGrace = time.Hour })
	c := h.plugin(t, ctx)
	h.waitGPUs(t, ctx, "healthy GPUs", kubelettest.AllHealth(n, dpapi.Healthy))
	var pods []*prapi.PodResources
	all := make([]string, n)
	for i := range n {
		all[i] = gpuID(i)
		if _, err := allocate(ctx, c, gpuID(i)); err != nil {
			t.Fatal(err)
		}
		pods = append(pods, kubelettest.Pod("ml", fmt.Sprint("p", i), "main", gpuResource, gpuID(i)))
	}
	h.pods.SetPods(pods...)
	for {
		if err := h.pods.WaitLists(ctx, h.pods.Lists()+1); err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(agent.active(), func(r device.Reservation) bool { return !strings.HasPrefix(r.OwnerID, "k8s/ml/p") }) {
			break
		}
	}
	h.pods.SetPods()
	if _, err := allocate(ctx, c, all...); err != nil {
		t.Fatalf("Allocate of the GPUs of %d gone pods: %v", n, err)
	}
	if rs := agent.active(); len(rs) != 1 || len(rs[0].DeviceIDs) != n {
		t.Errorf("active reservations %+v, want one of all %d GPUs", rs, n)
	}
	want := [][]string{{"k8s/", "kubelet/" + gpuResource + "/"}}
	if got := agent.takeOverRequests(); !reflect.DeepEqual(got, want) || agent.releaseCount() != 0 {
		t.Errorf("take-over prefixes asked %q and %d Release calls; want %q and none", got, agent.releaseCount(), want)
	}
}
