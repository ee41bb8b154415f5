package manager

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/internal/backoff"
	"github.com/devicehost/devicehost/pluginloader"
)

func TestConfigDefaults(t *testing.T) {
	tests := []struct {
		name      string
		in        Config
		want      func(c Config) bool
		wantNote  string
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
		{name: "stats interval below the bound is raised", in: Config{StatsInterval: time.Millisecond},
			want:     func(c Config) bool { return c.StatsInterval == MinStatsInterval },
			wantNote: "below the lower bound"},
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
			got, notes, err := tc.in.withDefaults()
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
			if gotNote := strings.Join(notes, "\n"); !strings.Contains(gotNote, tc.wantNote) || (tc.wantNote == "") != (gotNote == "") {
				t.Errorf("notes = %q, want %q", gotNote, tc.wantNote)
			}
		})
	}
}

func TestConfigIsCopiedNotMutated(t *testing.T) {
	in := Config{
		Binaries: []pluginloader.Binary{{Path: "/bin/p", Args: []string{"plugin"}}},
		Plugins:  map[string]PluginConfig{"p": {ConfigJSON: []byte(`{}`), Env: []string{"A=1"}}},
	}
	got, _, err := in.withDefaults()
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

func TestBackoff(t *testing.T) {
	none := func() float64 { return 0 }
	b := restartBackoff{Backoff: backoff.Backoff{Base: 200 * time.Millisecond, Max: time.Second, Jitter: none}, stable: time.Minute, served: time.Second}
	var got []time.Duration
	for range 6 {
		got = append(got, b.next(time.Second, 0))
	}
	want := []time.Duration{200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond, time.Second, time.Second, time.Second}
	if !slices.Equal(got, want) {
		t.Errorf("delays = %v, want %v (first fast, doubling, capped)", got, want)
	}
	if got, want := b.next(time.Minute, 0), 200*time.Millisecond; got != want {
		t.Errorf("delay after a stable run = %v, want %v", got, want)
	}

	for _, j := range []float64{-1, 1} {
		b := restartBackoff{Backoff: backoff.Backoff{Base: time.Second, Max: time.Second, Jitter: func() float64 { return j }}, stable: time.Minute}
		if got, want := b.next(0, 0), time.Duration(float64(time.Second)*(1+0.2*j)); got != want {
			t.Errorf("jitter %v: delay = %v, want %v", j, got, want)
		}
	}
	r := restartBackoff{Backoff: backoff.Backoff{Base: time.Second, Max: time.Second}, stable: time.Minute}
	for range 100 {
		if d := r.next(0, 0); d < 800*time.Millisecond || d > 1200*time.Millisecond {
			t.Fatalf("random jitter delay %v outside ±20%% of 1s", d)
		}
	}
}

// TestBackoffServedRunDoesNotInheritThePenalty: a plugin killed after it served
// restarts after the base delay, however long the crash loop before it; one that dies
// before serving for ServedReset, or never serves, keeps backing off.
func TestBackoffServedRunDoesNotInheritThePenalty(t *testing.T) {
	none := func() float64 { return 0 }
	base, maxDelay := 200*time.Millisecond, 30*time.Second
	b := restartBackoff{Backoff: backoff.Backoff{Base: base, Max: maxDelay, Jitter: none}, stable: time.Minute, served: time.Second}
	// A crash loop before the plugin ever fingerprints: 0.2, 0.4, ... 25.6s.
	var d time.Duration
	for range 8 {
		d = b.next(100*time.Millisecond, 0)
	}
	if want := 25600 * time.Millisecond; d != want {
		t.Fatalf("8th delay of a crash loop = %v, want %v", d, want)
	}
	// Then it comes up, serves 5s and is killed: back after the base delay.
	if got := b.next(5500*time.Millisecond, 5*time.Second); got != base {
		t.Errorf("delay after a run that served 5s = %v, want %v", got, base)
	}
	// Killed again and again after serving 1.5s each: never more than the base delay.
	for i := range 8 {
		if got := b.next(2*time.Second, 1500*time.Millisecond); got != base {
			t.Errorf("delay after served run %d = %v, want %v", i, got, base)
		}
	}
	// A run that fingerprints and dies within ServedReset still counts as a failure.
	b.next(2*time.Second, 1500*time.Millisecond)
	if got, want := b.next(600*time.Millisecond, 500*time.Millisecond), 2*base; got != want {
		t.Errorf("delay after a run that served only 0.5s = %v, want %v (still backing off)", got, want)
	}
	// Without a served threshold (the stats stream's backoff), serving resets nothing.
	s := restartBackoff{Backoff: backoff.Backoff{Base: base, Max: maxDelay, Jitter: none}, stable: time.Minute}
	s.next(0, 0)
	if got, want := s.next(0, time.Hour), 2*base; got != want {
		t.Errorf("delay with no served threshold = %v, want %v", got, want)
	}
}
