package manager

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger"
	"github.com/devicehost/devicehost/tools/testwait"
)

// These tests run the manager on the durable ledger (Config.StateDir) with in-process
// plugins: conflicts, holders, restarts, and the garbage collector's plugin cleanups.

var acmeA1 = device.GroupKey{Vendor: "acme", Type: "gpu", Name: "A1"}

// durableConfig is testConfig with a fresh state dir.
func durableConfig(t *testing.T) (Config, *logRecorder) {
	t.Helper()
	cfg, logs := testConfig(t)
	cfg.StateDir = t.TempDir()
	return cfg, logs
}

// waitReady waits for m's first fingerprints.
func waitReady(t *testing.T, m *Manager) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if _, err := m.WaitForFirstFingerprint(ctx); err != nil {
		t.Fatal(err)
	}
}

// reserve reserves ids of acme/gpu/A1 for owner and fails the test on error.
func reserve(t *testing.T, m *Manager, owner string, ids ...string) device.Reservation {
	t.Helper()
	r, err := m.Reserve(context.Background(), device.ReserveRequest{OwnerID: owner, Group: acmeA1, DeviceIDs: ids})
	if err != nil {
		t.Fatalf("Reserve(%s, %v): %v", owner, ids, err)
	}
	return r
}

// release releases req and fails the test on error.
func release(t *testing.T, m *Manager, req device.ReleaseRequest) device.ReleaseResult {
	t.Helper()
	res, err := m.Release(context.Background(), req)
	if err != nil {
		t.Fatalf("Release(%+v): %v", req, err)
	}
	return res
}

// reservation returns reservation id as m lists it, and whether it is listed.
func reservation(t *testing.T, m *Manager, id string) (device.Reservation, bool) {
	t.Helper()
	all, err := m.Reservations(context.Background(), device.ReservationFilter{})
	if err != nil {
		t.Fatalf("Reservations: %v", err)
	}
	i := slices.IndexFunc(all, func(r device.Reservation) bool { return r.ID == id })
	if i < 0 {
		return device.Reservation{}, false
	}
	return all[i], true
}

// waitReservation checks reservation id against ok (which gets false for "not listed")
// until ok accepts it or testwait.Timeout passes. The garbage collector's writes have no event
// a test can wait on, so this checks on a short tick, against a deadline.
func waitReservation(t *testing.T, m *Manager, id, what string, ok func(r device.Reservation, listed bool) bool) device.Reservation {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := time.NewTimer(testwait.Timeout)
	defer deadline.Stop()
	for {
		r, listed := reservation(t, m, id)
		if ok(r, listed) {
			return r
		}
		select {
		case <-tick.C:
		case <-deadline.C:
			t.Fatalf("reservation %s not %s within %v; last: %+v (listed %v)", id, what, testwait.Timeout, r, listed)
		}
	}
}

func cleanedUp(r device.Reservation, listed bool) bool {
	return listed && r.State == device.ReservationReleased && !r.CleanupPending
}

// crash stops m the way a crashed host stops: the state file is let go of first (a dead
// process's lock is released, and it writes nothing more), then its goroutines end.
// Whether its plugins die is up to its launcher (see survivor). A later Shutdown of m
// only waits.
func crash(t *testing.T, m *Manager) {
	t.Helper()
	if m.ledger == nil {
		t.Fatal("crash: the manager has no ledger")
	}
	if err := m.ledger.Close(); err != nil {
		t.Fatalf("closing the ledger: %v", err)
	}
	shutdown(t, m)
}

func TestNewOpensTheLedgerInStateDir(t *testing.T) {
	cfg, _ := testConfig(t)
	cfg.StateDir = filepath.Join(t.TempDir(), "new", "state")
	m, _ := startInprocManager(t, cfg)
	fi, err := os.Stat(cfg.StateDir)
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("state dir: %v, %v; want created with mode 0700", fi.Mode(), err)
	}
	if got, want := m.ledger.Path(), filepath.Join(cfg.StateDir, ledger.DefaultFileName); got != want {
		t.Errorf("ledger at %s, want %s", got, want)
	}
}

func TestNewRefusesAStateFileItCannotUse(t *testing.T) {
	t.Run("corrupt", func(t *testing.T) {
		cfg, _ := durableConfig(t)
		path := filepath.Join(cfg.StateDir, ledger.DefaultFileName)
		garbage := []byte(strings.Repeat("not a bbolt file ", 512))
		if err := os.WriteFile(path, garbage, 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := newManager(cfg, newLauncher(t).launch)
		var sfe *ledger.StateFileError
		if !errors.Is(err, ledger.ErrCorrupt) || !errors.As(err, &sfe) || sfe.Recovery == "" || !strings.Contains(err.Error(), path) {
			t.Fatalf("New on a corrupt state file: %v; want the ledger's StateFileError naming the file and a recovery", err)
		}
		if got, _ := os.ReadFile(path); string(got) != string(garbage) {
			t.Errorf("the corrupt state file was changed")
		}
	})
	t.Run("in use", func(t *testing.T) {
		cfg, _ := durableConfig(t)
		first, _ := startInprocManager(t, cfg)
		_, err := newManager(cfg, newLauncher(t).launch)
		if !errors.Is(err, ledger.ErrLocked) {
			t.Fatalf("second New on the same state dir: %v, want ErrLocked", err)
		}
		if _, err := first.Reservations(context.Background(), device.ReservationFilter{}); err != nil {
			t.Errorf("the first manager after the refused second: %v", err)
		}
	})
}

// Without a state dir the manager runs on a ledger in a temporary directory, says so,
// and removes the directory on Shutdown.
func TestNoStateDirUsesATemporaryLedger(t *testing.T) {
	cfg, logs := testConfig(t)
	m, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0")))
	logs.waitLine(t, "[WARN]", "no state dir", "temporary ledger", "dir="+m.tempState)
	if m.tempState == "" || filepath.Dir(m.ledger.Path()) != m.tempState {
		t.Fatalf("ledger at %q, temporary dir %q; want the ledger in the temporary dir", m.ledger.Path(), m.tempState)
	}
	waitReady(t, m)
	r := reserve(t, m, "o1", "a0")
	if got, err := m.ledger.Get(r.ID); err != nil || got.OwnerID != "o1" {
		t.Errorf("ledger has %+v, %v; want the reservation", got, err)
	}
	shutdown(t, m) // and again in t.Cleanup: Shutdown may be called twice
	if _, err := os.Stat(m.tempState); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("temporary state dir after Shutdown: %v, want it removed", err)
	}
}

// TestReserveConflicts checks the conflict rules and the holders through the manager,
// without a state dir (a temporary ledger) and with one.
func TestReserveConflicts(t *testing.T) {
	for _, durable := range []bool{false, true} {
		t.Run(map[bool]string{false: "temporary", true: "state-dir"}[durable], func(t *testing.T) {
			cfg, _ := testConfig(t)
			if durable {
				cfg.StateDir = t.TempDir()
			}
			alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1", "a2"))
			m, _ := startInprocManager(t, cfg, alpha)
			waitReady(t, m)
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
			defer cancel()
			watch := m.Watch(ctx)
			<-watch // the current snapshot

			r1 := reserve(t, m, "o1", "a0", "a1")
			want := device.Holder{ReservationID: r1.ID, OwnerID: "o1"}
			waitWithin(t, watch, testwait.Timeout, "a0 and a1 held by r1", func(s device.Snapshot) bool {
				h0, h1 := s.State.Devices["a0"].Holder, s.State.Devices["a1"].Holder
				return h0 != nil && *h0 == want && h1 != nil && *h1 == want && s.State.Devices["a2"].Holder == nil
			})
			calls := alpha.reserveCalls()

			tests := []struct {
				name     string
				owner    string
				ids      []string
				wantText []string
			}{
				{"held by another owner", "o2", []string{"a1"}, []string{"a1", r1.ID, "o1"}},
				{"partial overlap by the same owner", "o1", []string{"a1", "a2"}, []string{"a1", r1.ID}},
				{"subset by the same owner", "o1", []string{"a0"}, []string{"a0", r1.ID}},
			}
			for _, tc := range tests {
				_, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: tc.owner, Group: acmeA1, DeviceIDs: tc.ids})
				if !errors.Is(err, device.ErrDeviceHeld) {
					t.Errorf("%s: Reserve = %v, want ErrDeviceHeld", tc.name, err)
					continue
				}
				for _, s := range tc.wantText {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("%s: error %q does not name %q", tc.name, err, s)
					}
				}
				// The reservation ID is random hex and may itself contain "a2".
				if strings.Contains(strings.ReplaceAll(err.Error(), r1.ID, "<r1>"), "a2") {
					t.Errorf("%s: error %q names a2, which is free", tc.name, err)
				}
			}

			// A retry, devices in any order, gets r1 back without asking the plugin.
			again := reserve(t, m, "o1", "a1", "a0")
			if again.ID != r1.ID || !slices.Equal(again.DeviceIDs, r1.DeviceIDs) {
				t.Errorf("retried Reserve = %+v, want %+v", again, r1)
			}
			if got := alpha.reserveCalls(); got != calls {
				t.Errorf("plugin Reserve calls = %d after refusals and a retry, want %d", got, calls)
			}
			if list, err := m.Reservations(ctx, device.ReservationFilter{OwnerID: "o1"}); err != nil || len(list) != 1 {
				t.Errorf("Reservations(o1) = %+v, %v; want r1 only", list, err)
			}

			release(t, m, device.ReleaseRequest{ReservationID: r1.ID})
			waitWithin(t, watch, testwait.Timeout, "a0 and a1 free", func(s device.Snapshot) bool {
				return s.State.Devices["a0"].Holder == nil && s.State.Devices["a1"].Holder == nil
			})
			r2 := reserve(t, m, "o2", "a1")
			if h := m.State().Devices["a1"].Holder; h == nil || h.ReservationID != r2.ID || h.OwnerID != "o2" {
				t.Errorf("a1 holder = %v, want r2 of o2", h)
			}
		})
	}
}

// TestReservationsSurviveARestart reserves and releases, stops the manager (gracefully,
// or as a crash), starts another on the same state dir, and finds every reservation
// once, in its state, with its devices still held.
func TestReservationsSurviveARestart(t *testing.T) {
	for _, stop := range []string{"shutdown", "crash"} {
		t.Run(stop, func(t *testing.T) {
			cfg, _ := durableConfig(t)
			first, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1", "a2")))
			waitReady(t, first)
			r1 := reserve(t, first, "o1", "a0")
			r2 := reserve(t, first, "o2", "a1")
			r3 := reserve(t, first, "o3", "a2")
			release(t, first, device.ReleaseRequest{OwnerID: "o2"})
			if stop == "crash" {
				crash(t, first)
			} else {
				shutdown(t, first)
			}

			alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1", "a2"))
			second, _ := startInprocManager(t, cfg, alpha)
			all, err := second.Reservations(context.Background(), device.ReservationFilter{})
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, r := range all {
				got = append(got, r.ID+"/"+r.OwnerID+"/"+r.State.String())
			}
			want := []string{r1.ID + "/o1/active", r2.ID + "/o2/released", r3.ID + "/o3/active"}
			if !slices.Equal(got, want) {
				t.Errorf("reservations after a restart = %v, want %v", got, want)
			}
			if i := slices.IndexFunc(all, func(r device.Reservation) bool { return r.ID == r1.ID }); i < 0 ||
				all[i].Container.Envs["FAKE_VISIBLE_DEVICES"] != "a0" {
				t.Errorf("r1 after a restart = %+v, want its container reservation", all)
			}

			snap := waitSnapshot(t, second, "a0 held by r1 after the restart", func(s device.Snapshot) bool {
				h := s.State.Devices["a0"].Holder
				return h != nil && *h == device.Holder{ReservationID: r1.ID, OwnerID: "o1"}
			})
			if h := snap.State.Devices["a1"].Holder; h != nil {
				t.Errorf("a1 (released) holder = %v, want none", h)
			}
			_, err = second.Reserve(context.Background(), device.ReserveRequest{OwnerID: "o9", Group: acmeA1, DeviceIDs: []string{"a0"}})
			if !errors.Is(err, device.ErrDeviceHeld) || !strings.Contains(err.Error(), r1.ID) || !strings.Contains(err.Error(), "o1") {
				t.Errorf("Reserve of a0 by another owner after the restart = %v, want ErrDeviceHeld naming %s of o1", err, r1.ID)
			}
			if again := reserve(t, second, "o1", "a0"); again.ID != r1.ID || alpha.reserveCalls() != 0 {
				t.Errorf("retried Reserve after the restart = %s with %d plugin calls, want %s with none", again.ID, alpha.reserveCalls(), r1.ID)
			}
		})
	}
}

func TestGCCleansUpThroughThePlugin(t *testing.T) {
	cfg, _ := durableConfig(t)
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	r := reserve(t, m, "o1", "a0", "a1")
	var gotIDs []string
	alpha.set(func(f *fakeDevices) {
		f.release = func(_ context.Context, id string, ids []string) error {
			gotIDs = append(slices.Clone(ids), id) // before Release records id under f.mu; read after waitReleased saw it
			return nil
		}
	})
	if got := release(t, m, device.ReleaseRequest{OwnerID: "o1"}); !slices.Equal(got.Released, []string{r.ID}) || len(got.AlreadyReleased) != 0 {
		t.Fatalf("Release = %+v, want [%s] released now", got, r.ID)
	}
	if got := alpha.waitReleased(t, r.ID); !slices.Equal(got, []string{r.ID}) {
		t.Errorf("plugin cleanups = %v, want [%s] once", got, r.ID)
	}
	if want := []string{"a0", "a1", r.ID}; !slices.Equal(gotIDs, want) {
		t.Errorf("plugin Release got devices and ID %v, want %v", gotIDs, want)
	}
	waitReservation(t, m, r.ID, "cleaned up", cleanedUp)
	// Releasing it again names it as released before and owes no second cleanup.
	if got := release(t, m, device.ReleaseRequest{ReservationID: r.ID}); len(got.Released) != 0 || !slices.Equal(got.AlreadyReleased, []string{r.ID}) {
		t.Errorf("second Release = %+v, want [%s] already released", got, r.ID)
	}
	if got, _ := reservation(t, m, r.ID); got.CleanupPending {
		t.Errorf("after a second Release: %+v, want no cleanup pending", got)
	}
}

// TestCleanupLeavesOutDevicesWithNothingToRelease: the GC's cleanup of a reservation
// whose devices all say the plugin keeps nothing for them (a whole GPU) is done without
// calling the plugin's Release; one with such a device and another gets the call for
// the other device alone.
func TestCleanupLeavesOutDevicesWithNothingToRelease(t *testing.T) {
	cfg, _ := durableConfig(t)
	g := group("acme", "gpu", "A1", "a0", "a1", "a2")
	g.Devices[0].NothingToRelease, g.Devices[1].NothingToRelease = true, true
	alpha := newFakeDevices("alpha", g)
	var mu sync.Mutex
	var calls [][]string
	alpha.set(func(f *fakeDevices) {
		f.release = func(_ context.Context, _ string, ids []string) error {
			mu.Lock()
			defer mu.Unlock()
			calls = append(calls, ids)
			return nil
		}
	})
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	bare := reserve(t, m, "o1", "a0")
	mixed := reserve(t, m, "o2", "a1", "a2")
	release(t, m, device.ReleaseRequest{ReservationID: bare.ID})
	waitReservation(t, m, bare.ID, "cleaned up", cleanedUp)
	release(t, m, device.ReleaseRequest{ReservationID: mixed.ID})
	if got := alpha.waitReleased(t, mixed.ID); !slices.Equal(got, []string{mixed.ID}) {
		t.Errorf("plugin cleanups = %v; want [%s] alone (%s holds nothing the plugin keeps)", got, mixed.ID, bare.ID)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 1 || !slices.Equal(calls[0], []string{"a2"}) {
		t.Errorf("plugin Release calls with devices %v; want one, with a2 alone", calls)
	}
}

// TestGCCleanupWaitsForThePlugin releases while the plugin is down: the cleanup stays
// pending (never dropped) and runs once the plugin is back. The GC's own retry is an
// hour away, so only the plugin's return can make it run within the test.
func TestGCCleanupWaitsForThePlugin(t *testing.T) {
	cfg, logs := durableConfig(t)
	cfg.gcRetryMin = time.Hour
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0"))
	m, l := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	r := reserve(t, m, "o1", "a0")

	alpha.set(func(f *fakeDevices) { f.launchErr = "plugin binary missing" })
	p, _ := l.latest("alpha")
	p.exit("signal: killed")
	waitSnapshot(t, m, "alpha down", func(s device.Snapshot) bool { return pluginOf(s, "alpha").Status != device.PluginRunning })

	release(t, m, device.ReleaseRequest{ReservationID: r.ID})
	logs.waitLine(t, "reservation cleanup failed; will retry", "reservation_id="+r.ID, "not running")
	if got, _ := reservation(t, m, r.ID); !got.CleanupPending {
		t.Errorf("while the plugin is down: %+v, want the cleanup pending", got)
	}

	alpha.set(func(f *fakeDevices) { f.launchErr = "" })
	if got := alpha.waitReleased(t, r.ID); !slices.Equal(got, []string{r.ID}) {
		t.Errorf("plugin cleanups = %v, want [%s] once", got, r.ID)
	}
	waitReservation(t, m, r.ID, "cleaned up", cleanedUp)
}

// TestGCParallelDestroysBoundsPluginCleanups releases many reservations at once and
// holds every plugin cleanup until the test lets it go: GCParallelDestroys of them, and
// never more, are in flight at once.
func TestGCParallelDestroysBoundsPluginCleanups(t *testing.T) {
	const parallel, n = 3, 8
	cfg, _ := durableConfig(t)
	cfg.GCParallelDestroys = parallel
	cfg.ReserveTimeout = testwait.Timeout // cleanups wait for the test, not their deadline
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("a%d", i)
	}
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", ids...))
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	var rids []string
	for _, id := range ids {
		rids = append(rids, reserve(t, m, "o1", id).ID)
	}

	var mu sync.Mutex
	inflight, most := 0, 0
	entered := make(chan struct{}, n)
	gate := make(chan struct{})
	alpha.set(func(f *fakeDevices) {
		f.release = func(ctx context.Context, _ string, _ []string) error {
			mu.Lock()
			inflight++
			most = max(most, inflight)
			mu.Unlock()
			defer func() {
				mu.Lock()
				inflight--
				mu.Unlock()
			}()
			select {
			case entered <- struct{}{}:
			case <-ctx.Done():
				return ctx.Err()
			}
			select {
			case <-gate:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	})
	release(t, m, device.ReleaseRequest{OwnerID: "o1"})
	deadline := time.NewTimer(testwait.Timeout)
	defer deadline.Stop()
	for range parallel {
		select {
		case <-entered:
		case <-deadline.C:
			t.Fatalf("fewer than %d plugin cleanups in flight within %v", parallel, testwait.Timeout)
		}
	}
	for i := range n {
		select {
		case gate <- struct{}{}:
		case <-deadline.C:
			t.Fatalf("cleanup %d of %d never started", i+1, n)
		}
	}
	alpha.waitReleased(t, rids...)
	mu.Lock()
	defer mu.Unlock()
	if most != parallel {
		t.Errorf("at most %d plugin cleanups in flight at once, want %d (GCParallelDestroys)", most, parallel)
	}
}

func TestGCConfigReachesTheCollector(t *testing.T) {
	t.Run("max reservations", func(t *testing.T) {
		cfg, logs := durableConfig(t)
		cfg.GCMaxReservations = 1
		m, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1")))
		waitReady(t, m)
		reserve(t, m, "o1", "a0")
		reserve(t, m, "o2", "a1")
		line := logs.waitLine(t, "garbage collection due to number of reservations (2) is over the limit (1) skipped because no released reservations")
		if !strings.Contains(line, "[INFO]") {
			t.Errorf("skip line %q, want it at INFO", line)
		}
	})
	t.Run("interval", func(t *testing.T) {
		cfg, logs := durableConfig(t)
		cfg.GCInterval = 100 * time.Millisecond
		m, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0")))
		waitReady(t, m)
		r := reserve(t, m, "o1", "a0")
		release(t, m, device.ReleaseRequest{ReservationID: r.ID})
		waitReservation(t, m, r.ID, "garbage-collected", func(_ device.Reservation, listed bool) bool { return !listed })
		if n := len(logs.lines("marked for GC", "reservation_id="+r.ID)); n != 1 {
			t.Errorf("%d \"marked for GC\" lines for %s, want 1", n, r.ID)
		}
	})
}

// TestGCSkipsCleanupsOfPluginsNoLongerConfigured starts on a ledger holding a released
// reservation of a plugin that is not configured any more: it is logged once and
// counted as cleaned up.
func TestGCSkipsCleanupsOfPluginsNoLongerConfigured(t *testing.T) {
	cfg, logs := durableConfig(t)
	l, err := ledger.Open(filepath.Join(cfg.StateDir, ledger.DefaultFileName), ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, _, err := l.Reserve(ctx, device.Reservation{ID: "res-old", OwnerID: "o1", Plugin: "gone", Group: acmeA1, DeviceIDs: []string{"x0"}}, nil, nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Release(ctx, device.ReleaseRequest{ReservationID: "res-old"}, time.Time{}); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	m, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0")))
	waitReservation(t, m, "res-old", "cleaned up", cleanedUp)
	lines := logs.lines("[WARN]", "plugin cleanup of a released reservation skipped", "plugin=gone", "reservation_id=res-old")
	if len(lines) != 1 {
		t.Errorf("skip lines = %q, want one", lines)
	}
}
