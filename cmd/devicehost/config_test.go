package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/integrations/kubernetes/hosted"
)

// writeConfig writes content to a config file in a temporary directory and returns
// its path.
func writeConfig(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadConfigFile(t *testing.T) {
	path := writeConfig(t, "devicehost.hcl", `
listen               = "tcp://127.0.0.1:7070"
plugin_dir           = "/srv/plugins"
state_dir            = "/srv/state"
stats_interval       = "500ms"
log_level            = "debug"
log_json             = true
reserve_timeout      = "5s"
start_timeout        = "20s"
ready_timeout        = "1m"
gc_interval          = "10m"
gc_max_reservations  = 5000
gc_parallel_destroys = 4
tls_cert             = "/etc/dh/cert.pem"
tls_key              = "/etc/dh/key.pem"
tls_ca               = "/etc/dh/ca.pem"
metrics_listen       = "tcp://0.0.0.0:9400"
metrics_tls_cert     = "/etc/dh/metrics-cert.pem"
metrics_tls_key      = "/etc/dh/metrics-key.pem"
metrics_tls_ca       = "/etc/dh/metrics-ca.pem"
metrics_holder_labels = false
event_max_count      = 500
event_max_age        = "24h"
max_procs            = 2

plugin "nvidia-example" {
  sha256      = "9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08"
  env         = ["NVIDIA_DRIVER_ROOT=/run/nvidia", "DEBUG=1"]
  inherit_env = true
  reattach    = true
  device_ids  = ["GPU-*", "MIG-*"]
  config {
    simulate      = "dgxh100"
    health_period = "5s"
    ignored_xids  = [13, 31]
    limits        = { max = 8, strict = true }
  }
}

plugin "fpga" {}
`)
	cfg := defaultAgentConfig()
	if err := loadConfigFile(path, &cfg); err != nil {
		t.Fatalf("loadConfigFile: %v", err)
	}
	want := agentConfig{
		Listen:             "tcp://127.0.0.1:7070",
		PluginDir:          "/srv/plugins",
		StateDir:           "/srv/state",
		LogLevel:           "debug",
		LogJSON:            true,
		TLS:                endpoint.TLS{Cert: "/etc/dh/cert.pem", Key: "/etc/dh/key.pem", CA: "/etc/dh/ca.pem"},
		MetricsListen:      "tcp://0.0.0.0:9400",
		MetricsTLS:         endpoint.TLS{Cert: "/etc/dh/metrics-cert.pem", Key: "/etc/dh/metrics-key.pem", CA: "/etc/dh/metrics-ca.pem"},
		StatsInterval:      500 * time.Millisecond,
		ReserveTimeout:     5 * time.Second,
		StartTimeout:       20 * time.Second,
		ReadyTimeout:       time.Minute,
		GCInterval:         10 * time.Minute,
		GCMaxReservations:  5000,
		GCParallelDestroys: 4,
		EventMaxCount:      500,
		EventMaxAge:        24 * time.Hour,
		MaxProcs:           2,
		Plugins: map[string]pluginSettings{
			"nvidia-example": {
				SHA256:     "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
				Env:        []string{"NVIDIA_DRIVER_ROOT=/run/nvidia", "DEBUG=1"},
				InheritEnv: true,
				Reattach:   true,
				DeviceIDs:  []string{"GPU-*", "MIG-*"},
				ConfigJSON: []byte(`{"health_period":"5s","ignored_xids":[13,31],"limits":{"max":8,"strict":true},"simulate":"dgxh100"}`),
			},
			"fpga": {},
		},
	}
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("config:\ngot  %+v\nwant %+v", cfg, want)
		for name := range want.Plugins {
			t.Logf("plugin %s config JSON: got %s want %s", name, cfg.Plugins[name].ConfigJSON, want.Plugins[name].ConfigJSON)
		}
	}
}

func TestLoadConfigFileKeepsDefaults(t *testing.T) {
	path := writeConfig(t, "devicehost.hcl", `plugin "nvidia-example" {
  config { simulate = "dgxa100" }
}
`)
	cfg := defaultAgentConfig()
	if err := loadConfigFile(path, &cfg); err != nil {
		t.Fatal(err)
	}
	want := defaultAgentConfig()
	want.Plugins["nvidia-example"] = pluginSettings{ConfigJSON: []byte(`{"simulate":"dgxa100"}`)}
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("config:\ngot  %+v\nwant %+v", cfg, want)
	}
}

func TestLoadConfigFileJSON(t *testing.T) {
	path := writeConfig(t, "devicehost.json", `{
  "listen": "unix:///tmp/dh.sock",
  "stats_interval": "2s",
  "plugin": {"nvidia-example": {"config": {"simulate": "dgxb200"}}}
}`)
	cfg := defaultAgentConfig()
	if err := loadConfigFile(path, &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.Listen != "unix:///tmp/dh.sock" || cfg.StatsInterval != 2*time.Second {
		t.Errorf("listen %q stats_interval %v, want unix:///tmp/dh.sock and 2s", cfg.Listen, cfg.StatsInterval)
	}
	if got, want := string(cfg.Plugins["nvidia-example"].ConfigJSON), `{"simulate":"dgxb200"}`; got != want {
		t.Errorf("plugin config JSON = %s, want %s", got, want)
	}
}

// TestPluginConfigNumbers: whole numbers reach a plugin as JSON integers, whatever their
// size (HCL numbers are big floats, and 1000000 written as 1e+06 would be refused by
// encoding/json for an int field); fractions keep their value.
func TestPluginConfigNumbers(t *testing.T) {
	for _, tt := range []struct{ name, file string }{
		{"devicehost.hcl", `plugin "p" {
  config {
    million = 1000000
    big     = 9007199254740993
    neg     = -2000000
    frac    = 0.1
    tiny    = 1.5e-7
    huge    = 1.5e300
  }
}`},
		{"devicehost.json", `{"plugin": {"p": {"config": {"million": 1000000, "big": 9007199254740993, "neg": -2000000,
  "frac": 0.1, "tiny": 1.5e-7, "huge": 1.5e300}}}}`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := defaultAgentConfig()
			if err := loadConfigFile(writeConfig(t, tt.name, tt.file), &cfg); err != nil {
				t.Fatal(err)
			}
			got := string(cfg.Plugins["p"].ConfigJSON)
			want := `{"big":9007199254740993,"frac":0.1,"huge":1.5e+300,"million":1000000,"neg":-2000000,"tiny":1.5e-07}`
			if got != want {
				t.Errorf("config JSON:\n got %s\nwant %s", got, want)
			}
			// What a Go plugin does with it.
			var v struct {
				Million, Big, Neg int64
				Frac, Tiny, Huge  float64
			}
			dec := json.NewDecoder(strings.NewReader(got))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&v); err != nil {
				t.Fatalf("a plugin decoding %s: %v", got, err)
			}
			if v.Million != 1000000 || v.Big != 1<<53+1 || v.Neg != -2000000 || v.Frac != 0.1 || v.Tiny != 1.5e-7 || v.Huge != 1.5e300 {
				t.Errorf("a plugin decoded %+v", v)
			}
		})
	}
}

// TestPluginConfigBlocks: nested blocks in a plugin's config are JSON objects, a name
// given as several blocks a list of them in file order, at any depth; the same as the
// attribute form, numbers staying integers.
func TestPluginConfigLabeledBlocks(t *testing.T) {
	labeled := `plugin "hostdev" {
  config {
    device "fuse" {
      paths = ["/dev/fuse"]
      count = 8
    }
    device "zigbee" {
      usb {
        vendor  = "10c4"
        product = "ea60"
      }
    }
    rule "a" "b" { x = 1 }
    rule "a" "c" { x = 2 }
  }
}`
	// HCL's JSON form of the same config, which the host reads as it is.
	attrs := `plugin "hostdev" {
  config {
    device = {
      fuse   = { paths = ["/dev/fuse"], count = 8 }
      zigbee = { usb = { vendor = "10c4", product = "ea60" } }
    }
    rule = { a = { b = { x = 1 }, c = { x = 2 } } }
  }
}`
	want := `{"device":{"fuse":{"count":8,"paths":["/dev/fuse"]},"zigbee":{"usb":{"product":"ea60","vendor":"10c4"}}},` +
		`"rule":{"a":{"b":{"x":1},"c":{"x":2}}}}`
	for name, file := range map[string]string{"labeled blocks": labeled, "attributes": attrs} {
		t.Run(name, func(t *testing.T) {
			cfg := defaultAgentConfig()
			if err := loadConfigFile(writeConfig(t, "devicehost.hcl", file), &cfg); err != nil {
				t.Fatal(err)
			}
			if got := string(cfg.Plugins["hostdev"].ConfigJSON); got != want {
				t.Errorf("config JSON:\n got %s\nwant %s", got, want)
			}
		})
	}
}

func TestPluginConfigBlocks(t *testing.T) {
	blocks := `plugin "nomad-nvidia" {
  config {
    nomad_plugin = "/opt/nomad/plugins/nomad-device-nvidia"
    nomad_config {
      ignored_gpu_ids    = []
      fingerprint_period = "5s"
      limits {
        max = 1000000
      }
      volume {
        path = "/a"
      }
      volume {
        path = "/b"
        opts {}
      }
    }
  }
}`
	attrs := `plugin "nomad-nvidia" {
  config {
    nomad_plugin = "/opt/nomad/plugins/nomad-device-nvidia"
    nomad_config = {
      ignored_gpu_ids    = []
      fingerprint_period = "5s"
      limits             = { max = 1000000 }
      volume             = [{ path = "/a" }, { path = "/b", opts = {} }]
    }
  }
}`
	want := `{"nomad_config":{"fingerprint_period":"5s","ignored_gpu_ids":[],"limits":{"max":1000000},` +
		`"volume":[{"path":"/a"},{"opts":{},"path":"/b"}]},"nomad_plugin":"/opt/nomad/plugins/nomad-device-nvidia"}`
	for name, file := range map[string]string{"blocks": blocks, "attributes": attrs} {
		t.Run(name, func(t *testing.T) {
			cfg := defaultAgentConfig()
			if err := loadConfigFile(writeConfig(t, "devicehost.hcl", file), &cfg); err != nil {
				t.Fatal(err)
			}
			if got := string(cfg.Plugins["nomad-nvidia"].ConfigJSON); got != want {
				t.Errorf("config JSON:\n got %s\nwant %s", got, want)
			}
		})
	}
}

func TestLoadConfigFileErrors(t *testing.T) {
	tests := []struct {
		name    string
		content string
		line    int      // the line the error must point at
		want    []string // and what it must say (the key, the problem)
	}{
		{"overlapping device_ids", "plugin \"a\" {\n  device_ids = [\"GPU-*\"]\n}\nplugin \"b\" {\n  device_ids = [\"MIG-*\", \"GPU-1*\"]\n}\n", 5,
			[]string{"Overlapping device_ids", `pattern "GPU-1*" of plugin "b" and pattern "GPU-*" of plugin "a" (line 2)`}},
		{"empty device_ids", "plugin \"a\" {\n  device_ids = []\n}\n", 2, []string{"device_ids", "0 patterns"}},
		{"bad device_ids pattern", "plugin \"a\" {\n  device_ids = [\"\"]\n}\n", 2, []string{"device_ids", "entry 0", "empty pattern"}},
		{"unknown key", "listen = \"unix:///x.sock\"\nlisten_adress = \"x\"\n", 2,
			[]string{"Unsupported argument", `"listen_adress"`}},
		{"bad duration", "log_level = \"info\"\n\nstats_interval = \"fast\"\n", 3,
			[]string{"stats_interval", `"fast" is not a duration`}},
		{"negative duration", "reserve_timeout = \"-1s\"\n", 1, []string{"reserve_timeout", "negative"}},
		{"number where a duration goes", "ready_timeout = 30\n", 1, []string{"ready_timeout", "not a duration"}},
		{"wrong type", "log_json = \"very\"\n", 1, []string{"log_json", "want a bool"}},
		{"bad log level", "\nlog_level = \"loud\"\n", 2, []string{"log_level", `"loud" is not a log level`}},
		{"bad address", "listen = \"/run/dh.sock\"\n", 1, []string{"listen", "want unix:///path.sock"}},
		{"bad metrics address", "\nmetrics_listen = \":9400\"\n", 2, []string{"metrics_listen", "want unix:///path.sock or tcp://host:port"}},
		{"fractional count", "gc_max_reservations = 1.5\n", 1, []string{"gc_max_reservations", "whole number"}},
		{"zero max reservations", "gc_max_reservations = 0\n", 1, []string{"gc_max_reservations", "at least 1"}},
		{"zero parallel destroys", "gc_parallel_destroys = 0\n", 1, []string{"gc_parallel_destroys", "at least 1"}},
		{"huge max reservations", "gc_max_reservations = 2147483648\n", 1, []string{"gc_max_reservations", "at most 2147483647"}},
		{"unknown plugin key", "plugin \"p\" {\n  sha = \"x\"\n}\n", 2, []string{"Unsupported argument", `"sha"`}},
		{"sha256 not hex", "plugin \"p\" {\n  sha256 = \"xyz\"\n}\n", 2, []string{"sha256", `"xyz" is not a SHA-256: want 64 hex digits`}},
		{"sha256 one digit short", "\nplugin \"p\" {\n  sha256 = \"" + strings.Repeat("a", 63) + "\"\n}\n", 3, []string{"sha256", "64 hex digits"}},
		{"stats interval below the minimum", "stats_interval = \"10ms\"\n", 1, []string{"stats_interval", `"10ms" is below the minimum of 100ms`}},
		{"reserve timeout below the minimum", "reserve_timeout = \"1ms\"\n", 1, []string{"reserve_timeout", "below the minimum of 100ms"}},
		{"start timeout below the minimum", "start_timeout = \"500ms\"\n", 1, []string{"start_timeout", "below the minimum of 1s"}},
		{"gc interval below the minimum", "\n\ngc_interval = \"1ns\"\n", 3, []string{"gc_interval", "below the minimum of 1s"}},
		{"bad env entry", "plugin \"p\" {\n  env = [\"A=1\", \"oops\"]\n}\n", 2, []string{"env", `entry 1 ("oops") is not NAME=value`}},
		{"duplicate plugin", "plugin \"p\" {}\n\nplugin \"p\" {}\n", 3, []string{"Duplicate plugin block", "line 1"}},
		{"plugin config attribute and block of one name", "plugin \"p\" {\n  config {\n    limits = { max = 1 }\n    limits {\n      max = 2\n    }\n  }\n}\n", 4,
			[]string{"Ambiguous plugin config", "limits: given as an attribute at line 3 and as a block here"}},
		{"plugin config block after a block of one name", "plugin \"p\" {\n  config {\n    a {\n      limits {}\n      limits = 1\n    }\n  }\n}\n", 4,
			[]string{"Ambiguous plugin config", "limits: given as an attribute at line 5"}},
		{"plugin config block label given twice", "plugin \"p\" {\n  config {\n    device \"fuse\" {}\n    device \"fuse\" {}\n  }\n}\n", 4,
			[]string{"Duplicate plugin config block", `device "fuse" is given twice`}},
		{"plugin config block with and without labels", "plugin \"p\" {\n  config {\n    device \"fuse\" {}\n    device {}\n  }\n}\n", 4,
			[]string{"Mixed plugin config blocks", "device: given both with labels"}},
		{"syntax error", "listen = \n", 1, []string{"Invalid expression"}},
		{"unknown grant", "listener \"b\" {\n  address = \"unix:///b.sock\"\n  allow = [\"read\", \"reserv:k8s/\"]\n}\n", 3, []string{"allow", `unknown grant "reserv:k8s/"`}},
		{"listener without allow", "listener \"b\" {\n  address = \"unix:///b.sock\"\n}\n", 1, []string{"Missing allow", `listener "b"`}},
		{"listener without address", "\nlistener \"b\" {\n  allow = [\"read\"]\n}\n", 2, []string{"Missing address", `listener "b"`}},
		{"listener named main", "listener \"main\" {\n  address = \"unix:///b.sock\"\n  allow = [\"read\"]\n}\n", 1, []string{"Reserved listener name"}},
		{"duplicate listener", "listener \"b\" {\n  address = \"unix:///b.sock\"\n  allow = [\"read\"]\n}\nlistener \"b\" {\n  address = \"unix:///c.sock\"\n  allow = [\"read\"]\n}\n", 5, []string{"Duplicate listener block", "line 1"}},
		{"listener at listen's address", "listen = \"unix:///a.sock\"\nlistener \"b\" {\n  address = \"unix:///a.sock\"\n  allow = [\"read\"]\n}\n", 3, []string{"Duplicate address", "listen (line 1)"}},
		{"two listeners at one address", "listener \"b\" {\n  address = \"unix:///b.sock\"\n  allow = [\"read\"]\n}\nlistener \"c\" {\n  address = \"unix:///b.sock\"\n  allow = [\"admin\"]\n}\n", 6, []string{"Duplicate address", "line 2"}},
		{"tcp listener without TLS", "listener \"b\" {\n  address = \"tcp://0.0.0.0:7000\"\n  allow = [\"read\"]\n}\n", 1, []string{"Invalid listener", `listener "b"`, "TLS"}},
		{"listener mode not octal", "listener \"b\" {\n  address = \"unix:///b.sock\"\n  allow = [\"read\"]\n  mode = \"rw-rw-rw-\"\n}\n", 4, []string{"Invalid mode", `"rw-rw-rw-" is not a file mode`}},
		{"listener mode on tcp", "listener \"b\" {\n  address = \"tcp://127.0.0.1:7000\"\n  insecure = true\n  allow = [\"read\"]\n  mode = \"0666\"\n}\n", 5, []string{"Invalid mode", "for a unix socket"}},
		{"grant of two peers", "grant {\n  uid = 0\n  gid = 0\n  allow = [\"admin\"]\n}\n", 1, []string{"Invalid grant", "exactly one peer"}},
		{"grant of a negative uid", "grant {\n  uid = -1\n  allow = [\"admin\"]\n}\n", 2, []string{"uid", "at least 0"}},
		{"grant without allow", "grant {\n  gid = 5\n}\n", 1, []string{"Missing allow"}},
		{"identity grant without TLS", "grant {\n  identity = \"spiffe://x\"\n  allow = [\"read\"]\n}\n", 2, []string{"identity", "no listener (nor listen) has tls_cert"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := writeConfig(t, "devicehost.hcl", tt.content)
			cfg := defaultAgentConfig()
			err := loadConfigFile(path, &cfg)
			if err == nil {
				t.Fatalf("loadConfigFile succeeded, want an error at line %d", tt.line)
			}
			msg := err.Error()
			for _, w := range append([]string{fmt.Sprintf("%s:%d,", path, tt.line)}, tt.want...) {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q does not contain %q", msg, w)
				}
			}
		})
	}
}

// A file with several problems gets them all in one error, in the order of the file,
// rather than one per try.
func TestConfigFileReportsEveryProblem(t *testing.T) {
	path := writeConfig(t, "devicehost.hcl", `stats_interval = "fast"
plugn_dir      = "/srv/plugins"
listen         = "/run/dh.sock"
plugin "p" {
  sha = "x"
}
`)
	cfg := defaultAgentConfig()
	err := loadConfigFile(path, &cfg)
	if err == nil {
		t.Fatal("loadConfigFile succeeded, want an error")
	}
	want := []string{
		path + `:1,18: Invalid duration; stats_interval: "fast" is not a duration`,
		path + `:2,1: Unsupported argument; An argument named "plugn_dir" is not expected here. Did you mean "plugin_dir"?`,
		path + `:3,18: Invalid address; listen:`,
		path + `:5,3: Unsupported argument; An argument named "sha" is not expected here.`,
	}
	lines := strings.Split(err.Error(), "\n")[1:] // after "config FILE:"
	if len(lines) != len(want) {
		t.Fatalf("error has %d problems, want %d:\n%v", len(lines), len(want), err)
	}
	for i, w := range want {
		if !strings.HasPrefix(strings.TrimSpace(lines[i]), w) {
			t.Errorf("problem %d: %q, want it to start %q", i+1, lines[i], w)
		}
	}
}

func TestConfigZeroDurationsMeanTheDefaults(t *testing.T) {
	path := writeConfig(t, "devicehost.hcl", `
stats_interval  = "0s"
reserve_timeout = "0s"
start_timeout   = "0s"
ready_timeout   = "0s"
gc_interval     = "0s"
`)
	cfg := defaultAgentConfig()
	if err := loadConfigFile(path, &cfg); err != nil {
		t.Fatalf("loadConfigFile: %v", err)
	}
	if !reflect.DeepEqual(cfg, defaultAgentConfig()) {
		t.Errorf("config = %+v, want the defaults", cfg)
	}
}

func TestFlagsOverrideConfigFile(t *testing.T) {
	path := writeConfig(t, "devicehost.hcl", `
listen     = "unix:///from/file.sock"
plugin_dir = "/file/plugins"
state_dir  = "/file/state"
log_level  = "warn"
`)
	var stderr bytes.Buffer
	env := &cmdEnv{stdout: &stderr, stderr: &stderr, getenv: func(string) string { return "" }}
	a, err := parseAgentArgs(env, []string{"-config", path, "-listen", "tcp://127.0.0.1:9", "-insecure",
		"-state-dir", "/flag/state", "-log-json"})
	if err != nil {
		t.Fatalf("parseAgentArgs: %v (%s)", err, stderr.String())
	}
	want := defaultAgentConfig()
	want.Listen = "tcp://127.0.0.1:9" // flag
	want.TLS.Insecure = true          // flag
	want.StateDir = "/flag/state"     // flag
	want.LogJSON = true               // flag
	want.PluginDir = "/file/plugins"  // file
	want.LogLevel = "warn"            // file
	if !reflect.DeepEqual(a.cfg, want) {
		t.Errorf("config:\ngot  %+v\nwant %+v", a.cfg, want)
	}
}

func TestAgentArgsErrors(t *testing.T) {
	tests := []struct {
		name  string
		args  []string
		want  string
		usage bool
	}{
		{"bad log level flag", []string{"-log-level", "chatty"}, `"chatty" is not a log level`, true},
		{"bad listen flag", []string{"-listen", "localhost:80"}, "want unix:///path.sock or tcp://host:port", true},
		{"stray argument", []string{"now"}, `unexpected argument "now"`, true},
		{"missing config file", []string{"-config", "/nonexistent/devicehost.hcl"}, "/nonexistent/devicehost.hcl", false},
		{"plain metrics off loopback", []string{"-metrics-listen", "tcp://0.0.0.0:9400"},
			"metrics_listen: tcp://0.0.0.0:9400: insecure (plaintext) tcp is refused on a non-loopback address; use TLS with a certificate, key and CA (plain HTTP is served on loopback addresses only; elsewhere set metrics_tls_cert, metrics_tls_key and metrics_tls_ca", true},
		{"bad metrics address", []string{"-metrics-listen", "localhost:9400"}, "metrics_listen: address \"localhost:9400\": want unix:///path.sock or tcp://host:port", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			env := &cmdEnv{stdout: &out, stderr: &out, getenv: func(string) string { return "" }}
			_, err := parseAgentArgs(env, tt.args)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("parseAgentArgs(%q) = %v, want an error containing %q", tt.args, err, tt.want)
			}
			if _, isUsage := err.(usageError); isUsage != tt.usage {
				t.Errorf("usage error = %v, want %v", isUsage, tt.usage)
			}
		})
	}
}

func TestDevConfig(t *testing.T) {
	t.Run("defaults", func(t *testing.T) {
		cfg := defaultAgentConfig()
		cfg.Listen, cfg.TLS.CA = "tcp://10.0.0.1:7070", "/etc/dh/ca.pem" // from a config file
		replaced := devConfig(&cfg, map[string]bool{}, "/tmp/dev")
		// The file's listen is said to be unused; state_dir and plugin_dir, at their
		// defaults, are not mentioned.
		if want := []string{`the config's listen "tcp://10.0.0.1:7070" is not used: -dev uses "unix:///tmp/dev/devicehost.sock" (pass -listen to choose)`}; !reflect.DeepEqual(replaced, want) {
			t.Errorf("replaced %q, want %q", replaced, want)
		}
		if cfg.TLS != (endpoint.TLS{}) {
			t.Errorf("TLS = %+v, want none for the dev socket", cfg.TLS)
		}
		if cfg.Listen != "unix:///tmp/dev/devicehost.sock" || cfg.StateDir != "/tmp/dev/state" || cfg.PluginDir != "" {
			t.Errorf("listen %q state %q plugin dir %q, want the temp dir's socket and state and no plugin dir",
				cfg.Listen, cfg.StateDir, cfg.PluginDir)
		}
		if !reflect.DeepEqual(cfg.Bundled, []string{"nvidia-example"}) {
			t.Errorf("bundled = %q, want [nvidia-example]", cfg.Bundled)
		}
		if got := string(cfg.Plugins["nvidia-example"].ConfigJSON); got != `{"sim_state_file":"/tmp/dev/nvidia-sim.json","simulate":"dgxh100"}` {
			t.Errorf("nvidia-example config = %s, want the DGX H100 simulation, its MIG state in the dev dir", got)
		}
		if got := cfg.Plugins["nvidia-example"].DeviceIDs; !reflect.DeepEqual(got, []string{"GPU-*", "MIG-*"}) {
			t.Errorf("nvidia-example device_ids = %q, want GPU-* and MIG-*", got)
		}
	})
	t.Run("explicit flags and plugin config win", func(t *testing.T) {
		cfg := defaultAgentConfig()
		cfg.Listen = "unix:///mine.sock"
		cfg.Plugins["nvidia-example"] = pluginSettings{ConfigJSON: []byte(`{"simulate":"dgxb200","sim_state_file":""}`), DeviceIDs: []string{"GPU-1*"}}
		if replaced := devConfig(&cfg, map[string]bool{"listen": true}, "/tmp/dev"); len(replaced) != 0 {
			t.Errorf("replaced %q, want nothing: -listen was given", replaced)
		}
		if cfg.Listen != "unix:///mine.sock" {
			t.Errorf("listen = %q, want the -listen flag's", cfg.Listen)
		}
		if got := string(cfg.Plugins["nvidia-example"].ConfigJSON); got != `{"simulate":"dgxb200","sim_state_file":""}` {
			t.Errorf("nvidia-example config = %s, want the config file's", got)
		}
		if got := cfg.Plugins["nvidia-example"].DeviceIDs; !reflect.DeepEqual(got, []string{"GPU-1*"}) {
			t.Errorf("nvidia-example device_ids = %q, want the config file's", got)
		}
	})
}

func TestLoadConfigFileStreamLimits(t *testing.T) {
	path := writeConfig(t, "devicehost.hcl", "max_streams = 10000\nmax_streams_per_connection = 500\n")
	cfg := defaultAgentConfig()
	if err := loadConfigFile(path, &cfg); err != nil {
		t.Fatalf("loadConfigFile: %v", err)
	}
	if cfg.MaxStreams != 10000 || cfg.MaxStreamsPerConn != 500 {
		t.Errorf("max_streams %d, max_streams_per_connection %d, want 10000 and 500", cfg.MaxStreams, cfg.MaxStreamsPerConn)
	}
	for _, content := range []string{"max_streams = 0\n", "max_streams_per_connection = -1\n"} {
		path := writeConfig(t, "devicehost.hcl", content)
		key, _, _ := strings.Cut(content, " ")
		err := loadConfigFile(path, &cfg)
		if err == nil || !strings.Contains(err.Error(), key) || !strings.Contains(err.Error(), "at least 1") {
			t.Errorf("%q: %v, want an error naming %s and its lower bound", content, err, key)
		}
	}
}

// max_procs: the Go runtime's own choice (0) by default, any count from the file or
// -max-procs; a negative count is refused at its line.
func TestMaxProcsSetting(t *testing.T) {
	if got := defaultAgentConfig().MaxProcs; got != 0 {
		t.Errorf("default max_procs %d, want 0", got)
	}
	path := writeConfig(t, "devicehost.hcl", "max_procs = 4\n")
	cfg := defaultAgentConfig()
	if err := loadConfigFile(path, &cfg); err != nil {
		t.Fatalf("loadConfigFile: %v", err)
	}
	if cfg.MaxProcs != 4 {
		t.Errorf("max_procs %d, want the file's 4", cfg.MaxProcs)
	}
	env := &cmdEnv{stdout: io.Discard, stderr: io.Discard, getenv: func(string) string { return "" }}
	a, err := parseAgentArgs(env, []string{"-config", path, "-max-procs", "0"})
	if err != nil {
		t.Fatalf("parseAgentArgs: %v", err)
	}
	if a.cfg.MaxProcs != 0 {
		t.Errorf("-max-procs 0 over the file's 4: %d", a.cfg.MaxProcs)
	}
	bad := writeConfig(t, "devicehost.hcl", "\nmax_procs = -1\n")
	if err := loadConfigFile(bad, &cfg); err == nil || !strings.Contains(err.Error(), ":2,") || !strings.Contains(err.Error(), "at least 0") {
		t.Errorf("max_procs = -1: %v, want an error at line 2 naming the lower bound", err)
	}
	if _, err := parseAgentArgs(env, []string{"-max-procs", "-2"}); err == nil || !strings.Contains(err.Error(), "-max-procs -2") {
		t.Errorf("-max-procs -2: %v, want a usage error naming it", err)
	}
}

// applyMaxProcs sets the Go runtime's GOMAXPROCS, gives the choice back for 0, and
// leaves it alone when the GOMAXPROCS environment variable chose it.
func TestApplyMaxProcs(t *testing.T) {
	was := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(was) })
	if n, fromEnv := applyMaxProcs(3); n != 3 || fromEnv || runtime.GOMAXPROCS(0) != 3 {
		t.Errorf("applyMaxProcs(3) = %d, %v; GOMAXPROCS %d", n, fromEnv, runtime.GOMAXPROCS(0))
	}
	runtime.SetDefaultGOMAXPROCS()
	def := runtime.GOMAXPROCS(0)
	runtime.GOMAXPROCS(def + 1)
	if n, _ := applyMaxProcs(0); n != def {
		t.Errorf("applyMaxProcs(0) = %d, want the runtime's default %d", n, def)
	}
	t.Setenv("GOMAXPROCS", "5")
	runtime.GOMAXPROCS(2)
	if n, fromEnv := applyMaxProcs(1); n != 2 || !fromEnv {
		t.Errorf("with GOMAXPROCS set, applyMaxProcs(1) = %d, %v; want it left at 2, from the environment", n, fromEnv)
	}
}

// metrics_listen follows the API's transport policy: plain HTTP on loopback (no
// "insecure" needed) or a unix socket; mutual TLS elsewhere; TLS files only where they
// apply.
func TestMetricsListenPolicy(t *testing.T) {
	tls := endpoint.TLS{Cert: "/c.pem", Key: "/k.pem", CA: "/ca.pem"}
	for _, tt := range []struct {
		listen string
		tls    endpoint.TLS
		want   string // "" for accepted
	}{
		{"", endpoint.TLS{}, ""},
		{"tcp://127.0.0.1:9400", endpoint.TLS{}, ""},
		{"tcp://[::1]:9400", endpoint.TLS{}, ""},
		{"tcp://localhost:9400", endpoint.TLS{}, ""},
		{"unix:///run/devicehost/metrics.sock", endpoint.TLS{}, ""},
		{"tcp://0.0.0.0:9400", tls, ""},
		{"tcp://10.1.2.3:9400", tls, ""},
		{"tcp://0.0.0.0:9400", endpoint.TLS{}, "refused on a non-loopback address"},
		{"tcp://:9400", endpoint.TLS{}, "refused on a non-loopback address"},
		{"tcp://0.0.0.0:9400", endpoint.TLS{Cert: "/c.pem", Key: "/k.pem"}, "tcp needs mutual TLS: a certificate, a key and a CA"},
		{"unix:///run/m.sock", tls, "TLS settings and insecure apply to tcp addresses only"},
		{"", tls, "metrics_tls_cert, metrics_tls_key and metrics_tls_ca need metrics_listen"},
	} {
		cfg := defaultAgentConfig()
		cfg.MetricsListen, cfg.MetricsTLS = tt.listen, tt.tls
		err := checkMetrics(cfg)
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%q with %+v: %v, want it accepted", tt.listen, tt.tls, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("%q with %+v: %v, want an error with %q", tt.listen, tt.tls, err, tt.want)
		}
	}
}

func TestKubernetesDevicePluginsBlock(t *testing.T) {
	cfg := defaultAgentConfig()
	file := writeConfig(t, "devicehost.hcl", "kubernetes_device_plugins {\n  dir = \"/var/lib/devicehost/device-plugins\"\n}\n")
	if err := loadConfigFile(file, &cfg); err != nil {
		t.Fatal(err)
	}
	if got := string(cfg.Plugins[hosted.Name].ConfigJSON); got != `{"dir":"/var/lib/devicehost/device-plugins"}` {
		t.Errorf("%s config %s", hosted.Name, got)
	}
	if !slices.Contains(cfg.Bundled, hosted.Name) {
		t.Errorf("bundled plugins %v, want %s run from this binary", cfg.Bundled, hosted.Name)
	}
	for name, content := range map[string]string{
		"twice":          "kubernetes_device_plugins {}\nkubernetes_device_plugins {}\n",
		"and its plugin": "plugin \"kubernetes-device-plugins\" {}\nkubernetes_device_plugins {}\n",
	} {
		cfg := defaultAgentConfig()
		err := loadConfigFile(writeConfig(t, "devicehost.hcl", content), &cfg)
		if err == nil || !strings.Contains(err.Error(), ":2,1: Duplicate") {
			t.Errorf("%s: %v, want a Duplicate error at line 2", name, err)
		}
	}
}
