package nvidia

import (
	"context"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/deviceplugin"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/testwait"
	"github.com/devicehost/devicehost/validate"
)

// mpsDir is a short directory for a test's control daemons (their pipes must fit a
// Unix socket path, which t.TempDir's long names may not).
func mpsDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mps")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func mpsConfig(dir, isolation string) Config {
	return Config{Simulate: "dgxh100", Replicas: 4, Sharing: SharingModes{SharingMPS}, MPSIsolation: isolation, MPSDir: dir}
}

// restartableMPSConfig is mpsConfig in a new MPS directory, with a simulator state file,
// so that a second plugin process of it finds the first's GPUs and daemons.
func restartableMPSConfig(t *testing.T, isolation string) Config {
	t.Helper()
	stateFile := filepath.Join(t.TempDir(), "sim.json")
	cfg := mpsConfig(mpsDir(t), isolation)
	cfg.SimStateFile = &stateFile
	return cfg
}

// newMPSPlugin is a plugin on simulated GPUs with 4 MPS shares per GPU; every share it
// still holds is released when the test ends, so that no daemon outlives it.
func newMPSPlugin(t *testing.T, cfg Config) *Plugin {
	t.Helper()
	p, _ := newTestPlugin(t, cfg)
	t.Cleanup(func() { releaseAllShares(p) })
	return p
}

// releaseAllShares releases every share p's daemons still serve, so that none of them
// outlives a test.
func releaseAllShares(p *Plugin) {
	if p.mps == nil {
		return
	}
	p.mps.mu.Lock()
	held := slices.Collect(maps.Keys(p.mps.byShare))
	p.mps.mu.Unlock()
	p.mps.release(held)
}

// daemonOf reads the daemon.json of the daemon that serves shares of device with the
// config's isolation.
func daemonOf(t *testing.T, p *Plugin, device string, shares ...string) (mpsRecord, string) {
	t.Helper()
	return daemonWith(t, p, p.mps.settings.isolation, device, shares...)
}

// daemonWith reads the daemon.json of the daemon that serves shares of device with
// isolation.
func daemonWith(t *testing.T, p *Plugin, isolation, device string, shares ...string) (mpsRecord, string) {
	t.Helper()
	dir := filepath.Join(p.mps.settings.dir, p.mps.keyFor(device, shares, isolation))
	rec, err := readMPSRecord(filepath.Join(dir, mpsDaemonFile))
	if err != nil {
		t.Fatalf("daemon of %s %v: %v", device, shares, err)
	}
	return rec, dir
}

// ask sends one command to the daemon whose directory is dir, as a holder's
// CUDA client library would, and returns its answer.
func ask(t *testing.T, p *Plugin, dir, command string) string {
	t.Helper()
	out, err := p.mps.command(filepath.Join(dir, "pipe"), filepath.Join(dir, "log"), command)
	if err != nil {
		t.Fatalf("%s: %v", command, err)
	}
	return strings.TrimSpace(out)
}

func reserve(t *testing.T, p *Plugin, ids ...string) *pb.ContainerReservation {
	t.Helper()
	res, err := p.Reserve(context.Background(), ids)
	if err != nil {
		t.Fatalf("Reserve(%v): %v", ids, err)
	}
	return res
}

func release(t *testing.T, p *Plugin, ids ...string) {
	t.Helper()
	if err := p.Release(context.Background(), "r", ids); err != nil {
		t.Fatalf("Release(%v): %v", ids, err)
	}
}

func TestMPSConfigErrors(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"too many shares", Config{Replicas: 49, Sharing: SharingModes{"mps"}}, "replicas = 49: sharing = \"mps\" wants 2 to 48"},
		{"no shares", Config{Sharing: SharingModes{"mps"}}, "replicas = 0"},
		{"too many shares on demand", Config{Replicas: 9, Sharing: SharingModes{"mps"}, MIG: MIGOnDemand}, `replicas = 9: sharing = "mps" with mig = "on-demand" wants 2 to 8 shares per placement`},
		{"unknown sharing", Config{Replicas: 2, Sharing: SharingModes{"mig"}}, `sharing = "mig": want "time-slicing" or "mps"`},
		{"time-slicing without replicas", Config{Sharing: SharingModes{"time-slicing"}}, "needs replicas"},
		{"unknown isolation", Config{Replicas: 2, Sharing: SharingModes{"mps"}, MPSIsolation: "strict"}, `mps_isolation = "strict"`},
		{"relative dir", Config{Replicas: 2, Sharing: SharingModes{"mps"}, MPSDir: "mps"}, `mps_dir = "mps": must be an absolute path`},
		{"long dir", Config{Replicas: 2, Sharing: SharingModes{"mps"}, MPSDir: "/" + strings.Repeat("d", 70)}, "at most 64"},
		{"relative control", Config{Replicas: 2, Sharing: SharingModes{"mps"}, MPSControl: "bin/mps"}, `mps_control = "bin/mps"`},
		{"mps keys without mps", Config{Replicas: 2, MPSIsolation: "shared"}, `mps_isolation: only valid with sharing = "mps"`},
		{"a mode twice", Config{Replicas: 2, Sharing: SharingModes{"mps", "mps"}}, `sharing = ["mps", "mps"]: "mps" named twice`},
		{"an unknown mode in a list", Config{Replicas: 2, Sharing: SharingModes{"mps", "mig"}}, `sharing = ["mps", "mig"]: "mig": want "time-slicing" or "mps"`},
		{"both without replicas", Config{Sharing: SharingModes{"time-slicing", "mps"}}, `replicas = 0: sharing = ["time-slicing", "mps"] wants 2 to 48`},
		{"both, too many", Config{Replicas: 64, Sharing: SharingModes{"time-slicing", "mps"}}, `replicas = 64: sharing = ["time-slicing", "mps"] wants 2 to 48`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseConfig(mustJSON(t, tt.cfg))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("parseConfig(%+v) = %v, want an error with %q", tt.cfg, err, tt.want)
			}
		})
	}
	p, _ := newUnconfigured(t)
	err := p.SetConfig(context.Background(), mustJSON(t, Config{Simulate: "dgxh100", Replicas: 2, Sharing: SharingModes{"mps"}, MPSControl: "/nonexistent/nvidia-cuda-mps-control"}))
	if err == nil || !strings.Contains(err.Error(), "not an executable file") {
		t.Errorf("SetConfig with a missing mps_control: %v, want it refused", err)
	}
}

func TestMPSSharesInFingerprint(t *testing.T) {
	p := newMPSPlugin(t, mpsConfig(mpsDir(t), ""))
	fp := startFingerprint(t, p).next(t)
	gpu0 := simulatedUUID("dgxh100", 0)
	devs := devices(fp)
	var sets = make(map[string]map[string]int64)
	for _, cs := range fp.GetCounterSets() {
		sets[cs.GetName()] = cs.GetCounters()
	}
	capacity := sets[gpu0]
	if capacity[counterMPSCompute] != 100 || capacity[counterMPSMemory] <= 0 || capacity[counterMPSMemory]%4 != 0 {
		t.Fatalf("GPU 0's counter set = %v, want 100%% compute and its memory in 4 equal shares", capacity)
	}
	whole := devs[gpu0].GetConsumes()[0].GetCounters()
	if whole[counterMPSCompute] != 100 || whole[counterMPSMemory] != capacity[counterMPSMemory] {
		t.Errorf("the whole GPU consumes %v, want all of %v", whole, capacity)
	}
	for k := range 4 {
		d := devs[mpsShareID(gpu0, k)]
		if d == nil {
			t.Fatalf("no share %d of GPU 0 in %v", k, fp)
		}
		use := d.GetConsumes()[0]
		if use.GetCounterSet() != gpu0 || use.GetCounters()[counterMPSCompute] != 25 || use.GetCounters()[counterMPSMemory] != capacity[counterMPSMemory]/4 {
			t.Errorf("share %d consumes %v, want a quarter of %v", k, use, capacity)
		}
		if len(d.GetCdiDevices()) != 0 && d.GetCdiDevices()[0] != "nvidia.com/gpu="+mpsShareID(gpu0, k) {
			t.Errorf("share %d CDI names %v", k, d.GetCdiDevices())
		}
	}
	var group *pb.DeviceGroup
	for _, g := range fp.GetGroups() {
		if g.GetType() == "gpu.mps" {
			group = g
		}
	}
	if group == nil || len(group.GetDevices()) != 32 {
		t.Fatalf("gpu.mps group = %v, want 8 GPUs x 4 shares", group)
	}
	if got := group.GetAttributes()["memory"].GetIntValue(); got != capacity[counterMPSMemory]/4 {
		t.Errorf("a share's memory attribute = %d MiB, want %d", got, capacity[counterMPSMemory]/4)
	}
}

func TestMPSSharesOfStaticMIG(t *testing.T) {
	cfg := mpsConfig(mpsDir(t), "")
	cfg.MIGLayout = []byte(`{"0": ["3g.40gb"]}`)
	cfg.Replicas = 2
	p := newMPSPlugin(t, cfg)
	fp := startFingerprint(t, p).next(t)
	var mig *pb.Device
	var shares []*pb.Device
	for _, g := range fp.GetGroups() {
		switch {
		case g.GetType() == "mig" && g.GetName() == "3g.40gb":
			mig = g.GetDevices()[0]
		case g.GetType() == "mig" && g.GetName() == "3g.40gb.mps":
			shares = g.GetDevices()
		}
	}
	if mig == nil || len(shares) != 2 {
		t.Fatalf("groups %v: want a 3g.40gb device and its 2 MPS shares", fp.GetGroups())
	}
	set := mig.GetConsumes()[0]
	if set.GetCounterSet() != mig.GetId() || set.GetCounters()[counterMPSCompute] != 100 {
		t.Errorf("the MIG device consumes %v, want all of its own counter set", set)
	}
	if got := shares[0].GetConsumes()[0]; got.GetCounterSet() != mig.GetId() || got.GetCounters()[counterMPSCompute] != 50 {
		t.Errorf("a share consumes %v, want half of the MIG device's", got)
	}
	res := reserve(t, p, shares[1].GetId())
	if got := res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"]; got != mig.GetId() {
		t.Errorf("NVIDIA_VISIBLE_DEVICES = %q, want the MIG device %s", got, mig.GetId())
	}
	rec, _ := daemonOf(t, p, mig.GetId(), shares[1].GetId())
	if rec.Device != mig.GetId() {
		t.Errorf("the daemon serves %s, want the MIG device %s", rec.Device, mig.GetId())
	}
}

// TestMPSSharedDaemon: one daemon per device serves every holder of its shares; it
// starts with the first share and stops after the last.
func TestMPSSharedDaemon(t *testing.T) {
	p := newMPSPlugin(t, mpsConfig(mpsDir(t), ""))
	gpu0 := simulatedUUID("dgxh100", 0)
	a := reserve(t, p, mpsShareID(gpu0, 0))
	rec, dir := daemonOf(t, p, gpu0)
	if !processAlive(rec.PID, rec.Start) {
		t.Fatalf("daemon %d not running after the first share's Reserve", rec.PID)
	}
	env := a.GetEnvs()
	if env["CUDA_MPS_PIPE_DIRECTORY"] != filepath.Join(dir, "pipe") || env["CUDA_MPS_LOG_DIRECTORY"] != filepath.Join(dir, "log") {
		t.Errorf("envs %v, want the daemon's directories under %s", env, dir)
	}
	if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "25" || !strings.HasPrefix(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=") {
		t.Errorf("envs %v, want one share's limits", env)
	}
	if len(a.GetMounts()) != 2 || a.GetMounts()[0].GetHostPath() != filepath.Join(dir, "pipe") {
		t.Errorf("mounts %v, want the pipe and log directories", a.GetMounts())
	}
	// A second holder of two shares: the same daemon, twice the limits.
	b := reserve(t, p, mpsShareID(gpu0, 2), mpsShareID(gpu0, 3))
	if rec2, _ := daemonOf(t, p, gpu0); rec2.PID != rec.PID {
		t.Errorf("second holder got daemon %d, want the device's one, %d", rec2.PID, rec.PID)
	}
	if got := b.GetEnvs()["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]; got != "50" {
		t.Errorf("two shares' thread percentage = %s, want 50", got)
	}
	mem1, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0="), "M"))
	mem2, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(b.GetEnvs()["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0="), "M"))
	if mem1 <= 0 || mem2 != 2*mem1 {
		t.Errorf("memory limits %d and %d MiB, want the second twice the first", mem1, mem2)
	}
	release(t, p, mpsShareID(gpu0, 0))
	if !processAlive(rec.PID, rec.Start) {
		t.Fatalf("daemon stopped while a holder still has shares")
	}
	release(t, p, mpsShareID(gpu0, 2), mpsShareID(gpu0, 3))
	if processAlive(rec.PID, rec.Start) {
		t.Errorf("daemon %d still runs after the last share's Release", rec.PID)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("daemon directory %s left after the last Release: %v", dir, err)
	}
	// Release is idempotent.
	release(t, p, mpsShareID(gpu0, 0))
}

// TestMPSPerHolderDaemons: each holder gets a daemon of its own whose default limits
// are its shares, whatever its environment says.
func TestMPSPerHolderDaemons(t *testing.T) {
	p := newMPSPlugin(t, mpsConfig(mpsDir(t), MPSPerHolder))
	gpu0 := simulatedUUID("dgxh100", 0)
	a := reserve(t, p, mpsShareID(gpu0, 1))
	b := reserve(t, p, mpsShareID(gpu0, 2), mpsShareID(gpu0, 3))
	recA, dirA := daemonOf(t, p, gpu0, mpsShareID(gpu0, 1))
	recB, dirB := daemonOf(t, p, gpu0, mpsShareID(gpu0, 2))
	if recA.PID == recB.PID || dirA == dirB {
		t.Fatalf("two holders share daemon %d in %s", recA.PID, dirA)
	}
	if a.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"] != filepath.Join(dirA, "pipe") || b.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"] != filepath.Join(dirB, "pipe") {
		t.Errorf("pipe dirs %q and %q, want each holder's own", a.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"], b.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"])
	}
	if got := ask(t, p, dirA, "get_default_active_thread_percentage"); got != "25.0" {
		t.Errorf("holder A's daemon default thread percentage = %q, want 25.0", got)
	}
	if got := ask(t, p, dirB, "get_default_active_thread_percentage"); got != "50.0" {
		t.Errorf("holder B's daemon default thread percentage = %q, want 50.0", got)
	}
	memA, _ := parseMiB(ask(t, p, dirA, "get_default_device_pinned_mem_limit 0"))
	if want := recA.Limits.MemMiB; memA != want || want <= 0 {
		t.Errorf("holder A's pinned memory limit = %d MiB, want %d", memA, want)
	}
	release(t, p, mpsShareID(gpu0, 1))
	if processAlive(recA.PID, recA.Start) || !processAlive(recB.PID, recB.Start) {
		t.Errorf("after A's Release: A's daemon alive %v (want false), B's %v (want true)",
			processAlive(recA.PID, recA.Start), processAlive(recB.PID, recB.Start))
	}
}

// TestMPSDaemonKilledIsRestarted: a daemon killed with SIGKILL makes its shares
// unhealthy with the reason, and comes back on the same pipe with the same limits.
func TestMPSDaemonKilledIsRestarted(t *testing.T) {
	p := newMPSPlugin(t, mpsConfig(mpsDir(t), MPSPerHolder))
	gpu0 := simulatedUUID("dgxh100", 0)
	share := mpsShareID(gpu0, 0)
	reserve(t, p, share, mpsShareID(gpu0, 1))
	rec, dir := daemonOf(t, p, gpu0, share)
	fp := startFingerprint(t, p)
	if d := devices(fp.next(t))[share]; d.GetHealth() != pb.Health_HEALTH_HEALTHY {
		t.Fatalf("share before the kill: %v", d)
	}
	if err := syscall.Kill(rec.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	d := devices(fp.next(t))[share]
	if d.GetHealth() != pb.Health_HEALTH_UNHEALTHY || !strings.Contains(d.GetHealthReason(), "MPS control daemon for "+gpu0+" exited") {
		t.Fatalf("share after its daemon was killed: %v, want unhealthy with the daemon's exit", d)
	}
	if d := devices(fp.next(t))[share]; d.GetHealth() != pb.Health_HEALTH_HEALTHY {
		t.Fatalf("share after the restart: %v, want healthy", d)
	}
	again, _ := daemonOf(t, p, gpu0, share)
	if again.PID == rec.PID || !processAlive(again.PID, again.Start) {
		t.Fatalf("daemon after the restart: pid %d (was %d)", again.PID, rec.PID)
	}
	if got := ask(t, p, dir, "get_default_active_thread_percentage"); got != "50.0" {
		t.Errorf("restarted daemon's thread percentage = %q, want the holder's 50.0", got)
	}
}

// TestMPSRestartAdoptsDaemons: a new plugin process finds the daemons of live shares
// and adopts them (no second daemon), and stops the ones no live reservation holds.
func TestMPSRestartAdoptsDaemons(t *testing.T) {
	cfg := restartableMPSConfig(t, MPSPerHolder)
	dir := cfg.MPSDir
	first := newMPSPlugin(t, cfg)
	gpu0, gpu1 := simulatedUUID("dgxh100", 0), simulatedUUID("dgxh100", 1)
	reserve(t, first, mpsShareID(gpu0, 0))
	reserve(t, first, mpsShareID(gpu1, 3))
	kept, _ := daemonOf(t, first, gpu0, mpsShareID(gpu0, 0))
	stray, strayDir := daemonOf(t, first, gpu1, mpsShareID(gpu1, 3))
	// The plugin process ends (the host restarts it): its daemons run on.
	first.mps.close()
	first.mps = nil

	second := newMPSPlugin(t, cfg)
	live := []deviceplugin.LiveReservation{{ID: "r1", DeviceIDs: []string{mpsShareID(gpu0, 0)}}}
	if err := second.Reconcile(context.Background(), live); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	again, _ := daemonOf(t, second, gpu0, mpsShareID(gpu0, 0))
	if again.PID != kept.PID || !processAlive(kept.PID, kept.Start) {
		t.Errorf("live share's daemon: pid %d after the restart, want the adopted %d", again.PID, kept.PID)
	}
	if processAlive(stray.PID, stray.Start) {
		t.Errorf("daemon %d of a share no live reservation holds still runs", stray.PID)
	}
	if _, err := os.Stat(strayDir); !os.IsNotExist(err) {
		t.Errorf("stray daemon's directory %s left: %v", strayDir, err)
	}
	// The adopted daemon is supervised: a kill restarts it.
	if err := syscall.Kill(kept.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	testwait.WaitFor(t, "the adopted daemon restarted", func() bool {
		rec, err := readMPSRecord(filepath.Join(dir, second.mps.keyFor(gpu0, []string{mpsShareID(gpu0, 0)}, MPSPerHolder), mpsDaemonFile))
		return err == nil && rec.PID != kept.PID && processAlive(rec.PID, rec.Start)
	})
	release(t, second, mpsShareID(gpu0, 0))
	entries, _ := os.ReadDir(dir)
	if len(entries) != 0 {
		t.Errorf("%s holds %d entries after the last Release, want none", dir, len(entries))
	}
}

func TestMPSReserveRefusals(t *testing.T) {
	p := newMPSPlugin(t, mpsConfig(mpsDir(t), ""))
	gpu0, gpu1 := simulatedUUID("dgxh100", 0), simulatedUUID("dgxh100", 1)
	for _, ids := range [][]string{
		{mpsShareID(gpu0, 0), mpsShareID(gpu1, 0)},
		{mpsShareID(gpu0, 0), gpu1},
	} {
		_, err := p.Reserve(context.Background(), ids)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "names one device's daemon") {
			t.Errorf("Reserve(%v) = %v, want INVALID_ARGUMENT naming the rule", ids, err)
		}
	}
	if p.mps.active() != 0 {
		t.Errorf("%d daemons after refused Reserves, want none", p.mps.active())
	}
}

// TestMPSSharesOfOnDemandMIG: an on-demand placement is offered in shares that
// together take what its whole MIG device takes; the first share's Reserve makes the
// instance and its daemon, the last share's Release ends both, and a share of a
// placement that overlaps a held one is refused naming it.
func TestMPSSharesOfOnDemandMIG(t *testing.T) {
	cfg := onDemand(filepath.Join(t.TempDir(), "sim.json"))
	cfg.Sharing, cfg.Replicas, cfg.MPSDir = SharingModes{SharingMPS}, 2, mpsDir(t)
	p := newMPSPlugin(t, cfg)
	sim := simOf(t, p)
	fp := fingerprintOf(t, p)
	small := onDemandIDs(0, "1g.10gb", 0)[0]
	large := onDemandIDs(0, "2g.20gb", 0)[0]
	other := onDemandIDs(0, "1g.10gb", 2)[0]
	a, b, c := mpsShareID(small, 0), mpsShareID(small, 1), mpsShareID(large, 0)
	devs := devices(fp)
	for _, id := range []string{a, b, c, mpsShareID(other, 1)} {
		if devs[id] == nil {
			t.Fatalf("no device %s in the fingerprint", id)
		}
	}
	if n := groupSizes(fp)["nvidia/mig/1g.10gb.mps"]; n != 8*7*2 {
		t.Errorf("nvidia/mig/1g.10gb.mps has %d shares, want 2 per placement: %d", n, 8*7*2)
	}
	// The counters: both shares of a placement fit, as does its whole device alone; a
	// share beside the whole device, or beside a whole overlapping device, does not.
	if k := fits(fp, a, b); k != "" {
		t.Errorf("two shares of one placement do not fit: %s", k)
	}
	if k := fits(fp, a, small); k == "" {
		t.Error("a share and its whole placement fit the counters together")
	}
	if k := fits(fp, a, large); k == "" {
		t.Error("a share and a whole overlapping placement fit the counters together")
	}

	resA := reserve(t, p, a)
	instances := simInstances(sim, 0)
	if len(instances) != 1 {
		t.Fatalf("instances after the first share's Reserve: %v, want one", instances)
	}
	mig := resA.GetEnvs()["NVIDIA_VISIBLE_DEVICES"]
	if !strings.HasPrefix(mig, "MIG-") {
		t.Fatalf("NVIDIA_VISIBLE_DEVICES = %q, want the new MIG device", mig)
	}
	rec, _ := daemonOf(t, p, small)
	if rec.Device != mig {
		t.Errorf("the daemon runs on %s, want the MIG device %s", rec.Device, mig)
	}
	if got := resA.GetEnvs()["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]; got != "50" {
		t.Errorf("one of 2 shares: thread percentage %s, want 50", got)
	}
	if got := resA.GetCdiDevices(); len(got) != 1 || !strings.HasSuffix(got[0], "="+a) {
		t.Errorf("CDI devices %v, want the share's own name", got)
	}
	resB := reserve(t, p, b)
	if got := resB.GetEnvs()["NVIDIA_VISIBLE_DEVICES"]; got != mig {
		t.Errorf("second share on %s, want the same MIG device %s", got, mig)
	}
	if rec2, _ := daemonOf(t, p, small); rec2.PID != rec.PID {
		t.Errorf("second share's daemon %d, want the placement's one, %d", rec2.PID, rec.PID)
	}

	// Overlapping placement: the counters let it by, the hardware does not.
	_, err := p.Reserve(context.Background(), []string{c})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), small) {
		t.Errorf("Reserve of a share of an overlapping placement: %v, want FAILED_PRECONDITION naming %s", err, small)
	}
	if n := len(simInstances(sim, 0)); n != 1 || p.mps.serves(large) {
		t.Errorf("after the refusal: %d instances, a daemon for %s: %v; want the one instance and no daemon", n, large, p.mps.serves(large))
	}

	release(t, p, a)
	if len(simInstances(sim, 0)) != 1 || !processAlive(rec.PID, rec.Start) {
		t.Error("the instance or its daemon went while a share was still held")
	}
	release(t, p, b)
	if got := simInstances(sim, 0); len(got) != 0 {
		t.Errorf("instances after the last share's Release: %v, want none", got)
	}
	if processAlive(rec.PID, rec.Start) {
		t.Errorf("daemon %d runs on after the last share's Release", rec.PID)
	}
	// The placement is free for a whole device again.
	reserve(t, p, large)
	release(t, p, large)
}

// TestMPSOnDemandSharesOutliveThePlugin: a new plugin process keeps the instance and
// adopts the daemon of live shares of an on-demand placement, and ends both once no
// live reservation holds them.
func TestMPSOnDemandSharesOutliveThePlugin(t *testing.T) {
	cfg := onDemand(filepath.Join(t.TempDir(), "sim.json"))
	cfg.Sharing, cfg.Replicas, cfg.MPSDir = SharingModes{SharingMPS}, 2, mpsDir(t)
	first := newMPSPlugin(t, cfg)
	part := onDemandIDs(1, "3g.40gb", 4)[0]
	share := mpsShareID(part, 1)
	mig := reserve(t, first, share).GetEnvs()["NVIDIA_VISIBLE_DEVICES"]
	rec, _ := daemonOf(t, first, part)
	first.mps.close()
	first.mps = nil

	second := newMPSPlugin(t, cfg)
	live := []deviceplugin.LiveReservation{{ID: "r1", DeviceIDs: []string{share}}}
	if err := second.Reconcile(context.Background(), live); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	sim := simOf(t, second)
	if got := simInstances(sim, 1); len(got) != 1 {
		t.Fatalf("instances after Reconcile with the live share: %v, want its one", got)
	}
	again, _ := daemonOf(t, second, part)
	if again.PID != rec.PID || again.Device != mig {
		t.Errorf("daemon after the restart: pid %d on %s, want the adopted %d on %s", again.PID, again.Device, rec.PID, mig)
	}
	if err := second.Reconcile(context.Background(), nil); err != nil {
		t.Fatalf("Reconcile with nothing live: %v", err)
	}
	if got := simInstances(sim, 1); len(got) != 0 {
		t.Errorf("instances after Reconcile with nothing live: %v, want none", got)
	}
	if processAlive(rec.PID, rec.Start) {
		t.Errorf("daemon %d runs on with no live share", rec.PID)
	}
}

// TestFingerprintSaysWhatReleaseHasNothingFor: the devices the plugin hands out as they
// are (whole GPUs, time-sliced replicas, static MIG devices) say Release has nothing to
// do for them, so the host skips it; MPS shares (Release stops their daemon) and
// on-demand MIG placements (Release destroys the instance) do not.
func TestFingerprintSaysWhatReleaseHasNothingFor(t *testing.T) {
	cfg := mpsConfig(mpsDir(t), "")
	cfg.MIGLayout = []byte(`{"0": ["3g.40gb"]}`)
	cfg.Replicas = 2
	static := startFingerprint(t, newMPSPlugin(t, cfg)).next(t)
	od := onDemand(filepath.Join(t.TempDir(), "sim.json"))
	od.SimMIGModeOff = []int{4, 5, 6, 7}
	p, _ := newTestPlugin(t, od)
	onDemandFP := fingerprintOf(t, p)
	p, _ = newTestPlugin(t, Config{Simulate: "dgxh100", Replicas: 4})
	replicas := fingerprintOf(t, p)
	for _, c := range []struct {
		name string
		fp   *pb.FingerprintResponse
		want map[string]bool // by group type: NothingToRelease
	}{
		{"MPS over whole GPUs and a static MIG layout", static, map[string]bool{"gpu": true, "mig": true, "gpu.mps": false}},
		{"time-sliced replicas", replicas, map[string]bool{"gpu": true, "gpu.shared": true}},
		{"on-demand MIG", onDemandFP, map[string]bool{"gpu": true, "mig": false}},
	} {
		seen := map[string]int{}
		for _, g := range c.fp.GetGroups() {
			typ := g.GetType()
			if strings.HasSuffix(g.GetName(), ".mps") {
				typ = "gpu.mps" // a static MIG device's shares
			}
			want, ok := c.want[typ]
			if !ok {
				t.Errorf("%s: unexpected group %s/%s", c.name, g.GetType(), g.GetName())
				continue
			}
			for _, d := range g.GetDevices() {
				seen[typ]++
				if d.GetNothingToRelease() != want {
					t.Errorf("%s: %s device %s: nothing_to_release %v; want %v", c.name, typ, d.GetId(), d.GetNothingToRelease(), want)
				}
			}
		}
		for typ := range c.want {
			if seen[typ] == 0 {
				t.Errorf("%s: no %s device in the fingerprint", c.name, typ)
			}
		}
	}
}

// With sharing = ["time-slicing", "mps"] each whole GPU is offered both ways, N
// replicas and N MPS shares, each mode's uses of the GPU's counter set in a
// compatibility group of its own and the whole GPU in none, taking every counter; the
// config reads the list from JSON as the agent passes it, and one mode still as a
// string. With one mode nothing carries a group (the counters say it all).
func TestBothSharingModesOffered(t *testing.T) {
	var c Config
	if err := json.Unmarshal([]byte(`{"replicas": 4, "sharing": ["time-slicing", "mps"]}`), &c); err != nil || !slices.Equal(c.Sharing, []string{"time-slicing", "mps"}) {
		t.Fatalf("a list of modes reads as %q, %v", c.Sharing, err)
	}
	if b, err := json.Marshal(Config{Sharing: SharingModes{"mps"}}); err != nil || !strings.Contains(string(b), `"sharing":"mps"`) {
		t.Fatalf("one mode writes as %s, %v", b, err)
	}
	cfg := mpsConfig(mpsDir(t), MPSShared)
	cfg.Sharing = SharingModes{SharingTimeSlicing, SharingMPS}
	p := newMPSPlugin(t, cfg)
	fp := fingerprintOf(t, p)
	byType := make(map[string][]*pb.Device)
	for _, g := range fp.GetGroups() {
		byType[g.GetType()] = append(byType[g.GetType()], g.GetDevices()...)
		want := map[string]string{"gpu": "exclusive", "gpu.shared": "time-slicing", "gpu.mps": "mps"}[g.GetType()]
		if got := g.GetAttributes()["sharing"].GetStringValue(); got != want {
			t.Errorf("group %s/%s: sharing %q, want %q", g.GetType(), g.GetName(), got, want)
		}
	}
	if len(byType["gpu"]) != 8 || len(byType["gpu.shared"]) != 32 || len(byType["gpu.mps"]) != 32 {
		t.Fatalf("devices by type: gpu %d, gpu.shared %d, gpu.mps %d; want 8, 32, 32", len(byType["gpu"]), len(byType["gpu.shared"]), len(byType["gpu.mps"]))
	}
	sets := make(map[string]map[string]int64)
	for _, cs := range fp.GetCounterSets() {
		sets[cs.GetName()] = cs.GetCounters()
	}
	for typ, want := range map[string][]string{"gpu": nil, "gpu.shared": {"time-slicing"}, "gpu.mps": {"mps"}} {
		for _, d := range byType[typ] {
			if len(d.GetConsumes()) != 1 || !slices.Equal(d.GetConsumes()[0].GetCompatibilityGroups(), want) {
				t.Fatalf("%s device %s consumes %v, want one set in groups %q", typ, d.GetId(), d.GetConsumes(), want)
			}
		}
	}
	g := byType["gpu"][0].GetConsumes()[0]
	if !maps.Equal(g.GetCounters(), sets[g.GetCounterSet()]) || g.GetCounters()["time-slices"] != 4 || len(g.GetCounters()) < 2 {
		t.Errorf("the whole GPU consumes %v of %v, want every counter, time slices and MPS shares", g.GetCounters(), sets[g.GetCounterSet()])
	}
	if err := validate.Fingerprint(fp); err != nil {
		t.Errorf("the fingerprint does not validate: %v", err)
	}

	cfg.Sharing = SharingModes{SharingMPS}
	for _, g := range fingerprintOf(t, newMPSPlugin(t, cfg)).GetGroups() {
		for _, d := range g.GetDevices() {
			for _, c := range d.GetConsumes() {
				if len(c.GetCompatibilityGroups()) > 0 {
					t.Fatalf("with MPS alone, %s carries groups %q", d.GetId(), c.GetCompatibilityGroups())
				}
			}
		}
	}
}
