package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"

	dhclient "github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/tools/agenttest"
	"github.com/devicehost/devicehost/tools/proc"
)

// The end-to-end tests run the devicehost binary (agenttest.Binary, built once) as a
// real process: plugin re-executed from the same binary, real sockets, real signals.

func cleanupE2E() {
	agenttest.RemoveBinary()
	if fixtureBuild.dir != "" {
		os.RemoveAll(fixtureBuild.dir)
	}
}

// agentProcess is a running `devicehost agent` (or another devicehost command) and the
// address it serves on.
type agentProcess struct {
	*agenttest.Process
	addr endpoint.Address
}

// startDevAgent runs `devicehost agent -dev -log-json` on a socket in a fresh directory.
func startDevAgent(t *testing.T) *agentProcess {
	t.Helper()
	addr := endpoint.Address{Network: "unix", Path: filepath.Join(tempDir(t, "dhe2e"), "devicehost.sock")}
	return startAgentProcess(t, addr, "agent", "-dev", "-log-json", "-listen", addr.String())
}

// tempDir makes a fresh directory under the system's temp dir, with a name short
// enough for Unix socket paths (t.TempDir's names carry the test's name), and removes it
// in Cleanup.
func tempDir(t testing.TB, prefix string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// startAgentProcess runs the devicehost binary with args, a command line that serves
// on addr, as agenttest.Start does (stdout and stderr recorded apart).
func startAgentProcess(t testing.TB, addr endpoint.Address, args ...string) *agentProcess {
	t.Helper()
	// A SIGKILLed -dev agent cannot remove its temporary directory: give it a TMPDIR the
	// test removes. Not t.TempDir: its long name would push the socket path past the
	// 108-byte limit of a Unix socket name.
	return startAgentProcessIn(t, tempDir(t, "dh-e2e"), addr, args...)
}

// startAgentProcessIn is startAgentProcess with TMPDIR set to tmp.
func startAgentProcessIn(t testing.TB, tmp string, addr endpoint.Address, args ...string) *agentProcess {
	t.Helper()
	p := agenttest.Start(t, agenttest.Command{Path: agenttest.Binary(t), Args: args, TempDir: tmp})
	return &agentProcess{Process: p, addr: addr}
}

// client connects to the agent and waits until its health is SERVING.
func (a *agentProcess) client(t testing.TB, ctx context.Context) pb.DeviceHostClient {
	t.Helper()
	conn, err := endpoint.Dial(a.addr, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	// The socket may not exist yet: wait for it rather than fail.
	watch, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{Service: server.ServiceName}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("health Watch: %v", err)
	}
	for {
		resp, err := watch.Recv()
		if err != nil {
			t.Fatalf("waiting for SERVING: %v", err)
		}
		if resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return pb.NewDeviceHostClient(conn)
		}
	}
}

// waitFingerprint reads stream until a snapshot satisfies ok and returns it.
func waitFingerprint(t *testing.T, what string, stream grpc.ServerStreamingClient[pb.FingerprintResponse], ok func(*pb.FingerprintResponse) bool) *pb.FingerprintResponse {
	t.Helper()
	for {
		fp, err := stream.Recv()
		if err != nil {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		if ok(fp) {
			return fp
		}
	}
}

// devicesWithHealth returns the IDs of the devices with health h, if every device of
// every group has it; otherwise nil.
func devicesWithHealth(fp *pb.FingerprintResponse, h pb.Health) []string {
	var ids []string
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetHealth() != h {
				return nil
			}
			ids = append(ids, d.GetId())
		}
	}
	return ids
}

// childPID finds the child of parent whose command line contains all of args.
func childPID(t *testing.T, parent int, args ...string) int {
	t.Helper()
	pid, err := findChildPID(parent, args...)
	if err != nil {
		t.Fatal(err)
	}
	if pid == 0 {
		t.Fatalf("no child of %d runs %q", parent, args)
	}
	return pid
}

// findChildPID returns the child of parent whose command line contains all of args, or
// 0 when there is none.
func findChildPID(parent int, args ...string) (int, error) {
	kids, err := proc.Children(parent)
	if err != nil {
		return 0, err
	}
	for _, p := range kids {
		all := p.Argv != nil
		for _, a := range args {
			all = all && strings.Contains(p.Cmdline(), a)
		}
		if all {
			return p.PID, nil
		}
	}
	return 0, nil
}

func TestEndToEndDevAgent(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	agent := startDevAgent(t)
	client := agent.client(t, ctx)

	// Fingerprint: 8 healthy simulated H100s.
	fpStream, err := client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	fp := waitFingerprint(t, "8 healthy GPUs", fpStream, func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)) == 8
	})
	gpus := devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)
	g := fp.GetGroups()[0]
	if g.GetVendor() != "nvidia" || !strings.Contains(g.GetName(), "H100") {
		t.Errorf("group %s/%s/%s, want nvidia H100s", g.GetVendor(), g.GetType(), g.GetName())
	}

	// Reserve two: NVIDIA_VISIBLE_DEVICES names both.
	res, err := client.Reserve(ctx, &pb.ReserveRequest{
		OwnerId: "e2e-alloc", Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName(),
		DeviceIds: gpus[:2],
	})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	visible := res.GetReservation().GetEnvs()["NVIDIA_VISIBLE_DEVICES"]
	for _, id := range gpus[:2] {
		if !strings.Contains(visible, id) {
			t.Errorf("NVIDIA_VISIBLE_DEVICES = %q, does not name %s", visible, id)
		}
	}

	// Another owner asking for one of them learns who holds it: the holder travels typed
	// from the ledger through the manager and the server to the client.
	cl, err := dhclient.Dial(ctx, agent.addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	_, err = cl.Reserve(ctx, &pb.ReserveRequest{
		OwnerId: "e2e-other", Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName(), DeviceIds: gpus[:1],
	})
	held, ok := dhclient.IsHeld(err)
	wantHeld := &pb.DeviceHeld{OwnerId: "e2e-other", Conflicts: []*pb.DeviceConflict{{
		ReservationId: res.GetReservationId(), OwnerId: "e2e-alloc", DeviceIds: gpus[:1], HeldDeviceIds: slices.Sorted(slices.Values(gpus[:2])),
	}}}
	if !ok || !proto.Equal(held, wantHeld) {
		t.Errorf("Reserve of a held GPU: IsHeld = %v, %v (err %v); want %v", held, ok, err, wantHeld)
	}

	// Released twice: the second time says it was released already.
	address := agent.addr.String()
	if got, want := mustRunCLI(t, "release", "-address", address, "-owner", "e2e-alloc"), "released "+res.GetReservationId()+"\n"; got != want {
		t.Errorf("first release: %q, want %q", got, want)
	}
	if got, want := mustRunCLI(t, "release", "-address", address, "-owner", "e2e-alloc"), "already released "+res.GetReservationId()+" (nothing done)\n"; got != want {
		t.Errorf("second release: %q, want %q", got, want)
	}
	if r := runCLI(t, "release", "-address", address, "-reservation", "res-nope"); r.code != 1 ||
		r.stderr != "devicehost: release: reservation \"res-nope\": not found (NotFound)\n" {
		t.Errorf("release of an unknown ID: exit %d stderr %q, want one release: prefix and NotFound", r.code, r.stderr)
	}

	// An unknown device is told in the same words whether the CLI looked its group up
	// or was given it (and the agent's manager refused it).
	for _, args := range [][]string{
		{"-vendor", g.GetVendor(), "-type", g.GetType(), "-name", g.GetName()},
		nil,
	} {
		r := runCLI(t, append([]string{"reserve", "-address", address, "-owner", "e2e-x", "-device", "GPU-nope"}, args...)...)
		if !regexp.MustCompile(`^devicehost: reserve: device GPU-nope is not in [^:]+: unknown device \(NotFound\)\n$`).MatchString(r.stderr) || r.code != 1 {
			t.Errorf("reserve %v of an unknown device: exit %d stderr %q, want exit 1 and `devicehost: reserve: device GPU-nope is not in ...: unknown device (NotFound)`",
				args, r.code, r.stderr)
		}
	}

	// Stats: values for all 8.
	statsCtx, stopStats := context.WithCancel(ctx)
	stats, err := client.Stats(statsCtx, &pb.StatsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for {
		resp, err := stats.Recv()
		if err != nil {
			t.Fatalf("waiting for stats of 8 GPUs: %v", err)
		}
		withValues := 0
		for _, gs := range resp.GetGroups() {
			for _, d := range gs.GetDevices() {
				if len(d.GetValues()) > 0 {
					withValues++
				}
			}
		}
		if withValues == 8 {
			break
		}
	}
	stopStats()

	// SIGKILL the plugin: its devices turn unhealthy, then healthy after the restart.
	pluginPID := childPID(t, agent.Cmd.Process.Pid, "plugin", "nvidia-example")
	if err := syscall.Kill(pluginPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFingerprint(t, "8 unhealthy GPUs after the plugin was killed", fpStream, func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_UNHEALTHY)) == 8
	})
	waitFingerprint(t, "8 healthy GPUs after the plugin restarted", fpStream, func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)) == 8
	})
	if restarted := childPID(t, agent.Cmd.Process.Pid, "plugin", "nvidia-example"); restarted == pluginPID {
		t.Errorf("plugin PID %d unchanged after SIGKILL", restarted)
	}

	// A line the plugin itself logged (its "simulated GPUs" line, with the machine it
	// simulates) comes out of the agent's log, as JSON, under the plugin's name alone.
	if _, err := agent.Stderr.Wait(ctx, func(l string) bool {
		var m struct {
			Level   string `json:"@level"`
			Module  string `json:"@module"`
			Machine string `json:"machine"`
		}
		return json.Unmarshal([]byte(l), &m) == nil && m.Level == "info" && m.Module == devPluginName && m.Machine == "dgxh100"
	}); err != nil {
		t.Errorf("no INFO line from the plugin under %s in the agent's log: %v", devPluginName, err)
	}

	// SIGTERM: exit 0 within a few seconds, socket and dev directory removed, plugin gone.
	banner, err := agent.Stdout.Wait(ctx, func(l string) bool { return strings.Contains(l, "is removed on exit") })
	if err != nil {
		t.Fatalf("no dev banner: %v", err)
	}
	devDir := regexp.MustCompile(`\((\S+) is removed on exit\)`).FindStringSubmatch(banner)[1]
	pluginPID = childPID(t, agent.Cmd.Process.Pid, "plugin", "nvidia-example")
	if err := agent.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-agent.Exited():
	case <-time.After(15 * time.Second):
		t.Fatal("agent still running 15s after SIGTERM")
	}
	if agent.Err() != nil {
		t.Errorf("agent exit: %v, want exit status 0", agent.Err())
	}
	if _, err := os.Stat(agent.addr.Path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket %s still there after exit (%v)", agent.addr.Path, err)
	}
	if _, err := os.Stat(devDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("dev directory %s still there after exit (%v)", devDir, err)
	}
	if err := syscall.Kill(pluginPID, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("plugin process %d still exists after the agent exited (kill 0: %v)", pluginPID, err)
	}
	for _, l := range agent.Stderr.Lines() {
		if strings.Contains(l, "DATA RACE") || strings.Contains(l, "panic:") {
			t.Errorf("agent log: %s", l)
		}
	}
}
