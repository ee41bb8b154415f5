package manager

import (
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/pluginloader"
)

func TestConfigDefaults(t *testing.T) {
	tests := []struct {
		name      string
		in        Config
		want      func(c Config) bool
		wantError string
	}{
		{name: "zero means defaults", in: Config{}, want: func(c Config) bool {
			return c.StatsInterval == DefaultStatsInterval && c.ReserveTimeout == DefaultReserveTimeout &&
				c.StartTimeout == DefaultStartTimeout && c.ReadyTimeout == DefaultReadyTimeout &&
				c.FingerprintTimeout == DefaultFingerprintTimeout && c.KillTimeout == DefaultKillTimeout &&
				c.RestartBaseDelay == DefaultRestartBaseDelay && c.RestartMaxDelay == DefaultRestartMaxDelay &&
				c.StableRunReset == DefaultStableRunReset && c.ServedReset == DefaultServedReset &&
				c.Logger != nil && c.Now != nil &&
				c.GCInterval == time.Minute && c.GCMaxReservations == 1000 && c.GCParallelDestroys == 2
		}},
		{name: "stats interval below the minimum is refused", in: Config{StatsInterval: time.Millisecond},
			wantError: "StatsInterval (1ms) is below the minimum of 100ms"},
		{name: "stats interval at the minimum is kept", in: Config{StatsInterval: MinStatsInterval},
			want: func(c Config) bool { return c.StatsInterval == MinStatsInterval }},
		{name: "set values are kept", in: Config{StatsInterval: 3 * time.Second, ReserveTimeout: time.Second},
			want: func(c Config) bool { return c.StatsInterval == 3*time.Second && c.ReserveTimeout == time.Second }},
		{name: "negative is refused", in: Config{ReadyTimeout: -time.Second}, wantError: "ReadyTimeout is negative"},
		{name: "cap below base is refused", in: Config{RestartBaseDelay: time.Second, RestartMaxDelay: time.Millisecond}, wantError: "RestartMaxDelay"},
		{name: "GC settings are kept", in: Config{GCInterval: time.Hour, GCMaxReservations: 5, GCParallelDestroys: 7},
			want: func(c Config) bool {
				return c.GCInterval == time.Hour && c.GCMaxReservations == 5 && c.GCParallelDestroys == 7
			}},
		{name: "negative GC interval is refused", in: Config{GCInterval: -time.Second}, wantError: "GCInterval is negative"},
		{name: "negative GC limit is refused", in: Config{GCMaxReservations: -1}, wantError: "GCMaxReservations is negative"},
		{name: "negative GC parallelism is refused", in: Config{GCParallelDestroys: -1}, wantError: "GCParallelDestroys is negative"},
		{name: "reattach needs a state dir", in: Config{Plugins: map[string]PluginConfig{"p": {Reattach: true}}},
			wantError: `plugin "p": Reattach needs a StateDir`},
		{name: "reattach with a state dir", in: Config{StateDir: "/state", Plugins: map[string]PluginConfig{"p": {Reattach: true}}},
			want: func(c Config) bool { return c.Plugins["p"].Reattach }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.in.withDefaults()
			if tc.wantError != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantError) {
					t.Fatalf("withDefaults error = %v, want one about %q", err, tc.wantError)
				}
				return
			}
			if err != nil {
				t.Fatalf("withDefaults: %v", err)
			}
			if !tc.want(got) {
				t.Errorf("withDefaults(%+v) = %+v", tc.in, got)
			}
		})
	}
}

func TestConfigIsCopiedNotMutated(t *testing.T) {
	in := Config{
		Binaries: []pluginloader.Binary{{Path: "/bin/p", Args: []string{"plugin"}}},
		Plugins:  map[string]PluginConfig{"p": {ConfigJSON: []byte(`{}`), Env: []string{"A=1"}}},
	}
	got, err := in.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	got.Binaries[0].Args[0] = "changed"
	got.Plugins["p"].Env[0] = "changed"
	got.Plugins["p"].ConfigJSON[0] = 'X'
	got.Plugins["q"] = PluginConfig{}
	if in.Binaries[0].Args[0] != "plugin" || in.Plugins["p"].Env[0] != "A=1" || string(in.Plugins["p"].ConfigJSON) != "{}" || len(in.Plugins) != 1 {
		t.Errorf("caller's config changed: %+v", in)
	}
	if in.StatsInterval != 0 || in.Logger != nil {
		t.Errorf("caller's config got defaults: %+v", in)
	}
}

func TestNewRefusesDuplicatePluginNames(t *testing.T) {
	_, err := New(Config{Binaries: []pluginloader.Binary{{Name: "p", Path: "/a/p"}, {Path: "/b/p"}}})
	if err == nil || !strings.Contains(err.Error(), `two plugins named "p"`) {
		t.Errorf("New with two plugins named p: %v, want an error naming it", err)
	}
}
