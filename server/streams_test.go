package server_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
)

// snapshotWithHolder is testInventory with GPU-0 held by owner.
func snapshotWithHolder(owner string) device.Snapshot {
	return device.Snapshot{Time: t0, Inventory: testInventory, State: device.State{Devices: map[string]device.DeviceState{
		"GPU-0": {Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "r-" + owner, OwnerID: owner}},
	}}}
}

// holderOf returns GPU-0's owner in fp ("" when free or absent).
func holderOf(fp *pb.FingerprintResponse) string {
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetId() == "GPU-0" {
				return d.GetHolder().GetOwnerId()
			}
		}
	}
	return ""
}

// recvOwner receives from stream until GPU-0's owner is want.
func recvOwner(t *testing.T, stream grpc.ServerStreamingClient[pb.FingerprintResponse], want string) {
	t.Helper()
	for {
		fp, err := stream.Recv()
		if err != nil {
			t.Fatalf("waiting for owner %q: %v", want, err)
		}
		if holderOf(fp) == want {
			return
		}
	}
}

func TestStreamLimits(t *testing.T) {
	feed := newWatchFeed()
	h := startHostWith(t, server.Config{
		Manager:           &devicetest.Fake{WatchFunc: feed.Watch},
		MaxStreams:        3,
		MaxStreamsPerConn: 2,
	})
	ctx := testContext(t)
	feed.snaps <- snapshotWithHolder("a")

	open := func(c pb.DeviceHostClient) (grpc.ServerStreamingClient[pb.FingerprintResponse], context.CancelFunc, error) {
		sctx, cancel := context.WithCancel(ctx)
		s, err := c.Fingerprint(sctx, &pb.FingerprintRequest{})
		if err != nil {
			cancel()
			return nil, nil, err
		}
		if _, err := s.Recv(); err != nil {
			cancel()
			return nil, nil, err
		}
		return s, cancel, nil
	}
	mustOpen := func(c pb.DeviceHostClient, what string) (grpc.ServerStreamingClient[pb.FingerprintResponse], context.CancelFunc) {
		t.Helper()
		s, cancel, err := open(c)
		if err != nil {
			t.Fatalf("%s: %v, want a stream (below the limits)", what, err)
		}
		t.Cleanup(cancel)
		return s, cancel
	}
	refused := func(c pb.DeviceHostClient, what, wantInMessage string) {
		t.Helper()
		_, _, err := open(c)
		st := status.Convert(err)
		if st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), wantInMessage) {
			t.Errorf("%s: %v %q, want %v with %q", what, st.Code(), st.Message(), codes.ResourceExhausted, wantInMessage)
		}
	}

	connA := pb.NewDeviceHostClient(h.conn)
	a1, _ := mustOpen(connA, "stream 1 on connection A")
	_, a2cancel := mustOpen(connA, "stream 2 on connection A")
	refused(connA, "stream 3 on connection A", "max_streams_per_connection = 2")

	connB := pb.NewDeviceHostClient(h.dial(t))
	b1, _ := mustOpen(connB, "stream 1 on connection B")
	refused(connB, "stream 2 on connection B (4 in all)", "max_streams = 3")
	if got := h.srv.OpenStreams(); got != 3 {
		t.Errorf("OpenStreams = %d with 3 streams open and 2 refused, want 3", got)
	}
	// Stats counts too.
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	st, err := connB.Stats(sctx, &pb.StatsRequest{})
	if err == nil {
		_, err = st.Recv()
	}
	if status.Code(err) != codes.ResourceExhausted {
		t.Errorf("a Stats stream beyond max_streams: %v, want %v", err, codes.ResourceExhausted)
	}

	// The streams below the limits still work, and so do unary calls on a full connection.
	feed.snaps <- snapshotWithHolder("b")
	recvOwner(t, a1, "b")
	recvOwner(t, b1, "b")
	if _, err := connA.ListPlugins(ctx, &pb.ListPluginsRequest{}); err != nil {
		t.Errorf("ListPlugins on a connection at its stream limit: %v", err)
	}

	// A stream that ends frees its place.
	a2cancel()
	for {
		changed := h.logs.Changed()
		s, cancel, err := open(connA)
		if err == nil {
			t.Cleanup(cancel)
			feed.snaps <- snapshotWithHolder("c")
			recvOwner(t, s, "c")
			if got := h.srv.OpenStreams(); got != 3 {
				t.Errorf("OpenStreams = %d after one of 3 streams ended and another opened, want 3", got)
			}
			break
		}
		// The server counts the ended stream out when its handler returns, which can be
		// just after the client cancelled: a refusal until then is expected. The ended
		// stream is logged once it is counted out, so wait for a log line written since
		// this try began rather than for time.
		if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("stream after one ended: %v", err)
		}
		select {
		case <-changed:
		case <-ctx.Done():
			t.Fatal("the ended stream's place was never freed")
		}
	}
}

// TestUnaryCallsBesideMoreStreamsThanWorkers: every open stream holds one of the
// server's worker goroutines; with more streams open than there are workers, unary
// calls are still served (each on a goroutine of its own).
func TestUnaryCallsBesideMoreStreamsThanWorkers(t *testing.T) {
	feed := newWatchFeed()
	h := startHostWith(t, server.Config{
		Manager: &devicetest.Fake{
			WatchFunc: feed.Watch,
			ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
				return device.Reservation{ID: "r-1"}, nil
			},
		},
		MaxStreamsPerConn: server.StreamWorkers + 8,
	})
	ctx := testContext(t)
	feed.snaps <- snapshotWithHolder("a")
	c := pb.NewDeviceHostClient(h.conn)
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for i := range server.StreamWorkers + 8 {
		s, err := c.Fingerprint(sctx, &pb.FingerprintRequest{})
		if err == nil {
			_, err = s.Recv()
		}
		if err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
	}
	if got, want := h.srv.OpenStreams(), server.StreamWorkers+8; got != want {
		t.Fatalf("OpenStreams = %d, want %d", got, want)
	}
	if _, err := c.ListPlugins(ctx, &pb.ListPluginsRequest{}); err != nil {
		t.Errorf("ListPlugins beside %d streams: %v", server.StreamWorkers+8, err)
	}
	r, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "o", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{"GPU-0"}})
	if err != nil || r.GetReservationId() != "r-1" {
		t.Errorf("Reserve beside %d streams: %v, %v; want r-1", server.StreamWorkers+8, r, err)
	}
}

// bigInventory is one group of n devices with long attributes: about n KiB encoded.
func bigInventory(n int) device.Inventory {
	g := device.Group{GroupKey: h100, Plugin: "nvidia", Attributes: map[string]device.Value{
		"notes": {Kind: device.KindString, Str: strings.Repeat("x", 512)},
	}}
	for i := range n {
		g.Devices = append(g.Devices, device.DeviceInfo{ID: fmt.Sprintf("GPU-%d-%s", i, strings.Repeat("y", 900))})
	}
	return device.Inventory{Groups: []device.Group{g}}
}

func TestNeverReadingStreamBlocksNoOne(t *testing.T) {
	feed := newWatchFeed()
	h := startHost(t, &devicetest.Fake{WatchFunc: feed.Watch})
	ctx := testContext(t)
	inv := bigInventory(16) // ~16 KiB a snapshot: a few fill a stream's 64 KiB window
	snap := func(seq uint64) device.Snapshot {
		return device.Snapshot{Seq: seq, Time: t0.Add(time.Duration(seq) * time.Second), Inventory: inv}
	}
	feed.snaps <- snap(0)

	// Several streams that never read, each on its own connection, so that even their
	// connections' windows fill.
	for i := range 4 {
		c := pb.NewDeviceHostClient(h.dial(t))
		s, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Header(); err != nil { // the handler runs; the stream is never read
			t.Fatalf("stream %d: %v", i, err)
		}
	}
	reader, err := h.client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// 200 snapshots (~3 MiB per stream): each reaches the reader before the next is
	// made, and the manager's channel (a buffer of one) is always taken.
	for seq := uint64(1); seq <= 200; seq++ {
		select {
		case feed.snaps <- snap(seq):
		case <-ctx.Done():
			t.Fatalf("snapshot %d: the server stopped taking the manager's snapshots", seq)
		}
		for {
			fp, err := reader.Recv()
			if err != nil {
				t.Fatalf("reader, waiting for snapshot %d: %v", seq, err)
			}
			if fp.GetTimestamp().AsTime().Equal(snap(seq).Time) {
				break
			}
		}
	}
}

func TestFingerprintStreamsShareOneWatch(t *testing.T) {
	var watches atomic.Int32
	snaps := make(chan device.Snapshot, 1)
	snaps <- snapshotWithHolder("a")
	h := startHost(t, &devicetest.Fake{WatchFunc: func(context.Context) <-chan device.Snapshot {
		watches.Add(1)
		return snaps
	}})
	ctx := testContext(t)
	var streams []grpc.ServerStreamingClient[pb.FingerprintResponse]
	for i := range 5 {
		req := &pb.FingerprintRequest{}
		if i%2 == 1 {
			req.Plugins = []string{"nvidia"}
		}
		s, err := h.client.Fingerprint(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		recvOwner(t, s, "a")
		streams = append(streams, s)
	}
	snaps <- snapshotWithHolder("b")
	for _, s := range streams {
		recvOwner(t, s, "b")
	}
	if got := watches.Load(); got != 1 {
		t.Errorf("5 Fingerprint streams made %d manager watches, want 1", got)
	}
}

func TestFingerprintFilters(t *testing.T) {
	a100 := device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA A100"}
	fpga := device.GroupKey{Vendor: "acme", Type: "fpga", Name: "Widget"}
	inv := device.Inventory{Groups: []device.Group{
		{GroupKey: fpga, Plugin: "acme", Devices: []device.DeviceInfo{{ID: "fpga0"}}},
		{GroupKey: a100, Plugin: "nvidia", Devices: []device.DeviceInfo{{ID: "GPU-9"}}},
		{GroupKey: h100, Plugin: "nvidia", Devices: []device.DeviceInfo{{ID: "GPU-0"}}},
		{GroupKey: h100, Plugin: "nvidia-beta", Devices: []device.DeviceInfo{{ID: "GPU-7"}}},
	}}
	snaps := make(chan device.Snapshot, 1)
	snaps <- device.Snapshot{Time: t0, Inventory: inv}
	h := startHost(t, &devicetest.Fake{WatchFunc: func(context.Context) <-chan device.Snapshot { return snaps }})
	ctx := testContext(t)

	tests := []struct {
		name string
		req  *pb.FingerprintRequest
		want []string // device IDs
	}{
		{"no filter", &pb.FingerprintRequest{}, []string{"fpga0", "GPU-9", "GPU-0", "GPU-7"}},
		{"plugin", &pb.FingerprintRequest{Plugins: []string{"nvidia"}}, []string{"GPU-9", "GPU-0"}},
		{"two plugins", &pb.FingerprintRequest{Plugins: []string{"nvidia-beta", "acme"}}, []string{"fpga0", "GPU-7"}},
		{"group by name", &pb.FingerprintRequest{Groups: []*pb.GroupFilter{{Name: h100.Name}}}, []string{"GPU-0", "GPU-7"}},
		{"group by vendor and type", &pb.FingerprintRequest{Groups: []*pb.GroupFilter{{Vendor: "nvidia", Type: "gpu"}}}, []string{"GPU-9", "GPU-0", "GPU-7"}},
		{"group and plugin", &pb.FingerprintRequest{Groups: []*pb.GroupFilter{{Name: h100.Name}}, Plugins: []string{"nvidia"}}, []string{"GPU-0"}},
		{"matching nothing", &pb.FingerprintRequest{Plugins: []string{"amd"}}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := h.client.Fingerprint(ctx, tt.req)
			if err != nil {
				t.Fatal(err)
			}
			fp, err := s.Recv()
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, g := range fp.GetGroups() {
				for _, d := range g.GetDevices() {
					got = append(got, d.GetId())
				}
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("devices %q, want %q", got, tt.want)
			}
		})
	}

	t.Run("too many filters", func(t *testing.T) {
		s, err := h.client.Fingerprint(ctx, &pb.FingerprintRequest{Plugins: make([]string, 65)})
		if err != nil {
			t.Fatal(err)
		}
		_, err = s.Recv()
		assertInvalidField(t, err, "plugins")
	})
}

func TestStatsPluginFilter(t *testing.T) {
	snap := device.StatsSnapshot{Time: t1, Groups: []device.GroupStats{
		{GroupKey: h100, Plugin: "nvidia", Devices: []device.DeviceStats{{ID: "GPU-0", Time: t0}}},
		{GroupKey: h100, Plugin: "nvidia-beta", Devices: []device.DeviceStats{{ID: "GPU-7", Time: t0}}},
	}}
	h := startHost(t, &devicetest.Fake{WatchStatsFunc: func(context.Context, time.Duration) <-chan device.StatsSnapshot {
		ch := make(chan device.StatsSnapshot, 1)
		ch <- snap
		return ch
	}})
	s, err := h.client.Stats(testContext(t), &pb.StatsRequest{Plugins: []string{"nvidia-beta"}, Groups: []*pb.GroupFilter{{Type: "gpu"}}})
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(got.GetGroups()) != 1 || got.GetGroups()[0].GetPlugin() != "nvidia-beta" {
		t.Errorf("groups %v, want only the nvidia-beta plugin's", got.GetGroups())
	}
}
