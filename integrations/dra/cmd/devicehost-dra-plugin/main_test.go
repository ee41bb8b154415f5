package main

import (
	"strings"
	"testing"
	"time"
)

// The contract's flags exist, with the kubelet's directories and devicehost.io as
// defaults, and a missing node name is one clear error.
func TestFlags(t *testing.T) {
	t.Setenv("NODE_NAME", "")
	err := run([]string{"-address", "unix:///nonexistent/dh.sock", "-kubeconfig", "/nonexistent"})
	if err == nil || !strings.Contains(err.Error(), "-node-name") {
		t.Errorf("run without a node name: %v; want an error naming -node-name", err)
	}
	err = run([]string{"-node-name", "n", "-kubeconfig", "/nonexistent/kubeconfig"})
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/kubeconfig") {
		t.Errorf("run with a missing kubeconfig: %v; want an error naming it", err)
	}
	if err := run([]string{"-no-such-flag"}); err == nil {
		t.Error("run with an unknown flag: no error")
	}
}

func TestFlagDefaults(t *testing.T) {
	t.Setenv("NODE_NAME", "node-from-env")
	var s settings
	if err := newFlags(&s).Parse(nil); err != nil {
		t.Fatal(err)
	}
	want := settings{address: "unix:///run/devicehost/devicehost.sock", nodeName: "node-from-env", driverName: "devicehost.io",
		registryDir: "/var/lib/kubelet/plugins_registry", cdiDir: "/var/run/cdi", staleGrace: s.staleGrace, staleInterval: s.staleInterval, logLevel: "info",
		healthStall: time.Minute, healthAgent: 3 * time.Minute}
	if s != want {
		t.Errorf("defaults %+v; want %+v", s, want)
	}
	// The health socket lies beside the DRA socket, in the plugin dir.
	if err := s.finish(map[string]bool{}); err != nil {
		t.Fatal(err)
	}
	if want := "/var/lib/kubelet/plugins/devicehost.io/health.sock"; s.healthSocket != want {
		t.Errorf("health socket %q, want %q", s.healthSocket, want)
	}
}

// Health flags that cannot work are refused, all at once, each named.
func TestHealthFlagErrors(t *testing.T) {
	err := run([]string{"-node-name", "n", "-health-stall-timeout", "10ms", "-health-agent-timeout", "0s", "-health-socket", "h.sock"})
	for _, want := range []string{"-health-stall-timeout 10ms is below the minimum of 1s", "-health-agent-timeout 0s is below the minimum of 1s", `-health-socket "h.sock": want an absolute path`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("run: %v; want %q in it", err, want)
		}
	}
	var s settings
	fs := newFlags(&s)
	if err := fs.Parse([]string{"-node-name", "n", "-health-socket", ""}); err != nil {
		t.Fatal(err)
	}
	if err := s.finish(map[string]bool{"health-socket": true}); err != nil || s.healthSocket != "" {
		t.Errorf(`-health-socket "": %q, %v; want none`, s.healthSocket, err)
	}
}
