package ledger

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
)

// Set TMPDIR to the filesystem to measure: every state file lives in b.TempDir.

// BenchmarkReserve measures durable Reserve throughput (fsync on, one new reservation
// per op) with 1 and 64 concurrent callers. With group commit the 64-caller run should
// reach many times the single caller's reservations/s, since callers share fsyncs.
func BenchmarkReserve(b *testing.B) {
	for _, callers := range []int{1, 64} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			l, err := Open(b.TempDir()+"/"+DefaultFileName, Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			ctx := context.Background()
			var next atomic.Int64
			var wg sync.WaitGroup
			commits0 := l.Commits()
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
						dev := fmt.Sprintf("GPU-%d", i)
						if _, _, err := l.Reserve(ctx, res(fmt.Sprintf("owner-%d", c), dev), nil, nil); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "reservations/s")
			b.ReportMetric(float64(b.N)/float64(l.Commits()-commits0), "reservations/commit")
		})
	}
}

// BenchmarkReserveEvents compares a durable Reserve with the audit trail on (its event
// written in the Reserve's own transaction, at the default bound, so the trail is full
// and each event also drops the oldest) and off, interleaved at one caller so that both
// see the same machine; each Reserve's Release follows untimed. It reports the medians
// and on/off as "x-off" (the goal: at most 1.10).
func BenchmarkReserveEvents(b *testing.B) {
	open := func(maxEvents int) *Ledger {
		l, err := Open(b.TempDir()+"/"+DefaultFileName, Options{MaxEvents: maxEvents})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { l.Close() })
		return l
	}
	on, off := open(DefaultMaxEvents), open(-1)
	ctx := device.WithCaller(context.Background(), `listener "main" uid=0,gid=0,pid=1`)
	// Fill the trail to its bound, so that every event measured also drops one.
	for i := range DefaultMaxEvents {
		r, _, err := on.Reserve(ctx, res(fmt.Sprintf("fill-%d", i), "GPU-fill"), nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		if _, _, err := on.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}, time.Time{}); err != nil {
			b.Fatal(err)
		}
		if i%1000 == 999 {
			if err := on.Delete(ctx, deletable(on)...); err != nil {
				b.Fatal(err)
			}
		}
	}
	cycle := func(l *Ledger, i int) time.Duration {
		start := time.Now()
		r, _, err := l.Reserve(ctx, res(fmt.Sprintf("owner-%d", i), "GPU-0"), nil, nil)
		took := time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		if _, _, err := l.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}, time.Time{}); err != nil {
			b.Fatal(err)
		}
		return took
	}
	tOn, tOff := make([]time.Duration, 0, b.N), make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		if i%2 == 0 {
			tOn = append(tOn, cycle(on, i))
			tOff = append(tOff, cycle(off, i))
		} else {
			tOff = append(tOff, cycle(off, i))
			tOn = append(tOn, cycle(on, i))
		}
	}
	b.StopTimer()
	mOn, mOff := median(tOn), median(tOff)
	b.ReportMetric(float64(mOn.Microseconds()), "on-µs")
	b.ReportMetric(float64(mOff.Microseconds()), "off-µs")
	b.ReportMetric(float64(mOn)/float64(mOff), "x-off")
}

// deletable is the IDs of l's released reservations whose cleanup is done or pending:
// all of them, deleted as the GC would once cleaned.
func deletable(l *Ledger) []string {
	var ids []string
	for _, r := range l.PendingCleanups() {
		ids = append(ids, r.ID)
	}
	for _, id := range ids {
		_ = l.CleanupDone(context.Background(), id)
	}
	return ids
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}
