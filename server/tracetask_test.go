package server_test

import (
	"bytes"
	"context"
	"runtime/trace"
	"slices"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/calltrace"
)

// TestTracedCallsAreTasks: while the agent is traced, each call is a task named after its
// method that holds the handler's steps, and the manager's steps run in it (they mark
// their regions in the context the manager gets).
func TestTracedCallsAreTasks(t *testing.T) {
	mgr := &devicetest.Fake{ReserveFunc: func(ctx context.Context, _ device.ReserveRequest) (device.Reservation, error) {
		trace.WithRegion(ctx, "manager step", func() {})
		return device.Reservation{ID: "r1", Container: device.ContainerReservation{Envs: map[string]string{"A": "1"}}}, nil
	}, ReleaseFunc: func(context.Context, device.ReleaseRequest) (device.ReleaseResult, error) {
		return device.ReleaseResult{Released: []string{"r1"}}, nil
	}}
	h := startHost(t, mgr)
	ctx := testContext(t)
	// Untraced: nothing to see, and nothing breaks.
	if _, err := h.client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "o", Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: []string{"GPU-0"}}); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := trace.Start(&buf); err != nil {
		t.Fatal(err)
	}
	_, err := h.client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "o", Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: []string{"GPU-0"}})
	if err == nil {
		_, err = h.client.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: "r1"}})
	}
	if err == nil {
		// The client has its answer before the server ends the call: its call log line
		// comes after the task's end.
		h.logs.waitCallLines(t, "/devicehost.v1.DeviceHost/Release", 1)
	}
	trace.Stop()
	if err != nil {
		t.Fatal(err)
	}
	calls, err := calltrace.Read(&buf)
	if err != nil {
		t.Fatal(err)
	}
	for method, want := range map[string][]string{
		"/devicehost.v1.DeviceHost/Reserve": {"validate request", "manager step", "reply"},
		"/devicehost.v1.DeviceHost/Release": {"validate request"},
	} {
		if len(calls[method]) != 1 {
			t.Fatalf("%s: %d traced calls, want 1 (all: %v)", method, len(calls[method]), calls)
		}
		var got []string
		for _, r := range calls[method][0].Regions {
			got = append(got, r.Name)
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s's steps = %q, want %q", method, got, want)
		}
	}
}

// TestAfterReplyRunsOnceAnswered: what a unary handler defers with device.AfterReply
// runs once the caller has its answer: here it waits for the client to have it, which
// would never happen were it run before the reply.
func TestAfterReplyRunsOnceAnswered(t *testing.T) {
	answered, ran := make(chan struct{}), make(chan struct{})
	mgr := &devicetest.Fake{ReserveFunc: func(ctx context.Context, _ device.ReserveRequest) (device.Reservation, error) {
		device.AfterReply(ctx, func() {
			<-answered
			close(ran)
		})
		return device.Reservation{ID: "r1"}, nil
	}}
	h := startHost(t, mgr)
	ctx := testContext(t)
	if _, err := h.client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "o", Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: []string{"GPU-0"}}); err != nil {
		t.Fatal(err)
	}
	close(answered)
	select {
	case <-ran:
	case <-ctx.Done():
		t.Fatal("the deferred work never ran")
	}
}
