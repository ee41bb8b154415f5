package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// mpsDaemons reads the daemon records under the plugin's mps_dir: pid by directory.
func mpsDaemons(t *testing.T, dir string) map[string]int {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(dir, "*", "*", "daemon.json"))
	out := map[string]int{}
	for _, f := range files {
		out[filepath.Dir(f)] = daemonPID(t, f)
	}
	return out
}

// daemonPID reads the PID of a daemon's record, file (its daemon.json).
func daemonPID(t *testing.T, file string) int {
	t.Helper()
	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var rec struct {
		PID int `json:"pid"`
	}
	if err := json.Unmarshal(raw, &rec); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	return rec.PID
}

// pidRuns says whether pid runs (a zombie does not).
func pidRuns(pid int) bool {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(raw)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(f) > 0 && f[0] != "Z"
}

// newMPSAgentSetup is an agent setup whose nvidia-example plugin simulates a DGX H100
// with MPS shares (sharing = "mps", its daemons under the returned mps_dir, its MIG
// state in a file of the test's), with the plugin config lines pluginLines and the
// agent config lines top before the plugin block.
func newMPSAgentSetup(t *testing.T, top, pluginLines string) (setup agentSetup, mpsDir string) {
	t.Helper()
	return newSharingAgentSetup(t, `"mps"`, top, pluginLines)
}

// newSharingAgentSetup is newMPSAgentSetup with sharing = sharing (HCL).
func newSharingAgentSetup(t *testing.T, sharing, top, pluginLines string) (setup agentSetup, mpsDir string) {
	t.Helper()
	mpsDir = tempDir(t, "mps")
	return newAgentSetup(t, fmt.Sprintf(`%s
plugin "nvidia-example" {
  config {
    simulate       = "dgxh100"
    sharing        = %s
    mps_dir        = %q
    sim_state_file = %q
%s
  }
}
`, top, sharing, mpsDir, filepath.Join(tempDir(t, "dhsim"), "sim.json"), pluginLines)), mpsDir
}

// The nvidia-example plugin's MPS shares through a real agent: the ledger keeps shares
// and their whole GPU apart through the counters; each holder gets its own control
// daemon (per-holder isolation) with its limits; an agent SIGKILLed with live shares
// comes back to the same daemons (adopted, not doubled); a Release stops its daemon; and
// once the last share is released and the agent stopped, no daemon is left.
func TestAgentMPSShares(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	// Under -race every process sleeps 1 s at exit, and the plugin runs a control
	// client (this binary too) for each step of a daemon's start.
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	setup, mpsDir := newMPSAgentSetup(t, "", `    replicas       = 4
    mps_isolation  = "per-holder"`)
	agent := setup.start(t)
	c := agent.client(t, ctx)
	fp := currentFingerprint(t, ctx, c, "32 healthy MPS shares", func(fp *pb.FingerprintResponse) bool {
		for _, g := range fp.GetGroups() {
			if g.GetType() == "gpu.mps" {
				return len(devicesWithHealth(&pb.FingerprintResponse{Groups: []*pb.DeviceGroup{g}}, pb.Health_HEALTH_HEALTHY)) == 32
			}
		}
		return false
	})
	var gpus, shares *pb.DeviceGroup
	for _, g := range fp.GetGroups() {
		switch g.GetType() {
		case "gpu":
			gpus = g
		case "gpu.mps":
			shares = g
		}
	}
	gpu0, gpu1 := gpus.GetDevices()[0].GetId(), gpus.GetDevices()[1].GetId()
	share := func(gpu string, k int) string { return fmt.Sprintf("%s::mps::%d", gpu, k) }

	a, err := c.Reserve(ctx, reserveRequest(shares, "holder-a", share(gpu0, 0), share(gpu0, 1)))
	if err != nil {
		t.Fatalf("Reserve of two shares: %v", err)
	}
	env := a.GetReservation().GetEnvs()
	if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" || env["NVIDIA_VISIBLE_DEVICES"] != gpu0 ||
		!strings.HasPrefix(env["CUDA_MPS_PIPE_DIRECTORY"], mpsDir+"/") {
		t.Errorf("envs of two shares: %v", env)
	}
	if _, err := c.Reserve(ctx, reserveRequest(gpus, "whole", gpu0)); status.Code(err) == codes.OK {
		t.Errorf("whole GPU 0 reserved while two of its shares are held")
	}
	if _, err := c.Reserve(ctx, reserveRequest(gpus, "whole", gpu1)); err != nil {
		t.Fatalf("Reserve of whole GPU 1: %v", err)
	}
	if _, err := c.Reserve(ctx, reserveRequest(shares, "holder-c", share(gpu1, 0))); status.Code(err) == codes.OK {
		t.Errorf("a share of GPU 1 reserved while the whole GPU is held")
	}
	b, err := c.Reserve(ctx, reserveRequest(shares, "holder-b", share(gpu0, 3)))
	if err != nil {
		t.Fatalf("Reserve of a third share: %v", err)
	}
	if b.GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"] == env["CUDA_MPS_PIPE_DIRECTORY"] {
		t.Errorf("two holders share the pipe directory %s under per-holder isolation", env["CUDA_MPS_PIPE_DIRECTORY"])
	}
	before := mpsDaemons(t, mpsDir)
	if len(before) != 2 {
		t.Fatalf("daemons %v, want one per holder", before)
	}

	// The agent dies with live shares: the daemons run on, and the next agent's plugin
	// adopts them rather than starting others.
	agent.kill(t, ctx)
	agent = setup.start(t)
	c = agent.client(t, ctx)
	currentFingerprint(t, ctx, c, "shares back", func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)) > 0
	})
	after := mpsDaemons(t, mpsDir)
	for dir, pid := range before {
		if after[dir] != pid || !pidRuns(pid) {
			t.Errorf("daemon in %s: pid %d before the agent's restart, %d after (alive %v)", dir, pid, after[dir], pidRuns(after[dir]))
		}
	}
	if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: a.GetReservationId()}}); err != nil {
		t.Fatalf("Release: %v", err)
	}
	liveAfterCleanups(t, ctx, c) // the plugin's Release runs after the API's answer
	for dir, pid := range before {
		if strings.Contains(env["CUDA_MPS_PIPE_DIRECTORY"], dir) && pidRuns(pid) {
			t.Errorf("holder a's daemon %d still runs after its Release", pid)
		}
	}
	if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: b.GetReservationId()}}); err != nil {
		t.Fatalf("Release: %v", err)
	}
	liveAfterCleanups(t, ctx, c)
	if err := agent.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := agent.Wait(ctx); err != nil {
		t.Fatalf("agent stop: %v", err)
	}
	for _, pid := range before {
		if pidRuns(pid) {
			t.Errorf("daemon %d runs after the last Release and the agent's stop", pid)
		}
	}
	if entries, _ := os.ReadDir(mpsDir); len(entries) != 0 {
		t.Errorf("mps_dir holds %d entries after the last Release", len(entries))
	}
}

// MPS shares of on-demand MIG placements through a real agent: the ledger keeps a
// share and its whole placement apart; a share of an overlapping placement passes the
// counters but is refused by the plugin, naming the instance in its way; after the
// last share's Release the instance is gone and the overlapping placement is free.
func TestAgentMPSSharesOfOnDemandMIG(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	setup, mpsDir := newMPSAgentSetup(t, "", `    mig            = "on-demand"
    replicas       = 2`)
	agent := setup.start(t)
	defer agent.kill(t, ctx)
	c := agent.client(t, ctx)
	groups := map[string]*pb.DeviceGroup{}
	currentFingerprint(t, ctx, c, "on-demand MIG shares", func(fp *pb.FingerprintResponse) bool {
		for _, g := range fp.GetGroups() {
			groups[g.GetName()] = g
		}
		return groups["1g.10gb.mps"] != nil && groups["2g.20gb"] != nil
	})
	gpu0 := groups["1g.10gb"].GetDevices()[0].GetId()
	gpu0 = gpu0[:strings.Index(gpu0, "-mig-")]
	small, large := gpu0+"-mig-1g.10gb-0", gpu0+"-mig-2g.20gb-0"

	a, err := c.Reserve(ctx, reserveRequest(groups["1g.10gb.mps"], "holder-a", small+"::mps::0"))
	if err != nil {
		t.Fatalf("Reserve of a share of %s: %v", small, err)
	}
	if env := a.GetReservation().GetEnvs(); !strings.HasPrefix(env["NVIDIA_VISIBLE_DEVICES"], "MIG-") || env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" {
		t.Errorf("envs of a share: %v, want its new MIG device and half its threads", env)
	}
	if _, err := c.Reserve(ctx, reserveRequest(groups["1g.10gb"], "whole", small)); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("whole %s beside its held share: %v, want FAILED_PRECONDITION", small, err)
	}
	_, err = c.Reserve(ctx, reserveRequest(groups["2g.20gb.mps"], "holder-b", large+"::mps::0"))
	if err == nil || !strings.Contains(err.Error(), small) { // the plugin's refusal, passed on as the agent passes every plugin refusal on
		t.Errorf("a share of the overlapping %s: %v, want a refusal naming %s", large, err, small)
	}
	if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: a.GetReservationId()}}); err != nil {
		t.Fatalf("Release: %v", err)
	}
	liveAfterCleanups(t, ctx, c)
	if d := mpsDaemons(t, mpsDir); len(d) != 0 {
		t.Errorf("daemons after the last share's Release: %v", d)
	}
	if _, err := c.Reserve(ctx, reserveRequest(groups["2g.20gb"], "whole", large)); err != nil {
		t.Errorf("whole %s after the share's Release: %v", large, err)
	}
}

// sharing = ["time-slicing", "mps"] through a real agent: each GPU serves the mode its
// first holder chose. Two time-sliced replicas share GPU 0 and an MPS share of it is
// refused, naming the mode that holds it; GPU 1 takes an MPS share and refuses a
// replica; a SIGKILLed agent, then a SIGKILLed plugin, keep both GPUs in their modes
// (the ledger stores each use's group); with GPU 0's replicas released, GPU 0 takes an
// MPS share.
func TestAgentSharingModeChosenByFirstHolder(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	setup, mpsDir := newSharingAgentSetup(t, `["time-slicing", "mps"]`, "", "    replicas       = 4")
	agent := setup.start(t)
	c := agent.client(t, ctx)
	groups := make(map[string]*pb.DeviceGroup)
	currentFingerprint(t, ctx, c, "replicas and MPS shares", func(fp *pb.FingerprintResponse) bool {
		for _, g := range fp.GetGroups() {
			groups[g.GetType()] = g
		}
		return groups["gpu.shared"] != nil && groups["gpu.mps"] != nil &&
			len(devicesWithHealth(&pb.FingerprintResponse{Groups: []*pb.DeviceGroup{groups["gpu.mps"]}}, pb.Health_HEALTH_HEALTHY)) == 32
	})
	gpu0, gpu1 := groups["gpu"].GetDevices()[0].GetId(), groups["gpu"].GetDevices()[1].GetId()
	replica := func(gpu string, k int) string { return fmt.Sprintf("%s::%d", gpu, k) }
	share := func(gpu string, k int) string { return fmt.Sprintf("%s::mps::%d", gpu, k) }
	reserve := func(typ, owner, id string) (*pb.ReserveResponse, error) {
		return c.Reserve(ctx, reserveRequest(groups[typ], owner, id))
	}
	refused := func(what string, err error, mode string) {
		t.Helper()
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), "is held shared as "+mode) {
			t.Errorf("%s: %v, want refused: held shared as %s", what, err, mode)
		}
	}
	ts1, err := reserve("gpu.shared", "ts-1", replica(gpu0, 0))
	if err != nil {
		t.Fatal(err)
	}
	ts2, err := reserve("gpu.shared", "ts-2", replica(gpu0, 1))
	if err != nil {
		t.Fatalf("a second replica of GPU 0: %v", err)
	}
	if env := ts1.GetReservation().GetEnvs(); env["NVIDIA_VISIBLE_DEVICES"] != gpu0 || env["CUDA_MPS_PIPE_DIRECTORY"] != "" {
		t.Errorf("a replica's envs %v, want GPU 0 without MPS", env)
	}
	_, err = reserve("gpu.mps", "mps-1", share(gpu0, 0))
	refused("an MPS share of time-sliced GPU 0", err, `"time-slicing"`)
	m1, err := reserve("gpu.mps", "mps-1", share(gpu1, 0))
	if err != nil {
		t.Fatalf("an MPS share of GPU 1: %v", err)
	}
	if env := m1.GetReservation().GetEnvs(); !strings.HasPrefix(env["CUDA_MPS_PIPE_DIRECTORY"], mpsDir+"/") {
		t.Errorf("an MPS share's envs %v, want its daemon's pipe under %s", env, mpsDir)
	}
	_, err = reserve("gpu.shared", "ts-3", replica(gpu1, 0))
	refused("a replica of GPU 1 in MPS shares", err, `"mps"`)

	agent.kill(t, ctx)
	agent = setup.start(t)
	c = agent.client(t, ctx)
	currentFingerprint(t, ctx, c, "shares back", func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)) > 0
	})
	_, err = reserve("gpu.mps", "mps-2", share(gpu0, 1))
	refused("after the agent's restart, an MPS share of GPU 0", err, `"time-slicing"`)
	_, err = reserve("gpu.shared", "ts-3", replica(gpu1, 0))
	refused("after the agent's restart, a replica of GPU 1", err, `"mps"`)

	// The plugin SIGKILLed under both modes: restarted, it adopts GPU 1's daemon, and
	// the GPUs keep their modes.
	pluginPID := childPID(t, agent.Cmd.Process.Pid, "plugin", "nvidia-example")
	if err := syscall.Kill(pluginPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Until the restarted plugin is back, its devices are unhealthy and a Reserve it
	// must answer UNAVAILABLE ("restarting"); a second MPS share of GPU 1 then joins its
	// daemon.
	var m3 *pb.ReserveResponse
	for {
		m3, err = reserve("gpu.mps", "mps-3", share(gpu1, 1))
		if status.Code(err) != codes.Unavailable && !client.IsUnhealthy(err) || ctx.Err() != nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("a second MPS share of GPU 1 after the plugin's restart: %v", err)
	}
	if m3.GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"] != m1.GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"] {
		t.Errorf("GPU 1's second share got daemon %s, the first %s: the restarted plugin did not adopt it",
			m3.GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"], m1.GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"])
	}
	if restarted, _ := findChildPID(agent.Cmd.Process.Pid, "plugin", "nvidia-example"); restarted == pluginPID {
		t.Errorf("plugin PID %d unchanged after SIGKILL", restarted)
	}
	_, err = reserve("gpu.mps", "mps-2", share(gpu0, 1))
	refused("after the plugin's restart, an MPS share of GPU 0", err, `"time-slicing"`)
	_, err = reserve("gpu.shared", "ts-3", replica(gpu1, 0))
	refused("after the plugin's restart, a replica of GPU 1", err, `"mps"`)

	for _, r := range []*pb.ReserveResponse{ts1, ts2} {
		if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: r.GetReservationId()}}); err != nil {
			t.Fatalf("Release: %v", err)
		}
	}
	m2, err := reserve("gpu.mps", "mps-2", share(gpu0, 1))
	if err != nil {
		t.Fatalf("an MPS share of GPU 0 once its replicas are released: %v", err)
	}
	for _, r := range []*pb.ReserveResponse{m1, m2, m3} {
		if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: r.GetReservationId()}}); err != nil {
			t.Fatalf("Release: %v", err)
		}
	}
	liveAfterCleanups(t, ctx, c)
	agent.stop(t, ctx)
}

// A Reserve chooses its MPS isolation through plugin_options, end to end: on one GPU a
// shared holder and a per-holder holder get two daemons and two pipe directories; the
// reservations list their options; an option the plugin does not take, or one on a
// whole GPU, is INVALID_ARGUMENT naming it, with nothing held; a retry with other
// options is FAILED_PRECONDITION. The plugin SIGKILLed and restarted is told each live
// reservation's options at Reconcile and adopts both daemons, each holder keeping its
// pipe directory.
func TestAgentMPSIsolationPerReserve(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	setup, mpsDir := newMPSAgentSetup(t, "", `    replicas       = 4`) // the default isolation: shared
	agent := setup.start(t)
	c := agent.client(t, ctx)
	groups := make(map[string]*pb.DeviceGroup)
	currentFingerprint(t, ctx, c, "32 healthy MPS shares", func(fp *pb.FingerprintResponse) bool {
		for _, g := range fp.GetGroups() {
			groups[g.GetType()] = g
		}
		return groups["gpu.mps"] != nil && len(devicesWithHealth(&pb.FingerprintResponse{Groups: []*pb.DeviceGroup{groups["gpu.mps"]}}, pb.Health_HEALTH_HEALTHY)) == 32
	})
	gpu0 := groups["gpu"].GetDevices()[0].GetId()
	share := func(k int) string { return fmt.Sprintf("%s::mps::%d", gpu0, k) }
	reserve := func(typ, owner string, opts map[string]string, ids ...string) (*pb.ReserveResponse, error) {
		req := reserveRequest(groups[typ], owner, ids...)
		req.PluginOptions = opts
		return c.Reserve(ctx, req)
	}
	refusedInvalid := func(what string, err error, want string) {
		t.Helper()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), want) {
			t.Errorf("%s: %v; want INVALID_ARGUMENT with %q", what, err, want)
			return
		}
		t.Logf("%s: %s", what, status.Convert(err).Message())
	}
	_, err := reserve("gpu.mps", "typo", map[string]string{"mps_isolaton": "shared"}, share(0))
	refusedInvalid("an option the plugin does not take", err, `option "mps_isolaton" is unknown to plugin "nvidia-example", which takes mps_isolation, mps_thread_percentage, mps_memory_limit`)
	_, err = reserve("gpu", "whole", map[string]string{"mps_isolation": "per-holder"}, gpu0)
	refusedInvalid("mps_isolation on a whole GPU", err, "option mps_isolation applies to MPS shares only; "+gpu0+" is a whole GPU")
	if rs, err := c.ListReservations(ctx, &pb.ListReservationsRequest{}); err != nil || len(rs.GetReservations()) != 0 {
		t.Fatalf("reservations after the refusals: %v, %v; want none", rs.GetReservations(), err)
	}

	shared, err := reserve("gpu.mps", "holder-shared", map[string]string{"mps_isolation": "shared"}, share(0))
	if err != nil {
		t.Fatalf("a shared share: %v", err)
	}
	own, err := reserve("gpu.mps", "holder-own", map[string]string{"mps_isolation": "per-holder"}, share(1), share(2))
	if err != nil {
		t.Fatalf("a per-holder holder's shares: %v", err)
	}
	pipeS, pipeH := shared.GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"], own.GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"]
	t.Logf("pipe dirs: shared %s, per-holder %s", pipeS, pipeH)
	if !strings.HasPrefix(pipeS, mpsDir+"/") || !strings.HasPrefix(pipeH, filepath.Dir(filepath.Dir(pipeS))+"/") ||
		!strings.Contains(pipeH, "/holder-1/") || pipeS == pipeH {
		t.Fatalf("pipe dirs %s and %s; want GPU 0's shared daemon's and, under its directory, holder-1's", pipeS, pipeH)
	}
	daemons := mpsDaemons(t, mpsDir)
	pidH := daemons[filepath.Dir(pipeH)]
	pidS := sharedDaemonPID(t, filepath.Dir(pipeS))
	if pidH == 0 || pidS == 0 || pidH == pidS {
		t.Fatalf("daemons: per-holder %d, shared %d; want two", pidH, pidS)
	}
	if _, err := reserve("gpu.mps", "holder-own", map[string]string{"mps_isolation": "shared"}, share(1), share(2)); status.Code(err) != codes.FailedPrecondition ||
		client.Reason(err) != client.ReasonOptionsDiffer || !strings.Contains(err.Error(), own.GetReservationId()) {
		t.Errorf("a retry with other options: %v; want FAILED_PRECONDITION, PLUGIN_OPTIONS_DIFFER naming %s", err, own.GetReservationId())
	} else {
		t.Logf("a retry with other options: %s", status.Convert(err).Message())
	}
	if again, err := reserve("gpu.mps", "holder-own", map[string]string{"mps_isolation": "per-holder"}, share(2), share(1)); err != nil || again.GetReservationId() != own.GetReservationId() {
		t.Errorf("a retry with the same options: %v, %v; want %s back", again.GetReservationId(), err, own.GetReservationId())
	}
	rs, err := c.ListReservations(ctx, &pb.ListReservationsRequest{OwnerId: "holder-own"})
	if err != nil || len(rs.GetReservations()) != 1 || rs.GetReservations()[0].GetPluginOptions()["mps_isolation"] != "per-holder" {
		t.Errorf("holder-own's reservations %v, %v; want one with its plugin options", rs.GetReservations(), err)
	}

	pluginPID := childPID(t, agent.Cmd.Process.Pid, "plugin", "nvidia-example")
	if err := syscall.Kill(pluginPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Back once a new plugin process has reconciled and fingerprinted: a third holder
	// asking for the shared daemon joins the one it adopted.
	var third *pb.ReserveResponse
	testwait.Until(t, time.Minute, "the restarted plugin serving a shared share", func() (bool, string) {
		third, err = reserve("gpu.mps", "holder-third", map[string]string{"mps_isolation": "shared"}, share(3))
		return err == nil, fmt.Sprint(err)
	})
	if restarted, _ := findChildPID(agent.Cmd.Process.Pid, "plugin", "nvidia-example"); restarted == pluginPID {
		t.Errorf("plugin PID %d unchanged after SIGKILL", restarted)
	}
	if got := third.GetReservation().GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"]; got != pipeS {
		t.Errorf("after the plugin's restart a shared holder got pipe dir %s; want the adopted shared daemon's %s", got, pipeS)
	}
	after := mpsDaemons(t, mpsDir)
	t.Logf("daemons before the plugin's restart: per-holder %d, shared %d; after: per-holder %d in %s, shared %d", pidH, pidS, after[filepath.Dir(pipeH)], filepath.Dir(pipeH), sharedDaemonPID(t, filepath.Dir(pipeS)))
	if after[filepath.Dir(pipeH)] != pidH || !pidRuns(pidH) || sharedDaemonPID(t, filepath.Dir(pipeS)) != pidS || !pidRuns(pidS) {
		t.Errorf("after the plugin's restart: per-holder daemon %d, shared %d; want %d and %d adopted in their directories",
			after[filepath.Dir(pipeH)], sharedDaemonPID(t, filepath.Dir(pipeS)), pidH, pidS)
	}
	for _, r := range []*pb.ReserveResponse{shared, own, third} {
		if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: r.GetReservationId()}}); err != nil {
			t.Fatalf("Release: %v", err)
		}
	}
	liveAfterCleanups(t, ctx, c)
	agent.stop(t, ctx)
	if pidRuns(pidH) || pidRuns(pidS) {
		t.Errorf("daemons left after every Release: per-holder %v, shared %v", pidRuns(pidH), pidRuns(pidS))
	}
}

// sharedDaemonPID reads the PID of the daemon.json in dir, a device's shared daemon's
// directory (mpsDaemons reads the per-holder ones, a level below).
func sharedDaemonPID(t *testing.T, dir string) int {
	t.Helper()
	return daemonPID(t, filepath.Join(dir, "daemon.json"))
}
