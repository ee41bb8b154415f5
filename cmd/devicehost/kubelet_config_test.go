package main

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/integrations/kubernetes"
)

func TestLoadKubeletConfigFile(t *testing.T) {
	path := writeConfig(t, "kubelet.hcl", `
kubernetes {
  address                = "unix:///run/dh/dh.sock"
  device_plugin_dir      = "/srv/device-plugins"
  pod_resources_socket   = "/srv/pod-resources/kubelet.sock"
  release_grace          = "45s"
  pod_resources_interval = "2s"
  device_list_strategy   = "cdi-cri"
  health_socket          = "/run/dh/bridge-health.sock"
  health_stall_timeout   = "30s"
  health_agent_timeout   = "10m"

  resource "nvidia.com/gpu" {
    vendor = "nvidia"
    type   = "gpu"
    name   = ""
  }
  resource "acme.com/widget-9000" {
    vendor = "acme"
    type   = "fpga"
    name   = "Widget 9000"
  }
}
`)
	cfg := kubeletPluginConfig{}
	if err := loadKubeletConfigFile(path, &cfg); err != nil {
		t.Fatalf("loadKubeletConfigFile: %v", err)
	}
	want := kubeletPluginConfig{
		Address:              "unix:///run/dh/dh.sock",
		DevicePluginDir:      "/srv/device-plugins",
		PodResourcesSocket:   "/srv/pod-resources/kubelet.sock",
		ReleaseGrace:         45 * time.Second,
		PodResourcesInterval: 2 * time.Second,
		DeviceListStrategy:   kubernetes.DeviceListStrategy{CDI: true},
		HealthSocket:         "/run/dh/bridge-health.sock",
		healthSocketSet:      true,
		HealthStallTimeout:   30 * time.Second,
		HealthAgentTimeout:   10 * time.Minute,
		Resources: []kubernetes.Resource{
			{Name: "nvidia.com/gpu", Vendor: "nvidia", Type: "gpu"},
			{Name: "acme.com/widget-9000", Vendor: "acme", Type: "fpga", Model: "Widget 9000"},
		},
	}
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("config:\n got %+v\nwant %+v", cfg, want)
	}
}

// Every mistake is reported with the file, line and what is wrong.
func TestLoadKubeletConfigFileErrors(t *testing.T) {
	for _, tc := range []struct {
		name, content, want string
	}{
		{"unknown key", "kubernetes {\n  releas_grace = \"1s\"\n}\n", `:2,3: Unsupported argument; An argument named "releas_grace" is not expected here. Did you mean "release_grace"?`},
		{"unknown block", "kubernets {}\n", `:1,1: Unsupported block type`},
		{"grace too short", "kubernetes {\n  release_grace = \"100ms\"\n}\n", `:2,19: Invalid duration; release_grace: "100ms" is below the minimum of 1s`},
		{"interval too short", "kubernetes {\n  pod_resources_interval = \"1ms\"\n}\n", `pod_resources_interval: "1ms" is below the minimum of 100ms`},
		{"bad resource name", "kubernetes {\n  resource \"GPU\" {\n    vendor = \"nvidia\"\n    type = \"gpu\"\n  }\n}\n", `:2,3: Invalid resource name; resource name "GPU" has no domain`},
		{"kubernetes.io", "kubernetes {\n  resource \"kubernetes.io/gpu\" {\n    vendor = \"nvidia\"\n    type = \"gpu\"\n  }\n}\n", `kubernetes.io namespace`},
		{"no vendor", "kubernetes {\n  resource \"nvidia.com/gpu\" {\n    type = \"gpu\"\n  }\n}\n", `:2,3: Missing required argument; The argument "vendor" is required`},
		{"empty type", "kubernetes {\n  resource \"nvidia.com/gpu\" {\n    vendor = \"nvidia\"\n    type = \"\"\n  }\n}\n", `:4,12: Invalid value; type: must not be empty`},
		{"overlap", "kubernetes {\n  resource \"nvidia.com/gpu\" {\n    vendor = \"nvidia\"\n    type = \"gpu\"\n  }\n  resource \"nvidia.com/h100\" {\n    vendor = \"nvidia\"\n    type = \"gpu\"\n    name = \"H100\"\n  }\n}\n",
			`:1,1: Invalid resources; resources "nvidia.com/gpu" and "nvidia.com/h100" both match device groups of vendor "nvidia" type "gpu" name "H100"`},
		{"a name twice", "kubernetes {\n  resource \"a.com/x\" {\n    vendor = \"a\"\n    type = \"x\"\n  }\n  resource \"a.com/x\" {\n    vendor = \"b\"\n    type = \"y\"\n  }\n}\n", `resource "a.com/x" is configured twice`},
		{"two blocks", "kubernetes {}\nkubernetes {}\n", `:2,1: Duplicate kubernetes block; the kubernetes block is already at line 1`},
		{"bad address", "kubernetes {\n  address = \"http://x\"\n}\n", `:2,13: Invalid address`},
		{"health timeout too short", "kubernetes {\n  health_agent_timeout = \"100ms\"\n}\n", `:2,26: Invalid duration; health_agent_timeout: "100ms" is below the minimum of 1s`},
		{"bad strategy", "kubernetes {\n  device_list_strategy = \"volume-mounts\"\n}\n", `:2,26: Invalid value; device_list_strategy: device-list strategy "volume-mounts": want envvar, cdi-cri or both`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := writeConfig(t, "kubelet.hcl", tc.content)
			err := loadKubeletConfigFile(path, &kubeletPluginConfig{})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error:\n%v\nwant it to contain\n%s", err, tc.want)
			}
		})
	}
}

// A typo and a bad value are reported together.
func TestKubeletConfigFileReportsEveryProblem(t *testing.T) {
	path := writeConfig(t, "kubelet.hcl", "kubernetes {\n  releas_grace = \"1s\"\n  address = \"http://x\"\n}\n")
	err := loadKubeletConfigFile(path, &kubeletPluginConfig{})
	want := "config " + path + ":\n  " +
		path + `:2,3: Unsupported argument; An argument named "releas_grace" is not expected here. Did you mean "release_grace"?` + "\n  " +
		path + ":3,13: Invalid address; address: "
	if err == nil || !strings.HasPrefix(err.Error(), want) || strings.Count(err.Error(), "\n") != 2 {
		t.Errorf("error:\n%v\nwant the two problems:\n%s...", err, want)
	}
}

// Flags override the file; bad values are usage errors.
func TestParseKubeletPluginArgs(t *testing.T) {
	env := &cmdEnv{stdout: &bytes.Buffer{}, stderr: &bytes.Buffer{}, getenv: func(string) string { return "" }}
	path := writeConfig(t, "kubelet.hcl", `
kubernetes {
  device_plugin_dir = "/from/file"
  release_grace     = "45s"
  resource "nvidia.com/gpu" {
    vendor = "nvidia"
    type   = "gpu"
  }
}
`)
	cfg, err := parseKubeletPluginArgs(env, []string{"-config", path, "-release-grace", "10s", "-pod-resources-socket", "/flag/pr.sock", "-device-list-strategy", "envvar"})
	if err != nil {
		t.Fatal(err)
	}
	want := kubeletPluginConfig{
		Address:            endpoint.DefaultAddress,
		DevicePluginDir:    "/from/file",
		PodResourcesSocket: "/flag/pr.sock",
		ReleaseGrace:       10 * time.Second,
		DeviceListStrategy: kubernetes.DeviceListStrategy{EnvVar: true},
		Resources:          []kubernetes.Resource{{Name: "nvidia.com/gpu", Vendor: "nvidia", Type: "gpu"}},
		LogLevel:           "info",
		// Beside the agent's socket, in the directory the DaemonSet's containers share.
		HealthSocket: "/run/devicehost/kubelet-plugin-health.sock",
	}
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("config:\n got %+v\nwant %+v", cfg, want)
	}

	// The health socket: beside another agent socket, where a flag says, or none.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-address", "unix:///srv/dh/agent.sock"}, "/srv/dh/kubelet-plugin-health.sock"},
		{[]string{"-address", "unix:///srv/dh/agent.sock", "-health-socket", "/x/h.sock"}, "/x/h.sock"},
		{[]string{"-health-socket", ""}, ""},
		{[]string{"-address", "tcp://127.0.0.1:7000", "-insecure"}, ""},
	} {
		cfg, err := parseKubeletPluginArgs(env, tc.args)
		if err != nil || cfg.HealthSocket != tc.want {
			t.Errorf("args %v: health socket %q, %v; want %q", tc.args, cfg.HealthSocket, err, tc.want)
		}
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-release-grace", "10ms"}, "-release-grace 10ms is below the minimum of 1s"},
		{[]string{"-pod-resources-interval", "1ms"}, "-pod-resources-interval 1ms is below the minimum of 100ms"},
		{[]string{"-log-level", "loud"}, `"loud" is not a log level`},
		{[]string{"-health-stall-timeout", "10ms"}, "-health-stall-timeout 10ms is below the minimum of 1s"},
		{[]string{"-health-agent-timeout", "0s"}, "-health-agent-timeout 0s is below the minimum of 1s"},
		{[]string{"-health-socket", "h.sock"}, `health socket "h.sock": want an absolute path`},
		{[]string{"-device-list-strategy", "cdi"}, `-device-list-strategy: device-list strategy "cdi": want envvar, cdi-cri or both`},
		{[]string{"-address", "http://x"}, "address"},
		{[]string{"extra"}, `unexpected argument "extra"`},
	} {
		_, err := parseKubeletPluginArgs(env, tc.args)
		var ue usageError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("args %v: %v, want a usage error containing %q", tc.args, err, tc.want)
		}
	}
}

// A missing device-plugins directory stops the plugin at once with a message naming
// it (exit 1).
func TestKubeletPluginMissingDir(t *testing.T) {
	r := runCLI(t, "kubelet-plugin", "-address", "unix:///nonexistent/dh.sock", "-device-plugin-dir", "/nonexistent/device-plugins")
	if r.code != 1 || !strings.Contains(r.stderr, "device-plugins directory: stat /nonexistent/device-plugins: no such file or directory") {
		t.Errorf("exit %d, stderr %q; want 1 naming the directory", r.code, r.stderr)
	}
}
