package nvidia

import (
	"context"
	"encoding/json"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
)

// BenchmarkMPSReserve is the plugin's own part of an MPS share's Reserve+Release
// against a whole GPU's, in one run, taking turns: with isolation "shared" and the
// device's daemon already running (another holder keeps it up), a share needs no
// process; its ratio to the whole GPU's is the figure to read (goal <= 1.3). The first
// share's cycle, which starts and stops the daemon (two control client runs and the
// daemon's own start), is reported apart, and so is a per-holder share's, which always
// starts a daemon of its own. The simulated daemon is this test binary.
func BenchmarkMPSReserve(b *testing.B) {
	dir, err := os.MkdirTemp("", "mpsb")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	ctx := context.Background()
	setup := func(b *testing.B, isolation string) *Plugin {
		raw, err := json.Marshal(Config{Simulate: "dgxh100", SimStateFile: ptr(""), Replicas: 4, Sharing: SharingModes{SharingMPS}, MPSIsolation: isolation, MPSDir: dir})
		if err != nil {
			b.Fatal(err)
		}
		p := New(hclog.NewNullLogger())
		if err := p.SetConfig(ctx, raw); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() {
			releaseAllShares(p)
			p.Close()
		})
		return p
	}
	cycle := func(b *testing.B, p *Plugin, ids ...string) time.Duration {
		start := time.Now()
		if _, err := p.Reserve(ctx, ids); err != nil {
			b.Fatal(err)
		}
		if err := p.Release(ctx, "", ids); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	p50 := func(d []time.Duration) float64 {
		slices.Sort(d)
		return float64(d[len(d)/2].Nanoseconds()) / 1e3
	}
	gpu0 := simulatedUUID("dgxh100", 0)

	b.Run("shared/daemon-running", func(b *testing.B) {
		p := setup(b, MPSShared)
		if _, err := p.Reserve(ctx, []string{mpsShareID(gpu0, 0)}); err != nil {
			b.Fatal(err)
		}
		var whole, share []time.Duration
		for b.Loop() {
			whole = append(whole, cycle(b, p, simulatedUUID("dgxh100", 1)))
			share = append(share, cycle(b, p, mpsShareID(gpu0, 1)))
		}
		w, s := p50(whole), p50(share)
		b.ReportMetric(w, "whole-p50-µs")
		b.ReportMetric(s, "share-p50-µs")
		b.ReportMetric(s/w, "share/whole")
	})
	for _, isolation := range []string{MPSShared, MPSPerHolder} {
		b.Run(isolation+"/daemon-start", func(b *testing.B) {
			p := setup(b, isolation)
			var first []time.Duration
			for b.Loop() {
				first = append(first, cycle(b, p, mpsShareID(gpu0, 2)))
			}
			b.ReportMetric(p50(first)/1e3, "cycle-p50-ms")
		})
	}
}
