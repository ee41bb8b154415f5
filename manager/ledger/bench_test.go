package ledger

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
)

// BenchmarkReserve measures durable Reserve throughput (fsync on, one new reservation
// per op) with 1 and 64 concurrent callers. With group commit the 64-caller run should
// reach many times the single caller's reservations/s, since callers share fsyncs.
// Set TMPDIR to the filesystem to measure: the state file lives in b.TempDir.
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
			commits0 := l.commits.Load()
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
						if _, _, err := l.Reserve(ctx, res(fmt.Sprintf("owner-%d", c), dev)); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "reservations/s")
			b.ReportMetric(float64(b.N)/float64(l.commits.Load()-commits0), "reservations/commit")
		})
	}
}
