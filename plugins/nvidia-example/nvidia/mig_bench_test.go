package nvidia

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/hashicorp/go-hclog"
)

// BenchmarkPartitionCycle is the plugin's own share of a partition's Reserve+Release on
// an on-demand DGX H100: create and destroy one 1g.10gb instance on GPU 7, with none
// or 49 (seven on each other GPU) held, without and with a CDI spec to keep in step.
// Its cost should not grow with the instances held elsewhere; compare the held=0 and
// held=49 rows (scripts/bench's partition ratio is the host's view of the same).
func BenchmarkPartitionCycle(b *testing.B) {
	for _, cdiOn := range []bool{false, true} {
		for _, held := range []int{0, 49} {
			name := fmt.Sprintf("cdi=%t/held=%d", cdiOn, held)
			b.Run(name, func(b *testing.B) {
				cfg := Config{Simulate: "dgxh100", MIG: MIGOnDemand, SimStateFile: ptr("")}
				if cdiOn {
					cfg.CDISpecDir = ptr(b.TempDir())
				}
				raw, err := json.Marshal(cfg)
				if err != nil {
					b.Fatal(err)
				}
				p := New(hclog.NewNullLogger())
				b.Cleanup(p.Close)
				ctx := context.Background()
				if err := p.SetConfig(ctx, raw); err != nil {
					b.Fatal(err)
				}
				for g := 0; g < held/7; g++ {
					for _, id := range onDemandIDs(g, "1g.10gb", 0, 1, 2, 3, 4, 5, 6) {
						if _, err := p.Reserve(ctx, []string{id}); err != nil {
							b.Fatal(err)
						}
					}
				}
				id := onDemandIDs(7, "1g.10gb", 0)
				for b.Loop() {
					if _, err := p.Reserve(ctx, id); err != nil {
						b.Fatal(err)
					}
					if err := p.Release(ctx, "", id); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
