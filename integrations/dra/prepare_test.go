package dra

import (
	"context"
	"fmt"
	"testing"
	"time"

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
