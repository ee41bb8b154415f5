package nvidia

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	oci "github.com/opencontainers/runtime-spec/specs-go"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/devicehost/devicehost/deviceplugin/deviceplugintest"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/logtest"
)

// runtimeCache reads dir as a container runtime does, with the CDI library's cache.
func runtimeCache(t *testing.T, dir string) *cdiapi.Cache {
	t.Helper()
	c, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatalf("NewCache: %v", err)
	}
	if errs := c.GetErrors(); len(errs) > 0 {
		t.Fatalf("the CDI cache found errors in %s: %v", dir, errs)
	}
	return c
}

// cdiDevices lists the GPU IDs the spec in dir holds, sorted.
func cdiDevices(t *testing.T, dir string) []string {
	t.Helper()
	var ids []string
	for _, name := range runtimeCache(t, dir).ListDevices() {
		id, ok := strings.CutPrefix(name, cdiKind+"=")
		if !ok {
			t.Errorf("spec dir holds %q, not of kind %s", name, cdiKind)
		}
		ids = append(ids, id)
	}
	return ids
}

func simUUIDs(machine string, idx ...int) []string {
	var ids []string
	for _, i := range idx {
		ids = append(ids, simulatedUUID(machine, i))
	}
	slices.Sort(ids)
	return ids
}

// newLoggedPlugin is newTestPlugin with the plugin's log captured.
func newLoggedPlugin(t *testing.T, cfg Config) (*Plugin, *fakeClock, *logtest.Recorder) {
	t.Helper()
	logs := &logtest.Recorder{}
	p := New(hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Debug}))
	clk := newFakeClock()
	p.clock = clk
	p.eventPoll = 5 * time.Millisecond
	t.Cleanup(p.Close)
	if cfg.Simulate != "" && cfg.SimStateFile == nil {
		cfg.SimStateFile = ptr(filepath.Join(t.TempDir(), "sim-state.json"))
	}
	if err := p.SetConfig(context.Background(), mustJSON(t, cfg)); err != nil {
		t.Fatalf("SetConfig(%+v): %v", cfg, err)
	}
	return p, clk, logs
}

// The CDI names a real Reserve answer gives (over go-plugin gRPC, as the host gets
// them) resolve with the CDI library and inject the GPUs' device nodes and env into an
// OCI spec, although a simulated GPU's node does not exist on this host.
func TestCDINamesFromReserveInject(t *testing.T) {
	dir := t.TempDir()
	p, _ := newUnconfigured(t)
	c := deviceplugintest.Connect(t, p)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := c.SetConfig(ctx, &pb.SetConfigRequest{ConfigJson: mustJSON(t, Config{Simulate: "dgxh100", CDISpecDir: &dir})}); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	fpCtx, fpCancel := context.WithCancel(ctx)
	defer fpCancel()
	fp, err := c.Fingerprint(fpCtx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	if _, err := fp.Recv(); err != nil { // the spec is written before the first fingerprint
		t.Fatalf("Fingerprint recv: %v", err)
	}

	ids := []string{simulatedUUID("dgxh100", 5), simulatedUUID("dgxh100", 2)}
	res, err := c.Reserve(ctx, &pb.ReserveRequest{DeviceIds: ids})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	names := res.GetReservation().GetCdiDevices()
	if len(names) != 2 {
		t.Fatalf("Reserve gave CDI names %q, want 2", names)
	}

	// The container's env as a CRI runtime builds it: the image's and the
	// reservation's; CDI edits come after. The GPUs' list must survive them.
	env := []string{"PATH=/usr/bin"}
	for k, v := range res.GetReservation().GetEnvs() {
		env = append(env, k+"="+v)
	}
	spec := &oci.Spec{Process: &oci.Process{Env: env}, Linux: &oci.Linux{}}
	if unresolved, err := runtimeCache(t, dir).InjectDevices(spec, names...); err != nil {
		t.Fatalf("InjectDevices(%q): %v (unresolved %q)", names, err, unresolved)
	}
	var nodes []string
	for _, d := range spec.Linux.Devices {
		nodes = append(nodes, fmt.Sprintf("%s %s %d:%d", d.Path, d.Type, d.Major, d.Minor))
	}
	slices.Sort(nodes)
	// The mock's minor numbers are the GPU indexes.
	if want := []string{"/dev/nvidia2 c 195:2", "/dev/nvidia5 c 195:5", "/dev/nvidiactl c 195:255"}; !slices.Equal(nodes, want) {
		t.Errorf("device nodes in the OCI spec = %q, want %q", nodes, want)
	}
	visible := "NVIDIA_VISIBLE_DEVICES=" + ids[0] + "," + ids[1]
	if want := []string{"PATH=/usr/bin", visible}; !slices.Equal(spec.Process.Env, want) {
		t.Errorf("env in the OCI spec = %q, want %q: the CDI edits must leave the reservation's GPU list alone", spec.Process.Env, want)
	}
	var rules []string
	for _, r := range spec.Linux.Resources.Devices {
		rules = append(rules, fmt.Sprintf("allow=%v %s %d:%d %s", r.Allow, r.Type, *r.Major, *r.Minor, r.Access))
	}
	slices.Sort(rules)
	if want := []string{"allow=true c 195:2 rw", "allow=true c 195:255 rw", "allow=true c 195:5 rw"}; !slices.Equal(rules, want) {
		t.Errorf("cgroup device rules = %q, want %q", rules, want)
	}
	t.Logf("injected %q: devices %q, env %q, cgroup %q", names, nodes, spec.Process.Env, rules)
}

// A GPU that leaves the inventory leaves the spec at the next re-read, before the
// host hears of it; with no GPUs left the spec file goes.
func TestCDISpecFollowsTheInventory(t *testing.T) {
	dir := t.TempDir()
	p, clk, logs := newLoggedPlugin(t, Config{Simulate: "dgxh100", FingerprintPeriod: "1m", CDISpecDir: &dir})
	s := startFingerprint(t, p)
	s.next(t)
	if got, want := cdiDevices(t, dir), simUUIDs("dgxh100", 0, 1, 2, 3, 4, 5, 6, 7); !slices.Equal(got, want) {
		t.Fatalf("spec devices = %q, want all 8 GPUs %q", got, want)
	}

	clk.waitForTimerAt(t, t0.Add(time.Minute))
	lib := p.rt.lib.(*simLib)
	lib.devices = lib.devices[:6] // GPUs 6 and 7 fall off the bus
	clk.Advance(time.Minute)
	if got := len(devices(s.next(t))); got != 6 {
		t.Fatalf("fingerprint after the loss has %d GPUs, want 6", got)
	}
	if got, want := cdiDevices(t, dir), simUUIDs("dgxh100", 0, 1, 2, 3, 4, 5); !slices.Equal(got, want) {
		t.Errorf("spec devices = %q, want GPUs 0-5 %q", got, want)
	}

	clk.waitForTimerAt(t, t0.Add(2*time.Minute))
	lib.devices = nil
	clk.Advance(time.Minute)
	if got := len(devices(s.next(t))); got != 0 {
		t.Fatalf("fingerprint has %d GPUs, want none", got)
	}
	if _, err := os.Stat(filepath.Join(dir, cdiSpecName+".yaml")); !os.IsNotExist(err) {
		t.Errorf("spec with no GPUs left: stat = %v, want it removed", err)
	}
	for _, want := range []string{"CDI spec written", "gpus=8", "gpus=6", "CDI spec removed: no GPUs"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, logs)
		}
	}
}

// A plugin the host stops takes its spec away (a helm uninstall leaves no spec naming
// GPUs nobody serves); a plugin that never configured CDI has nothing to remove.
func TestCDISpecRemovedAtShutdown(t *testing.T) {
	dir := t.TempDir()
	p, _, logs := newLoggedPlugin(t, Config{Simulate: "dgxh100", CDISpecDir: &dir})
	s := startFingerprint(t, p)
	s.next(t)
	if got := len(cdiDevices(t, dir)); got != 8 {
		t.Fatalf("spec has %d GPUs, want 8", got)
	}
	if err := s.stop(t); err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	p.Shutdown()
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("spec dir after Shutdown holds %v, want nothing", entries)
	}
	if !strings.Contains(logs.String(), "CDI spec removed at shutdown") {
		t.Errorf("log lacks the removal:\n%s", logs)
	}
	if _, err := p.Reserve(context.Background(), []string{simUUIDs("dgxh100", 0)[0]}); err == nil {
		t.Error("Reserve after Shutdown succeeded, want the plugin closed")
	}
	New(hclog.NewNullLogger()).Shutdown() // never configured: nothing to remove, no panic
}

// A spec dir that cannot be written is logged once, naming the path and why, while
// the plugin goes on fingerprinting and reserving; once the dir is fixed the next
// re-read writes the spec.
func TestCDISpecDirUnwritable(t *testing.T) {
	parent := t.TempDir()
	blocker := filepath.Join(parent, "run")
	if err := os.WriteFile(blocker, nil, 0o644); err != nil { // a file where a dir should be stops root too
		t.Fatal(err)
	}
	dir := filepath.Join(blocker, "cdi")
	p, clk, logs := newLoggedPlugin(t, Config{Simulate: "dgxh100", FingerprintPeriod: "1m", CDISpecDir: &dir})
	s := startFingerprint(t, p)
	if got := len(devices(s.next(t))); got != 8 {
		t.Fatalf("fingerprint has %d GPUs, want 8", got)
	}
	if _, err := p.Reserve(context.Background(), []string{simulatedUUID("dgxh100", 0)}); err != nil {
		t.Errorf("Reserve while the spec cannot be written: %v", err)
	}
	clk.waitForTimerAt(t, t0.Add(time.Minute))
	clk.Advance(time.Minute) // a re-read: tries again, fails the same way
	clk.waitForTimerAt(t, t0.Add(2*time.Minute))

	log := logs.String()
	if got := strings.Count(log, "CDI spec not written"); got != 1 {
		t.Errorf("logged %d lines about the spec not written, want 1:\n%s", got, log)
	}
	for _, want := range []string{"[ERROR]", filepath.Join(dir, cdiSpecName+".yaml"), "not a directory", "goes on serving"} {
		if !strings.Contains(log, want) {
			t.Errorf("log lacks %q:\n%s", want, log)
		}
	}

	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	lib := p.rt.lib.(*simLib)
	lib.devices = lib.devices[:7] // a change, so the re-read sends a fingerprint to wait for
	clk.Advance(time.Minute)
	s.next(t)
	if got := cdiDevices(t, dir); len(got) != 7 {
		t.Errorf("spec after the fix has %d GPUs, want 7", len(got))
	}
	if !strings.Contains(logs.String(), "CDI spec written") {
		t.Errorf("log lacks the recovery:\n%s", logs)
	}
}

// Moving the spec (or turning it off) in a new config removes the old file, which
// nobody would keep up to date.
func TestCDISpecMovesWithConfig(t *testing.T) {
	oldDir, newDir := t.TempDir(), t.TempDir()
	p, _ := newTestPlugin(t, Config{Simulate: "dgxh100", CDISpecDir: &oldDir})
	s := startFingerprint(t, p)
	s.next(t)
	if got := len(cdiDevices(t, oldDir)); got != 8 {
		t.Fatalf("old dir has %d GPUs, want 8", got)
	}
	if err := s.stop(t); err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	if err := p.SetConfig(context.Background(), mustJSON(t, Config{Simulate: "dgxh100", CDISpecDir: &newDir})); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	if entries, _ := os.ReadDir(oldDir); len(entries) != 0 {
		t.Errorf("old spec dir still holds %v", entries)
	}
	startFingerprint(t, p).next(t)
	if got := len(cdiDevices(t, newDir)); got != 8 {
		t.Errorf("new dir has %d GPUs, want 8", got)
	}
	off := ""
	if err := p.SetConfig(context.Background(), mustJSON(t, Config{Simulate: "dgxh100", CDISpecDir: &off})); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	if entries, _ := os.ReadDir(newDir); len(entries) != 0 {
		t.Errorf("spec turned off, but its dir still holds %v", entries)
	}
}

// The UVM nodes CUDA needs go into the spec when this host has them, by path only
// (their major number is assigned at module load; the runtime reads it from the node).
func TestCDISpecListsHostUVMNodes(t *testing.T) {
	dir := t.TempDir()
	p, _ := newUnconfigured(t)
	p.charDevice = func(path string) bool { return path == "/dev/nvidia-uvm" }
	if err := p.SetConfig(context.Background(), mustJSON(t, Config{Simulate: "dgxa100", CDISpecDir: &dir})); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	startFingerprint(t, p).next(t)
	dev := runtimeCache(t, dir).GetDevice(cdiKind + "=" + simulatedUUID("dgxa100", 0))
	if dev == nil {
		t.Fatalf("GPU 0 not in the spec")
	}
	var common []string
	for _, n := range dev.GetSpec().ContainerEdits.DeviceNodes {
		common = append(common, fmt.Sprintf("%s %s %d:%d", n.Path, n.Type, n.Major, n.Minor))
	}
	if want := []string{"/dev/nvidiactl c 195:255", "/dev/nvidia-uvm  0:0"}; !slices.Equal(common, want) {
		t.Errorf("common device nodes = %q, want %q", common, want)
	}
}

// With a CDI spec, every device of the fingerprint but an on-demand MIG partition names
// its CDI name (what the host hands an admin access), and the spec resolves each; without
// a spec, none names one.
func TestFingerprintCDINames(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{Simulate: "dgxh100", CDISpecDir: &dir, MIG: MIGOnDemand, MIGLayout: json.RawMessage(`{"1": ["3g.40gb"]}`), Replicas: 2}
	p, _ := newTestPlugin(t, cfg)
	resp := fingerprintOf(t, p)
	named, bare := 0, 0
	for _, g := range resp.GetGroups() {
		for _, d := range g.GetDevices() {
			names := d.GetCdiDevices()
			if strings.Contains(d.GetId(), "-mig-") { // an on-demand partition
				if len(names) != 0 {
					t.Errorf("on-demand partition %s names %v, want none (its instance exists only while reserved)", d.GetId(), names)
				}
				bare++
				continue
			}
			if want := []string{cdiKind + "=" + d.GetId()}; !slices.Equal(names, want) {
				t.Errorf("%s %s names %v, want %v", g.GetType(), d.GetId(), names, want)
			}
			named++
		}
	}
	inSpec := cdiDevices(t, dir)
	for _, g := range resp.GetGroups() {
		for _, d := range g.GetDevices() {
			for _, n := range d.GetCdiDevices() {
				if !slices.Contains(inSpec, strings.TrimPrefix(n, cdiKind+"=")) {
					t.Errorf("%s: its CDI name %s is not in the spec", d.GetId(), n)
				}
			}
		}
	}
	if named == 0 || bare == 0 {
		t.Fatalf("%d named devices, %d partitions: the fingerprint lacks a kind", named, bare)
	}

	off := ""
	cfg.CDISpecDir = &off
	q, _ := newTestPlugin(t, cfg)
	for _, g := range fingerprintOf(t, q).GetGroups() {
		for _, d := range g.GetDevices() {
			if len(d.GetCdiDevices()) > 0 {
				t.Fatalf("without a CDI spec %s names %v", d.GetId(), d.GetCdiDevices())
			}
		}
	}
}
