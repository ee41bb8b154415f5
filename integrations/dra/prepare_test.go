package dra

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/server/servertest"
)

// A Reserve the agent refuses for a held device or a counter over its capacity fails the
// claim in the contract's words: the claim's owner, each holder or counter, once; any
// other refusal as the agent sent it.
func TestReserveErrorWordsRefusals(t *testing.T) {
	const owner = "k8s-claim/default/trainer/0f1e"
	set := device.CounterSetKey{Plugin: "nvidia", Name: "GPU-0"}
	tests := []struct {
		name string
		err  error // what the agent's manager refuses with
		want string
	}{
		{"held", &device.HeldError{OwnerID: owner, Conflicts: []device.Conflict{
			{Holder: device.Holder{ReservationID: "res-1", OwnerID: "k8s/default/legacy/main"}, Overlap: []string{"GPU-1"}, Held: []string{"GPU-1"}},
			{Holder: device.Holder{OwnerID: "nomad/racing"}, Overlap: []string{"GPU-0"}, Held: []string{"GPU-0"}},
		}}, `reserve GPU-0, GPU-1: owner "k8s-claim/default/trainer/0f1e": GPU-1 held by reservation res-1 of owner ` +
			`"k8s/default/legacy/main"; GPU-0 being reserved for owner "nomad/racing": device held`},
		{"over capacity", &device.CapacityError{OwnerID: owner, Overruns: []device.Overrun{
			{Set: set, Counter: "slices", Capacity: 7, Used: 6, Requested: 3, Users: []device.Holder{
				{ReservationID: "res-2", OwnerID: "k8s-claim/default/a/1a2b"}, {ReservationID: "res-3", OwnerID: "nomad/x"}}},
		}}, `reserve GPU-0, GPU-1: owner "k8s-claim/default/trainer/0f1e": counter "slices" of set "GPU-0" (plugin "nvidia"): ` +
			`3 requested, 6 of 7 used by reservation res-2 of owner "k8s-claim/default/a/1a2b", reservation res-3 of owner "nomad/x": ` +
			device.ErrCapacityExceeded.Error()},
		{"unhealthy", fmt.Errorf("devices not healthy: GPU-1: %w", device.ErrUnhealthyDevice),
			"reserve GPU-0, GPU-1: rpc error: code = FailedPrecondition desc = devices not healthy: GPU-1: device unhealthy"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sock := servertest.SocketPath(t)
			servertest.Serve(t, sock, server.Config{Manager: &devicetest.Fake{
				ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
					return device.Reservation{}, tt.err
				},
			}})
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			c, err := client.Dial(ctx, "unix://"+sock)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			ids := []string{"GPU-0", "GPU-1"}
			_, err = c.Reserve(ctx, &pb.ReserveRequest{OwnerId: owner, Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: ids})
			if got := reserveError(ids, err).Error(); got != tt.want {
				t.Errorf("reserveError:\n got %q\nwant %q", got, tt.want)
			}
		})
	}
}

// A claim's owner labels name the pods it is reserved for, sorted and joined by ",",
// as many whole names as fit the agent's bound, and its namespace; consumers that are
// not pods are left out, and a claim reserved for no pod has none.
func TestOwnerLabelsNameTheClaimsPods(t *testing.T) {
	claim := func(consumers ...resourceapi.ResourceClaimConsumerReference) *resourceapi.ResourceClaim {
		c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ml", Name: "gpus"}}
		c.Status.ReservedFor = consumers
		return c
	}
	pod := func(name string) resourceapi.ResourceClaimConsumerReference {
		return resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: name}
	}
	if got := ownerLabels(claim(pod("trainer-1"), resourceapi.ResourceClaimConsumerReference{APIGroup: "apps", Resource: "statefulsets", Name: "x"}, pod("trainer-0"))); !maps.Equal(got, map[string]string{"pod": "trainer-0,trainer-1", "namespace": "ml"}) {
		t.Errorf("two pods and a statefulset: %v; want the pods, sorted", got)
	}
	if got := ownerLabels(claim()); got != nil {
		t.Errorf("no consumer: %v; want none", got)
	}
	var many []resourceapi.ResourceClaimConsumerReference
	for i := range 10 {
		many = append(many, pod(fmt.Sprintf("%d%s", i, strings.Repeat("p", 199)))) // 200 bytes each
	}
	got := ownerLabels(claim(many...))["pod"]
	if n := strings.Count(got, ",") + 1; len(got) > client.MaxOwnerLabelLen || n != 5 || !strings.HasPrefix(got, many[0].Name+","+many[1].Name) {
		t.Errorf("ten pods of 200 bytes: %d bytes, %d names; want the first 5 whole, within %d bytes", len(got), n, client.MaxOwnerLabelLen)
	}
}
