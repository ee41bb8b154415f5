package server_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
)

var (
	t0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	t1 = t0.Add(time.Minute)

	h100 = device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3"}

	testInventory = device.Inventory{Groups: []device.Group{{
		GroupKey: h100,
		Plugin:   "nvidia",
		Attributes: map[string]device.Value{
			"memory":        {Kind: device.KindInt, Int: 81559, Unit: "MiB"},
			"driver":        {Kind: device.KindString, Str: "550.54"},
			"clock":         {Kind: device.KindFloat, Float: 1.98, Unit: "GHz"},
			"mig_supported": {Kind: device.KindBool, Bool: true},
		},
		Devices: []device.DeviceInfo{
			{ID: "GPU-0", Locality: device.Locality{PCIBusID: "0000:17:00.0", NUMANode: 0}},
			{ID: "GPU-1", Locality: device.Locality{PCIBusID: "0000:2a:00.0", NUMANode: -1}},
		},
	}}}
)

func TestFingerprintStreamsSnapshots(t *testing.T) {
	feed := newWatchFeed()
	h := startHost(t, &devicetest.Fake{WatchFunc: feed.Watch})
	ctx, cancel := context.WithCancel(testContext(t))

	feed.snaps <- device.Snapshot{Time: t0, Inventory: testInventory, State: device.State{
		Devices: map[string]device.DeviceState{
			"GPU-0": {Health: device.HealthHealthy, Since: t0},
			"GPU-1": {Health: device.HealthHealthy, Since: t0},
		},
	}}
	stream, err := h.client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := stream.Recv()
	if err != nil {
		t.Fatalf("first Recv: %v", err)
	}
	group := func(devs ...*pb.Device) *pb.FingerprintResponse {
		return &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{{
			Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3", Plugin: "nvidia",
			Attributes: map[string]*pb.Value{
				"memory":        {Kind: &pb.Value_IntValue{IntValue: 81559}, Unit: "MiB"},
				"driver":        {Kind: &pb.Value_StringValue{StringValue: "550.54"}},
				"clock":         {Kind: &pb.Value_FloatValue{FloatValue: 1.98}, Unit: "GHz"},
				"mig_supported": {Kind: &pb.Value_BoolValue{BoolValue: true}},
			},
			Devices: devs,
		}}}
	}
	want := group(
		&pb.Device{Id: "GPU-0", Health: pb.Health_HEALTH_HEALTHY, HealthSince: timestamppb.New(t0),
			Locality: &pb.Locality{PciBusId: "0000:17:00.0", NumaNode: 0}},
		&pb.Device{Id: "GPU-1", Health: pb.Health_HEALTH_HEALTHY, HealthSince: timestamppb.New(t0),
			Locality: &pb.Locality{PciBusId: "0000:2a:00.0", NumaNode: -1}},
	)
	want.Timestamp = timestamppb.New(t0)
	assertProtoEqual(t, "first snapshot", first, want)

	// A change: GPU-0 held, GPU-1 unhealthy. The next message is the full snapshot again.
	feed.snaps <- device.Snapshot{Time: t1, Inventory: testInventory, State: device.State{
		Devices: map[string]device.DeviceState{
			"GPU-0": {Health: device.HealthHealthy, Since: t0, Holder: &device.Holder{ReservationID: "r1", OwnerID: "alloc-1"}},
			"GPU-1": {Health: device.HealthUnhealthy, Reason: "plugin nvidia exited: signal: killed", Since: t1},
		},
	}}
	second, err := stream.Recv()
	if err != nil {
		t.Fatalf("second Recv: %v", err)
	}
	want = group(
		&pb.Device{Id: "GPU-0", Health: pb.Health_HEALTH_HEALTHY, HealthSince: timestamppb.New(t0),
			Locality: &pb.Locality{PciBusId: "0000:17:00.0", NumaNode: 0},
			Holder:   &pb.Holder{ReservationId: "r1", OwnerId: "alloc-1"}},
		&pb.Device{Id: "GPU-1", Health: pb.Health_HEALTH_UNHEALTHY, HealthReason: "plugin nvidia exited: signal: killed",
			HealthSince: timestamppb.New(t1), Locality: &pb.Locality{PciBusId: "0000:2a:00.0", NumaNode: -1}},
	)
	want.Timestamp = timestamppb.New(t1)
	assertProtoEqual(t, "second snapshot", second, want)

	// The client going away ends the manager watch's context.
	watchCtx := <-feed.ctxs
	cancel()
	select {
	case <-watchCtx.Done():
	case <-testContext(t).Done():
		t.Fatal("watch context not cancelled after the client cancelled the stream")
	}
}

// A Fingerprint stream opened after a Reserve was answered shows the Reserve, though the
// Manager publishes the change to its watch only later (after the reply) and another
// stream's shared feed still holds the snapshot before it; and it then gets the feed's
// changes after that one, without the one it already had again.
func TestFingerprintStartsNoOlderThanAnsweredCalls(t *testing.T) {
	feed := newWatchFeed()
	var current atomic.Pointer[device.Snapshot]
	h := startHost(t, &devicetest.Fake{WatchFunc: feed.Watch,
		SnapshotFunc: func() device.Snapshot { return *current.Load() }})
	ctx := testContext(t)
	free := device.Snapshot{Seq: 1, Time: t0, Inventory: testInventory, State: device.State{Devices: map[string]device.DeviceState{
		"GPU-0": {Health: device.HealthHealthy, Since: t0}, "GPU-1": {Health: device.HealthHealthy, Since: t0}}}}
	held := free
	held.Seq, held.Time = 2, t1
	held.State = device.State{Devices: map[string]device.DeviceState{
		"GPU-0": {Health: device.HealthHealthy, Since: t0, Holder: &device.Holder{ReservationID: "r1", OwnerID: "alloc-1"}},
		"GPU-1": {Health: device.HealthHealthy, Since: t0}}}
	current.Store(&free)
	feed.snaps <- free
	recv := func(what string, s pb.DeviceHost_FingerprintClient) *pb.FingerprintResponse {
		t.Helper()
		m, err := s.Recv()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return m
	}
	holderOf := func(m *pb.FingerprintResponse) string {
		return m.GetGroups()[0].GetDevices()[0].GetHolder().GetReservationId()
	}
	a, err := h.client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if m := recv("stream a's first", a); holderOf(m) != "" {
		t.Fatalf("stream a's first: GPU-0 held by %q, want free", holderOf(m))
	}

	current.Store(&held) // a Reserve answered; its change not yet published
	b, err := h.client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if m := recv("stream b's first", b); holderOf(m) != "r1" || !m.GetTimestamp().AsTime().Equal(t1) {
		t.Fatalf("stream b's first: GPU-0 held by %q at %v, want r1 at %v (the answered Reserve)", holderOf(m), m.GetTimestamp().AsTime(), t1)
	}

	feed.snaps <- held // published now
	if m := recv("stream a's second", a); holderOf(m) != "r1" {
		t.Fatalf("stream a's second: GPU-0 held by %q, want r1", holderOf(m))
	}
	sick := held
	sick.Seq, sick.Time = 3, t1.Add(time.Second)
	sick.State = device.State{Devices: map[string]device.DeviceState{
		"GPU-0": held.State.Devices["GPU-0"],
		"GPU-1": {Health: device.HealthUnhealthy, Reason: "xid 79", Since: sick.Time}}}
	current.Store(&sick)
	feed.snaps <- sick
	m := recv("stream b's second", b)
	if got := m.GetGroups()[0].GetDevices()[1].GetHealth(); got != pb.Health_HEALTH_UNHEALTHY || !m.GetTimestamp().AsTime().Equal(sick.Time) {
		t.Fatalf("stream b's second: GPU-1 %v at %v, want unhealthy at %v (not the held snapshot again)", got, m.GetTimestamp().AsTime(), sick.Time)
	}

	if m := recv("stream a's third", a); !m.GetTimestamp().AsTime().Equal(sick.Time) {
		t.Fatalf("stream a's third at %v, want %v", m.GetTimestamp().AsTime(), sick.Time)
	}

	// Once caught up, a stream takes every change as it comes, even from a Manager
	// whose Seq went back (one that started counting again).
	again := free
	again.Time = t1.Add(time.Minute)
	current.Store(&again)
	feed.snaps <- again
	for _, st := range []struct {
		name string
		s    pb.DeviceHost_FingerprintClient
	}{{"a", a}, {"b", b}} {
		if m := recv("stream "+st.name+"'s change after Seq went back", st.s); holderOf(m) != "" || !m.GetTimestamp().AsTime().Equal(again.Time) {
			t.Fatalf("stream %s: GPU-0 held by %q at %v, want free at %v", st.name, holderOf(m), m.GetTimestamp().AsTime(), again.Time)
		}
	}
}

// Shared capacity reaches the API: each device's consumption and blockers, and the
// counter sets listed devices consume, with their use; a set no listed device
// consumes is left out.
func TestFingerprintCounterSets(t *testing.T) {
	feed := newWatchFeed()
	h := startHost(t, &devicetest.Fake{WatchFunc: feed.Watch})
	gpu0 := device.CounterSetKey{Plugin: "nvidia", Name: "GPU-0"}
	other := device.CounterSetKey{Plugin: "nvidia", Name: "GPU-9"}
	slice := map[string]int64{"compute-slices": 1}
	feed.snaps <- device.Snapshot{
		Inventory: device.Inventory{
			Groups: []device.Group{{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "mig", Name: "1g.10gb"}, Plugin: "nvidia",
				Devices: []device.DeviceInfo{
					{ID: "MIG-0-0", Consumes: []device.Consumption{{Set: gpu0, Counters: slice}}},
					{ID: "MIG-0-1", Consumes: []device.Consumption{{Set: gpu0, Counters: slice}}},
				}}},
			CounterSets: []device.CounterSet{{Key: gpu0, Capacity: map[string]int64{"compute-slices": 1}}, {Key: other, Capacity: slice}},
		},
		State: device.State{
			Devices: map[string]device.DeviceState{
				"MIG-0-0": {Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "r1", OwnerID: "a"}},
				"MIG-0-1": {Health: device.HealthHealthy, BlockedBy: []device.Holder{{ReservationID: "r1", OwnerID: "a"}}},
			},
			CounterUse: map[device.CounterSetKey]map[string]int64{gpu0: slice},
		},
	}
	stream, err := h.client.Fingerprint(testContext(t), &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	devs := got.GetGroups()[0].GetDevices()
	assertProtoEqual(t, "consumption", devs[1].GetConsumes()[0], &pb.CounterConsumption{CounterSet: "GPU-0", Counters: slice})
	assertProtoEqual(t, "blocker", devs[1].GetBlockedBy()[0], &pb.Holder{ReservationId: "r1", OwnerId: "a"})
	if len(devs[0].GetBlockedBy()) != 0 {
		t.Errorf("held device blocked by %v, want none", devs[0].GetBlockedBy())
	}
	if len(got.GetCounterSets()) != 1 {
		t.Fatalf("counter sets %v, want GPU-0 alone", got.GetCounterSets())
	}
	assertProtoEqual(t, "counter set", got.GetCounterSets()[0], &pb.CounterSet{
		Plugin: "nvidia", Name: "GPU-0", Capacity: map[string]int64{"compute-slices": 1}, Used: slice,
	})
}

func TestFingerprintDeviceWithoutStateIsUnknown(t *testing.T) {
	feed := newWatchFeed()
	h := startHost(t, &devicetest.Fake{WatchFunc: feed.Watch})
	feed.snaps <- device.Snapshot{Inventory: testInventory}
	stream, err := h.client.Fingerprint(testContext(t), &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range got.GetGroups()[0].GetDevices() {
		if d.GetHealth() != pb.Health_HEALTH_UNKNOWN {
			t.Errorf("device %s health = %v, want %v", d.GetId(), d.GetHealth(), pb.Health_HEALTH_UNKNOWN)
		}
	}
}

func TestStreamEndsUnavailableWhenManagerClosesIt(t *testing.T) {
	feed := newWatchFeed()
	h := startHost(t, &devicetest.Fake{WatchFunc: feed.Watch})
	close(feed.snaps)
	stream, err := h.client.Fingerprint(testContext(t), &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = stream.Recv()
	if got, want := status.Code(err), codes.Unavailable; got != want {
		t.Errorf("Recv after the manager closed the watch: code %v (%v), want %v", got, err, want)
	}
}

func TestStatsFiltersGroupsAndPassesInterval(t *testing.T) {
	a100 := device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA A100"}
	fpga := device.GroupKey{Vendor: "acme", Type: "fpga", Name: "Widget"}
	snap := device.StatsSnapshot{Time: t1, Groups: []device.GroupStats{
		{GroupKey: h100, Plugin: "nvidia", Devices: []device.DeviceStats{{
			ID: "GPU-0", Time: t0,
			Values: map[string]device.Value{"gpu_utilization": {Kind: device.KindFloat, Float: 42, Unit: "%"}},
		}}},
		{GroupKey: a100, Plugin: "nvidia", Devices: []device.DeviceStats{{ID: "GPU-9", Time: t0}}},
		{GroupKey: fpga, Plugin: "acme", Devices: []device.DeviceStats{{ID: "fpga0", Time: t0}}},
	}}
	intervals := make(chan time.Duration, 1)
	mgr := &devicetest.Fake{WatchStatsFunc: func(ctx context.Context, interval time.Duration) <-chan device.StatsSnapshot {
		intervals <- interval
		ch := make(chan device.StatsSnapshot, 1)
		ch <- snap
		return ch
	}}
	h := startHost(t, mgr)

	tests := []struct {
		name      string
		req       *pb.StatsRequest
		wantIvl   time.Duration
		wantGroup []string
	}{
		{"no filter, default interval", &pb.StatsRequest{}, 0,
			[]string{h100.String(), a100.String(), fpga.String()}},
		{"vendor filter", &pb.StatsRequest{Interval: durationpb.New(5 * time.Second),
			Groups: []*pb.GroupFilter{{Vendor: "nvidia"}}}, 5 * time.Second,
			[]string{h100.String(), a100.String()}},
		{"two filters, name and type", &pb.StatsRequest{
			Groups: []*pb.GroupFilter{{Name: "NVIDIA A100"}, {Type: "fpga"}}}, 0,
			[]string{a100.String(), fpga.String()}},
		{"filter matching nothing", &pb.StatsRequest{
			Groups: []*pb.GroupFilter{{Vendor: "amd"}}}, 0, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(testContext(t))
			defer cancel()
			stream, err := h.client.Stats(ctx, tt.req)
			if err != nil {
				t.Fatal(err)
			}
			got, err := stream.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if ivl := <-intervals; ivl != tt.wantIvl {
				t.Errorf("manager asked for interval %v, want %v", ivl, tt.wantIvl)
			}
			var names []string
			for _, g := range got.GetGroups() {
				names = append(names, g.GetVendor()+"/"+g.GetType()+"/"+g.GetName())
			}
			if fmt.Sprint(names) != fmt.Sprint(tt.wantGroup) {
				t.Errorf("groups = %q, want %q", names, tt.wantGroup)
			}
		})
	}

	t.Run("values converted", func(t *testing.T) {
		stream, err := h.client.Stats(testContext(t), &pb.StatsRequest{Groups: []*pb.GroupFilter{{Name: h100.Name}}})
		if err != nil {
			t.Fatal(err)
		}
		got, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		<-intervals
		want := &pb.StatsResponse{Timestamp: timestamppb.New(t1), Groups: []*pb.GroupStats{{
			Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, Plugin: "nvidia",
			Devices: []*pb.DeviceStats{{
				DeviceId:  "GPU-0",
				Timestamp: timestamppb.New(t0),
				Values:    map[string]*pb.Value{"gpu_utilization": {Kind: &pb.Value_FloatValue{FloatValue: 42}, Unit: "%"}},
			}},
		}}}
		assertProtoEqual(t, "stats", got, want)
	})

	t.Run("negative interval", func(t *testing.T) {
		stream, err := h.client.Stats(testContext(t), &pb.StatsRequest{Interval: durationpb.New(-time.Second)})
		if err != nil {
			t.Fatal(err)
		}
		_, err = stream.Recv()
		assertInvalidField(t, err, "interval")
	})
}

func TestReserveConvertsRequestAndAnswer(t *testing.T) {
	got := make(chan device.ReserveRequest, 1)
	mgr := &devicetest.Fake{ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
		got <- req
		return device.Reservation{ID: "res-7", Container: device.ContainerReservation{
			Envs:       map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-0,GPU-1"},
			Mounts:     []device.Mount{{HostPath: "/usr/lib/x", ContainerPath: "/usr/lib/x", ReadOnly: true}},
			Devices:    []device.DeviceSpec{{HostPath: "/dev/nvidia0", ContainerPath: "/dev/nvidia0", Permissions: "rw"}},
			CDIDevices: []string{"nvidia.com/gpu=GPU-0", "nvidia.com/gpu=GPU-1"},
		}, TakenOver: []string{"res-3", "res-5"}}, nil
	}}
	h := startHost(t, mgr)
	resp, err := h.client.Reserve(testContext(t), &pb.ReserveRequest{
		OwnerId: "alloc-1", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name,
		DeviceIds: []string{"GPU-0", "GPU-1"}, TakeOverOwnerPrefixes: []string{"nomad/", "k8s/ns/"},
	})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	req := <-got
	wantReq := device.ReserveRequest{OwnerID: "alloc-1", Group: h100, DeviceIDs: []string{"GPU-0", "GPU-1"}, TakeOverOwnerPrefixes: []string{"nomad/", "k8s/ns/"}}
	if !reflect.DeepEqual(req, wantReq) {
		t.Errorf("manager got %+v, want %+v", req, wantReq)
	}
	assertProtoEqual(t, "Reserve response", resp, &pb.ReserveResponse{
		TakenOverReservationIds: []string{"res-3", "res-5"},
		ReservationId:           "res-7",
		Reservation: &pb.ContainerReservation{
			Envs:       map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-0,GPU-1"},
			Mounts:     []*pb.Mount{{HostPath: "/usr/lib/x", ContainerPath: "/usr/lib/x", ReadOnly: true}},
			Devices:    []*pb.DeviceSpec{{HostPath: "/dev/nvidia0", ContainerPath: "/dev/nvidia0", Permissions: "rw"}},
			CdiDevices: []string{"nvidia.com/gpu=GPU-0", "nvidia.com/gpu=GPU-1"},
		},
	})
}

// assertInvalidField checks that err is INVALID_ARGUMENT naming field in its message and
// in its google.rpc.BadRequest detail.
func assertInvalidField(t *testing.T, err error, field string) {
	t.Helper()
	st := status.Convert(err)
	if st.Code() != codes.InvalidArgument {
		t.Fatalf("code %v (%v), want %v", st.Code(), err, codes.InvalidArgument)
	}
	if !strings.Contains(st.Message(), field) {
		t.Errorf("message %q does not name field %q", st.Message(), field)
	}
	var fields []string
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				fields = append(fields, v.GetField())
			}
		}
	}
	for _, f := range fields {
		if f == field {
			return
		}
	}
	t.Errorf("BadRequest detail fields %q do not include %q", fields, field)
}

func TestRequestValidation(t *testing.T) {
	var called atomic.Int32
	mgr := &devicetest.Fake{
		ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
			called.Add(1)
			return device.Reservation{}, nil
		},
		ReleaseFunc: func(context.Context, device.ReleaseRequest) (device.ReleaseResult, error) {
			called.Add(1)
			return device.ReleaseResult{}, nil
		},
		ReservationsFunc: func(context.Context, device.ReservationFilter) ([]device.Reservation, error) {
			called.Add(1)
			return nil, nil
		},
	}
	h := startHost(t, mgr)
	ctx := testContext(t)
	good := func() *pb.ReserveRequest {
		return &pb.ReserveRequest{OwnerId: "alloc-1", Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: []string{"GPU-0"}}
	}
	tests := []struct {
		name  string
		call  func() error
		field string
	}{
		{"reserve without owner", func() error {
			r := good()
			r.OwnerId = ""
			_, err := h.client.Reserve(ctx, r)
			return err
		}, "owner_id"},
		{"reserve with a blank owner", func() error {
			r := good()
			r.OwnerId = "   "
			_, err := h.client.Reserve(ctx, r)
			return err
		}, "owner_id"},
		{"reserve with a space-padded owner", func() error {
			r := good()
			r.OwnerId = " job-lead"
			_, err := h.client.Reserve(ctx, r)
			return err
		}, "owner_id"},
		{"release of a space-padded owner", func() error {
			_, err := h.client.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_OwnerId{OwnerId: "job-lead "}})
			return err
		}, "owner_id"},
		{"reserve without group vendor", func() error {
			r := good()
			r.Vendor = ""
			_, err := h.client.Reserve(ctx, r)
			return err
		}, "vendor"},
		{"reserve without devices", func() error {
			r := good()
			r.DeviceIds = nil
			_, err := h.client.Reserve(ctx, r)
			return err
		}, "device_ids"},
		{"reserve with an empty device ID", func() error {
			r := good()
			r.DeviceIds = []string{"GPU-0", ""}
			_, err := h.client.Reserve(ctx, r)
			return err
		}, "device_ids[1]"},
		{"reserve taking over an empty prefix", func() error {
			r := good()
			r.TakeOverOwnerPrefixes = []string{"nomad/", ""}
			_, err := h.client.Reserve(ctx, r)
			return err
		}, "take_over_owner_prefixes[1]"},
		{"reserve taking over a prefix without its slash", func() error {
			r := good()
			r.TakeOverOwnerPrefixes = []string{"nomad"}
			_, err := h.client.Reserve(ctx, r)
			return err
		}, "take_over_owner_prefixes[0]"},
		{"release naming nothing", func() error {
			_, err := h.client.Release(ctx, &pb.ReleaseRequest{})
			return err
		}, "reservation_id"},
		{"list with an unknown state", func() error {
			_, err := h.client.ListReservations(ctx, &pb.ListReservationsRequest{State: pb.ReservationState(99)})
			return err
		}, "state"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assertInvalidField(t, tt.call(), tt.field)
		})
	}
	if n := called.Load(); n != 0 {
		t.Errorf("manager called %d times for invalid requests, want 0", n)
	}
}

func TestErrorCodes(t *testing.T) {
	overrun := &device.CapacityError{OwnerID: "alloc-1", Overruns: []device.Overrun{{
		Set: device.CounterSetKey{Plugin: "nvidia", Name: "GPU-0"}, Counter: "compute-slices",
		Capacity: 7, Used: 7, Requested: 1, Users: []device.Holder{{ReservationID: "r1", OwnerID: "alloc-2"}},
	}}}
	held := &device.HeldError{OwnerID: "alloc-1", Conflicts: []device.Conflict{
		{Holder: device.Holder{ReservationID: "r1", OwnerID: "alloc-2"}, Overlap: []string{"GPU-0"}, Held: []string{"GPU-0", "GPU-1"}},
		{Holder: device.Holder{OwnerID: "alloc-3"}, Overlap: []string{"GPU-2"}, Held: []string{"GPU-2"}},
	}}
	tests := []struct {
		name       string
		err        error
		want       codes.Code
		wantReason string // the ErrorInfo reason as on the wire; "" for no ErrorInfo
	}{
		{"field error", &device.FieldError{Field: "device_ids[0]", Rule: "unknown"}, codes.InvalidArgument, "INVALID_REQUEST"},
		{"invalid request", fmt.Errorf("group: %w", device.ErrInvalidRequest), codes.InvalidArgument, "INVALID_REQUEST"},
		{"unknown device", fmt.Errorf("GPU-9: %w", device.ErrUnknownDevice), codes.NotFound, "DEVICE_UNKNOWN"},
		{"unknown reservation", fmt.Errorf("reservation r9: %w", device.ErrNotFound), codes.NotFound, "RESERVATION_NOT_FOUND"},
		{"unhealthy", fmt.Errorf("GPU-0: %w", device.ErrUnhealthyDevice), codes.FailedPrecondition, "DEVICE_UNHEALTHY"},
		{"held, untyped", fmt.Errorf("GPU-0 held by r1 of alloc-2: %w", device.ErrDeviceHeld), codes.FailedPrecondition, "DEVICE_HELD"},
		{"held, typed and wrapped", fmt.Errorf("record reservation: %w", held), codes.FailedPrecondition, "DEVICE_HELD"},
		{"over shared capacity", fmt.Errorf("record reservation: %w", overrun), codes.FailedPrecondition, "CAPACITY_EXCEEDED"},
		{"retry with other plugin options", &device.OptionsDifferError{OwnerID: "o", ReservationID: "res-1"}, codes.FailedPrecondition, "PLUGIN_OPTIONS_DIFFER"},
		{"plugin down", fmt.Errorf("plugin nvidia: %w", device.ErrPluginUnavailable), codes.Unavailable, "PLUGIN_UNAVAILABLE"},
		{"plugin answer rejected", fmt.Errorf("plugin nvidia: env LD_PRELOAD: %w", device.ErrPluginResponse), codes.Internal, "PLUGIN_RESPONSE_INVALID"},
		{"shutting down", device.ErrShuttingDown, codes.Unavailable, "SHUTTING_DOWN"},
		{"shutting down wins over plugin down", errors.Join(device.ErrPluginUnavailable, device.ErrShuttingDown), codes.Unavailable, "SHUTTING_DOWN"},
		{"joined: bad request wins", errors.Join(device.ErrUnhealthyDevice, &device.FieldError{Field: "owner_id", Rule: "empty"}), codes.InvalidArgument, "INVALID_REQUEST"},
		{"deadline", fmt.Errorf("reserve: %w", context.DeadlineExceeded), codes.DeadlineExceeded, ""},
		{"a gRPC status passes through", status.Error(codes.ResourceExhausted, "too many"), codes.ResourceExhausted, ""},
		{"anything else", errors.New("disk on fire"), codes.Unknown, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mgr := &devicetest.Fake{ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
				return device.Reservation{}, tt.err
			}}
			h := startHost(t, mgr)
			_, err := h.client.Reserve(testContext(t), &pb.ReserveRequest{
				OwnerId: "alloc-1", Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: []string{"GPU-0"},
			})
			st := status.Convert(err)
			if st.Code() != tt.want {
				t.Errorf("code = %v, want %v (err %v)", st.Code(), tt.want, err)
			}
			if tt.want != codes.ResourceExhausted && st.Message() != tt.err.Error() {
				t.Errorf("message = %q, want the domain error's %q", st.Message(), tt.err.Error())
			}
			var reasons []string
			var gotHeld *pb.DeviceHeld
			var gotCapacity *pb.CapacityExceeded
			for _, d := range st.Details() {
				switch d := d.(type) {
				case *errdetails.ErrorInfo:
					if d.GetDomain() != server.ErrorDomain {
						t.Errorf("ErrorInfo domain = %q, want %q", d.GetDomain(), server.ErrorDomain)
					}
					reasons = append(reasons, d.GetReason())
				case *pb.DeviceHeld:
					gotHeld = d
				case *pb.CapacityExceeded:
					gotCapacity = d
				}
			}
			var wantReasons []string
			if tt.wantReason != "" {
				wantReasons = []string{tt.wantReason}
			}
			if !slices.Equal(reasons, wantReasons) {
				t.Errorf("ErrorInfo reasons = %q, want %q", reasons, wantReasons)
			}
			// The holders come from the typed error, whole; an untyped one has none.
			if errors.As(tt.err, new(*device.HeldError)) {
				assertProtoEqual(t, "DeviceHeld detail", gotHeld, &pb.DeviceHeld{OwnerId: "alloc-1", Conflicts: []*pb.DeviceConflict{
					{ReservationId: "r1", OwnerId: "alloc-2", DeviceIds: []string{"GPU-0"}, HeldDeviceIds: []string{"GPU-0", "GPU-1"}},
					{OwnerId: "alloc-3", DeviceIds: []string{"GPU-2"}, HeldDeviceIds: []string{"GPU-2"}},
				}})
			} else if gotHeld != nil {
				t.Errorf("DeviceHeld detail %v on a status that is not a typed held error", gotHeld)
			}
			if errors.As(tt.err, new(*device.CapacityError)) {
				assertProtoEqual(t, "CapacityExceeded detail", gotCapacity, &pb.CapacityExceeded{OwnerId: "alloc-1", Overruns: []*pb.CounterOverrun{{
					Plugin: "nvidia", CounterSet: "GPU-0", Counter: "compute-slices", Capacity: 7, Used: 7, Requested: 1,
					Users: []*pb.Holder{{ReservationId: "r1", OwnerId: "alloc-2"}},
				}}})
			} else if gotCapacity != nil {
				t.Errorf("CapacityExceeded detail %v on a status that is not a capacity error", gotCapacity)
			}
		})
	}
}

func TestPanicInHandlerBecomesInternalAndServerKeepsServing(t *testing.T) {
	var calls atomic.Int32
	mgr := &devicetest.Fake{
		ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
			if calls.Add(1) == 1 {
				panic("reserve exploded")
			}
			return device.Reservation{ID: "res-2"}, nil
		},
		WatchFunc: func(context.Context) <-chan device.Snapshot {
			panic("watch exploded")
		},
	}
	h := startHost(t, mgr)
	ctx := testContext(t)
	req := &pb.ReserveRequest{OwnerId: "alloc-1", Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: []string{"GPU-0"}}

	_, err := h.client.Reserve(ctx, req)
	if got := status.Code(err); got != codes.Internal {
		t.Errorf("Reserve that panics: code %v (%v), want %v", got, err, codes.Internal)
	}
	stream, err := h.client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Internal {
		t.Errorf("Fingerprint that panics: code %v (%v), want %v", status.Code(err), err, codes.Internal)
	}

	res, err := h.client.Reserve(ctx, req)
	if err != nil {
		t.Fatalf("Reserve after a panic: %v, want the server still serving", err)
	}
	if got, want := res.GetReservationId(), "res-2"; got != want {
		t.Errorf("reservation ID = %q, want %q", got, want)
	}

	var sawPanic bool
	for _, l := range h.logs.lines(t) {
		if l["@message"] == "panic in handler" && l["panic"] == "reserve exploded" {
			sawPanic = true
		}
	}
	if !sawPanic {
		t.Error(`no "panic in handler" log line with the panic value`)
	}
}

func TestHealthFollowsReadinessAndShutdown(t *testing.T) {
	ready := make(chan struct{})
	h := startHost(t, &devicetest.Fake{ReadyFunc: func() <-chan struct{} { return ready }})
	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()

	check := func(service string) healthpb.HealthCheckResponse_ServingStatus {
		t.Helper()
		resp, err := h.health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			t.Fatalf("Check(%q): %v", service, err)
		}
		return resp.GetStatus()
	}
	for _, svc := range []string{"", server.ServiceName} {
		if got, want := check(svc), healthpb.HealthCheckResponse_NOT_SERVING; got != want {
			t.Errorf("before ready, Check(%q) = %v, want %v", svc, got, want)
		}
	}

	watch, err := h.health.Watch(ctx, &healthpb.HealthCheckRequest{Service: server.ServiceName})
	if err != nil {
		t.Fatal(err)
	}
	next := func() healthpb.HealthCheckResponse_ServingStatus {
		t.Helper()
		resp, err := watch.Recv()
		if err != nil {
			t.Fatalf("health Watch Recv: %v", err)
		}
		return resp.GetStatus()
	}
	if got, want := next(), healthpb.HealthCheckResponse_NOT_SERVING; got != want {
		t.Fatalf("health Watch first = %v, want %v", got, want)
	}
	close(ready)
	if got, want := next(), healthpb.HealthCheckResponse_SERVING; got != want {
		t.Fatalf("after ready, health Watch = %v, want %v", got, want)
	}
	if got, want := check(""), healthpb.HealthCheckResponse_SERVING; got != want {
		t.Errorf(`after ready, Check("") = %v, want %v`, got, want)
	}

	shutdownDone := make(chan struct{})
	go func() {
		defer close(shutdownDone)
		h.srv.Shutdown(ctx)
	}()
	if got, want := next(), healthpb.HealthCheckResponse_NOT_SERVING; got != want {
		t.Errorf("during shutdown, health Watch = %v, want %v", got, want)
	}
	cancel() // the health Watch is the last open call; Shutdown waits for it
	<-shutdownDone
}

func TestShutdownEndsOpenStreams(t *testing.T) {
	feed := newWatchFeed()
	statsCh := make(chan device.StatsSnapshot, 1)
	statsCh <- device.StatsSnapshot{Time: t0}
	h := startHost(t, &devicetest.Fake{
		WatchFunc:      feed.Watch,
		WatchStatsFunc: func(context.Context, time.Duration) <-chan device.StatsSnapshot { return statsCh },
	})
	ctx := testContext(t)
	feed.snaps <- device.Snapshot{Inventory: testInventory}
	fp, err := h.client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fp.Recv(); err != nil {
		t.Fatal(err)
	}
	st, err := h.client.Stats(ctx, &pb.StatsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}

	// Neither manager channel closes: only the server's shutdown can end the streams
	// before the deadline.
	shutdownCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	h.srv.Shutdown(shutdownCtx)
	if shutdownCtx.Err() != nil {
		t.Errorf("Shutdown waited for its deadline: open streams were not ended")
	}
	for name, recv := range map[string]func() error{
		"Fingerprint": func() error { _, err := fp.Recv(); return err },
		"Stats":       func() error { _, err := st.Recv(); return err },
	} {
		if err := recv(); status.Code(err) != codes.Unavailable {
			t.Errorf("%s after Shutdown: code %v (%v), want %v", name, status.Code(err), err, codes.Unavailable)
		}
	}
}

func TestReleaseAndListReservations(t *testing.T) {
	releases := make(chan device.ReleaseRequest, 1)
	filters := make(chan device.ReservationFilter, 1)
	mgr := &devicetest.Fake{
		ReleaseFunc: func(_ context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
			releases <- req
			return device.ReleaseResult{Released: []string{"r2"}, AlreadyReleased: []string{"r1"}}, nil
		},
		ReservationsFunc: func(_ context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
			filters <- f
			return []device.Reservation{{
				ID: "r1", OwnerID: "alloc-1", Group: h100, Plugin: "nvidia", DeviceIDs: []string{"GPU-0"},
				Container: device.ContainerReservation{Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-0"}},
				State:     device.ReservationReleased, CreatedAt: t0, ReleasedAt: t1, CleanupPending: true,
			}}, nil
		},
	}
	h := startHost(t, mgr)
	ctx := testContext(t)

	rel, err := h.client.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_OwnerId{OwnerId: "alloc-1"}})
	if err != nil {
		t.Fatalf("Release: %v", err)
	}
	if got, want := <-releases, (device.ReleaseRequest{OwnerID: "alloc-1"}); !reflect.DeepEqual(got, want) {
		t.Errorf("manager Release got %+v, want %+v", got, want)
	}
	assertProtoEqual(t, "Release", rel, &pb.ReleaseResponse{
		ReleasedReservationIds: []string{"r2"}, AlreadyReleasedReservationIds: []string{"r1"},
	})

	list, err := h.client.ListReservations(ctx, &pb.ListReservationsRequest{
		DeviceId: "GPU-0", State: pb.ReservationState_RESERVATION_STATE_RELEASED,
	})
	if err != nil {
		t.Fatalf("ListReservations: %v", err)
	}
	if got, want := <-filters, (device.ReservationFilter{DeviceID: "GPU-0", State: device.ReservationReleased}); got != want {
		t.Errorf("manager Reservations got %+v, want %+v", got, want)
	}
	assertProtoEqual(t, "ListReservations", list, &pb.ListReservationsResponse{Reservations: []*pb.Reservation{{
		ReservationId: "r1", OwnerId: "alloc-1", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name,
		Plugin: "nvidia", DeviceIds: []string{"GPU-0"}, State: pb.ReservationState_RESERVATION_STATE_RELEASED,
		Reservation: &pb.ContainerReservation{Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-0"}},
		CreatedAt:   timestamppb.New(t0), ReleasedAt: timestamppb.New(t1), CleanupPending: true,
	}}})
}

func TestReownReservation(t *testing.T) {
	reowns := make(chan device.ReownRequest, 1)
	mgr := &devicetest.Fake{
		ReownFunc: func(_ context.Context, req device.ReownRequest) (device.Reservation, error) {
			reowns <- req
			if req.ReservationID == "r-gone" {
				return device.Reservation{}, fmt.Errorf("reservation %q: %w", req.ReservationID, device.ErrNotFound)
			}
			return device.Reservation{ID: req.ReservationID, OwnerID: req.NewOwnerID, Group: h100, Plugin: "nvidia",
				DeviceIDs: []string{"GPU-0"}, State: device.ReservationActive, CreatedAt: t0}, nil
		},
	}
	h := startHost(t, mgr)
	ctx := testContext(t)

	resp, err := h.client.ReownReservation(ctx, &pb.ReownReservationRequest{ReservationId: "r1", OwnerId: "kubelet/x", NewOwnerId: "k8s/ml/a/main"})
	if err != nil {
		t.Fatalf("ReownReservation: %v", err)
	}
	if got, want := <-reowns, (device.ReownRequest{ReservationID: "r1", OwnerID: "kubelet/x", NewOwnerID: "k8s/ml/a/main"}); got != want {
		t.Errorf("manager Reown got %+v, want %+v", got, want)
	}
	assertProtoEqual(t, "ReownReservation", resp, &pb.ReownReservationResponse{Reservation: &pb.Reservation{
		ReservationId: "r1", OwnerId: "k8s/ml/a/main", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, Plugin: "nvidia",
		DeviceIds: []string{"GPU-0"}, State: pb.ReservationState_RESERVATION_STATE_ACTIVE,
		Reservation: &pb.ContainerReservation{}, CreatedAt: timestamppb.New(t0),
	}})

	_, err = h.client.ReownReservation(ctx, &pb.ReownReservationRequest{ReservationId: "r-gone", OwnerId: "a", NewOwnerId: "b"})
	if status.Code(err) != codes.NotFound {
		t.Errorf("ReownReservation of an unknown reservation: %v, want NotFound", err)
	}
	<-reowns
	_, err = h.client.ReownReservation(ctx, &pb.ReownReservationRequest{ReservationId: "r1", OwnerId: "a"})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "new_owner_id") {
		t.Errorf("ReownReservation without a new owner: %v, want InvalidArgument naming new_owner_id", err)
	}
	select {
	case req := <-reowns:
		t.Errorf("an invalid request reached the manager: %+v", req)
	default:
	}
}

func TestListPlugins(t *testing.T) {
	mgr := &devicetest.Fake{StateFunc: func() device.State {
		return device.State{Plugins: []device.PluginState{
			{Name: "acme", Version: "1.0.0", Path: "/opt/p/acme", Status: device.PluginFailed, Restarts: 5,
				LastError: "exit status 2", LastErrorAt: t0},
			{Name: "nvidia", Version: "0.1.0", Path: "/opt/p/nvidia", Status: device.PluginRestarting, Restarts: 1,
				NextRetry: t1, DeviceCount: 8},
		}}
	}}
	h := startHost(t, mgr)
	got, err := h.client.ListPlugins(testContext(t), &pb.ListPluginsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	assertProtoEqual(t, "ListPlugins", got, &pb.ListPluginsResponse{Plugins: []*pb.Plugin{
		{Name: "acme", Version: "1.0.0", Path: "/opt/p/acme", Status: pb.PluginStatus_PLUGIN_STATUS_FAILED,
			Restarts: 5, LastError: "exit status 2", LastErrorAt: timestamppb.New(t0)},
		{Name: "nvidia", Version: "0.1.0", Path: "/opt/p/nvidia", Status: pb.PluginStatus_PLUGIN_STATUS_RESTARTING,
			Restarts: 1, NextRetry: timestamppb.New(t1), DeviceCount: 8},
	}})
}

func TestOneLogLinePerCall(t *testing.T) {
	h := startHost(t, &devicetest.Fake{})
	ctx := testContext(t)
	if _, err := h.client.ListPlugins(ctx, &pb.ListPluginsRequest{}); err != nil {
		t.Fatal(err)
	}
	_, err := h.client.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: "nope"}})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("Release of an unknown reservation: %v, want NotFound", err)
	}

	tests := []struct {
		method    string
		wantCode  string
		wantLevel string
		wantError bool
	}{
		{"/devicehost.v1.DeviceHost/ListPlugins", "OK", "info", false},
		{"/devicehost.v1.DeviceHost/Release", "NotFound", "info", true},
	}
	for _, tt := range tests {
		h.logs.waitCallLines(t, tt.method, 1)
	}
	// Every call is logged as it ends: one more call, answered and logged, and no line
	// was written twice meanwhile.
	if _, err := h.client.ListReservations(ctx, &pb.ListReservationsRequest{}); err != nil {
		t.Fatal(err)
	}
	h.logs.waitCallLines(t, "/devicehost.v1.DeviceHost/ListReservations", 1)
	for _, tt := range tests {
		lines := h.logs.callLines(t, tt.method)
		if len(lines) != 1 {
			t.Errorf("%s: %d log lines, want 1: %v", tt.method, len(lines), lines)
			continue
		}
		l := lines[0]
		if l["code"] != tt.wantCode || l["@level"] != tt.wantLevel {
			t.Errorf("%s: code %v level %v, want %v %v", tt.method, l["code"], l["@level"], tt.wantCode, tt.wantLevel)
		}
		if d, ok := l["duration"].(string); !ok {
			t.Errorf("%s: no duration in %v", tt.method, l)
		} else if _, err := time.ParseDuration(d); err != nil {
			t.Errorf("%s: duration %q: %v", tt.method, d, err)
		}
		if _, has := l["error"]; has != tt.wantError {
			t.Errorf("%s: error field present = %v, want %v", tt.method, has, tt.wantError)
		}
	}
}

// A client that ends its own stream (devicehost devices takes one snapshot and hangs
// up) is logged at DEBUG; a stream the server ends with an error keeps its level.
func TestEndedStreamsLogLevel(t *testing.T) {
	const method = "/devicehost.v1.DeviceHost/Fingerprint"
	feed := newWatchFeed()
	h := startHost(t, &devicetest.Fake{WatchFunc: feed.Watch})

	ctx, cancel := context.WithCancel(testContext(t))
	feed.snaps <- device.Snapshot{Inventory: testInventory}
	stream, err := h.client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel()
	l := h.logs.waitCallLines(t, method, 1)[0]
	if l["code"] != "Canceled" || l["@level"] != "debug" {
		t.Errorf("a stream its client cancelled: code %v level %v, want Canceled debug: %v", l["code"], l["@level"], l)
	}

	closed := newWatchFeed()
	close(closed.snaps) // the watch ends at once: the server ends the stream UNAVAILABLE
	h = startHost(t, &devicetest.Fake{WatchFunc: closed.Watch})
	stream, err = h.client.Fingerprint(testContext(t), &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("Recv: %v, want Unavailable", err)
	}
	l = h.logs.waitCallLines(t, method, 1)[0]
	if l["code"] != "Unavailable" || l["@level"] != "warn" {
		t.Errorf("a stream the server ended: code %v level %v, want Unavailable warn: %v", l["code"], l["@level"], l)
	}
}

// A unix socket client has no address ("@"): the call log names it by the uid and pid
// the kernel recorded for the connection, where the platform tells them, and otherwise
// leaves the peer out.
func TestCallLogNamesUnixPeer(t *testing.T) {
	h := startHost(t, &devicetest.Fake{})
	if _, err := h.client.ListPlugins(testContext(t), &pb.ListPluginsRequest{}); err != nil {
		t.Fatal(err)
	}
	l := h.logs.waitCallLines(t, "/devicehost.v1.DeviceHost/ListPlugins", 1)[0]
	if p, has := l["peer"]; has {
		t.Errorf("peer = %q, want no peer field for a unix socket client", p)
	}
	if runtime.GOOS != "linux" {
		return
	}
	if got, want := l["peer_uid"], float64(os.Getuid()); got != want {
		t.Errorf("peer_uid = %v, want %v (this process's)", got, want)
	}
	if got, want := l["peer_pid"], float64(os.Getpid()); got != want {
		t.Errorf("peer_pid = %v, want %v (this process's)", got, want)
	}
}

func TestMaxRecvMsgSize(t *testing.T) {
	h := startHost(t, &devicetest.Fake{})
	big := strings.Repeat("x", server.DefaultMaxRecvMsgSize)
	_, err := h.client.Reserve(testContext(t), &pb.ReserveRequest{OwnerId: big})
	if got, want := status.Code(err), codes.ResourceExhausted; got != want {
		t.Errorf("oversized request: code %v (%v), want %v", got, err, want)
	}
}

func TestReflectionListsServices(t *testing.T) {
	h := startHost(t, &devicetest.Fake{})
	stream, err := reflectionpb.NewServerReflectionClient(h.conn).ServerReflectionInfo(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{},
	}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, s := range resp.GetListServicesResponse().GetService() {
		got[s.GetName()] = true
	}
	for _, want := range []string{server.ServiceName, "grpc.health.v1.Health"} {
		if !got[want] {
			t.Errorf("reflection lists %v, missing %s", got, want)
		}
	}
	// GetServiceInfo names the same services, with their methods.
	info := h.srv.GetServiceInfo()
	for name := range got {
		if _, ok := info[name]; !ok {
			t.Errorf("GetServiceInfo lacks %s, which reflection lists", name)
		}
	}
	var methods []string
	for _, m := range info[server.ServiceName].Methods {
		methods = append(methods, m.Name)
	}
	slices.Sort(methods)
	// Every method the API's .proto declares.
	var want []string
	for _, m := range pb.DeviceHost_ServiceDesc.Methods {
		want = append(want, m.MethodName)
	}
	for _, st := range pb.DeviceHost_ServiceDesc.Streams {
		want = append(want, st.StreamName)
	}
	slices.Sort(want)
	if len(want) < 7 || !slices.Equal(methods, want) {
		t.Errorf("GetServiceInfo methods of %s = %v, want %v", server.ServiceName, methods, want)
	}
}
