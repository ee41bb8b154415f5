package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/plugins/nvidia-example/nvidia"
)

// unitSettings reads a systemd unit's Key=Value lines (comments and sections
// skipped); a key given more than once keeps every value.
func unitSettings(t *testing.T, path string) map[string][]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == '[' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s: not Key=Value: %q", path, line)
		}
		out[k] = append(out[k], v)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// The example config in deploy/systemd loads, and its paths are the unit's: the socket
// in RuntimeDirectory, the ledger in StateDirectory, the config where ExecStart looks,
// and the nvidia-example plugin's CDI spec dir among the unit's writable paths.
func TestSystemdExampleConfigMatchesTheUnit(t *testing.T) {
	unit := unitSettings(t, "../../deploy/systemd/devicehost.service")
	one := func(key string) string {
		t.Helper()
		if len(unit[key]) != 1 {
			t.Fatalf("unit has %s = %q, want one value", key, unit[key])
		}
		return unit[key][0]
	}
	if got := one("Type"); got != "notify" {
		t.Errorf("Type=%s, want notify (the agent sends READY=1 and STOPPING=1)", got)
	}
	if got := one("ExecReload"); got != "/bin/kill -HUP $MAINPID" {
		t.Errorf("ExecReload=%s, want /bin/kill -HUP $MAINPID (SIGHUP reloads the config)", got)
	}
	if got := one("KillMode"); got != "process" {
		t.Errorf("KillMode=%s, want process (kept plugins must outlive a crashed agent)", got)
	}
	exec := strings.Fields(one("ExecStart"))
	i := slices.Index(exec, "-config")
	if i < 0 || i+1 >= len(exec) || !slices.Contains(exec, "agent") {
		t.Fatalf("ExecStart=%q does not run `agent -config FILE`", exec)
	}
	if got, want := filepath.Dir(exec[i+1]), "/etc/"+one("ConfigurationDirectory"); got != want {
		t.Errorf("ExecStart reads its config from %s, want ConfigurationDirectory %s", got, want)
	}

	cfg := defaultAgentConfig()
	if err := loadConfigFile("../../deploy/systemd/devicehost.hcl", &cfg); err != nil {
		t.Fatalf("example config: %v", err)
	}
	addr, err := endpoint.Parse(cfg.Listen)
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	if got, want := filepath.Dir(addr.Path), "/run/"+one("RuntimeDirectory"); got != want {
		t.Errorf("socket %s is not in RuntimeDirectory %s", addr.Path, want)
	}
	if got, want := cfg.StateDir, "/var/lib/"+one("StateDirectory"); got != want {
		t.Errorf("state_dir %s, want StateDirectory %s", got, want)
	}

	plugin, ok := cfg.Plugins["nvidia-example"]
	if !ok {
		t.Fatalf("example config has no nvidia-example block")
	}
	var pc nvidia.Config
	dec := json.NewDecoder(bytes.NewReader(plugin.ConfigJSON))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&pc); err != nil {
		t.Fatalf("nvidia-example config %s: %v", plugin.ConfigJSON, err)
	}
	if pc.CDISpecDir == nil {
		t.Fatalf("example config does not set cdi_spec_dir")
	}
	cdiDir := filepath.Join("/run", strings.TrimPrefix(*pc.CDISpecDir, "/var/run")) // /var/run is /run
	var writable []string
	for _, v := range unit["ReadWritePaths"] {
		for _, p := range strings.Fields(v) {
			writable = append(writable, strings.TrimPrefix(p, "-"))
		}
	}
	if !slices.Contains(writable, cdiDir) {
		t.Errorf("cdi_spec_dir %s (%s) is not among the unit's ReadWritePaths %q", *pc.CDISpecDir, cdiDir, writable)
	}
}
