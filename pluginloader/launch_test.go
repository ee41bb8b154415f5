package pluginloader_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/logtest"
)

// firstFingerprint opens a Fingerprint stream and returns its first message.
func firstFingerprint(t *testing.T, p *pluginloader.Plugin) *pb.FingerprintResponse {
	t.Helper()
	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	stream, err := p.Client().Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	m, err := stream.Recv()
	if err != nil {
		t.Fatalf("Fingerprint Recv: %v", err)
	}
	return m
}

func deviceIDs(m *pb.FingerprintResponse) []string {
	var ids []string
	for _, g := range m.GetGroups() {
		for _, d := range g.GetDevices() {
			ids = append(ids, d.GetId())
		}
	}
	return ids
}

func TestLaunchFixture(t *testing.T) {
	p := launchFixture(t, fixtureplugin.Config{}, pluginloader.Options{})

	info := p.Info()
	if info.GetName() != fixtureplugin.Name || info.GetPluginVersion() != fixtureplugin.Version ||
		!slices.Equal(info.GetProtocolVersions(), []string{deviceplugin.ProtocolVersion}) {
		t.Errorf("Info: got %v, want name %q version %q protocols [v1]", info, fixtureplugin.Name, fixtureplugin.Version)
	}
	if p.Name() != fixtureplugin.Name {
		t.Errorf("Name: got %q, want %q", p.Name(), fixtureplugin.Name)
	}
	if p.PID() <= 0 || p.PID() == os.Getpid() {
		t.Errorf("PID: got %d, want a child's PID", p.PID())
	}
	if got := p.ExitReason(); got != "" {
		t.Errorf("ExitReason while running: got %q, want empty", got)
	}
	select {
	case <-p.ExitContext().Done():
		t.Fatal("Exited is closed while the plugin runs")
	default:
	}
	if rc := p.ReattachConfig(); rc != nil {
		t.Errorf("ReattachConfig with AutoMTLS: got %+v, want nil (cannot be reattached)", rc)
	}

	if got, want := deviceIDs(firstFingerprint(t, p)), []string{"w0", "w1"}; !slices.Equal(got, want) {
		t.Errorf("fingerprint IDs: got %q, want %q", got, want)
	}
	res, err := p.Client().Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: []string{"w1"}})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	if got := res.GetReservation().GetEnvs()["FIXTURE_DEVICES"]; got != "w1" {
		t.Errorf("FIXTURE_DEVICES: got %q, want w1", got)
	}
}

func TestLaunchNvidiaExample(t *testing.T) {
	if nvidiaBin == "" {
		t.Skip(nvidiaSkip)
	}
	p := launch(t, pluginloader.Binary{Name: "nvidia-example", Path: nvidiaBin},
		pluginloader.Options{ConfigJSON: []byte(`{"simulate":"dgxh100"}`)})
	if got := p.Info().GetName(); got != "nvidia-example" {
		t.Errorf("Info name: got %q, want nvidia-example", got)
	}
	m := firstFingerprint(t, p)
	if got := len(deviceIDs(m)); got != 8 {
		t.Errorf("simulated dgxh100: got %d devices, want 8", got)
	}
	if len(m.GetGroups()) > 0 && m.GetGroups()[0].GetVendor() == "" {
		t.Errorf("group without vendor: %v", m.GetGroups()[0])
	}
}

// TestExitedOnSIGKILL kills the plugin behind the host's back: Exited must be closed
// within a second, the reason must say so, and an RPC cut off by the exit must be
// classified as ErrExited.
func TestExitedOnSIGKILL(t *testing.T) {
	p := launchFixture(t, fixtureplugin.Config{}, pluginloader.Options{})
	ctx := testContext(t)
	stream, err := p.Client().Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("Fingerprint Recv: %v", err)
	}

	if err := syscall.Kill(p.PID(), syscall.SIGKILL); err != nil {
		t.Fatalf("kill: %v", err)
	}
	// Noticing the exit is the behaviour; how soon is for a benchmark.
	select {
	case <-p.ExitContext().Done():
	case <-ctx.Done():
		t.Fatalf("Exited not closed after SIGKILL: %v", ctx.Err())
	}
	if got, want := p.ExitReason(), "signal: killed"; got != want {
		t.Errorf("ExitReason: got %q, want %q", got, want)
	}

	_, err = stream.Recv()
	if err == nil {
		t.Fatal("Fingerprint Recv after the plugin died: got a message, want an error")
	}
	if got := p.RPCError(ctx, err); !errors.Is(got, pluginloader.ErrExited) || !strings.Contains(got.Error(), "signal: killed") {
		t.Errorf("RPCError(%v): got %v, want ErrExited with the reason", err, got)
	}
	// Kill after the process is gone must return and release everything.
	p.Kill(ctx)
}

func TestRPCErrorKeepsCallerCancellation(t *testing.T) {
	p := launchFixture(t, fixtureplugin.Config{FingerprintHang: true}, pluginloader.Options{})
	ctx, cancel := context.WithCancel(testContext(t))
	stream, err := p.Client().Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	cancel()
	_, err = stream.Recv()
	if got := p.RPCError(ctx, err); errors.Is(got, pluginloader.ErrExited) || got != err {
		t.Errorf("RPCError after the caller cancelled: got %v, want the RPC's own error %v", got, err)
	}
}

func TestExitReasonOnCrash(t *testing.T) {
	p := launchFixture(t, fixtureplugin.Config{ExitAfter: fixtureplugin.Duration(100 * time.Millisecond)}, pluginloader.Options{})
	select {
	case <-p.ExitContext().Done():
	case <-testContext(t).Done():
		t.Fatal("plugin with exit_after never reported exited")
	}
	if got, want := p.ExitReason(), "exit status 3"; got != want {
		t.Errorf("ExitReason: got %q, want %q", got, want)
	}
}

func TestLaunchRefusesProtocolMismatch(t *testing.T) {
	tests := []struct {
		name    string
		env     string
		wantMsg []string // both sides' versions
	}{
		{name: "go-plugin handshake", env: "FIXTURE_PROTOCOL=2",
			wantMsg: []string{"speaks go-plugin protocol version 2", "the host speaks 1"}},
		{name: "GetPluginInfo", env: "FIXTURE_INFO_PROTOCOLS=v2,v3",
			wantMsg: []string{"speaks protocol versions [v2, v3]", "host speaks [v1]"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := pluginloader.Launch(testContext(t), fixtureBinary(),
				pluginloader.Options{Logger: testLogger(t), Env: []string{tt.env}})
			if !errors.Is(err, pluginloader.ErrProtocolVersion) {
				t.Fatalf("Launch: got %v, want ErrProtocolVersion", err)
			}
			for _, want := range tt.wantMsg {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
		})
	}
}

func TestLaunchChecksum(t *testing.T) {
	b, err := os.ReadFile(fixtureBin)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	good := hex.EncodeToString(sum[:])
	wrong := strings.Repeat("ab", sha256.Size)

	t.Run("match", func(t *testing.T) {
		p := launch(t, fixtureBinary(), pluginloader.Options{SHA256: good})
		if p.Info().GetName() != fixtureplugin.Name {
			t.Errorf("Info: got %v", p.Info())
		}
	})
	t.Run("match, upper-case hex", func(t *testing.T) {
		launch(t, fixtureBinary(), pluginloader.Options{SHA256: strings.ToUpper(good)})
	})
	t.Run("mismatch is refused before the binary runs", func(t *testing.T) {
		// A script that leaves a mark if it is ever run.
		dir := t.TempDir()
		mark := filepath.Join(dir, "ran")
		script := filepath.Join(dir, "marker")
		if err := os.WriteFile(script, []byte("#!/bin/sh\ntouch "+mark+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		_, err := pluginloader.Launch(testContext(t), pluginloader.Binary{Name: "marker", Path: script},
			pluginloader.Options{SHA256: wrong, Logger: testLogger(t)})
		if !errors.Is(err, pluginloader.ErrChecksumMismatch) {
			t.Fatalf("Launch: got %v, want ErrChecksumMismatch", err)
		}
		for _, want := range []string{script, wrong} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not name %q", err, want)
			}
		}
		if _, err := os.Stat(mark); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the binary ran despite the checksum mismatch (stat mark: %v)", err)
		}
	})
	t.Run("mismatch names the actual sum", func(t *testing.T) {
		_, err := pluginloader.Launch(testContext(t), fixtureBinary(), pluginloader.Options{SHA256: wrong})
		if !errors.Is(err, pluginloader.ErrChecksumMismatch) || !strings.Contains(err.Error(), good) {
			t.Errorf("Launch: got %v, want ErrChecksumMismatch naming %s", err, good)
		}
	})
	t.Run("malformed pin", func(t *testing.T) {
		_, err := pluginloader.Launch(testContext(t), fixtureBinary(), pluginloader.Options{SHA256: "xyz"})
		if err == nil || errors.Is(err, pluginloader.ErrChecksumMismatch) {
			t.Errorf("Launch: got %v, want a malformed-pin error", err)
		}
	})
}

func TestLaunchRefusesWorldWritableBinary(t *testing.T) {
	path := copyBinary(t, fixtureBin, t.TempDir(), "open", 0o777)
	_, err := pluginloader.Launch(testContext(t), pluginloader.Binary{Name: "open", Path: path}, pluginloader.Options{})
	if !errors.Is(err, pluginloader.ErrInsecurePath) || !strings.Contains(err.Error(), path) {
		t.Errorf("Launch: got %v, want ErrInsecurePath naming %s", err, path)
	}
}

func TestLaunchStartTimeout(t *testing.T) {
	_, err := pluginloader.Launch(testContext(t), fixtureBinary(), pluginloader.Options{
		Logger:       testLogger(t),
		Env:          []string{"FIXTURE_HANG_START=1"},
		StartTimeout: 300 * time.Millisecond,
	})
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "did not complete its go-plugin handshake within 300ms") {
		t.Errorf("Launch: got %v, want a start timeout wrapping context.DeadlineExceeded", err)
	}
}

func TestLaunchCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(testContext(t))
	cancel()
	_, err := pluginloader.Launch(ctx, fixtureBinary(), pluginloader.Options{
		Logger: testLogger(t),
		Env:    []string{"FIXTURE_HANG_START=1"},
	})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Launch with a cancelled context: got %v, want context.Canceled", err)
	}
}

func TestLaunchConfigRejected(t *testing.T) {
	tests := []struct {
		name    string
		config  []byte
		wantMsg string
	}{
		{name: "plugin says no", config: fixtureplugin.Config{RejectConfig: "widgets must be blue"}.JSON(),
			wantMsg: "widgets must be blue"},
		{name: "unknown knob", config: []byte(`{"no_such_knob":1}`), wantMsg: "no_such_knob"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			logs := &logtest.Recorder{}
			host := hclog.New(&hclog.LoggerOptions{Name: "host", Level: hclog.Info, Output: logs})
			_, err := pluginloader.Launch(testContext(t), fixtureBinary(),
				pluginloader.Options{Logger: host, ConfigJSON: tt.config})
			if !errors.Is(err, pluginloader.ErrConfigRejected) || !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("Launch: got %v, want ErrConfigRejected with %q", err, tt.wantMsg)
			}
			var ce *pluginloader.ConfigError
			if !errors.As(err, &ce) || ce.Plugin != "fixture" || !strings.Contains(ce.Message, tt.wantMsg) {
				t.Errorf("Launch: got %#v, want a *ConfigError of plugin \"fixture\" with %q", ce, tt.wantMsg)
			}
			// The kill that follows is said to be the host's, not logged as a crash.
			got := logs.String()
			if !strings.Contains(got, "stopping plugin after it rejected its config: plugin=fixture") {
				t.Errorf("log does not say why the plugin is stopped:\n%s", got)
			}
			if strings.Contains(got, "[ERROR]") {
				t.Errorf("log has an ERROR line for the plugin the host stopped:\n%s", got)
			}
		})
	}
}

// envAttributes returns the fixture's env_* attributes from its first group.
func envAttributes(t *testing.T, p *pluginloader.Plugin) map[string]string {
	t.Helper()
	out := map[string]string{}
	for k, v := range firstFingerprint(t, p).GetGroups()[0].GetAttributes() {
		if name, ok := strings.CutPrefix(k, "env_"); ok {
			out[name] = v.GetStringValue()
		}
	}
	return out
}

func TestLaunchEnvironment(t *testing.T) {
	t.Setenv("DEVICEHOST_TEST_HOST_ONLY", "host")
	t.Setenv("DEVICEHOST_TEST_BOTH", "host")
	cfg := fixtureplugin.Config{ReportEnv: []string{"DEVICEHOST_TEST_HOST_ONLY", "DEVICEHOST_TEST_BOTH", "DEVICEHOST_TEST_PLUGIN", "PATH"}}

	tests := []struct {
		name    string
		inherit bool
		want    map[string]string
	}{
		{name: "not inherited", want: map[string]string{"DEVICEHOST_TEST_BOTH": "plugin", "DEVICEHOST_TEST_PLUGIN": "yes"}},
		{name: "inherited, Env wins", inherit: true, want: map[string]string{
			"DEVICEHOST_TEST_HOST_ONLY": "host", "DEVICEHOST_TEST_BOTH": "plugin", "DEVICEHOST_TEST_PLUGIN": "yes",
			"PATH": os.Getenv("PATH")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Spare capacity: Launch must not append into the caller's array.
			env := make([]string, 2, 8)
			env[0], env[1] = "DEVICEHOST_TEST_BOTH=plugin", "DEVICEHOST_TEST_PLUGIN=yes"
			opts := pluginloader.Options{Env: env, InheritEnv: tt.inherit}
			p := launchFixture(t, cfg, opts)

			got := envAttributes(t, p)
			if len(got) != len(tt.want) {
				t.Errorf("plugin env: got %v, want %v", got, tt.want)
			}
			for k, v := range tt.want {
				if got[k] != v {
					t.Errorf("plugin env %s: got %q, want %q", k, got[k], v)
				}
			}
			if spare := env[:cap(env)][2:]; slices.ContainsFunc(spare, func(s string) bool { return s != "" }) {
				t.Errorf("Launch wrote into the caller's Env array: %q", spare)
			}
			if len(opts.Env) != 2 {
				t.Errorf("caller's Options.Env changed: %q", opts.Env)
			}
		})
	}
}

func TestKill(t *testing.T) {
	t.Run("graceful, twice, concurrently", func(t *testing.T) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		p, err := pluginloader.Launch(testContext(t), fixtureBinary(), pluginloader.Options{Logger: testLogger(t)})
		if err != nil {
			t.Fatalf("Launch: %v", err)
		}
		var wg sync.WaitGroup
		for range 2 {
			wg.Go(func() { p.Kill(testContext(t)) })
		}
		wg.Wait()
		select {
		case <-p.ExitContext().Done():
		default:
			t.Fatal("Exited not closed after Kill returned")
		}
		if got, want := p.ExitReason(), "exit status 0"; got != want {
			t.Errorf("ExitReason after a graceful Kill: got %q, want %q", got, want)
		}
		p.Kill(testContext(t)) // a third time, after the fact
	})
	t.Run("forceful when the plugin does not answer", func(t *testing.T) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		p, err := pluginloader.Launch(testContext(t), fixtureBinary(), pluginloader.Options{Logger: testLogger(t)})
		if err != nil {
			t.Fatalf("Launch: %v", err)
		}
		// A stopped process cannot shut down gracefully; only SIGKILL ends it.
		if err := syscall.Kill(p.PID(), syscall.SIGSTOP); err != nil {
			t.Fatalf("SIGSTOP: %v", err)
		}
		// kill(2) returns before the stop takes effect; a Kill sent in between could still
		// be answered gracefully.
		waitStopped(t, p.PID())
		ctx, cancel := context.WithTimeout(testContext(t), 100*time.Millisecond)
		defer cancel()
		p.Kill(ctx)
		if got, want := p.ExitReason(), "signal: killed"; got != want {
			t.Errorf("ExitReason after a forced Kill: got %q, want %q", got, want)
		}
	})
}

func TestReattach(t *testing.T) {
	first := launchFixture(t, fixtureplugin.Config{}, pluginloader.Options{DisableAutoMTLS: true})
	rc := first.ReattachConfig()
	if rc == nil {
		t.Fatal("ReattachConfig: nil for a plugin launched without AutoMTLS")
	}
	if rc.Pid != first.PID() {
		t.Errorf("ReattachConfig pid: got %d, want %d", rc.Pid, first.PID())
	}

	second := launch(t, pluginloader.Binary{Name: fixtureplugin.Name}, pluginloader.Options{Reattach: rc})
	if second.PID() != first.PID() {
		t.Errorf("reattached PID: got %d, want %d", second.PID(), first.PID())
	}
	if got := deviceIDs(firstFingerprint(t, second)); len(got) != 2 {
		t.Errorf("fingerprint through the reattached client: got %q, want 2 devices", got)
	}

	// Killing through the reattached plugin ends the process both see.
	second.Kill(testContext(t))
	for _, p := range []*pluginloader.Plugin{first, second} {
		select {
		case <-p.ExitContext().Done():
		case <-testContext(t).Done():
			t.Fatal("Exited not closed after the reattached plugin was killed")
		}
	}
}

func TestStatsThroughLoader(t *testing.T) {
	p := launchFixture(t, fixtureplugin.Config{}, pluginloader.Options{})
	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	stream, err := p.Client().Stats(ctx, &pb.StatsRequest{Interval: durationpb.New(10 * time.Millisecond)})
	if err != nil {
		t.Fatalf("Stats: %v", err)
	}
	for want := int64(1); want <= 2; want++ {
		m, err := stream.Recv()
		if err != nil {
			t.Fatalf("Stats Recv: %v", err)
		}
		if got := m.GetDevices()[0].GetValues()["seq"].GetIntValue(); got != want {
			t.Errorf("seq: got %d, want %d", got, want)
		}
	}
}

// TestParentLogger: a plugin's INFO line comes out of the host's logger in the host's
// format, named after the plugin, and its DEBUG line is dropped by a host at INFO.
func TestParentLogger(t *testing.T) {
	const (
		infoMsg  = "fixture says hello at info"
		debugMsg = "fixture whispers at debug"
	)
	cfg := fixtureplugin.Config{LogInfo: infoMsg, LogDebug: debugMsg}

	t.Run("JSON host", func(t *testing.T) {
		logs := &logtest.Recorder{}
		host := hclog.New(&hclog.LoggerOptions{Name: "host", Level: hclog.Info, Output: logs, JSONFormat: true})
		launchFixture(t, cfg, pluginloader.Options{Logger: host})

		line, err := logs.Wait(waitContext(t), logtest.Containing(infoMsg))
		if err != nil {
			t.Fatalf("%v; log:\n%s", err, logs)
		}
		var entry map[string]any
		if err := json.Unmarshal([]byte(line), &entry); err != nil {
			t.Fatalf("plugin line is not a JSON object: %v: %s", err, line)
		}
		if got := entry["@message"]; got != infoMsg {
			t.Errorf("@message: got %v, want %q", got, infoMsg)
		}
		if got := entry["@level"]; got != "info" {
			t.Errorf("@level: got %v, want info", got)
		}
		module, _ := entry["@module"].(string)
		if want := "host." + fixtureplugin.Name; module != want {
			t.Errorf("@module: got %q, want the host logger named after the plugin (%s)", module, want)
		}
		// The plugin logs the DEBUG line before the INFO one, on the same pipe.
		if strings.Contains(logs.String(), debugMsg) {
			t.Errorf("a DEBUG line from the plugin reached a host logging at INFO:\n%s", logs)
		}
	})

	t.Run("text host", func(t *testing.T) {
		logs := &logtest.Recorder{}
		host := hclog.New(&hclog.LoggerOptions{Name: "host", Level: hclog.Info, Output: logs})
		launchFixture(t, cfg, pluginloader.Options{Logger: host})

		line, err := logs.Wait(waitContext(t), logtest.Containing(infoMsg))
		if err != nil {
			t.Fatalf("%v; log:\n%s", err, logs)
		}
		if !strings.Contains(line, "[INFO]  host."+fixtureplugin.Name) {
			t.Errorf("plugin line not in the host's text format at INFO, named after the plugin: %q", line)
		}
		if json.Valid([]byte(line)) {
			t.Errorf("plugin line is JSON under a text host logger: %q", line)
		}
		if strings.Contains(logs.String(), debugMsg) {
			t.Errorf("a DEBUG line from the plugin reached a host logging at INFO:\n%s", logs)
		}
	})
}

// waitStopped waits until the process pid is stopped (state T in /proc/pid/stat).
func waitStopped(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			t.Fatalf("process %d: %v", pid, err)
		}
		// The state follows the command name, which is in parentheses.
		if i := bytes.LastIndexByte(b, ')'); i >= 0 && i+2 < len(b) && b[i+2] == 'T' {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d not stopped after SIGSTOP: %s", pid, b)
		}
		time.Sleep(time.Millisecond)
	}
}
