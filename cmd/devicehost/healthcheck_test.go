package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
)

// `devicehost health-check` speaks node-problem-detector's custom plugin protocol: one
// line and exit 0 when every device is healthy, 1 naming the unhealthy ones and why, 2
// when the agent cannot be asked; -type narrows it.
func TestHealthCheckForNPD(t *testing.T) {
	addr := startAgent(t, &devicetest.Fake{WatchFunc: watchOnce(twoGroups())})
	r := runCLI(t, "health-check", "-address", addr)
	if r.code != npdNonOK || r.stdout != "1 of 4 devices unhealthy: GPU-1 (XID 79: fell off the bus)\n" {
		t.Errorf("one GPU unhealthy: exit %d, stdout %q", r.code, r.stdout)
	}
	snap := twoGroups()
	st := snap.State.Devices["GPU-1"]
	st.Health, st.Reason = device.HealthHealthy, ""
	snap.State.Devices["GPU-1"] = st
	ok := startAgent(t, &devicetest.Fake{WatchFunc: watchOnce(snap)})
	if r := runCLI(t, "health-check", "-address", ok); r.code != npdOK || r.stdout != "4 devices healthy\n" {
		t.Errorf("all healthy: exit %d, stdout %q", r.code, r.stdout)
	}
	if r := runCLI(t, "health-check", "-address", addr, "-type", "cpu"); r.code != npdOK || r.stdout != "0 devices healthy\n" {
		t.Errorf("-type cpu: exit %d, stdout %q", r.code, r.stdout)
	}
	gone := "unix://" + filepath.Join(t.TempDir(), "none.sock")
	if r := runCLI(t, "health-check", "-address", gone, "-timeout", "2s"); r.code != npdUnknown || !strings.HasPrefix(r.stdout, "devicehost agent unreachable: ") || strings.Count(r.stdout, "\n") != 1 {
		t.Errorf("agent unreachable: exit %d, stdout %q", r.code, r.stdout)
	}
}

// The example node-problem-detector config runs this command with its exit codes'
// condition.
func TestNPDConfigRunsHealthCheck(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "deploy", "node-problem-detector", "devicehost-health.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Plugin     string `json:"plugin"`
		Conditions []struct{ Type string }
		Rules      []struct {
			Condition string
			Path      string
			Args      []string
		}
	}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.Plugin != "custom" || len(cfg.Rules) != 1 || len(cfg.Conditions) != 1 || cfg.Rules[0].Condition != cfg.Conditions[0].Type ||
		!strings.HasSuffix(cfg.Rules[0].Path, "/devicehost") || !slices.Contains(cfg.Rules[0].Args, "health-check") {
		t.Errorf("devicehost-health.json: %+v; want a custom plugin rule running devicehost health-check for its condition", cfg)
	}
}
