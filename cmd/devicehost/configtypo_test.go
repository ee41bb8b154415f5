package main

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/hashicorp/hcl/v2"

	"github.com/devicehost/devicehost/manager"
	"github.com/devicehost/devicehost/pluginloader"
)

func TestRejectedConfigErrorNamesTheBlock(t *testing.T) {
	blocks := pluginBlocks{"gpu": {Filename: "/etc/dh.hcl", Start: hcl.Pos{Line: 7, Column: 1}}}
	plugins := map[string]pluginSettings{"gpu": {}, "dev": {}}
	rejected := func(name string) *manager.ConfigRejectedError {
		return &manager.ConfigRejectedError{Plugin: name, Err: fmt.Errorf("launch: %w",
			&pluginloader.ConfigError{Plugin: name, Message: `json: unknown field "mgi" (did you mean "mig"?)`})}
	}
	tests := []struct {
		name string
		want string
	}{
		{"gpu", "config /etc/dh.hcl:\n  /etc/dh.hcl:7,1: Plugin config rejected; plugin \"gpu\": json: unknown field \"mgi\" (did you mean \"mig\"?)"},
		{"dev", `plugin "dev" rejected its config: json: unknown field "mgi" (did you mean "mig"?)`},
		{"dir", `plugin "dir" rejected its config (it has no plugin block; give it one with the config it needs): json: unknown field "mgi" (did you mean "mig"?)`},
	}
	for _, tt := range tests {
		err := rejectedConfigError(blocks, plugins, []*manager.ConfigRejectedError{rejected(tt.name)})
		if err == nil || err.Error() != tt.want {
			t.Errorf("plugin %s: got %v\nwant %s", tt.name, err, tt.want)
		}
	}

	// SetPlugins joins its rejections with other errors: each is found.
	joined := errors.Join(rejected("gpu"), errors.New("other"), rejected("dev"))
	if got := configRejections(joined); len(got) != 2 || got[0].Plugin != "gpu" || got[1].Plugin != "dev" {
		t.Errorf("configRejections(%v) = %v, want gpu's and dev's", joined, got)
	}
	if got := configRejections(nil); got != nil {
		t.Errorf("configRejections(nil) = %v, want none", got)
	}
}

// A rejection that names a key of the plugin's config block points at that key's line,
// not the block's; a message naming no key (or only part of one) points at the block.
func TestRejectedConfigErrorNamesTheKey(t *testing.T) {
	path := writeConfig(t, "dh.hcl", `plugin "gpu" {
  config {
    simulate       = "dgxh100"
    mgi            = "on-demand"
    replicas_extra = 1
  }
}
`)
	blocks := pluginBlocks{"gpu": {Filename: path, Start: hcl.Pos{Line: 1, Column: 1}}}
	plugins := map[string]pluginSettings{"gpu": {}}
	for msg, at := range map[string]string{
		`json: unknown field "mgi" (did you mean "mig"?)`: ":4,5: ",
		`config: simulate = "dgxh100": no such machine`:   ":3,5: ",
		`config: replicas = 99: want 2 to 64`:             ":1,1: ", // replicas_extra is another key
		`the GPU is on fire`:                              ":1,1: ",
	} {
		err := rejectedConfigError(blocks, plugins, []*manager.ConfigRejectedError{{Plugin: "gpu", Err: errors.New(msg)}})
		if err == nil || !strings.Contains(err.Error(), path+at+"Plugin config rejected") {
			t.Errorf("%q: %v, want it at %s", msg, err, at)
		}
	}
}
