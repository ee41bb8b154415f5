package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/agenttest"
	"github.com/devicehost/devicehost/tools/testwait"
)

const exampleGroup = "nomad/file/mock" // the example plugin's vendor/type/name

// exampleUnderAgent is Nomad's example device plugin, run by the devicehost agent
// through the adapter (plugin "nomad-example").
type exampleUnderAgent struct {
	bins    map[string]string
	devDir  string
	address string
	agent   *agenttest.Process
}

func startExampleUnderAgent(t *testing.T) *exampleUnderAgent {
	t.Helper()
	bins := build(t)
	tmp := tempDir(t, "dhnx")
	e := &exampleUnderAgent{bins: bins, devDir: filepath.Join(tmp, "devices"), address: "unix://" + filepath.Join(tmp, "dh.sock")}
	pluginDir := filepath.Join(tmp, "plugins")
	for _, d := range []string{e.devDir, pluginDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"dev0", "dev1"} {
		if err := os.WriteFile(filepath.Join(e.devDir, f), []byte("device "+f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	install(t, bins[adapterName], pluginDir, "nomad-example")
	config := fmt.Sprintf(`
listen         = %q
plugin_dir     = %q
state_dir      = %q
stats_interval = "200ms"
ready_timeout  = "1m"

plugin "nomad-example" {
  config {
    nomad_plugin = %q
    nomad_config {                        # a block, as in a Nomad client's config
      dir         = %q
      list_period = "100ms"
    }
  }
}
`, e.address, pluginDir, filepath.Join(tmp, "state"), bins[exampleName], e.devDir)
	cfgPath := filepath.Join(tmp, "devicehost.hcl")
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	e.agent = startAgent(t, bins[agentName], tmp, "agent", "-config", cfgPath, "-log-json", "-log-level", "debug")
	t.Cleanup(func() {
		// The agent's plugins die with it (parent-death signal), and the example plugin
		// with the adapter: nothing may be left behind.
		e.agent.Kill()
		noProcesses(t, "after the agent was killed", bins[exampleName])
	})
	return e
}

// Nomad's example device plugin, built unmodified from Nomad v1.6.3, runs under the
// real devicehost agent through the adapter: its devices show in `devicehost devices`,
// Reserve returns its mounts, a file made unhealthy shows unhealthy, its stats arrive,
// and a SIGKILL of it recovers.
func TestNomadExamplePluginUnderAgent(t *testing.T) {
	e := startExampleUnderAgent(t)
	c := dial(t, e.address)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()

	healthy := func(id string) func(*pb.FingerprintResponse) bool {
		return func(s *pb.FingerprintResponse) bool {
			d := findDevice(s, exampleGroup, id)
			return d != nil && d.GetHealth() == pb.Health_HEALTH_HEALTHY
		}
	}
	waitDevices(t, c, "dev0 and dev1 healthy", func(s *pb.FingerprintResponse) bool {
		return healthy("dev0")(s) && healthy("dev1")(s)
	})

	// `devicehost devices` lists them.
	out, err := exec.CommandContext(ctx, e.bins[agentName], "devices", "-address", e.address).CombinedOutput()
	if err != nil {
		t.Fatalf("devicehost devices: %v\n%s", err, out)
	}
	for _, id := range []string{"dev0", "dev1"} {
		if !hasRow(string(out), exampleGroup, id, "healthy") {
			t.Errorf("devicehost devices has no healthy %s of %s:\n%s", id, exampleGroup, out)
		}
	}

	// Reserve returns the example's mount of the file.
	res, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-1", Vendor: "nomad", Type: "file", Name: "mock", DeviceIds: []string{"dev0"}})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	mounts := res.GetReservation().GetMounts()
	if len(mounts) != 1 || mounts[0].GetHostPath() != filepath.Join(e.devDir, "dev0") || mounts[0].GetContainerPath() != "/tmp/task-mounts/dev0" || mounts[0].GetReadOnly() {
		t.Errorf("mounts %v; want %s at /tmp/task-mounts/dev0, read-write", mounts, filepath.Join(e.devDir, "dev0"))
	}

	// Stats: the file's size in bytes, and the summary.
	statsCtx, stopStats := context.WithTimeout(ctx, testwait.Timeout)
	for u := range c.WatchStats(statsCtx, 0) {
		if v := deviceStat(u.Snapshot, "dev0", "size"); v != nil {
			if v.GetIntValue() != int64(len("device dev0")) || v.GetUnit() != "B" {
				t.Errorf("dev0 size %v; want %d B", v, len("device dev0"))
			}
			if deviceStat(u.Snapshot, "dev0", "summary") == nil {
				t.Error("dev0 has no summary value")
			}
			break
		}
	}
	stopStats()

	// A file with the unhealthy permissions is an unhealthy device, with the example's
	// reason.
	if err := os.Chmod(filepath.Join(e.devDir, "dev1"), 0o777); err != nil {
		t.Fatal(err)
	}
	waitDevices(t, c, "dev1 unhealthy", func(s *pb.FingerprintResponse) bool {
		d := findDevice(s, exampleGroup, "dev1")
		return d != nil && d.GetHealth() == pb.Health_HEALTH_UNHEALTHY && d.GetHealthReason() == `Device has bad permissions "-rwxrwxrwx"`
	})

	// SIGKILL the Nomad plugin: its devices go unhealthy, the agent restarts the
	// adapter (and with it a new example process), and they come back.
	pid := onlyProcess(t, e.bins[exampleName])
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitDevices(t, c, "dev0 unhealthy after the kill", func(s *pb.FingerprintResponse) bool {
		d := findDevice(s, exampleGroup, "dev0")
		return d != nil && d.GetHealth() == pb.Health_HEALTH_UNHEALTHY
	})
	waitDevices(t, c, "dev0 healthy after the restart", healthy("dev0"))
	if again := onlyProcess(t, e.bins[exampleName]); again == pid {
		t.Errorf("the example plugin still runs as %d; want a new process", pid)
	}
	plugins, err := c.Plugins(ctx)
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*pb.Plugin{}
	for _, p := range plugins {
		byName[p.GetName()] = p
	}
	if p := byName["nomad-example"]; p.GetStatus() != pb.PluginStatus_PLUGIN_STATUS_RUNNING || p.GetRestarts() < 1 {
		t.Errorf("nomad-example: %v; want running after at least one restart", p)
	}
	// The reservation survived the crash.
	rs, err := c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: "job-1", State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil || len(rs) != 1 {
		t.Errorf("job-1's reservations after the crash: %v, %v; want one active", rs, err)
	}
}

// A Nomad config that Nomad's example plugin rejects is a config error of the agent's:
// it exits 1 naming the plugin block's file:line and the example plugin's own message.
func TestNomadConfigRejectedStopsTheAgent(t *testing.T) {
	bins := build(t)
	tmp := tempDir(t, "dhnr")
	pluginDir := filepath.Join(tmp, "plugins")
	if err := os.Mkdir(pluginDir, 0o755); err != nil {
		t.Fatal(err)
	}
	install(t, bins[adapterName], pluginDir, "nomad-broken")
	config := fmt.Sprintf(`listen     = %q
plugin_dir = %q
state_dir  = %q

plugin "nomad-broken" {
  config {
    nomad_plugin = %q
    nomad_config = { list_period = "soon" } # the object form works too
  }
}
`, "unix://"+filepath.Join(tmp, "dh.sock"), pluginDir, filepath.Join(tmp, "state"), bins[exampleName])
	cfgPath := filepath.Join(tmp, "devicehost.hcl")
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	agent := startAgent(t, bins[agentName], tmp, "agent", "-config", cfgPath)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	err := agent.Wait(ctx)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("agent with a Nomad config the plugin rejects: %v, want exit status 1", err)
	}
	out := strings.Join(agent.Stdout.Lines(), "\n")
	if want := cfgPath + `:5,1: Plugin config rejected; plugin "nomad-broken"`; !strings.Contains(out, want) {
		t.Errorf("output does not say %q:\n%s", want, out)
	}
	if !strings.Contains(out, `failed to parse list period "soon"`) {
		t.Errorf("output does not carry the example plugin's message about list_period:\n%s", out)
	}
}

// hasRow reports whether the table out has a row with these cells in this order.
func hasRow(out string, cells ...string) bool {
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= len(cells) && equal(f[:len(cells)], cells) {
			return true
		}
	}
	return false
}

// deviceStat returns the value name of device id in snap, or nil.
func deviceStat(snap *pb.StatsResponse, id, name string) *pb.Value {
	for _, g := range snap.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetDeviceId() == id {
				return d.GetValues()[name]
			}
		}
	}
	return nil
}
