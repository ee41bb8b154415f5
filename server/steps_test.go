package server_test

import (
	"context"
	"slices"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/internal/steps"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// TestCallsAreTimedWhileTimingIsOn: with internal/steps timing on (a benchmark build of
// the agent), a Reserve's record spans its headers to its status and holds the server's
// steps and those the manager marked on the call's context.
func TestCallsAreTimedWhileTimingIsOn(t *testing.T) {
	steps.SetTiming(true)
	steps.Take()
	defer func() { steps.SetTiming(false); steps.Take() }()
	mgr := &devicetest.Fake{ReserveFunc: func(ctx context.Context, req device.ReserveRequest) (device.Reservation, error) {
		defer steps.Start(ctx, "plugin").End()
		return device.Reservation{ID: "res-1"}, nil
	}}
	h := startHost(t, mgr)
	if _, err := h.client.Reserve(testContext(t), &pb.ReserveRequest{
		OwnerId: "alloc-1", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{"GPU-0"},
	}); err != nil {
		t.Fatal(err)
	}
	// The record is kept once the status is sent, after the client has its answer.
	var got *steps.Record
	testwait.WaitFor(t, "a record of the Reserve", func() bool { // kept by the server's stats handler
		records, _ := steps.Take()
		for i := range records {
			if records[i].Method == "/devicehost.v1.DeviceHost/Reserve" {
				got = &records[i]
			}
		}
		return got != nil
	})
	var names []string
	for _, s := range got.Steps {
		names = append(names, s.Name)
		if s.Begin.Before(got.Begin) || got.End.Before(s.End) {
			t.Errorf("step %q outside the call", s.Name)
		}
	}
	if !slices.Equal(names, []string{"validate request", "plugin", "reply"}) {
		t.Errorf("steps %q; want the server's validation, the manager's plugin step, the reply", names)
	}
}
