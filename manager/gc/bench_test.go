package gc

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger"
)

// BenchmarkCycleGC measures the ledger and its GC alone (no plugin, no gRPC) at one
// caller: one op is a Reserve and the Release of that reservation, with a GC running
// whose cleanup succeeds at once. The ledger starts with N released, cleaned-up
// reservations and MaxReservations is N, so every cycle puts it over the limit and the
// GC deletes the oldest. It reports the process's CPU time per cycle, which should not
// grow with N, commits per cycle, and the Go heap the N reservations take in the
// ledger's index and the GC (bytes and objects per reservation, after a collection):
// what Go's garbage collector marks on every cycle.
func BenchmarkCycleGC(b *testing.B) {
	for _, n := range []int{1000, 100_000} {
		b.Run(fmt.Sprintf("reservations=%d", n), func(b *testing.B) {
			heap0 := liveHeap()
			l, err := ledger.Open(b.TempDir()+"/"+ledger.DefaultFileName, ledger.Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			ctx := context.Background()
			var next atomic.Int64
			var wg sync.WaitGroup
			for range 256 {
				wg.Go(func() {
					for i := next.Add(1); i <= int64(n); i = next.Add(1) {
						r, _, err := l.Reserve(ctx, res(fmt.Sprint("old-", i), fmt.Sprint("old-GPU-", i)), nil, nil)
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

			g, err := New(l, Config{
				MaxReservations: n,
				Interval:        time.Hour,
				Cleanup:         func(context.Context, Entry) error { return nil },
			})
			if err != nil {
				b.Fatal(err)
			}
			firstPass := make(chan struct{})
			var once sync.Once
			g.onPass = func(bool) { once.Do(func() { close(firstPass) }) }
			gctx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- g.Run(gctx) }()
			<-firstPass // it has taken in the ledger: start-up is not measured
			// Nor is the garbage of filling the ledger: collected here.
			heap1 := liveHeap()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					b.Error(err)
				}
			}()

			i := 0
			commits0, cpu0 := l.Commits(), processCPU(b)
			for b.Loop() {
				i++
				r, _, err := l.Reserve(ctx, res(fmt.Sprint("owner-", i), "GPU-0"), nil, nil)
				if err != nil {
					b.Fatal(err)
				}
				if _, _, err := l.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}, time.Time{}); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64((processCPU(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/cycle")
			b.ReportMetric(float64(l.Commits()-commits0)/float64(b.N), "commits/cycle")
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cycles/s")
			b.ReportMetric(float64(heap1.bytes-heap0.bytes)/float64(n), "heap-B/reservation")
			b.ReportMetric(float64(heap1.objects-heap0.objects)/float64(n), "heap-objs/reservation")
		})
	}
}

// heapUse is the live Go heap.
type heapUse struct{ bytes, objects int64 }

// liveHeap collects garbage and returns the heap that is left.
func liveHeap() heapUse {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return heapUse{int64(ms.HeapAlloc), int64(ms.HeapObjects)}
}

// processCPU is the CPU time (user + system) this process has used so far.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
