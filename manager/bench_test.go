package manager

import (
	"context"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/gc"
	"github.com/devicehost/devicehost/manager/ledger"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Set TMPDIR to the filesystem to measure: every state file lives in b.TempDir.

var benchKey = device.GroupKey{Vendor: "bench", Type: "widget", Name: "Widget"}

// startBenchManager starts a durable manager on stateDir (a fresh temp dir when empty)
// with one in-process plugin "bench" owning devs, and waits for its first fingerprint
// and for its GC to have taken in the ledger: one Reserve+Release cycle on devs[0]
// whose plugin cleanup has run. A run measured after it does not pay for start-up.
func startBenchManager(b *testing.B, stateDir string, gcMax int, devs ...string) (*Manager, *launcher) {
	b.Helper()
	cfg, _ := testConfig(b)
	cfg.Logger = hclog.NewNullLogger()
	cfg.StateDir = stateDir
	if cfg.StateDir == "" {
		cfg.StateDir = b.TempDir()
	}
	cfg.GCMaxReservations = gcMax
	cfg.GCInterval = time.Hour // no interval pass during a run: only the limit collects
	plugin := newFakeDevices("bench", group(benchKey.Vendor, benchKey.Type, benchKey.Name, devs...))
	m, l := startInprocManager(b, cfg, plugin)
	ctx := context.Background()
	if _, err := m.WaitForFirstFingerprint(ctx); err != nil {
		b.Fatal(err)
	}
	r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "warm-up", Group: benchKey, DeviceIDs: devs[:1]})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := m.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}); err != nil {
		b.Fatal(err)
	}
	deadline := time.After(time.Minute)
	for {
		plugin.mu.Lock()
		done, ch := slices.Contains(plugin.released, r.ID), plugin.releasedCh
		plugin.mu.Unlock()
		if done {
			return m, l
		}
		select {
		case <-ch:
		case <-deadline:
			b.Fatal("the GC did not clean up after the warm-up reservation within a minute")
		}
	}
}

// processCPU is the CPU time (user + system) this process has used so far.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cleanups returns how many plugin cleanups (Release calls) the bench plugin has done.
func cleanups(l *launcher) int {
	f := l.devices["bench"]
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.released)
}

// cycle is one Reserve of dev for owner and the Release of that reservation.
func cycle(ctx context.Context, m *Manager, owner, dev string) error {
	r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: owner, Group: benchKey, DeviceIDs: []string{dev}})
	if err != nil {
		return err
	}
	_, err = m.Release(ctx, device.ReleaseRequest{ReservationID: r.ID})
	return err
}

// BenchmarkReserveRelease measures what the allocation runtime sees: one op is a Reserve
// (validate, route to the plugin over gRPC, validate its answer, fsync into the ledger)
// and the Release of that reservation (fsync), on a durable ledger, with 1 and 64
// concurrent callers, each cycling its own device. The plugin runs in-process over gRPC;
// GC cleanups run alongside as they would in production. Besides cycles/s it reports
// durable batches per cycle (each one bbolt commit), the CPU time of the whole test process per cycle (caller, manager, GC and
// plugin together), and plugin cleanups done per cycle during the run (below 1, the GC
// fell behind and left work for later, which the CPU figure then does not include).
func BenchmarkReserveRelease(b *testing.B) {
	for _, callers := range []int{1, 64} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			ids := make([]string, callers)
			for i := range ids {
				ids[i] = fmt.Sprintf("dev-%d", i)
			}
			m, l := startBenchManager(b, "", 0, ids...)
			ctx := context.Background()

			var next atomic.Int64
			var wg sync.WaitGroup
			commits0, cpu0, cleanups0 := m.ledger.Commits(), processCPU(b), cleanups(l)
			b.ResetTimer()
			for c := range callers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						i := next.Add(1)
						if i > int64(b.N) {
							return
						}
						if err := cycle(ctx, m, fmt.Sprintf("alloc-%d", i), ids[c]); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cycles/s")
			b.ReportMetric(float64(m.ledger.Commits()-commits0)/float64(b.N), "commits/cycle")
			b.ReportMetric(float64((processCPU(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/cycle")
			b.ReportMetric(float64(cleanups(l)-cleanups0)/float64(b.N), "cleanups/cycle")
		})
	}
}

// BenchmarkReserveFloor compares, at one caller, the host's Reserve latency (through
// the manager, the plugin in-process over gRPC, a durable ledger) with its floor: the
// same plugin's Reserve called directly over the same gRPC connection plus a bare bbolt
// commit (one small put, fsync on) on the same filesystem. Each iteration times all
// three, interleaved, so they see the same machine; the host's Release follows
// untimed. The ledger starts full: 1,000 released reservations, the default
// GCMaxReservations, as on a host that has been busy for a while. It reports the medians
// and host/floor as "x-floor".
func BenchmarkReserveFloor(b *testing.B) {
	dir := b.TempDir()
	prefillLedger(b, filepath.Join(dir, ledger.DefaultFileName), gc.DefaultMaxReservations)
	m, l := startBenchManager(b, dir, gc.DefaultMaxReservations, "dev-0")
	p, _ := l.latest("bench")
	db, err := bolt.Open(filepath.Join(b.TempDir(), "floor.db"), 0o600, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	if err := db.Update(func(tx *bolt.Tx) error { _, err := tx.CreateBucket([]byte("b")); return err }); err != nil {
		b.Fatal(err)
	}
	value := make([]byte, 300) // about a reservation record
	ctx := context.Background()
	var host, plugin, commit []time.Duration
	i := 0
	for b.Loop() {
		i++
		start := time.Now()
		if _, err := p.Client().Reserve(ctx, &pb.ReserveRequest{DeviceIds: []string{"dev-0"}}); err != nil {
			b.Fatal(err)
		}
		plugin = append(plugin, time.Since(start))

		start = time.Now()
		err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("b")).Put(fmt.Appendf(nil, "k%d", i), value) })
		if err != nil {
			b.Fatal(err)
		}
		commit = append(commit, time.Since(start))

		start = time.Now()
		r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: fmt.Sprintf("alloc-%d", i), Group: benchKey, DeviceIDs: []string{"dev-0"}})
		if err != nil {
			b.Fatal(err)
		}
		host = append(host, time.Since(start))
		if _, err := m.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}); err != nil {
			b.Fatal(err)
		}
	}
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	hostP50, pluginP50, commitP50 := median(host), median(plugin), median(commit)
	b.ReportMetric(us(hostP50), "reserve-p50-µs")
	b.ReportMetric(us(pluginP50), "plugin-p50-µs")
	b.ReportMetric(us(commitP50), "commit-p50-µs")
	b.ReportMetric(float64(hostP50)/float64(pluginP50+commitP50), "x-floor")
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkCycleLedgerSize measures the cost of a Reserve+Release cycle at one caller
// as the ledger fills: the state file starts with N released (and cleaned up)
// reservations and GCMaxReservations is N, so every cycle puts the ledger over the limit
// and the GC deletes the oldest one, as on a busy host at steady state. It reports the
// test process's CPU time per cycle (caller, manager, GC and plugin together) and
// commits and plugin cleanups per cycle; the CPU should not grow with N.
func BenchmarkCycleLedgerSize(b *testing.B) {
	for _, n := range []int{1000, 100_000} {
		b.Run(fmt.Sprintf("reservations=%d", n), func(b *testing.B) {
			dir := b.TempDir()
			prefillLedger(b, filepath.Join(dir, ledger.DefaultFileName), n)
			m, l := startBenchManager(b, dir, n, "dev-0")
			ctx := context.Background()
			if c := m.ledger.Counts(); c.Total < n || c.Live != 0 {
				b.Fatalf("prefilled ledger holds %+v, want %d released", c, n)
			}
			runtime.GC() // the garbage of loading the ledger is not the steady state measured
			i := 0
			commits0, cpu0, cleanups0 := m.ledger.Commits(), processCPU(b), cleanups(l)
			for b.Loop() {
				i++
				if err := cycle(ctx, m, fmt.Sprintf("alloc-%d", i), "dev-0"); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64((processCPU(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/cycle")
			b.ReportMetric(float64(m.ledger.Commits()-commits0)/float64(b.N), "commits/cycle")
			b.ReportMetric(float64(cleanups(l)-cleanups0)/float64(b.N), "cleanups/cycle")
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cycles/s")
		})
	}
}

// prefillLedger writes n released, cleaned-up reservations of plugin "bench" (on
// devices the plugin does not report) into a new ledger at path, many at a time so
// that they share commits.
func prefillLedger(b *testing.B, path string, n int) {
	b.Helper()
	l, err := ledger.Open(path, ledger.Options{})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 256 {
		wg.Go(func() {
			for i := next.Add(1); i <= int64(n); i = next.Add(1) {
				r, _, err := l.Reserve(ctx, device.Reservation{
					OwnerID: fmt.Sprintf("old-%d", i), Group: benchKey, Plugin: "bench",
					DeviceIDs: []string{fmt.Sprintf("old-dev-%d", i)},
				}, nil, nil)
				if err == nil {
					_, _, err = l.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}, time.Time{})
				}
				if err == nil {
					err = l.CleanupDone(ctx, r.ID)
				}
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := l.Close(); err != nil {
		b.Fatal(err)
	}
}
