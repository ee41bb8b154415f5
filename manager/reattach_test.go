package manager

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	goplugin "github.com/hashicorp/go-plugin"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/manager/ledger"
	"github.com/devicehost/devicehost/manager/supervise"
	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/proc"
	"github.com/devicehost/devicehost/tools/testwait"
)

// These tests keep real plugin processes across a "crash" of the host (PluginConfig.Reattach).

// procLauncher launches real plugin processes like supervise.LaunchProcess, counting fresh
// launches and reattach attempts. Once crashed is set, a Kill from the manager leaves the
// process running, as a host that died would; killLeft kills those at the end of the
// test. Safe for concurrent use.
type procLauncher struct {
	crashed atomic.Bool

	mu                   sync.Mutex
	fresh                int
	reattaches, attached int // attempts; successes
	left                 []supervise.Plugin
}

func (l *procLauncher) launch(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options) (supervise.Plugin, error) {
	p, err := supervise.LaunchProcess(ctx, bin, opts)
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case opts.Reattach == nil:
		l.fresh++
	case err == nil:
		l.reattaches++
		l.attached++
	default:
		l.reattaches++
	}
	if err != nil {
		return nil, err
	}
	return &survivingPlugin{Plugin: p.(*pluginloader.Plugin), l: l}, nil
}

// counts returns fresh launches, reattach attempts and successful reattaches.
func (l *procLauncher) counts() (fresh, reattaches, attached int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.fresh, l.reattaches, l.attached
}

// killLeft kills the processes a crashed host left running (those still running) and
// waits for go-plugin's goroutines of the crashed host to end.
func (l *procLauncher) killLeft(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	left := l.left
	l.mu.Unlock()
	for _, p := range left {
		ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
		p.Kill(ctx)
		cancel()
	}
}

// waitLeftExited waits until every process the crashed host left has exited.
func (l *procLauncher) waitLeftExited(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	left := l.left
	l.mu.Unlock()
	deadline := time.NewTimer(testwait.Timeout)
	defer deadline.Stop()
	for _, p := range left {
		select {
		case <-p.ExitContext().Done():
		case <-deadline.C:
			t.Fatalf("a plugin process left by the crashed host still runs after %v", testwait.Timeout)
		}
	}
}

// survivingPlugin is a plugin process whose Kill does nothing once its host "crashed".
type survivingPlugin struct {
	*pluginloader.Plugin
	l *procLauncher
}

func (p *survivingPlugin) Kill(ctx context.Context) {
	if p.l.crashed.Load() {
		p.l.mu.Lock()
		p.l.left = append(p.l.left, p.Plugin)
		p.l.mu.Unlock()
		return
	}
	p.Plugin.Kill(ctx)
}

// startWith starts a manager on launch and shuts it down in t.Cleanup.
func startWith(t *testing.T, cfg Config, launch supervise.LaunchFunc) *Manager {
	t.Helper()
	m, err := newManager(cfg, launch)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { shutdown(t, m) })
	return m
}

// reportedPID is the process ID the plugin's fixture reports about itself (report_pid),
// zero before it fingerprinted.
func reportedPID(s device.Snapshot, plugin string) int {
	for _, g := range s.Inventory.Groups {
		if g.Plugin == plugin {
			return int(g.Attributes["pid"].Int)
		}
	}
	return 0
}

// servedByProcess accepts a snapshot in which plugin's devices are healthy and its
// fixture has said which process it is.
func servedByProcess(plugin string, ids ...string) func(device.Snapshot) bool {
	return func(s device.Snapshot) bool {
		return healthIs(device.HealthHealthy, ids...)(s) && reportedPID(s, plugin) != 0
	}
}

// savedRecord returns the reattach record of plugin in l, and whether there is one.
func savedRecord(t *testing.T, l *ledger.Ledger, plugin string) (reattachRecord, bool) {
	t.Helper()
	data, ok, err := l.LoadReattach(plugin)
	if err != nil || !ok {
		if err != nil {
			t.Errorf("LoadReattach(%s): %v", plugin, err)
		}
		return reattachRecord{}, false
	}
	rec, err := decodeReattachRecord(data)
	if err != nil {
		t.Fatalf("reattach record of %s: %v", plugin, err)
	}
	return rec, true
}

// writeRecord puts rec into the ledger in stateDir, as a previous host would have.
func writeRecord(t *testing.T, stateDir string, rec reattachRecord) {
	t.Helper()
	l, err := ledger.Open(filepath.Join(stateDir, ledger.DefaultFileName), ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	data, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.SaveReattach(context.Background(), rec.Plugin, data); err != nil {
		t.Fatal(err)
	}
}

// fixtureChildren returns the live (not zombie) child processes of this test that run
// the fixture binary.
func fixtureChildren(t *testing.T) []int {
	t.Helper()
	want, err := filepath.EvalSymlinks(fixtureBin)
	if err != nil {
		t.Fatal(err)
	}
	kids, err := proc.Children(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, p := range kids {
		if p.Exe == want && !p.Zombie() {
			out = append(out, p.PID)
		}
	}
	return out
}

// alive reports whether pid is a running process (not gone, not a zombie).
func alive(pid int) bool {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
	return len(f) > 0 && f[0] != "Z" && f[0] != "X"
}

// TestProcessReattachAfterHostCrash runs a kept plugin under host A, "crashes" A (its
// goroutines end, its state file is let go, the plugin process runs on), and starts
// host B on the same state dir: B reattaches to the very same process, whose devices are
// healthy, and starts no second one. B's graceful Shutdown then stops the plugin and
// forgets its record.
func TestProcessReattachAfterHostCrash(t *testing.T) {
	cfg, logs := testConfig(t)
	cfg.StateDir = t.TempDir()
	cfg = withFixtures(cfg, fixture{name: "keep", reattach: true,
		cfg: fixtureplugin.Config{Groups: widgets("keep", "k0"), ReportPID: true}})
	hostA := &procLauncher{}
	t.Cleanup(func() { hostA.killLeft(t) }) // last: after both managers shut down

	a := startWith(t, cfg, hostA.launch)
	snap := waitSnapshot(t, a, "k0 served by a process", servedByProcess("keep", "k0"))
	pidA := reportedPID(snap, "keep")
	if got := pid(t, a, "keep"); got != pidA {
		t.Fatalf("the loader's PID %d is not the fixture's own %d", got, pidA)
	}
	rec, ok := savedRecord(t, a.ledger, "keep")
	if !ok || rec.PID != pidA || rec.Network != "unix" || !strings.HasPrefix(rec.Address, filepath.Join(cfg.StateDir, socketDirName)+"/") {
		t.Fatalf("reattach record = %+v (saved %v), want PID %d and a socket in the state dir", rec, ok, pidA)
	}
	res, err := a.Reserve(context.Background(), device.ReserveRequest{OwnerID: "o1", Group: widgetKey("keep"), DeviceIDs: []string{"k0"}})
	if err != nil {
		t.Fatal(err)
	}

	hostA.crashed.Store(true)
	crash(t, a)
	if !alive(pidA) {
		t.Fatalf("plugin process %d did not outlive its host", pidA)
	}

	hostB := &procLauncher{}
	b := startWith(t, cfg, hostB.launch)
	snap = waitSnapshot(t, b, "k0 served by a process", servedByProcess("keep", "k0"))
	if got := reportedPID(snap, "keep"); got != pidA {
		t.Errorf("host B talks to process %d, want the one host A left: %d", got, pidA)
	}
	if fresh, reattaches, attached := hostB.counts(); fresh != 0 || reattaches != 1 || attached != 1 {
		t.Errorf("host B: %d fresh launches, %d reattach attempts (%d good); want 0, 1 (1)", fresh, reattaches, attached)
	}
	if kids := fixtureChildren(t); !slices.Equal(kids, []int{pidA}) {
		t.Errorf("fixture processes running = %v, want only %d", kids, pidA)
	}
	logs.waitLine(t, "reattached to the plugin process", "plugin=keep", "pid="+strconv.Itoa(pidA))
	if h := snap.State.Devices["k0"].Holder; h == nil || h.ReservationID != res.ID {
		t.Errorf("k0 holder on host B = %v, want %s", h, res.ID)
	}
	// The reattached plugin serves the GC's cleanup.
	release(t, b, device.ReleaseRequest{ReservationID: res.ID})
	waitReservation(t, b, res.ID, "cleaned up", cleanedUp)

	shutdown(t, b)
	hostA.waitLeftExited(t)
	l, err := ledger.Open(filepath.Join(cfg.StateDir, ledger.DefaultFileName), ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if rec, ok := savedRecord(t, l, "keep"); ok {
		t.Errorf("after a graceful Shutdown the reattach record is still there: %+v", rec)
	}
}

// TestProcessReattachOnlyToTheRecordedProcess starts a kept plugin on a state dir whose
// reattach record does not lead to a usable plugin process: the host starts the plugin
// afresh, kills the recorded process only when it checks out as the plugin, and never
// touches a process that does not.
func TestProcessReattachOnlyToTheRecordedProcess(t *testing.T) {
	self, err := pluginloader.IdentifyProcess(os.Getpid(), "")
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	boot := self.BootID
	// orphan launches a fixture process the way a previous host did and returns it with
	// its reattach record; it is killed at the end of the test.
	orphan := func(t *testing.T) (*pluginloader.Plugin, reattachRecord) {
		t.Helper()
		sockets, err := os.MkdirTemp("", "sock") // short: a socket path has a length limit
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.RemoveAll(sockets) }) // after the Kill below: cleanups run last-in first-out
		p, err := pluginloader.Launch(context.Background(), pluginloader.Binary{Name: "keep", Path: fixtureBin},
			pluginloader.Options{
				DisableAutoMTLS: true,
				ConfigJSON:      fixtureplugin.Config{Groups: widgets("keep", "k0")}.JSON(),
				Env:             []string{goplugin.EnvUnixSocketDir + "=" + sockets},
			})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
			defer cancel()
			p.Kill(ctx)
		})
		rec, err := newReattachRecord("keep", fixtureBin, p.ReattachConfig())
		if err != nil {
			t.Fatal(err)
		}
		return p, rec
	}
	waitExited := func(t *testing.T, p *pluginloader.Plugin) {
		t.Helper()
		select {
		case <-p.ExitContext().Done():
		case <-time.After(testwait.Timeout):
			t.Errorf("recorded plugin process %d still runs after %v, want it killed", p.PID(), testwait.Timeout)
		}
	}

	tests := []struct {
		name         string
		reattach     bool                                        // the plugin is kept now
		record       func(t *testing.T) (reattachRecord, func()) // the record, and a check run once the plugin is up
		wantAttempts int
		wantLog      []string
	}{
		{name: "process gone", reattach: true, record: func(t *testing.T) (reattachRecord, func()) {
			cmd := exec.Command(fixtureBin) // exits at once: no host launched it
			_ = cmd.Run()
			return reattachRecord{Format: reattachFormat, Plugin: "keep", Path: fixtureBin, PID: cmd.Process.Pid, StartTicks: 1,
				BootID: boot, Protocol: "grpc", ProtocolVersion: deviceplugin.HandshakeVersion, Network: "unix",
				Address: filepath.Join(t.TempDir(), "gone.sock")}, func() {}
		}, wantLog: []string{"not reattaching", "is gone"}},
		{name: "PID of another binary", reattach: true, record: func(t *testing.T) (reattachRecord, func()) {
			cmd := exec.Command("sleep", "600")
			if err := cmd.Start(); err != nil {
				t.Skipf("no sleep: %v", err)
			}
			t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
			id, err := pluginloader.IdentifyProcess(cmd.Process.Pid, "")
			if err != nil {
				t.Fatal(err)
			}
			rec := reattachRecord{Format: reattachFormat, Plugin: "keep", Path: fixtureBin, PID: cmd.Process.Pid, StartTicks: id.StartTicks,
				BootID: boot, Protocol: "grpc", ProtocolVersion: deviceplugin.HandshakeVersion, Network: "unix",
				Address: filepath.Join(t.TempDir(), "sleep.sock")}
			return rec, func() {
				if !alive(cmd.Process.Pid) {
					t.Errorf("the unrelated process %d was killed", cmd.Process.Pid)
				}
			}
		}, wantLog: []string{"not reattaching", "not the plugin binary"}},
		{name: "PID reused by another run of the binary", reattach: true, record: func(t *testing.T) (reattachRecord, func()) {
			p, rec := orphan(t)
			rec.StartTicks++
			return rec, func() {
				if !alive(p.PID()) {
					t.Errorf("process %d, not the recorded one, was killed", p.PID())
				}
			}
		}, wantLog: []string{"not reattaching", "another process"}},
		{name: "the plugin, unreachable", reattach: true, record: func(t *testing.T) (reattachRecord, func()) {
			p, rec := orphan(t)
			rec.Address = filepath.Join(t.TempDir(), "elsewhere.sock")
			return rec, func() { waitExited(t, p) }
		}, wantAttempts: 1, wantLog: []string{"cannot reattach to the plugin process left by the previous host"}},
		{name: "the plugin, not kept any more", reattach: false, record: func(t *testing.T) (reattachRecord, func()) {
			p, rec := orphan(t)
			return rec, func() { waitExited(t, p) }
		}, wantLog: []string{"killed the plugin process left by the previous host: the plugin is not kept any more"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, logs := testConfig(t)
			cfg.StateDir = t.TempDir()
			cfg = withFixtures(cfg, fixture{name: "keep", reattach: tc.reattach,
				cfg: fixtureplugin.Config{Groups: widgets("keep", "k0"), ReportPID: true}})
			rec, check := tc.record(t)
			writeRecord(t, cfg.StateDir, rec)

			host := &procLauncher{}
			m := startWith(t, cfg, host.launch)
			snap := waitSnapshot(t, m, "k0 served by a process", servedByProcess("keep", "k0"))
			got := reportedPID(snap, "keep")
			if got == rec.PID {
				t.Errorf("the plugin runs as the recorded process %d, want a fresh one", got)
			}
			if fresh, attempts, _ := host.counts(); fresh != 1 || attempts != tc.wantAttempts {
				t.Errorf("%d fresh launches, %d reattach attempts; want 1, %d", fresh, attempts, tc.wantAttempts)
			}
			logs.waitLine(t, append([]string{"plugin=keep"}, tc.wantLog...)...)
			check()
			saved, ok := savedRecord(t, m.ledger, "keep")
			switch {
			case tc.reattach && (!ok || saved.PID != got):
				t.Errorf("reattach record after the fresh start = %+v (saved %v), want PID %d", saved, ok, got)
			case !tc.reattach && ok:
				t.Errorf("reattach record of a plugin not kept = %+v, want none", saved)
			}
		})
	}
}

func TestReattachRecordRoundTrip(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	id, err := pluginloader.IdentifyProcess(os.Getpid(), self)
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	rec := reattachRecord{Format: reattachFormat, Plugin: "p", Path: self, PID: os.Getpid(), StartTicks: id.StartTicks,
		BootID: id.BootID, Protocol: "grpc", ProtocolVersion: 1, Network: "unix", Address: "/run/p.sock"}
	if rec.process() != id {
		t.Errorf("process() = %+v, want %+v", rec.process(), id)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	back, err := decodeReattachRecord(data)
	if err != nil || back != rec {
		t.Fatalf("decode(encode(%+v)) = %+v, %v", rec, back, err)
	}
	rc, err := back.config()
	if err != nil || rc.Pid != rec.PID || rc.Addr.Network() != "unix" || rc.Addr.String() != "/run/p.sock" || rc.Protocol != "grpc" {
		t.Errorf("config() = %+v, %v", rc, err)
	}

	bad := []struct {
		name string
		edit func(r *reattachRecord)
		want string
	}{
		{"other format", func(r *reattachRecord) { r.Format = 2 }, "format 2"},
		{"no pid", func(r *reattachRecord) { r.PID = 0 }, "pid, path or address missing"},
		{"no address", func(r *reattachRecord) { r.Address = "" }, "pid, path or address missing"},
	}
	for _, tc := range bad {
		r := rec
		tc.edit(&r)
		data, _ := json.Marshal(r)
		if _, err := decodeReattachRecord(data); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: decode = %v, want an error about %q", tc.name, err, tc.want)
		}
	}
	if _, err := decodeReattachRecord([]byte(`{"format":1,"surprise":true}`)); err == nil {
		t.Errorf("decode of a record with an unknown field: no error")
	}
	if _, err := (reattachRecord{Network: "udp"}).config(); err == nil {
		t.Errorf("config() of a udp address: no error")
	}
}
