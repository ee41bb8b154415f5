package manager

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/tools/testwait"
)

// LatestStats reads the latest samples the plugins' own stats streams brought: however
// often it is called, no plugin is asked for anything more (one stats stream each).
func TestLatestStatsAsksNoPlugin(t *testing.T) {
	alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, alpha)
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	waitStats(t, m.WatchStats(ctx, 0), func(s device.StatsSnapshot) bool {
		return statValue(s, "a0", "seq") >= 3
	}, "seq 3 of a0")

	for i := range 1000 {
		s := m.LatestStats()
		if got := statValue(s, "a0", "seq"); got < 3 {
			t.Fatalf("LatestStats call %d: seq of a0 = %d, want at least 3 (what WatchStats already delivered)", i, got)
		}
		if got := statValue(s, "a1", "seq"); got < 1 {
			t.Fatalf("LatestStats call %d: no stats of a1", i)
		}
		if len(s.Groups) != 1 || s.Groups[0].Plugin != "alpha" || s.Groups[0].GroupKey != acmeA1 {
			t.Fatalf("LatestStats groups = %+v, want the one group of alpha", s.Groups)
		}
	}
	if got := alpha.streams(); got != 1 {
		t.Errorf("the plugin saw %d stats streams after 1000 LatestStats calls, want 1", got)
	}
	// It moves with the samples.
	first := statValue(m.LatestStats(), "a0", "seq")
	waitStats(t, m.WatchStats(ctx, 0), func(s device.StatsSnapshot) bool {
		return statValue(s, "a0", "seq") > first
	}, "a newer sample than seq %d", first)
	if got := statValue(m.LatestStats(), "a0", "seq"); got <= first {
		t.Errorf("LatestStats seq = %d after a newer sample was delivered, want more than %d", got, first)
	}
}

// Config.OnLedgerCommit hears of the commits a Reserve and a Release make, before they
// return.
func TestOnLedgerCommit(t *testing.T) {
	var mu sync.Mutex
	var writes []int
	var took []time.Duration
	cfg, _ := durableConfig(t)
	cfg.OnLedgerCommit = func(d time.Duration, n int) {
		mu.Lock()
		defer mu.Unlock()
		writes = append(writes, n)
		took = append(took, d)
	}
	commits := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(writes)
	}
	m, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0")))
	waitReady(t, m)

	before := commits()
	r := reserve(t, m, "job-1", "a0")
	afterReserve := commits()
	if afterReserve <= before {
		t.Errorf("OnLedgerCommit called %d times before Reserve returned, %d after: want more", before, afterReserve)
	}
	release(t, m, device.ReleaseRequest{ReservationID: r.ID})
	if got := commits(); got <= afterReserve {
		t.Errorf("OnLedgerCommit called %d times before Release returned, %d after: want more", afterReserve, got)
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range writes {
		if writes[i] < 1 || took[i] <= 0 {
			t.Errorf("commit %d: %d writes in %v, want at least 1 in more than 0", i, writes[i], took[i])
		}
	}
}
