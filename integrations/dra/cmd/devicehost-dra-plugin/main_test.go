package main

import (
	"strings"
	"testing"
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
		registryDir: "/var/lib/kubelet/plugins_registry", cdiDir: "/var/run/cdi", staleGrace: s.staleGrace, staleInterval: s.staleInterval, logLevel: "info"}
	if s != want {
		t.Errorf("defaults %+v; want %+v", s, want)
	}
}
