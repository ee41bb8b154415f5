package manager

import (
	"context"
	"errors"
	"math"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/internal/backoff"
	"github.com/devicehost/devicehost/manager/device"
	"github.com/devicehost/devicehost/manager/ledger"
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

func TestBroadcastDownsamplesAndReplaces(t *testing.T) {
	var b broadcast[int]
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := 0
	every := b.subscribe(ctx, 1, &first)
	third := b.subscribe(ctx, 3, nil)

	for v := 1; v <= 7; v++ {
		b.publish(v)
	}
	// The every-one watcher never read: it holds only the latest value.
	if got := drain(every); !slices.Equal(got, []int{7}) {
		t.Errorf("every-1 watcher holds %v, want [7]", got)
	}
	if got := drain(third); !slices.Equal(got, []int{6}) {
		t.Errorf("every-3 watcher holds %v, want [6] (publications 3 and 6, latest kept)", got)
	}
	var got []int
	for v := 8; v <= 12; v++ {
		b.publish(v)
		got = append(got, drain(third)...)
	}
	if !slices.Equal(got, []int{9, 12}) {
		t.Errorf("every-3 watcher read %v, want [9 12]", got)
	}

	b.close()
	waitClosed(t, every)
	waitClosed(t, third)
	if _, ok := <-b.subscribe(ctx, 1, &first); ok {
		t.Error("subscribe after close delivered a value, want a closed channel")
	}
}

// drain returns what ch holds now without waiting.
func drain[T any](ch <-chan T) []T {
	var out []T
	for {
		select {
		case v, ok := <-ch:
			if !ok {
				return out
			}
			out = append(out, v)
		default:
			return out
		}
	}
}

func TestStatsEvery(t *testing.T) {
	h := newStatsHub(100*time.Millisecond, time.Now)
	for _, tc := range []struct {
		in   time.Duration
		want int
	}{{0, 1}, {10 * time.Millisecond, 1}, {100 * time.Millisecond, 1}, {150 * time.Millisecond, 2}, {time.Second, 10},
		// Near the largest Duration, rounding up must not overflow into "every tick".
		{math.MaxInt64, math.MaxInt64/int(100*time.Millisecond) + 1}, {24 * time.Hour, 864000}} {
		if got := h.every(tc.in); got != tc.want {
			t.Errorf("every(%v) = %d, want %d", tc.in, got, tc.want)
		}
	}
}

// The reservation stores the manager can run on: in memory, and the bbolt ledger.
var (
	_ reservationStore = (*memStore)(nil)
	_ reservationStore = (*ledger.Ledger)(nil)
)

// reservationStores opens each store the manager can run on, empty.
var reservationStores = map[string]func(t *testing.T) reservationStore{
	"memory": func(*testing.T) reservationStore { return newMemStore() },
	"ledger": func(t *testing.T) reservationStore {
		l, err := ledger.Open(filepath.Join(t.TempDir(), "state.db"), ledger.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = l.Close() })
		return l
	},
}

func TestReservationStores(t *testing.T) {
	for name, open := range reservationStores {
		t.Run(name, func(t *testing.T) {
			s := open(t)
			ctx := context.Background()
			r1, err := s.Commit(ctx, device.Reservation{ID: "r1", OwnerID: "o1", Plugin: "p", DeviceIDs: []string{"d0", "d1"}, CreatedAt: time.Unix(1, 0)}, nil)
			if err != nil {
				t.Fatal(err)
			}
			checks := []struct {
				name    string
				owner   string
				ids     []string
				wantID  string
				wantErr error
			}{
				{"free devices", "o2", []string{"d2"}, "", nil},
				{"same owner, same devices", "o1", []string{"d1", "d0"}, "r1", nil},
				{"another owner", "o2", []string{"d1"}, "", device.ErrDeviceHeld},
				{"same owner, overlap", "o1", []string{"d0", "d2"}, "", device.ErrDeviceHeld},
			}
			for _, c := range checks {
				got, err := s.Check(c.owner, c.ids, nil)
				gotID := ""
				if got != nil {
					gotID = got.ID
				}
				if gotID != c.wantID || !errors.Is(err, c.wantErr) {
					t.Errorf("%s: Check = %q, %v; want %q, %v", c.name, gotID, err, c.wantID, c.wantErr)
				}
			}
			if again, err := s.Commit(ctx, device.Reservation{ID: "r-other", OwnerID: "o1", DeviceIDs: []string{"d0", "d1"}}, nil); err != nil || again.ID != r1.ID {
				t.Errorf("retried Commit = %q, %v; want %q", again.ID, err, r1.ID)
			}
			_, err = s.Commit(ctx, device.Reservation{ID: "r2", OwnerID: "o2", DeviceIDs: []string{"d1", "d9"}}, nil)
			if !errors.Is(err, device.ErrDeviceHeld) || !strings.Contains(err.Error(), "o1") {
				t.Errorf("conflicting Commit: %v, want ErrDeviceHeld naming o1", err)
			}
			// The holder comes typed, for the server's error details: no one parses the text.
			var held *device.HeldError
			wantConflicts := []device.Conflict{{Holder: device.Holder{ReservationID: "r1", OwnerID: "o1"}, Overlap: []string{"d1"}, Held: []string{"d0", "d1"}}}
			if !errors.As(err, &held) || held.OwnerID != "o2" || !reflect.DeepEqual(held.Conflicts, wantConflicts) {
				t.Errorf("conflicting Commit: %#v, want a *device.HeldError for o2 with %+v", err, wantConflicts)
			}
			if got, want := s.Holders()["d0"], (device.Holder{ReservationID: "r1", OwnerID: "o1"}); got != want {
				t.Errorf("holder of d0 = %+v, want %+v", got, want)
			}

			// Reown: the owner changes and nothing else; a stale expected owner is refused.
			if got, err := s.Reown(ctx, device.ReownRequest{ReservationID: "r1", OwnerID: "o1", NewOwnerID: "pod-a"}); err != nil ||
				got.OwnerID != "pod-a" || !reflect.DeepEqual(got.DeviceIDs, r1.DeviceIDs) || got.State != device.ReservationActive {
				t.Errorf("Reown = %+v, %v; want r1 owned by pod-a", got, err)
			}
			if got, want := s.Holders()["d0"], (device.Holder{ReservationID: "r1", OwnerID: "pod-a"}); got != want {
				t.Errorf("holder of d0 after Reown = %+v, want %+v", got, want)
			}
			if _, err := s.Reown(ctx, device.ReownRequest{ReservationID: "r1", OwnerID: "o1", NewOwnerID: "pod-b"}); !errors.Is(err, device.ErrInvalidRequest) {
				t.Errorf("Reown from a stale owner = %v, want ErrInvalidRequest", err)
			}
			if _, err := s.Reown(ctx, device.ReownRequest{ReservationID: "nope", OwnerID: "o1", NewOwnerID: "pod-b"}); !errors.Is(err, device.ErrNotFound) {
				t.Errorf("Reown(unknown) = %v, want ErrNotFound", err)
			}
			if _, err := s.Reown(ctx, device.ReownRequest{ReservationID: "r1", OwnerID: "pod-a", NewOwnerID: "o1"}); err != nil {
				t.Fatalf("Reown back to o1: %v", err)
			}

			rel, already, err := s.Release(ctx, device.ReleaseRequest{ReservationID: "r1"}, time.Unix(2, 0))
			if err != nil || len(rel) != 1 || len(already) != 0 || rel[0].State != device.ReservationReleased || !rel[0].CleanupPending {
				t.Fatalf("Release = %+v, %+v, %v; want r1 released now with cleanup pending", rel, already, err)
			}
			rel, already, err = s.Release(ctx, device.ReleaseRequest{OwnerID: "o1"}, time.Unix(3, 0))
			if err != nil || len(rel) != 0 || len(already) != 1 || !already[0].ReleasedAt.Equal(time.Unix(2, 0)) {
				t.Fatalf("second Release = %+v, %+v, %v; want r1 already released at its first release time", rel, already, err)
			}
			if _, err := s.Reown(ctx, device.ReownRequest{ReservationID: "r1", OwnerID: "o1", NewOwnerID: "pod-a"}); !errors.Is(err, device.ErrInvalidRequest) {
				t.Errorf("Reown of a released reservation = %v, want ErrInvalidRequest", err)
			}
			if err := s.CleanupDone(ctx, "r1"); err != nil {
				t.Fatal(err)
			}
			if len(s.Holders()) != 0 {
				t.Errorf("holders after release = %v, want none", s.Holders())
			}
			if _, _, err := s.Release(ctx, device.ReleaseRequest{ReservationID: "nope"}, time.Unix(3, 0)); !errors.Is(err, device.ErrNotFound) {
				t.Errorf("Release(unknown) = %v, want ErrNotFound", err)
			}
			list, err := s.List(ctx, device.ReservationFilter{OwnerID: "o1", State: device.ReservationReleased})
			if err != nil || len(list) != 1 || list[0].CleanupPending {
				t.Errorf("List(o1, released) = %+v, %v; want r1, cleaned up", list, err)
			}
		})
	}
}

// Both stores take over alike: holders of the prefixes are released with the new
// reservation's record, at its creation time, cleanup pending; any other holder
// refuses, named alone, and nothing changes; a retry takes nothing over.
func TestReservationStoresTakeOver(t *testing.T) {
	for name, open := range reservationStores {
		t.Run(name, func(t *testing.T) {
			s := open(t)
			ctx := context.Background()
			commit := func(id, owner string, at int64, ids ...string) (device.Reservation, error) {
				return s.Commit(ctx, device.Reservation{ID: id, OwnerID: owner, Plugin: "p", DeviceIDs: ids, CreatedAt: time.Unix(at, 0)}, []string{"nomad/"})
			}
			for _, r := range []struct{ id, owner, dev string }{{"r1", "nomad/a", "d1"}, {"r2", "nomad/b", "d2"}, {"r3", "job-c", "d3"}} {
				if _, err := commit(r.id, r.owner, 1, r.dev); err != nil {
					t.Fatal(err)
				}
			}
			before, _ := s.List(ctx, device.ReservationFilter{})

			if _, err := s.Check("nomad/new", []string{"d1", "d3"}, []string{"nomad/"}); !errors.Is(err, device.ErrDeviceHeld) {
				t.Errorf("Check over job-c's device = %v, want ErrDeviceHeld", err)
			}
			_, err := commit("r4", "nomad/new", 2, "d1", "d3")
			var held *device.HeldError
			want := []device.Conflict{{Holder: device.Holder{ReservationID: "r3", OwnerID: "job-c"}, Overlap: []string{"d3"}, Held: []string{"d3"}}}
			if !errors.As(err, &held) || !reflect.DeepEqual(held.Conflicts, want) {
				t.Errorf("take-over over job-c = %v, want a HeldError naming only r3: %+v", err, want)
			}
			if after, _ := s.List(ctx, device.ReservationFilter{}); !reflect.DeepEqual(after, before) {
				t.Errorf("a refused take-over changed the store:\n%+v\nwas\n%+v", after, before)
			}

			if got, err := s.Check("nomad/new", []string{"d2", "d1"}, []string{"nomad/"}); got != nil || err != nil {
				t.Errorf("Check of a take-over = %v, %v; want nil, nil", got, err)
			}
			got, err := commit("r4", "nomad/new", 2, "d2", "d1")
			if err != nil || got.ID != "r4" || !reflect.DeepEqual(got.TakenOver, []string{"r1", "r2"}) {
				t.Fatalf("take-over = %+v, %v; want r4 taking over r1 and r2", got, err)
			}
			for _, id := range []string{"r1", "r2"} {
				rs, _ := s.List(ctx, device.ReservationFilter{OwnerID: map[string]string{"r1": "nomad/a", "r2": "nomad/b"}[id]})
				if len(rs) != 1 || rs[0].State != device.ReservationReleased || !rs[0].CleanupPending || !rs[0].ReleasedAt.Equal(time.Unix(2, 0)) || rs[0].TakenOver != nil {
					t.Errorf("%s after the take-over: %+v; want released at r4's creation, cleanup pending", id, rs)
				}
			}
			if h := s.Holders(); h["d1"].ReservationID != "r4" || h["d2"].ReservationID != "r4" || h["d3"].ReservationID != "r3" {
				t.Errorf("holders %+v, want d1 and d2 held by r4, d3 by r3", h)
			}
			if rs, _ := s.List(ctx, device.ReservationFilter{OwnerID: "nomad/new"}); len(rs) != 1 || rs[0].TakenOver != nil {
				t.Errorf("listed r4: %+v; want it without TakenOver (never stored)", rs)
			}
			again, err := commit("r5", "nomad/new", 3, "d1", "d2")
			if err != nil || again.ID != "r4" || again.TakenOver != nil {
				t.Errorf("retried take-over = %+v, %v; want r4 back, nothing taken over", again, err)
			}
		})
	}
}
