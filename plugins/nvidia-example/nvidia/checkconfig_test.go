package nvidia

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
)

// CheckConfig refuses what SetConfig refuses, with SetConfig's message.
func TestCheckConfigRefusesWhatSetConfigRefuses(t *testing.T) {
	other := filepath.Join(t.TempDir(), "other-machine.json")
	if err := os.WriteFile(other, []byte(`{"machine":"dgxa100","gpus":[]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		config string
		want   string
	}{
		{"typo", `{"simulate":"dgxh100","sim_state_file":"","mgi":"on-demand"}`, `config: json: unknown field "mgi" (did you mean "mig"?)`},
		{"bad value", `{"simulate":"dgxh100","sim_state_file":"","replicas":1}`, `config: replicas = 1: want 2 to 64, or 0 for none`},
		{"no such GPU", `{"simulate":"dgxh100","sim_state_file":"","inject_faults":[{"gpu_index":8,"xid":79,"after":"1s"}]}`,
			`config: inject_faults[0].gpu_index = 8: the simulated machine has GPUs 0 to 7`},
		{"state file of another machine", `{"simulate":"dgxh100","sim_state_file":"` + other + `"}`,
			`config: sim_state_file = "` + other + `" holds the state of a simulated dgxa100 with 0 GPUs, not of this dgxh100; remove it or choose another file`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, _ := newUnconfigured(t)
			cerr := p.CheckConfig(context.Background(), []byte(tt.config))
			if cerr == nil || cerr.Error() != tt.want {
				t.Errorf("CheckConfig(%s): got %v, want %q", tt.config, cerr, tt.want)
			}
			serr := p.SetConfig(context.Background(), []byte(tt.config))
			if serr == nil || cerr == nil || serr.Error() != cerr.Error() {
				t.Errorf("SetConfig(%s): got %v, want CheckConfig's %v", tt.config, serr, cerr)
			}
		})
	}
}

// CheckConfig of a config with a mig_layout creates no instance and writes nothing:
// the simulator's state file keeps its bytes and its mtime. SetConfig of the same
// config then applies it.
func TestCheckConfigLeavesTheSimulatorStateAlone(t *testing.T) {
	state := filepath.Join(t.TempDir(), "sim-state.json")
	p, _ := newTestPlugin(t, Config{Simulate: "dgxh100", MIG: MIGOnDemand, SimStateFile: ptr(state)})
	before, beforeInfo := readState(t, state)

	cfg := mustJSON(t, Config{Simulate: "dgxh100", MIG: MIGOnDemand, SimStateFile: ptr(state),
		MIGLayout: []byte(`{"0": ["3g.40gb", "2g.20gb"]}`)})
	if err := p.CheckConfig(context.Background(), cfg); err != nil {
		t.Fatalf("CheckConfig of a valid config with a mig_layout: %v", err)
	}
	after, afterInfo := readState(t, state)
	if !bytes.Equal(after, before) || !afterInfo.ModTime().Equal(beforeInfo.ModTime()) {
		t.Errorf("CheckConfig changed the simulator state file (mtime %v, then %v):\n%s\nthen:\n%s",
			beforeInfo.ModTime(), afterInfo.ModTime(), before, after)
	}
	if n := p.sim.instanceCount(); n != 0 {
		t.Errorf("CheckConfig left %d MIG instances, want 0", n)
	}

	// Another state file, not the running machine's: read if there, never made.
	fresh := filepath.Join(t.TempDir(), "fresh.json")
	cfg2 := mustJSON(t, Config{Simulate: "dgxh100", SimStateFile: ptr(fresh), MIGLayout: []byte(`"1g.10gb"`)})
	if err := p.CheckConfig(context.Background(), cfg2); err != nil {
		t.Fatalf("CheckConfig with a new state file: %v", err)
	}
	if _, err := os.Stat(fresh); !os.IsNotExist(err) {
		t.Errorf("CheckConfig made the state file it was given: stat: %v", err)
	}

	if err := p.SetConfig(context.Background(), cfg); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	if applied, _ := readState(t, state); bytes.Equal(applied, before) {
		t.Errorf("SetConfig of the checked config did not change the state file: the test checks nothing")
	}
}

// readState returns the state file's bytes and its stat.
func readState(t *testing.T, path string) ([]byte, os.FileInfo) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return raw, fi
}
