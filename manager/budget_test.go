package manager

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/inventory"
	"github.com/devicehost/devicehost/manager/supervise"
	"github.com/devicehost/devicehost/pluginloader"
	hostpb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/server/servertest"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/testwait"
	"github.com/devicehost/devicehost/validate"
)

// These tests check that no plugin, nor plugins together, can make a host API message
// too big for the host's clients: they serve the manager with the real
// server and read it with a gRPC client on default options (4 MiB receive limit, as
// grpcurl's and the CLI's).

// serveHostAPI serves m with the real host API server (servertest: the agent's
// server, interceptors and limits, on a Unix socket) and returns a client with gRPC's
// default options. Both are stopped in t.Cleanup.
func serveHostAPI(t *testing.T, m *Manager) hostpb.DeviceHostClient {
	t.Helper()
	agent := servertest.Serve(t, servertest.SocketPath(t), server.Config{Manager: m})
	conn, err := grpc.NewClient(agent.Addr.Target(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return hostpb.NewDeviceHostClient(conn)
}

// fatFixture is a fixture whose fingerprint is about 504 KB (under
// validate.MaxFingerprintBytes) without breaking any per-field rule: 9 groups of one
// device, each with 56,000 bytes of attributes.
func fatFixture(name string) fixture {
	var groups []fixtureplugin.Group
	for g := range 9 {
		groups = append(groups, fixtureplugin.Group{Vendor: "fixture", Type: "fat", Name: fmt.Sprintf("%s-%d", name, g), IDs: []string{fmt.Sprintf("%s-d%d", name, g)}})
	}
	return fixture{name: name, cfg: fixtureplugin.Config{Groups: groups, AttributeBytes: 56000}}
}

// TestSnapshotStaysWithinClientLimit runs a plugin of 1024 devices, all held by an owner
// with the longest owner ID, beside nine plugins of about 504 KB of inventory each:
// together over 4 MiB. The plugins that would take the Fingerprint message over
// inventory.MaxSnapshotBytes are refused with their size and the limit, and a client on default
// options reads the whole inventory.
func TestSnapshotStaysWithinClientLimit(t *testing.T) {
	cfg, logs := testConfig(t)
	cfg.StatsInterval = time.Second
	cfg.ReadyTimeout = time.Hour
	cfg.FingerprintTimeout = time.Minute // a refused plugin is not restarted meanwhile
	var many []string
	for i := range validate.MaxDevicesPerGroup {
		many = append(many, fmt.Sprintf("m%04d", i))
	}
	fixtures := []fixture{{name: "many", cfg: fixtureplugin.Config{Groups: widgets("many", many...)}}}
	var fat []string
	for i := range 9 {
		fat = append(fat, fmt.Sprintf("fat%d", i))
		fixtures = append(fixtures, fatFixture(fat[i]))
	}
	// The budget is first come, first served: "many" fingerprints before the fat
	// plugins are launched, so that it is the fat ones the budget refuses.
	l := &fixtureLauncher{t: t}
	manyIn := make(chan struct{})
	launch := func(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options) (supervise.Plugin, error) {
		if bin.Name != "many" {
			select {
			case <-manyIn:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		return l.launch(ctx, bin, opts)
	}
	m, err := newManager(withFixtures(cfg, fixtures...), launch)
	if err != nil {
		t.Fatalf("newManager: %v", err)
	}
	t.Cleanup(func() { shutdown(t, m) })
	waitSnapshot(t, m, "many's devices", func(s device.Snapshot) bool { return pluginOf(s, "many").DeviceCount == len(many) })
	close(manyIn)
	waitReady(t, m)

	snap := m.Snapshot()
	accepted, refused := 0, 0
	for _, name := range fat {
		switch ps := pluginOf(snap, name); {
		case ps.DeviceCount > 0:
			accepted++
		case strings.Contains(ps.LastError, fmt.Sprintf("fingerprint of plugin %q refused", name)) &&
			strings.Contains(ps.LastError, fmt.Sprintf("limit of %d bytes", inventory.MaxSnapshotBytes)):
			refused++
		default:
			t.Errorf("plugin %s = %+v, want its devices, or a last error saying it was refused and why", name, ps)
		}
	}
	if refused == 0 {
		t.Errorf("all %d fat plugins accepted, want some refused", accepted)
	}

	// Every device of "many" held by an owner with the longest ID there may be.
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: strings.Repeat("o", validate.MaxNameLen), Group: widgetKey("many"), DeviceIDs: many}); err != nil {
		t.Fatalf("Reserve every device of many: %v", err)
	}

	stream, err := serveHostAPI(t, m).Fingerprint(ctx, &hostpb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	msg, err := stream.Recv()
	if err != nil {
		t.Fatalf("a client on default options cannot read the Fingerprint message: %v", err)
	}
	size := proto.Size(msg)
	t.Logf("Fingerprint message: %d bytes with %d of 9 fat plugins accepted (limit %d)", size, accepted, inventory.MaxSnapshotBytes)
	if size > inventory.MaxSnapshotBytes {
		t.Errorf("Fingerprint message is %d bytes, over inventory.MaxSnapshotBytes %d", size, inventory.MaxSnapshotBytes)
	}
	if got := msg.GetGroups()[len(msg.GetGroups())-1].GetDevices()[0].GetHolder().GetOwnerId(); len(got) != validate.MaxNameLen {
		t.Errorf("holder of many's devices not in the message (owner %q)", got)
	}
	logs.waitLine(t, "[ERROR]", "fingerprint refused", "limit of 3670016 bytes")
}

// TestStatsStayWithinClientLimit runs nine plugins whose stats are about 480 KB each:
// together over 4 MiB. The stats that would take the Stats message over
// inventory.MaxStatsSnapshotBytes are refused, and a client on default options reads the stream.
func TestStatsStayWithinClientLimit(t *testing.T) {
	cfg, logs := testConfig(t)
	cfg.StatsInterval = time.Second
	var names []string
	var fixtures []fixture
	for i := range 9 {
		name := fmt.Sprintf("chatty%d", i)
		names = append(names, name)
		fixtures = append(fixtures, fixture{name: name, cfg: fixtureplugin.Config{
			Groups:          widgets(name, name+"-0", name+"-1", name+"-2", name+"-3"),
			StatsValueBytes: 120000,
		}})
	}
	m, _ := startFixtures(t, cfg, fixtures...)
	waitReady(t, m)

	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	// Wait until every plugin's stats were taken or refused.
	var withStats int
	waitStats(t, m.WatchStats(ctx, 0), func(s device.StatsSnapshot) bool {
		snap := m.Snapshot()
		withStats = len(s.Groups)
		settled := withStats
		for _, name := range names {
			if strings.Contains(pluginOf(snap, name).LastError, fmt.Sprintf("stats of plugin %q refused", name)) {
				settled++
			}
		}
		return settled == len(names)
	}, "every plugin's stats taken or refused")
	if withStats == len(names) {
		t.Errorf("stats of all %d plugins taken, want some refused", withStats)
	}

	// Its own deadline: the wait above may have used most of ctx's on a loaded machine.
	sctx, scancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer scancel()
	stream, err := serveHostAPI(t, m).Stats(sctx, &hostpb.StatsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		msg, err := stream.Recv()
		if err != nil {
			t.Fatalf("a client on default options cannot read Stats message %d: %v", i, err)
		}
		size := proto.Size(msg)
		t.Logf("Stats message %d: %d bytes, %d of %d plugins' stats (limit %d)", i, size, len(msg.GetGroups()), len(names), inventory.MaxStatsSnapshotBytes)
		if size > inventory.MaxStatsSnapshotBytes {
			t.Errorf("Stats message is %d bytes, over inventory.MaxStatsSnapshotBytes %d", size, inventory.MaxStatsSnapshotBytes)
		}
	}
	logs.waitLine(t, "[ERROR]", "stats refused", "limit of 3670016 bytes")
	// Refused again every second, logged once.
	for _, name := range names {
		if n := len(logs.lines("[ERROR]", "stats refused", "plugin="+name+" ")); n > 1 {
			t.Errorf("%d \"stats refused\" lines for %s, want one while it stays refused", n, name)
		}
	}
}
