package nvidia

import (
	"context"
	"testing"
	"time"

	"github.com/devicehost/devicehost/validate"
)

// What the plugin sends passes the host's own checks, on every simulated machine and
// with a GPU unhealthy.
func TestOutputPassesHostValidation(t *testing.T) {
	for _, m := range machineNames() {
		t.Run(m, func(t *testing.T) {
			p, clk := newTestPlugin(t, Config{Simulate: m,
				InjectFaults: []FaultConfig{{GPUIndex: ptr(1), XID: 79, After: "1s"}}})
			fp := startFingerprint(t, p)
			if err := validate.Fingerprint(fp.next(t)); err != nil {
				t.Errorf("fingerprint: %v", err)
			}
			clk.Advance(time.Second)
			resp := fp.next(t)
			if err := validate.Fingerprint(resp); err != nil {
				t.Errorf("fingerprint with an unhealthy GPU: %v", err)
			}
			known := devices(resp)
			stats := startStats(t, p, time.Second).next(t)
			if err := validate.Stats(stats, func(id string) bool { _, ok := known[id]; return ok }); err != nil {
				t.Errorf("stats: %v", err)
			}
			ids := []string{simulatedUUID(m, 7), simulatedUUID(m, 0)}
			res, err := p.Reserve(context.Background(), ids)
			if err != nil {
				t.Fatalf("Reserve: %v", err)
			}
			if err := validate.Reservation(res, ids); err != nil {
				t.Errorf("reservation: %v", err)
			}
		})
	}
}
