package server_test

import (
	"context"
	"strings"
	"testing"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
)

// TestMinimalManager shows the least a device.Manager must do for the host API to serve
// devices: Watch hands out a snapshot of its devices, and Reserve answers with how a
// container gets them. Every other Fake field is nil: Ready is then ready at once,
// State is empty, and Stats streams end at once. (The server never calls Snapshot or
// LatestStats; the agent's metrics read those, and get this Fake's empty answers.)
func TestMinimalManager(t *testing.T) {
	inventory := device.Inventory{Groups: []device.Group{{
		GroupKey: device.GroupKey{Vendor: "acme", Type: "fpga", Name: "Widget 9000"},
		Plugin:   "acme",
		Devices:  []device.DeviceInfo{{ID: "fpga0", Locality: device.Locality{NUMANode: -1}}},
	}}}
	mgr := &devicetest.Fake{
		WatchFunc: func(ctx context.Context) <-chan device.Snapshot {
			// Latest-value delivery: a buffer of one holding the newest snapshot. A real
			// manager also closes the channel when ctx ends.
			ch := make(chan device.Snapshot, 1)
			ch <- device.Snapshot{Inventory: inventory, State: device.State{
				Devices: map[string]device.DeviceState{"fpga0": {Health: device.HealthHealthy}},
			}}
			return ch
		},
		ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
			return device.Reservation{
				ID: "res-1",
				Container: device.ContainerReservation{
					Envs: map[string]string{"ACME_VISIBLE_DEVICES": strings.Join(req.DeviceIDs, ",")},
				},
			}, nil
		},
	}
	h := startHost(t, mgr)
	ctx := testContext(t)

	hc, err := h.health.Check(ctx, &healthpb.HealthCheckRequest{Service: server.ServiceName})
	if err != nil {
		t.Fatalf("health Check: %v", err)
	}
	if got, want := hc.GetStatus(), healthpb.HealthCheckResponse_SERVING; got != want {
		t.Errorf("health = %v, want %v", got, want)
	}

	stream, err := h.client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	fp, err := stream.Recv()
	if err != nil {
		t.Fatalf("Fingerprint Recv: %v", err)
	}
	if got := len(fp.GetGroups()); got != 1 {
		t.Fatalf("Fingerprint: %d groups, want 1", got)
	}
	dev := fp.GetGroups()[0].GetDevices()[0]
	if got, want := dev.GetId(), "fpga0"; got != want {
		t.Errorf("device ID = %q, want %q", got, want)
	}
	if got, want := dev.GetHealth(), pb.Health_HEALTH_HEALTHY; got != want {
		t.Errorf("device health = %v, want %v", got, want)
	}

	res, err := h.client.Reserve(ctx, &pb.ReserveRequest{
		OwnerId: "alloc-1", Vendor: "acme", Type: "fpga", Name: "Widget 9000", DeviceIds: []string{"fpga0"},
	})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	if got, want := res.GetReservation().GetEnvs()["ACME_VISIBLE_DEVICES"], "fpga0"; got != want {
		t.Errorf("Reserve env ACME_VISIBLE_DEVICES = %q, want %q", got, want)
	}
}
