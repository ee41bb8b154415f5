package client_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/server/servertest"
	"github.com/devicehost/devicehost/tools/testwait"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

var h100 = device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3"}

// socketPath returns a socket path in a fresh directory short enough for socket names.
func socketPath(t *testing.T) string { return servertest.SocketPath(t) }

// startAgent serves mgr at path until its Stop (called at cleanup at the latest).
func startAgent(t *testing.T, mgr device.Manager, path string) *servertest.Agent {
	return servertest.Serve(t, path, server.Config{Manager: mgr})
}

// dial connects a client to path and closes it at cleanup.
func dial(t *testing.T, path string, opts ...client.Option) *client.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	c, err := client.Dial(ctx, "unix://"+path, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// inventory is a snapshot of one H100 group with the given device IDs, all healthy.
func inventory(ids ...string) device.Snapshot {
	g := device.Group{GroupKey: h100, Plugin: "nvidia"}
	st := device.State{Devices: map[string]device.DeviceState{}}
	for _, id := range ids {
		g.Devices = append(g.Devices, device.DeviceInfo{ID: id, Locality: device.Locality{NUMANode: -1}})
		st.Devices[id] = device.DeviceState{Health: device.HealthHealthy}
	}
	return device.Snapshot{Time: time.Now(), Inventory: device.Inventory{Groups: []device.Group{g}}, State: st}
}

// watchHolding is a Manager.Watch that delivers snap and then holds the stream open
// until its caller goes away, as the real manager does between changes.
func watchHolding(snap device.Snapshot) func(context.Context) <-chan device.Snapshot {
	return func(context.Context) <-chan device.Snapshot {
		ch := make(chan device.Snapshot, 1)
		ch <- snap
		return ch
	}
}

// next returns the next update from ch, failing the test if ch closes or nothing comes
// in time.
func next[T any](t *testing.T, ch <-chan client.Update[T]) client.Update[T] {
	t.Helper()
	select {
	case u, ok := <-ch:
		if !ok {
			t.Fatal("watch channel closed; it must stay open until ctx ends")
		}
		return u
	case <-time.After(testwait.Timeout):
		t.Fatal("no update from the watch")
	}
	panic("unreachable")
}

// nextSnapshot skips disconnected updates and returns the next snapshot.
func nextSnapshot[T any](t *testing.T, ch <-chan client.Update[T]) T {
	t.Helper()
	for {
		if u := next(t, ch); !u.Disconnected() {
			return u.Snapshot
		}
	}
}

func deviceIDs(fp *pb.FingerprintResponse) []string {
	var ids []string
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			ids = append(ids, d.GetId())
		}
	}
	return ids
}

// waitClosed fails the test unless ch closes (after draining what is left in it).
func waitClosed[T any](t *testing.T, ch <-chan client.Update[T]) {
	t.Helper()
	timeout := time.After(testwait.Timeout)
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-timeout:
			t.Fatal("watch channel still open")
		}
	}
}

func TestWatchDevicesReconnectsAfterTheAgentRestarts(t *testing.T) {
	path := socketPath(t)
	agent := startAgent(t, &devicetest.Fake{WatchFunc: watchHolding(inventory("GPU-gen1"))}, path)
	c := dial(t, path, client.WithBackoff(10*time.Millisecond, 100*time.Millisecond))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	updates := c.WatchDevices(ctx)
	if got := deviceIDs(nextSnapshot(t, updates)); fmt.Sprint(got) != "[GPU-gen1]" {
		t.Fatalf("first snapshot devices = %v, want [GPU-gen1]", got)
	}

	// Twice: stopped, the watch says disconnected (the channel stays open); started
	// again on the same socket, the watch delivers the new agent's snapshot.
	for gen := 2; gen <= 3; gen++ {
		agent.Stop()
		u := next(t, updates)
		if !u.Disconnected() || !client.IsUnavailable(u.Err) || u.Snapshot != nil {
			t.Fatalf("after the agent stopped: %+v, want a disconnected update with an UNAVAILABLE error", u)
		}
		if u.RetryIn <= 0 || u.RetryIn > 100*time.Millisecond {
			t.Errorf("RetryIn = %v, want within (0, 100ms] (the backoff's cap)", u.RetryIn)
		}
		want := fmt.Sprintf("GPU-gen%d", gen)
		agent = startAgent(t, &devicetest.Fake{WatchFunc: watchHolding(inventory(want))}, path)
		if got := deviceIDs(nextSnapshot(t, updates)); fmt.Sprint(got) != "["+want+"]" {
			t.Fatalf("snapshot after restart %d: devices %v, want [%s]", gen-1, got, want)
		}
	}
	cancel()
	waitClosed(t, updates)
}

// A snapshot carries each device that did not change since the last as the last one's
// message (the same pointer): a watcher can tell what changed without comparing.
func TestWatchDevicesSharesTheDevicesThatDidNotChange(t *testing.T) {
	path := socketPath(t)
	free := inventory("GPU-a", "GPU-b", "GPU-c")
	held := free
	held.State = device.State{Devices: maps.Clone(free.State.Devices)}
	held.State.Devices["GPU-b"] = device.DeviceState{Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "res-1", OwnerID: "job"}}
	snaps := make(chan device.Snapshot, 1) // the agent's changes, sent by the test
	snaps <- free
	startAgent(t, &devicetest.Fake{WatchFunc: func(context.Context) <-chan device.Snapshot { return snaps }}, path)
	c := dial(t, path)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	updates := c.WatchDevices(ctx)
	devices := func(fp *pb.FingerprintResponse) map[string]*pb.Device {
		m := map[string]*pb.Device{}
		for _, g := range fp.GetGroups() {
			for _, d := range g.GetDevices() {
				m[d.GetId()] = d
			}
		}
		return m
	}
	first := devices(nextSnapshot(t, updates))
	snaps <- held
	second := devices(nextSnapshot(t, updates))
	for _, id := range []string{"GPU-a", "GPU-c"} {
		if first[id] == nil || first[id] != second[id] {
			t.Errorf("%s did not change: its message %p then %p, want the same", id, first[id], second[id])
		}
	}
	if first["GPU-b"] == second["GPU-b"] || second["GPU-b"].GetHolder().GetReservationId() != "res-1" {
		t.Errorf("GPU-b became held: %v, then %v, want a new message with the holder", first["GPU-b"], second["GPU-b"])
	}
}

func TestWatchStatsReconnectsWithItsRequest(t *testing.T) {
	path := socketPath(t)
	type ask struct {
		interval time.Duration
	}
	asked := make(chan ask, 4)
	mgr := func(value int64) *devicetest.Fake {
		return &devicetest.Fake{WatchStatsFunc: func(_ context.Context, interval time.Duration) <-chan device.StatsSnapshot {
			asked <- ask{interval}
			ch := make(chan device.StatsSnapshot, 1)
			ch <- device.StatsSnapshot{Time: time.Now(), Groups: []device.GroupStats{
				{GroupKey: h100, Plugin: "nvidia", Devices: []device.DeviceStats{{ID: "GPU-0", Values: map[string]device.Value{
					"power": {Kind: device.KindInt, Int: value, Unit: "W"},
				}}}},
				{GroupKey: device.GroupKey{Vendor: "acme", Type: "fpga", Name: "F1"}, Plugin: "acme"},
			}}
			return ch
		}}
	}
	agent := startAgent(t, mgr(100), path)
	c := dial(t, path, client.WithBackoff(10*time.Millisecond, 100*time.Millisecond))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	updates := c.WatchStats(ctx, 2*time.Second, &pb.GroupFilter{Vendor: "nvidia"})
	check := func(want int64) {
		t.Helper()
		s := nextSnapshot(t, updates)
		if len(s.GetGroups()) != 1 || s.GetGroups()[0].GetVendor() != "nvidia" {
			t.Fatalf("stats groups = %v, want the nvidia group only (the filter)", s.GetGroups())
		}
		if got := s.GetGroups()[0].GetDevices()[0].GetValues()["power"].GetIntValue(); got != want {
			t.Errorf("power = %d, want %d", got, want)
		}
		if a := <-asked; a.interval != 2*time.Second {
			t.Errorf("interval asked = %v, want 2s", a.interval)
		}
	}
	check(100)
	agent.Stop()
	if u := next(t, updates); !u.Disconnected() {
		t.Fatalf("after the agent stopped: %+v, want disconnected", u)
	}
	startAgent(t, mgr(200), path)
	check(200)
}

func TestWatchStartsBeforeTheAgent(t *testing.T) {
	path := socketPath(t)
	c := dial(t, path, client.WithoutReachCheck(), client.WithBackoff(10*time.Millisecond, 50*time.Millisecond))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	updates := c.WatchDevices(ctx)
	if u := next(t, updates); !u.Disconnected() || !client.IsUnavailable(u.Err) {
		t.Fatalf("first update with no agent: %+v, want disconnected and UNAVAILABLE", u)
	}
	startAgent(t, &devicetest.Fake{WatchFunc: watchHolding(inventory("GPU-0"))}, path)
	if got := deviceIDs(nextSnapshot(t, updates)); fmt.Sprint(got) != "[GPU-0]" {
		t.Errorf("devices = %v, want [GPU-0]", got)
	}
}

func TestCloseEndsWatches(t *testing.T) {
	path := socketPath(t)
	startAgent(t, &devicetest.Fake{WatchFunc: watchHolding(inventory("GPU-0"))}, path)
	c := dial(t, path)
	devices := c.WatchDevices(context.Background())
	stats := c.WatchStats(context.Background(), 0)
	nextSnapshot(t, devices)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, devices)
	waitClosed(t, stats)
	if _, ok := <-c.WatchDevices(context.Background()); ok {
		t.Error("WatchDevices on a closed client delivered an update, want a closed channel")
	}
}

func TestDialErrors(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	for _, tt := range []struct {
		name, address string
		opts          []client.Option
	}{
		{"no scheme", "localhost:80", nil},
		{"tcp without TLS", "tcp://127.0.0.1:1", nil},
		{"insecure off loopback", "tcp://10.0.0.1:1", []client.Option{client.WithInsecure()}},
		{"TLS on a unix socket", "unix:///tmp/x.sock", []client.Option{client.WithTLS(endpoint.TLS{CA: "/etc/ca.pem"})}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := client.Dial(ctx, tt.address, tt.opts...)
			var ce *endpoint.ConfigError
			if !errors.As(err, &ce) {
				t.Errorf("Dial(%q) = %v, want an *endpoint.ConfigError", tt.address, err)
			}
		})
	}

	path := socketPath(t)
	_, err := client.Dial(ctx, "unix://"+path)
	if !client.IsUnavailable(err) || !strings.HasPrefix(err.Error(), "cannot reach agent at unix://"+path+": ") ||
		!strings.Contains(err.Error(), "no such file or directory") {
		t.Errorf("Dial of a missing socket = %v, want UNAVAILABLE naming the address and why", err)
	}
	if status.Code(err) != codes.Unavailable {
		t.Errorf("status.Code = %v, want Unavailable", status.Code(err))
	}
}

func TestErrorsToBranchOn(t *testing.T) {
	held := &device.HeldError{OwnerID: "job-43", Conflicts: []device.Conflict{
		{Holder: device.Holder{ReservationID: "res-1", OwnerID: "job-42"}, Overlap: []string{"GPU-0"}, Held: []string{"GPU-0", "GPU-1"}},
	}}
	tests := []struct {
		name                                        string
		err                                         error
		held, unknown, unhealthy, unavail, notFound bool
	}{
		{"held", fmt.Errorf("record reservation: %w", held), true, false, false, false, false},
		{"unknown device", fmt.Errorf("devices GPU-9 are not in group x: %w", device.ErrUnknownDevice), false, true, false, false, false},
		{"unhealthy", fmt.Errorf("devices not healthy: GPU-1: %w", device.ErrUnhealthyDevice), false, false, true, false, false},
		{"plugin down", fmt.Errorf(`plugin "nvidia" is restarting: %w`, device.ErrPluginUnavailable), false, false, false, true, false},
		{"shutting down", device.ErrShuttingDown, false, false, false, true, false},
		{"no such reservation", fmt.Errorf("reservation x: %w", device.ErrNotFound), false, false, false, false, true},
		{"bad request", &device.FieldError{Field: "owner_id", Rule: "must not be empty"}, false, false, false, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := socketPath(t)
			startAgent(t, &devicetest.Fake{
				ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
					return device.Reservation{}, tt.err
				},
				ReleaseFunc: func(context.Context, device.ReleaseRequest) (device.ReleaseResult, error) {
					return device.ReleaseResult{}, tt.err
				},
			}, path)
			c := dial(t, path)
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
			defer cancel()
			_, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-43", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{"GPU-0"}})
			if err == nil {
				t.Fatal("Reserve succeeded")
			}
			if _, relErr := c.ReleaseReservation(ctx, "x"); client.Reason(relErr) != client.Reason(err) {
				t.Errorf("Release reason %q, Reserve reason %q: want the same for the same error", client.Reason(relErr), client.Reason(err))
			}
			gotHeld, isHeld := client.IsHeld(err)
			got := [5]bool{isHeld, client.IsUnknownDevice(err), client.IsUnhealthy(err), client.IsUnavailable(err), client.IsReservationNotFound(err)}
			want := [5]bool{tt.held, tt.unknown, tt.unhealthy, tt.unavail, tt.notFound}
			if got != want {
				t.Errorf("IsHeld, IsUnknownDevice, IsUnhealthy, IsUnavailable, IsReservationNotFound = %v, want %v (err %v)", got, want, err)
			}
			if !tt.held {
				return
			}
			wantHeld := &pb.DeviceHeld{OwnerId: "job-43", Conflicts: []*pb.DeviceConflict{
				{ReservationId: "res-1", OwnerId: "job-42", DeviceIds: []string{"GPU-0"}, HeldDeviceIds: []string{"GPU-0", "GPU-1"}},
			}}
			if !proto.Equal(gotHeld, wantHeld) {
				t.Errorf("IsHeld holders = %v, want %v", gotHeld, wantHeld)
			}
		})
	}
	if _, ok := client.IsHeld(errors.New("plain")); ok || client.IsUnavailable(nil) || client.Reason(nil) != "" {
		t.Error("a plain error or nil is none of the kinds")
	}
}

// A Reserve over a shared counter's capacity is its own kind, with the counter, its
// figures and its users, and is not a held device.
func TestIsCapacityExceeded(t *testing.T) {
	path := socketPath(t)
	startAgent(t, &devicetest.Fake{ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
		return device.Reservation{}, fmt.Errorf("record reservation: %w", &device.CapacityError{OwnerID: "job-43", Overruns: []device.Overrun{{
			Set: device.CounterSetKey{Plugin: "nvidia", Name: "GPU-0"}, Counter: "memory-slice-3",
			Capacity: 1, Used: 1, Requested: 1, Users: []device.Holder{{ReservationID: "res-1", OwnerID: "job-42"}},
		}}})
	}}, path)
	c := dial(t, path)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	_, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-43", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{"MIG-0-3"}})
	ce, ok := client.IsCapacityExceeded(err)
	if _, held := client.IsHeld(err); !ok || held || status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("IsCapacityExceeded %v, IsHeld %v, code %v (err %v): want a capacity refusal alone", ok, held, status.Code(err), err)
	}
	want := &pb.CapacityExceeded{OwnerId: "job-43", Overruns: []*pb.CounterOverrun{{
		Plugin: "nvidia", CounterSet: "GPU-0", Counter: "memory-slice-3", Capacity: 1, Used: 1, Requested: 1,
		Users: []*pb.Holder{{ReservationId: "res-1", OwnerId: "job-42"}},
	}}}
	if !proto.Equal(ce, want) {
		t.Errorf("detail %v, want %v", ce, want)
	}
	if _, ok := client.IsCapacityExceeded(errors.New("plain")); ok {
		t.Error("a plain error is a capacity refusal")
	}
}

// A held or capacity refusal of a real server converts back to the contract's error the
// manager returned: equal to it, with the text the server sent as its message. Other
// errors, and refusals that carry no holder or counter, do not convert.
func TestRefusalsConvertToTheContractsErrors(t *testing.T) {
	held := &device.HeldError{OwnerID: "job-43", Conflicts: []device.Conflict{
		{Holder: device.Holder{ReservationID: "res-1", OwnerID: "job-42"}, Overlap: []string{"GPU-0", "GPU-1"}, Held: []string{"GPU-0", "GPU-1", "GPU-2"}},
		{Holder: device.Holder{ReservationID: "res-2", OwnerID: "job-43"}, Overlap: []string{"GPU-3"}, Held: []string{"GPU-3", "GPU-4"}},
		{Holder: device.Holder{OwnerID: "nomad/racing"}, Overlap: []string{"GPU-5"}, Held: []string{"GPU-5"}},
	}}
	users := func(n int) []device.Holder {
		var out []device.Holder
		for i := range n {
			out = append(out, device.Holder{ReservationID: fmt.Sprintf("res-%d", i), OwnerID: fmt.Sprintf("job-%d", i)})
		}
		return out
	}
	set := device.CounterSetKey{Plugin: "nvidia", Name: "GPU-0"}
	capacity := &device.CapacityError{OwnerID: "job-43", Overruns: []device.Overrun{
		{Set: set, Counter: "compute-slices", Capacity: 7, Used: 7, Requested: 7, Users: users(5)},
		{Set: set, Counter: "memory-slice-0", Capacity: 1, Used: 1, Requested: 1, Users: users(1)},
		{Set: set, Counter: "memory-slice-1", Capacity: 1, Used: 1, Requested: 1},
	}}
	mode := &device.CapacityError{OwnerID: "job-43", Overruns: []device.Overrun{
		{Set: set, Groups: []string{"mps"}, UsersGroups: []string{"time-slicing"}, Users: users(2)},
		{Set: device.CounterSetKey{Plugin: "nvidia", Name: "GPU-1"}, Users: users(1)},
	}}
	tests := []struct {
		name               string
		err                error // what the manager returns
		wantHeld, wantCapa error // what HeldError and CapacityError give; nil for not ok
	}{
		{"held", held, held, nil},
		{"over capacity", capacity, nil, capacity},
		{"in another sharing mode", mode, nil, mode},
		{"held, untyped", fmt.Errorf("GPU-0 held: %w", device.ErrDeviceHeld), nil, nil},
		{"over capacity, untyped", fmt.Errorf("counter full: %w", device.ErrCapacityExceeded), nil, nil},
		{"unknown device", fmt.Errorf("GPU-9: %w", device.ErrUnknownDevice), nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := socketPath(t)
			startAgent(t, &devicetest.Fake{ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
				return device.Reservation{}, tt.err
			}}, path)
			c := dial(t, path)
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
			defer cancel()
			_, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-43", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{"GPU-0"}})
			sent := status.Convert(err).Message()
			if sent != tt.err.Error() {
				t.Fatalf("the server sent %q, want the manager's %q", sent, tt.err.Error())
			}
			gotHeld, okHeld := client.HeldError(err)
			gotCapa, okCapa := client.CapacityError(err)
			for _, k := range []struct {
				kind string
				ok   bool
				got  error
				want error
				is   error
			}{
				{"HeldError", okHeld, gotHeld, tt.wantHeld, device.ErrDeviceHeld},
				{"CapacityError", okCapa, gotCapa, tt.wantCapa, device.ErrCapacityExceeded},
			} {
				switch {
				case k.ok != (k.want != nil):
					t.Errorf("%s ok = %v, want %v", k.kind, k.ok, k.want != nil)
				case !k.ok:
				case !reflect.DeepEqual(k.got, k.want):
					t.Errorf("%s = %#v\nwant the manager's %#v", k.kind, k.got, k.want)
				case k.got.Error() != sent || !errors.Is(k.got, k.is):
					t.Errorf("%s text %q (is %v: %v); want the server's %q", k.kind, k.got.Error(), k.is, errors.Is(k.got, k.is), sent)
				}
			}
		})
	}
	if _, ok := client.HeldError(errors.New("plain")); ok {
		t.Error("a plain error converts to a HeldError")
	}
	if _, ok := client.CapacityError(nil); ok {
		t.Error("nil converts to a CapacityError")
	}
}

// The Reason variables are the API's wire strings, one for each ErrorReason the server
// sends, and the client's domain is the server's.
func TestReasonsAreTheWireStrings(t *testing.T) {
	pairs := [][2]string{
		{client.ErrorDomain, server.ErrorDomain},
		{client.ServiceName, server.ServiceName},
		{client.ReasonInvalidRequest, "INVALID_REQUEST"},
		{client.ReasonDeviceUnknown, "DEVICE_UNKNOWN"},
		{client.ReasonReservationNotFound, "RESERVATION_NOT_FOUND"},
		{client.ReasonDeviceUnhealthy, "DEVICE_UNHEALTHY"},
		{client.ReasonDeviceHeld, "DEVICE_HELD"},
		{client.ReasonCapacityExceeded, "CAPACITY_EXCEEDED"},
		{client.ReasonPluginUnavailable, "PLUGIN_UNAVAILABLE"},
		{client.ReasonShuttingDown, "SHUTTING_DOWN"},
		{client.ReasonPluginResponse, "PLUGIN_RESPONSE_INVALID"},
		{client.ReasonPermissionDenied, "PERMISSION_DENIED"},
		{client.ReasonDeviceCordoned, "DEVICE_CORDONED"},
		{client.ReasonNoCDIDevices, "NO_CDI_DEVICES"},
		{client.ReasonTooManyAccesses, "TOO_MANY_ADMIN_ACCESSES"},
		{client.ReasonOptionsDiffer, "PLUGIN_OPTIONS_DIFFER"},
	}
	for _, p := range pairs {
		if p[0] != p[1] {
			t.Errorf("client has %q where the wire has %q", p[0], p[1])
		}
	}
	if got, want := len(pb.ErrorReason_name)-1, len(pairs)-2; got != want {
		t.Errorf("devicehost.proto has %d error reasons, the client %d", got, want)
	}
}

func TestCalls(t *testing.T) {
	path := socketPath(t)
	reqs := make(chan any, 4)
	startAgent(t, &devicetest.Fake{
		WatchFunc: watchHolding(inventory("GPU-0", "GPU-1")),
		StateFunc: func() device.State {
			return device.State{Plugins: []device.PluginState{{Name: "nvidia", Status: device.PluginRunning, DeviceCount: 2}}}
		},
		ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
			reqs <- req
			return device.Reservation{ID: "res-1", Container: device.ContainerReservation{Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-0"}},
				TakenOver: []string{"res-0"}}, nil
		},
		ReleaseFunc: func(_ context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
			reqs <- req
			return device.ReleaseResult{Released: []string{"res-2"}, AlreadyReleased: []string{"res-1"}}, nil
		},
		ReservationsFunc: func(_ context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
			reqs <- f
			return []device.Reservation{{ID: "res-1", OwnerID: "job-42", State: device.ReservationReleased}}, nil
		},
	}, path)
	c := dial(t, path)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if err := c.WaitServing(ctx); err != nil {
		t.Fatalf("WaitServing: %v", err)
	}

	fp, err := c.Devices(ctx)
	if err != nil || fmt.Sprint(deviceIDs(fp)) != "[GPU-0 GPU-1]" {
		t.Errorf("Devices = %v, %v; want GPU-0 and GPU-1", deviceIDs(fp), err)
	}
	res, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-42", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{"GPU-0"},
		TakeOverOwnerPrefixes: []string{"job/"}})
	if err != nil || res.GetReservationId() != "res-1" || res.GetReservation().GetEnvs()["NVIDIA_VISIBLE_DEVICES"] != "GPU-0" ||
		!slices.Equal(res.GetTakenOverReservationIds(), []string{"res-0"}) {
		t.Errorf("Reserve = %v, %v", res, err)
	}
	if got := <-reqs; !reflect.DeepEqual(got, device.ReserveRequest{OwnerID: "job-42", Group: h100, DeviceIDs: []string{"GPU-0"}, TakeOverOwnerPrefixes: []string{"job/"}}) {
		t.Errorf("manager got %+v", got)
	}
	rel, err := c.ReleaseOwner(ctx, "job-42")
	if err != nil || fmt.Sprint(rel.GetReleasedReservationIds(), rel.GetAlreadyReleasedReservationIds()) != "[res-2] [res-1]" {
		t.Errorf("ReleaseOwner = %v, %v; want res-2 released now, res-1 before", rel, err)
	}
	if got := <-reqs; !reflect.DeepEqual(got, device.ReleaseRequest{OwnerID: "job-42"}) {
		t.Errorf("manager got %+v, want a release by owner", got)
	}
	if _, err := c.ReleaseReservation(ctx, "res-1"); err != nil {
		t.Error(err)
	}
	if got := <-reqs; !reflect.DeepEqual(got, device.ReleaseRequest{ReservationID: "res-1"}) {
		t.Errorf("manager got %+v, want a release by ID", got)
	}
	rs, err := c.Reservations(ctx, nil)
	if err != nil || len(rs) != 1 || rs[0].GetOwnerId() != "job-42" {
		t.Errorf("Reservations = %v, %v", rs, err)
	}
	if got := <-reqs; got != (device.ReservationFilter{}) {
		t.Errorf("manager got %+v, want an empty filter", got)
	}
	ps, err := c.Plugins(ctx)
	if err != nil || len(ps) != 1 || ps[0].GetName() != "nvidia" || ps[0].GetDeviceCount() != 2 {
		t.Errorf("Plugins = %v, %v", ps, err)
	}
}

func TestWatchEndsQuietlyAtItsDeadline(t *testing.T) {
	path := socketPath(t)
	startAgent(t, &devicetest.Fake{WatchFunc: watchHolding(inventory("GPU-0"))}, path)
	c := dial(t, path)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	for u := range c.WatchDevices(ctx) {
		// The end of the watch is the channel closing, not a disconnection.
		if u.Disconnected() {
			t.Errorf("update %+v at the watch's deadline, want the channel to close", u)
		}
	}
	if ctx.Err() == nil {
		t.Error("watch channel closed before its context ended")
	}
}

func TestReservationsPastFourMiB(t *testing.T) {
	// A ledger allowed to keep many reservations answers ListReservations with more than
	// gRPC's default 4 MiB.
	path := socketPath(t)
	big := strings.Repeat("x", 2048)
	startAgent(t, &devicetest.Fake{ReservationsFunc: func(context.Context, device.ReservationFilter) ([]device.Reservation, error) {
		rs := make([]device.Reservation, 3000)
		for i := range rs {
			rs[i] = device.Reservation{ID: fmt.Sprint("res-", i), OwnerID: "o", DeviceIDs: []string{"GPU-0"},
				Container: device.ContainerReservation{Envs: map[string]string{"PAD": big}}}
		}
		return rs, nil
	}}, path)
	c := dial(t, path)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	rs, err := c.Reservations(ctx, nil)
	if err != nil || len(rs) != 3000 {
		t.Errorf("Reservations of ~6 MiB: %d, %v; want all 3000", len(rs), err)
	}
}
