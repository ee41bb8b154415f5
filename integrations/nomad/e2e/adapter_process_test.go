package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/integrations/nomad/adapter"
	dpb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/logtest"
	"github.com/devicehost/devicehost/tools/testwait"
	"github.com/devicehost/devicehost/validate"
)

// newAdapter returns an in-process adapter whose OnExit reports on the returned
// channel, closed at cleanup (which also checks that no example process is left).
func newAdapter(t *testing.T, exampleBin string) (*adapter.Adapter, <-chan error) {
	t.Helper()
	exits := make(chan error, 1)
	logs := &logtest.Recorder{}
	a := adapter.New(adapter.Options{
		Logger: hclog.New(&hclog.LoggerOptions{Level: hclog.Debug, Output: logs}),
		OnExit: func(err error) { exits <- err },
	})
	t.Cleanup(func() {
		a.Close()
		noProcesses(t, "after Close", exampleBin)
		if t.Failed() {
			t.Logf("adapter log:\n%s", logs)
		}
	})
	return a, exits
}

// adapterConfig is the adapter's config block for the example plugin on dir.
func adapterConfig(t *testing.T, exampleBin string, nomadConfig map[string]any, extra map[string]any) []byte {
	t.Helper()
	cfg := map[string]any{"nomad_plugin": exampleBin, "nomad_config": nomadConfig}
	for k, v := range extra {
		cfg[k] = v
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// fingerprints runs a's Fingerprint until ctx ends, delivering its messages.
func fingerprints(ctx context.Context, a *adapter.Adapter) (<-chan *dpb.FingerprintResponse, <-chan error) {
	msgs := make(chan *dpb.FingerprintResponse, 16)
	done := make(chan error, 1)
	go func() {
		done <- a.Fingerprint(ctx, func(m *dpb.FingerprintResponse) error {
			select {
			case msgs <- m:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})
	}()
	return msgs, done
}

// A config the Nomad plugin or its schema refuses fails SetConfig with the reason, and
// leaves no Nomad plugin running.
func TestAdapterRefusesConfigs(t *testing.T) {
	bins := build(t)
	for _, tc := range []struct {
		name   string
		config map[string]any
		want   string
	}{
		{"plugin refuses", map[string]any{"list_period": "soon"}, `rejected its config: rpc error: code = Unknown desc = SetConfig failed: failed to parse list period "soon"`},
		{"schema refuses a key", map[string]any{"directory": "/x"}, `nomad_config for "example-fs-device": `},
		{"schema refuses a type", map[string]any{"dir": []string{"a"}}, `dir`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, _ := newAdapter(t, bins[exampleName])
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
			defer cancel()
			err := a.SetConfig(ctx, adapterConfig(t, bins[exampleName], tc.config, nil))
			if !errContains(err, tc.want) {
				t.Fatalf("SetConfig: %v; want an error containing %q", err, tc.want)
			}
			if tc.name == "schema refuses a key" && !strings.Contains(err.Error(), `"directory"`) {
				t.Errorf("error %q does not name the key", err)
			}
			noProcesses(t, "after the refusal", bins[exampleName])
		})
	}
}

// A binary that does not speak Nomad's plugin protocol is refused at SetConfig.
func TestAdapterRefusesNonNomadBinary(t *testing.T) {
	bins := build(t)
	a, _ := newAdapter(t, bins[exampleName])
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	// The shim is a Nomad plugin, the adapter is not: it speaks devicehost's protocol.
	err := a.SetConfig(ctx, adapterConfig(t, bins[adapterName], nil, nil))
	if !errContains(err, "start Nomad plugin "+bins[adapterName]) {
		t.Fatalf("SetConfig with a devicehost plugin binary: %v; want a start failure naming it", err)
	}
}

// The adapter translates the example plugin's devices and answers the host's
// validation; a Nomad plugin with no devices yet (which sends nothing) gets an empty
// inventory after empty_inventory_after, and its devices when they appear.
func TestAdapterFingerprintReserve(t *testing.T) {
	const fpClient, statsClient = "devicePluginClient).handleFingerprint", "devicePluginClient).handleStats"
	fpBefore, statsBefore := goroutinesIn(fpClient), goroutinesIn(statsClient)
	bins := build(t)
	dir := tempDir(t, "dhnd")
	a, _ := newAdapter(t, bins[exampleName])
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	cfg := adapterConfig(t, bins[exampleName], map[string]any{"dir": dir, "list_period": "50ms"}, map[string]any{"empty_inventory_after": "100ms"})
	if err := a.SetConfig(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	pid := onlyProcess(t, bins[exampleName])
	// The same config again (a host reattaching) keeps the running plugin.
	if err := a.SetConfig(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if again := onlyProcess(t, bins[exampleName]); again != pid {
		t.Errorf("SetConfig with the same config replaced the plugin (%d -> %d)", pid, again)
	}

	fctx, stop := context.WithCancel(ctx)
	msgs, done := fingerprints(fctx, a)
	select {
	case m := <-msgs:
		if len(m.GetGroups()) != 0 {
			t.Fatalf("first message %v; want the empty inventory", m)
		}
	case <-ctx.Done():
		t.Fatal("no empty inventory from a plugin without devices")
	}
	if err := os.WriteFile(filepath.Join(dir, "gpu0"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	var m *dpb.FingerprintResponse
	select {
	case m = <-msgs:
	case <-ctx.Done():
		t.Fatal("no fingerprint after a device appeared")
	}
	if err := validate.Fingerprint(m); err != nil {
		t.Errorf("the host would refuse %v: %v", m, err)
	}
	if g := m.GetGroups(); len(g) != 1 || g[0].GetVendor() != "nomad" || len(g[0].GetDevices()) != 1 || g[0].GetDevices()[0].GetId() != "gpu0" {
		t.Fatalf("fingerprint %v; want nomad/file/mock with gpu0", m)
	}

	res, err := a.Reserve(ctx, []string{"gpu0"})
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Reservation(res, []string{"gpu0"}); err != nil || len(res.GetMounts()) != 1 || res.GetMounts()[0].GetHostPath() != filepath.Join(dir, "gpu0") {
		t.Errorf("reservation %v (%v); want the mount of %s", res, err, filepath.Join(dir, "gpu0"))
	}
	if _, err := a.Reserve(ctx, []string{"nope"}); !errContains(err, `unknown device "nope"`) {
		t.Errorf("Reserve of an unknown device: %v; want the example's refusal", err)
	}
	sctx, stopStats := context.WithCancel(ctx)
	statsDone := make(chan error, 1)
	go func() {
		statsDone <- a.Stats(sctx, 50*time.Millisecond, func(*dpb.StatsResponse) error { return nil })
	}()
	stop()
	if err := <-done; err != nil {
		t.Errorf("Fingerprint after its ctx ended: %v; want nil", err)
	}
	stopStats()
	if err := <-statsDone; err != nil {
		t.Errorf("Stats after its ctx ended: %v; want nil", err)
	}
	// A ctx that has ended is the caller's doing, not a plugin failure, however Nomad's
	// client reports it: here on the stream; when it ends while the stream is being
	// opened (the race of the Stats call above, 1 run in 16), by the call itself.
	ended, end := context.WithCancel(ctx)
	end()
	if err := a.Stats(ended, 50*time.Millisecond, func(*dpb.StatsResponse) error { return nil }); err != nil {
		t.Errorf("Stats with its ctx already ended: %v; want nil", err)
	}
	if err := a.Fingerprint(ended, func(*dpb.FingerprintResponse) error { return nil }); err != nil {
		t.Errorf("Fingerprint with its ctx already ended: %v; want nil", err)
	}
	// Nomad's device client sends a stream's last error without watching the context:
	// the adapter must read it, or that goroutine stays forever.
	noNewGoroutineIn(t, fpClient, fpBefore)
	noNewGoroutineIn(t, statsClient, statsBefore)
}

// A Nomad plugin that dies is reported through OnExit (the binary exits there, so the
// host restarts it with backoff), and its Fingerprint stream fails saying so; a plugin
// the adapter stops itself (Close, a new config) is not reported.
func TestAdapterReportsNomadPluginExit(t *testing.T) {
	bins := build(t)
	dir := tempDir(t, "dhnd")
	if err := os.WriteFile(filepath.Join(dir, "gpu0"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	a, exits := newAdapter(t, bins[exampleName])
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if err := a.SetConfig(ctx, adapterConfig(t, bins[exampleName], map[string]any{"dir": dir, "list_period": "50ms"}, nil)); err != nil {
		t.Fatal(err)
	}
	first := onlyProcess(t, bins[exampleName])
	// A new config replaces the plugin without reporting an exit.
	if err := a.SetConfig(ctx, adapterConfig(t, bins[exampleName], map[string]any{"dir": dir, "list_period": "60ms"}, nil)); err != nil {
		t.Fatal(err)
	}
	pid := onlyProcess(t, bins[exampleName])
	if pid == first {
		t.Fatalf("a new config kept plugin %d", pid)
	}
	msgs, done := fingerprints(ctx, a)
	select {
	case <-msgs:
	case <-ctx.Done():
		t.Fatal("no fingerprint")
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exits:
		if !errContains(err, "Nomad plugin "+bins[exampleName]+" exited") {
			t.Errorf("OnExit(%v); want the plugin's path", err)
		}
	case <-ctx.Done():
		t.Fatal("OnExit not called after the Nomad plugin was killed")
	}
	select {
	case err := <-done:
		if err == nil || errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "exited") {
			t.Errorf("Fingerprint ended with %v; want an error saying the plugin exited", err)
		}
	case <-ctx.Done():
		t.Fatal("Fingerprint still running after the Nomad plugin died")
	}
	// Close waits for the adapter's goroutines, OnExit's callers: after it, any second
	// OnExit has been sent (exits has room for it).
	a.Close()
	select {
	case err := <-exits:
		t.Errorf("a second OnExit: %v", err)
	default:
	}
}
