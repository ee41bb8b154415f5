package nvidia

import (
	"strings"
	"testing"
	"time"
)

func TestParseConfigDefaultsAndValues(t *testing.T) {
	tests := []struct {
		name string
		json string
		want settings
	}{
		{"no config", "", settings{fingerprintPeriod: time.Minute, quietPeriod: 5 * time.Minute}},
		{"null", "null", settings{fingerprintPeriod: time.Minute, quietPeriod: 5 * time.Minute}},
		{"empty object", "{}", settings{fingerprintPeriod: time.Minute, quietPeriod: 5 * time.Minute}},
		{"everything", `{"simulate":"dgxb200","fingerprint_period":"30s","health_quiet_period":"2m",
			"ignored_gpu_ids":["GPU-a","GPU-b"],
			"inject_faults":[{"gpu_index":0,"xid":79,"after":"1m","for":"30s"},{"gpu_id":"GPU-x","xid":48,"after":"0s"}]}`,
			settings{simulate: "dgxb200", fingerprintPeriod: 30 * time.Second, quietPeriod: 2 * time.Minute,
				ignored: map[string]bool{"GPU-a": true, "GPU-b": true},
				faults: []faultSpec{
					{key: "inject_faults[0]", gpuIndex: 0, xid: 79, after: time.Minute, lasts: 30 * time.Second},
					{key: "inject_faults[1]", gpuID: "GPU-x", gpuIndex: -1, xid: 48},
				}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseConfig([]byte(tt.json))
			if err != nil {
				t.Fatalf("parseConfig: %v", err)
			}
			if got.simulate != tt.want.simulate || got.fingerprintPeriod != tt.want.fingerprintPeriod ||
				got.quietPeriod != tt.want.quietPeriod {
				t.Errorf("got simulate %q period %v quiet %v, want %q %v %v", got.simulate, got.fingerprintPeriod,
					got.quietPeriod, tt.want.simulate, tt.want.fingerprintPeriod, tt.want.quietPeriod)
			}
			if len(got.ignored) != len(tt.want.ignored) {
				t.Errorf("ignored = %v, want %v", got.ignored, tt.want.ignored)
			}
			for id := range tt.want.ignored {
				if !got.ignored[id] {
					t.Errorf("ignored lacks %q", id)
				}
			}
			if len(got.faults) != len(tt.want.faults) {
				t.Fatalf("faults = %+v, want %+v", got.faults, tt.want.faults)
			}
			for i := range got.faults {
				if got.faults[i] != tt.want.faults[i] {
					t.Errorf("fault %d = %+v, want %+v", i, got.faults[i], tt.want.faults[i])
				}
			}
		})
	}
}

func TestParseConfigRejects(t *testing.T) {
	tests := []struct {
		name string
		json string
		want []string // each must appear in the error
	}{
		{"unknown machine", `{"simulate":"dgx9000"}`, []string{`simulate = "dgx9000"`, "dgxa100, dgxb200, dgxh100, dgxh200"}},
		{"bad fingerprint period", `{"fingerprint_period":"soon"}`, []string{`fingerprint_period = "soon"`, "invalid duration"}},
		{"zero fingerprint period", `{"fingerprint_period":"0s"}`, []string{`fingerprint_period = "0s"`, "positive"}},
		{"negative quiet period", `{"health_quiet_period":"-1m"}`, []string{`health_quiet_period = "-1m"`, "positive"}},
		{"bad quiet period", `{"health_quiet_period":"5 minutes"}`, []string{`health_quiet_period = "5 minutes"`}},
		{"number for a duration", `{"fingerprint_period":60}`, []string{"fingerprint_period"}},
		{"unknown key", `{"simulated":"dgxh100"}`, []string{`"simulated"`}},
		{"not an object", `["dgxh100"]`, []string{"config"}},
		{"trailing data", `{} {}`, []string{"trailing"}},
		{"empty ignored id", `{"ignored_gpu_ids":["GPU-a",""]}`, []string{"ignored_gpu_ids[1]"}},
		{"faults without simulate", `{"inject_faults":[{"gpu_index":0,"xid":79,"after":"1s"}]}`, []string{"inject_faults", "simulate"}},
		{"fault without gpu", `{"simulate":"dgxh100","inject_faults":[{"xid":79,"after":"1s"}]}`, []string{"inject_faults[0]", "gpu_id or gpu_index"}},
		{"fault with both gpus", `{"simulate":"dgxh100","inject_faults":[{"gpu_index":1,"gpu_id":"GPU-x","xid":79,"after":"1s"}]}`, []string{"inject_faults[0]", "not both"}},
		{"fault negative index", `{"simulate":"dgxh100","inject_faults":[{"gpu_index":-1,"xid":79,"after":"1s"}]}`, []string{"inject_faults[0].gpu_index = -1"}},
		{"fault without xid", `{"simulate":"dgxh100","inject_faults":[{"gpu_index":1,"after":"1s"}]}`, []string{"inject_faults[0].xid"}},
		{"fault without after", `{"simulate":"dgxh100","inject_faults":[{"gpu_index":1,"xid":79}]}`, []string{"inject_faults[0].after"}},
		{"fault bad after", `{"simulate":"dgxh100","inject_faults":[{"gpu_index":1,"xid":79,"after":"x"}]}`, []string{`inject_faults[0].after = "x"`}},
		{"fault negative for", `{"simulate":"dgxh100","inject_faults":[{"gpu_index":1,"xid":79,"after":"1s","for":"-1s"}]}`, []string{`inject_faults[0].for = "-1s"`}},
		{"fault unknown recovery action", `{"simulate":"dgxh100","inject_faults":[{"gpu_index":1,"xid":79,"after":"1s","recovery_action":"pray"}]}`, []string{`inject_faults[0].recovery_action = "pray"`, "gpu_reset"}},
		{"relative cdi_spec_dir", `{"cdi_spec_dir":"run/cdi"}`, []string{`cdi_spec_dir = "run/cdi"`, "absolute path"}},
		{"dot cdi_spec_dir", `{"simulate":"dgxh100","cdi_spec_dir":"./cdi"}`, []string{`cdi_spec_dir = "./cdi"`, "absolute path"}},
		{"every problem reported", `{"simulate":"nope","fingerprint_period":"x","health_quiet_period":"y"}`,
			[]string{`simulate = "nope"`, `fingerprint_period = "x"`, `health_quiet_period = "y"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseConfig([]byte(tt.json))
			if err == nil {
				t.Fatalf("parseConfig(%s) = nil error, want one mentioning %q", tt.json, tt.want)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

// Real GPUs get a CDI spec in /var/run/cdi unless told otherwise; simulated ones only
// where told, so fake GPUs never enter the host's real CDI registry.
func TestParseConfigCDISpecDir(t *testing.T) {
	tests := []struct{ json, want string }{
		{`{}`, "/var/run/cdi"},
		{`{"cdi_spec_dir":"/etc/cdi/"}`, "/etc/cdi"},
		{`{"cdi_spec_dir":""}`, ""},
		{`{"simulate":"dgxh100"}`, ""},
		{`{"simulate":"dgxh100","cdi_spec_dir":"/tmp/cdi"}`, "/tmp/cdi"},
	}
	for _, tt := range tests {
		got, err := parseConfig([]byte(tt.json))
		if err != nil {
			t.Fatalf("parseConfig(%s): %v", tt.json, err)
		}
		if got.cdiDir != tt.want {
			t.Errorf("parseConfig(%s): CDI spec dir %q, want %q", tt.json, got.cdiDir, tt.want)
		}
	}
}

// An unknown key is named with the known key it most likely meant, as the agent names
// its own.
func TestParseConfigSuggestsKnownKey(t *testing.T) {
	tests := []struct {
		name string
		json string
		want string // the whole error
	}{
		{"transposed", `{"mgi":"on-demand"}`, `config: json: unknown field "mgi" (did you mean "mig"?)`},
		{"missing letter", `{"simulate":"dgxh100","replica":2}`, `config: json: unknown field "replica" (did you mean "replicas"?)`},
		{"in a fault", `{"simulate":"dgxh100","inject_faults":[{"gpu_index":0,"xid":79,"afer":"1s"}]}`,
			`config: json: unknown field "afer" (did you mean "after"?)`},
		{"nothing near", `{"colour":"green"}`, `config: json: unknown field "colour"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseConfig([]byte(tt.json))
			if err == nil || err.Error() != tt.want {
				t.Errorf("parseConfig(%s): got %v, want %s", tt.json, err, tt.want)
			}
		})
	}
}
