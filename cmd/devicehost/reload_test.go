package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

// These tests run the built agent on a plugin dir holding copies of the fixture plugin,
// change its config file and its plugin dir, and send it SIGHUP.

var fixtureBuild struct {
	once sync.Once
	dir  string
	data []byte
	err  error
}

// fixturePlugin returns the fixture plugin binary's bytes, built once per test run.
func fixturePlugin(t *testing.T) []byte {
	t.Helper()
	fixtureBuild.once.Do(func() {
		dir, err := os.MkdirTemp("", "dhfixture")
		if err != nil {
			fixtureBuild.err = err
			return
		}
		fixtureBuild.dir = dir
		bin, err := fixtureplugin.Build(dir)
		if err == nil {
			err = os.Chmod(bin, 0o755) // not group-writable, whatever the umask
		}
		if err == nil {
			fixtureBuild.data, err = os.ReadFile(bin)
		}
		fixtureBuild.err = err
	})
	if fixtureBuild.err != nil {
		t.Fatalf("build the fixture plugin: %v", fixtureBuild.err)
	}
	return fixtureBuild.data
}

// installPlugin writes the fixture plugin to dir/name, mode 0755, and returns when the
// file is complete.
func installPlugin(t *testing.T, dir, name string) time.Time {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, fixturePlugin(t), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o755); err != nil {
		t.Fatal(err)
	}
	return time.Now()
}

// logEntry is one JSON line of the agent's log.
type logEntry map[string]any

func (e logEntry) str(key string) string { s, _ := e[key].(string); return s }

// waitLog waits for a JSON log line whose @message contains msg and for which ok (may
// be nil) holds, and returns it.
func (a *agentProcess) waitLog(t *testing.T, ctx context.Context, msg string, ok func(logEntry) bool) logEntry {
	t.Helper()
	var found logEntry
	_, err := a.Stderr.Wait(ctx, func(l string) bool {
		var e logEntry
		if json.Unmarshal([]byte(l), &e) != nil || !strings.Contains(e.str("@message"), msg) {
			return false
		}
		if ok != nil && !ok(e) {
			return false
		}
		found = e
		return true
	})
	if err != nil {
		t.Fatalf("no log line %q from the agent: %v", msg, err)
	}
	return found
}

// logCount counts the agent's log lines containing s.
func (a *agentProcess) logCount(s string) int {
	n := 0
	for _, l := range a.Stderr.Lines() {
		if strings.Contains(l, s) {
			n++
		}
	}
	return n
}

// groupAttr returns the int attribute key of the fingerprint's group of plugin.
func groupAttr(fp *pb.FingerprintResponse, plugin, key string) int64 {
	for _, g := range fp.GetGroups() {
		if g.GetPlugin() == plugin {
			return g.GetAttributes()[key].GetIntValue()
		}
	}
	return 0
}

// healthyIDs reports whether every id is in fp, healthy.
func healthyIDs(fp *pb.FingerprintResponse, ids ...string) bool {
	have := make(map[string]bool)
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			have[d.GetId()] = d.GetHealth() == pb.Health_HEALTH_HEALTHY
		}
	}
	for _, id := range ids {
		if !have[id] {
			return false
		}
	}
	return true
}

func hasDevice(fp *pb.FingerprintResponse, id string) bool {
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetId() == id {
				return true
			}
		}
	}
	return false
}

const reloadConfigV1 = `
log_level = "info"

plugin "a" {
  config {
    groups     = [{ vendor = "fixture", type = "widget", name = "a", ids = ["a0"] }]
    report_pid = true
    log_debug  = "fixture a: debug v1"
    log_info   = "fixture a: configured v1"
  }
}

plugin "b" {
  config {
    groups = [{ vendor = "fixture", type = "widget", name = "b", ids = ["b0"] }]
  }
}
`

// v2: a changed, b's block gone, c added (no binary yet), log level debug, and settings
// that need a restart: stats_interval (ignored until then), listen and plugin_dir (which
// the command line sets, so they do not change at all).
const reloadConfigV2 = `
log_level      = "debug"
max_procs      = 2
stats_interval = "2s"
listen         = "unix:///run/devicehost-elsewhere.sock"
plugin_dir     = "/srv/elsewhere"

plugin "a" {
  config {
    groups     = [{ vendor = "fixture", type = "widget", name = "a", ids = ["a0", "a1"] }]
    report_pid = true
    log_debug  = "fixture a: debug v2"
    log_info   = "fixture a: configured v2"
  }
}

plugin "c" {
  config {
    groups = [{ vendor = "fixture", type = "widget", name = "c", ids = ["c0"] }]
  }
}
`

const reloadConfigBroken = `
log_level = "info"
plugin "a" {
  config = 
}
`

func TestAgentReloadsItsConfigOnSIGHUP(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := tempDir(t, "dhrl")
	plugins := filepath.Join(dir, "plugins")
	if err := os.Mkdir(plugins, 0o755); err != nil {
		t.Fatal(err)
	}
	installPlugin(t, plugins, "a")
	installPlugin(t, plugins, "b")
	cfgPath := filepath.Join(dir, "agent.hcl")
	writeAgentConfig := func(content string) {
		t.Helper()
		if err := os.WriteFile(cfgPath, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeAgentConfig(reloadConfigV1)
	addr := endpoint.Address{Network: "unix", Path: filepath.Join(dir, "dh.sock")}
	agent := startAgentProcess(t, addr, "agent", "-config", cfgPath, "-plugin-dir", plugins,
		"-state-dir", filepath.Join(dir, "state"), "-listen", addr.String(), "-log-json")
	watchCtx, stopWatch := context.WithCancel(ctx) // the health watch: an open call would hold the agent's stop
	defer stopWatch()
	client := agent.client(t, watchCtx)
	hup := func() {
		t.Helper()
		if err := agent.Cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
	}

	fp := currentFingerprint(t, ctx, client, "a0 and b0", func(fp *pb.FingerprintResponse) bool { return healthyIDs(fp, "a0", "b0") })
	pidA := groupAttr(fp, "a", "pid")
	g := fp.GetGroups()[0]
	for _, gg := range fp.GetGroups() {
		if gg.GetPlugin() == "a" {
			g = gg
		}
	}
	res, err := client.Reserve(ctx, reserveRequest(g, "job-1", "a0"))
	if err != nil {
		t.Fatal(err)
	}
	// At INFO, the plugin's DEBUG line (logged before its INFO line) is dropped.
	agent.waitLog(t, ctx, "fixture a: configured v1", nil)
	if n := agent.logCount("fixture a: debug v1"); n != 0 {
		t.Errorf("%d DEBUG lines from the plugin at log level info, want 0", n)
	}

	// Added, changed and removed blocks, a new log level.
	writeAgentConfig(reloadConfigV2)
	hup()
	done := agent.waitLog(t, ctx, "configuration reloaded", nil)
	if got := done.str("needs_restart"); got != "stats_interval" {
		t.Errorf("settings reported as needing a restart: %q, want only stats_interval (listen and plugin_dir are the command line's)", got)
	}
	agent.waitLog(t, ctx, "log level changed", func(e logEntry) bool { return e.str("to") == "debug" })
	agent.waitLog(t, ctx, "max_procs changed", func(e logEntry) bool { return e["to"] == 2.0 && e["gomaxprocs"] == 2.0 })
	agent.waitLog(t, ctx, "fixture a: debug v2", func(e logEntry) bool { return e.str("@level") == "debug" })
	fp = currentFingerprint(t, ctx, client, "a restarted with a1, b with the fixture's default devices", func(fp *pb.FingerprintResponse) bool {
		return healthyIDs(fp, "a0", "a1", "w0", "w1") && !hasDevice(fp, "b0")
	})
	if got := groupAttr(fp, "a", "pid"); got == pidA {
		t.Errorf("plugin a still runs as pid %d after its config changed", got)
	}
	for _, grp := range fp.GetGroups() {
		for _, d := range grp.GetDevices() {
			if d.GetId() == "a0" && d.GetHolder().GetReservationId() != res.GetReservationId() {
				t.Errorf("a0 holder after the reload = %v, want reservation %s", d.GetHolder(), res.GetReservationId())
			}
		}
	}
	list, err := client.ListPlugins(ctx, &pb.ListPluginsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var c *pb.Plugin
	for _, p := range list.GetPlugins() {
		if p.GetName() == "c" {
			c = p
		}
	}
	if c.GetStatus() != pb.PluginStatus_PLUGIN_STATUS_FAILED || !strings.Contains(c.GetLastError(), "no such plugin binary") {
		t.Errorf("plugin c = %v, want listed as failed, no binary", c)
	}
	pidA = groupAttr(fp, "a", "pid")

	// A config that does not parse is refused with its file and line; nothing changes.
	writeAgentConfig(reloadConfigBroken)
	hup()
	refused := agent.waitLog(t, ctx, "configuration reload refused", nil)
	if got := refused.str("error"); !strings.Contains(got, cfgPath+":4,") {
		t.Errorf("refusal error %q does not name %s:4", got, cfgPath)
	}
	fp = currentFingerprint(t, ctx, client, "the same devices", func(fp *pb.FingerprintResponse) bool { return healthyIDs(fp, "a0", "a1", "w0", "w1") })
	if got := groupAttr(fp, "a", "pid"); got != pidA {
		t.Errorf("plugin a restarted (pid %d, then %d) by a refused config", pidA, got)
	}
	if n := agent.logCount("log level changed"); n != 1 {
		t.Errorf("%d log level changes, want 1 (the refused file's level is not applied)", n)
	}

	// Plugin c's binary dropped in: it runs with the block it was given.
	stream, err := client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	complete := installPlugin(t, plugins, "c")
	waitFingerprint(t, "c0 from the dropped-in plugin", stream, func(fp *pb.FingerprintResponse) bool { return healthyIDs(fp, "c0") })
	t.Logf("drop-in through the agent: c0 visible to a Fingerprint stream %v after the file was complete", time.Since(complete))

	// The API never went away: still SERVING on the same socket.
	conn, err := endpoint.Dial(addr, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: server.ServiceName})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health after the reloads and the drop-in: %v, %v; want SERVING", h, err)
	}

	stopWatch()
	if err := agent.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := agent.Wait(ctx); err != nil {
		t.Errorf("agent exit after SIGTERM: %v, want 0", err)
	}
}

// TestRestartOnlyNamesEverySettingAReloadCannotApply changes each setting of agentConfig
// in turn, except those a reload applies, and expects restartOnly to name it: a setting
// added later and forgotten there would be dropped by a reload without a word.
func TestRestartOnlyNamesEverySettingAReloadCannotApply(t *testing.T) {
	live := map[string]bool{
		"LogLevel": true, "Plugins": true, "Bundled": true, "MaxProcs": true,
		// Not a setting: whether metrics_listen may be plain HTTP follows from its address.
		"MetricsTLS.Insecure": true,
	}
	var change func(v reflect.Value) bool
	change = func(v reflect.Value) bool {
		switch v.Kind() {
		case reflect.String:
			v.SetString(v.String() + "x")
		case reflect.Bool:
			v.SetBool(!v.Bool())
		case reflect.Int, reflect.Int64: // time.Duration too
			v.SetInt(v.Int() + 1)
		case reflect.Slice: // listener and grant blocks: one more
			v.Set(reflect.Append(v, reflect.Zero(v.Type().Elem())))
		case reflect.Struct:
			changed := false
			for i := range v.NumField() {
				changed = change(v.Field(i)) || changed
			}
			return changed
		default:
			return false
		}
		return true
	}
	base := defaultAgentConfig()
	typ := reflect.TypeOf(base)
	for i := range typ.NumField() {
		f := typ.Field(i)
		if live[f.Name] {
			continue
		}
		if f.Type.Kind() == reflect.Struct {
			for j := range f.Type.NumField() {
				if live[f.Name+"."+f.Type.Field(j).Name] {
					continue
				}
				next := base
				if !change(reflect.ValueOf(&next).Elem().Field(i).Field(j)) {
					t.Fatalf("test cannot change %s.%s; teach it the type", f.Name, f.Type.Field(j).Name)
				}
				if got := restartOnly(base, next); len(got) != 1 {
					t.Errorf("changing %s.%s: restartOnly = %q, want it named once", f.Name, f.Type.Field(j).Name, got)
				}
			}
			continue
		}
		next := base
		if !change(reflect.ValueOf(&next).Elem().Field(i)) {
			t.Fatalf("test cannot change %s (%s); teach it the type or list it as live", f.Name, f.Type)
		}
		if got := restartOnly(base, next); len(got) != 1 {
			t.Errorf("changing %s: restartOnly = %q, want it named once", f.Name, got)
		}
	}
}
