package supervise

import (
	"context"
	"time"

	"github.com/devicehost/devicehost/backoff"
)

// restartBackoff is a supervisor's delay between runs (of the plugin, or of its stats
// stream): a backoff.Backoff that starts over at its base after a run that lasted at
// least stable, or that served (after its first good fingerprint) for at least served.
// So a plugin that crash-loops before it ever serves backs off, and one killed after it
// served restarts at once. It is owned by one goroutine and not safe for concurrent use.
type restartBackoff struct {
	backoff.Backoff
	stable time.Duration
	served time.Duration // zero: serving never resets
}

// next records a failed run that lasted ran, of which it served for served, and returns
// how long to wait before the next attempt.
func (b *restartBackoff) next(ran, served time.Duration) time.Duration {
	if ran >= b.stable || b.served > 0 && served >= b.served {
		b.Reset()
	}
	return b.Next()
}

// sleep waits for d to pass or ctx to end, and reports whether d passed (false: ctx
// ended first).
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	select {
	case <-ctx.Done():
		t.Stop()
		return false
	case <-t.C:
		return true
	}
}
