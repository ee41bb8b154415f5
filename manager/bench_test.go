package manager

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/manager/device"
)

// BenchmarkReserveRelease measures what the allocation runtime sees: one op is a Reserve
// (validate, route to the plugin over gRPC, validate its answer, fsync into the ledger)
// and the Release of that reservation (fsync), on a durable ledger, with 1 and 64
// concurrent callers, each cycling its own device. The plugin runs in-process over gRPC;
// GC cleanups run alongside as they would in production.
func BenchmarkReserveRelease(b *testing.B) {
	for _, callers := range []int{1, 64} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			ids := make([]string, callers)
			for i := range ids {
				ids[i] = fmt.Sprintf("dev-%d", i)
			}
			cfg, _ := testConfig(b)
			cfg.Logger = hclog.NewNullLogger()
			cfg.StateDir = b.TempDir()
			key := device.GroupKey{Vendor: "bench", Type: "widget", Name: "Widget"}
			m, _ := startInprocManager(b, cfg, newFakeDevices("bench", group(key.Vendor, key.Type, key.Name, ids...)))
			ctx := context.Background()
			if _, err := m.WaitForFirstFingerprint(ctx); err != nil {
				b.Fatal(err)
			}

			var next atomic.Int64
			var wg sync.WaitGroup
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
						r, err := m.Reserve(ctx, device.ReserveRequest{
							OwnerID:   fmt.Sprintf("alloc-%d", i),
							Group:     key,
							DeviceIDs: []string{ids[c]},
						})
						if err != nil {
							b.Error(err)
							return
						}
						if _, err := m.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cycles/s")
		})
	}
}
