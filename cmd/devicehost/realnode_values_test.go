package main

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"testing"

	"github.com/hashicorp/go-hclog"
	"go.yaml.in/yaml/v3"

	"github.com/devicehost/devicehost/internal/suggest"
	"github.com/devicehost/devicehost/plugins/nvidia-example/nvidia"
)

// deploy/helm/real-node-values.yaml is a complete config for a real node: its
// agent.config, after the lines the chart writes before it, is one the agent accepts,
// its nvidia-example config block one the plugin accepts, and every key of the agent's
// config (but the blocks and the three the chart writes) and of the plugin's block and
// config appears in it, set or commented at its default. A key added to either and not
// to the example fails here.
func TestRealNodeValues(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "deploy", "helm", "real-node-values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var values struct {
		Agent struct {
			Config string `yaml:"config"`
		} `yaml:"agent"`
	}
	if err := yaml.Unmarshal(raw, &values); err != nil {
		t.Fatal(err)
	}
	text := values.Agent.Config
	path := filepath.Join(t.TempDir(), "devicehost.hcl")
	chart := "listen     = \"unix:///run/devicehost/devicehost.sock\"\nplugin_dir = \"/opt/devicehost/plugins\"\nstate_dir  = \"/var/lib/devicehost\"\n"
	if err := os.WriteFile(path, []byte(chart+text), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := defaultAgentConfig()
	if _, err := loadConfig(path, &cfg); err != nil {
		t.Fatalf("the example's agent.config: %v", err)
	}
	p, ok := cfg.Plugins["nvidia-example"]
	if !ok {
		t.Fatal("the example has no plugin \"nvidia-example\" block")
	}
	if err := nvidia.New(hclog.NewNullLogger()).CheckConfig(context.Background(), p.ConfigJSON); err != nil {
		t.Errorf("the nvidia-example plugin refuses the example's config block: %v", err)
	}
	mentions := func(key string) bool { return regexp.MustCompile(`\b` + key + `\b`).MatchString(text) }
	keys, blocks := schemaKeys(reflect.TypeFor[fileSchema]())
	for _, k := range keys {
		if _, block := blocks[k]; block || k == "listen" || k == "plugin_dir" || k == "state_dir" {
			continue
		}
		if !mentions(k) {
			t.Errorf("the example's agent.config does not mention the agent key %s", k)
		}
	}
	for _, k := range blocks["plugin"] {
		if !mentions(k) {
			t.Errorf("the example's plugin block does not mention the key %s", k)
		}
	}
	for _, k := range suggest.JSONKeys(nvidia.Config{}) {
		if !mentions(k) {
			t.Errorf("the example's nvidia-example config does not mention the key %s", k)
		}
	}
}
