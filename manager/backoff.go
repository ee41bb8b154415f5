package manager

import (
	"context"
	"math/rand/v2"
	"time"
)

// jitterFraction is the ± spread applied to every backoff delay.
const jitterFraction = 0.2

// backoff computes restart delays: base, 2×base, 4×base ... capped at max, each spread by
// ±20% jitter, and reset to base after a run that lasted at least stable, or that served
// (after its first good fingerprint) for at least served: a plugin that crash-loops
// before it ever serves backs off, one killed after it served restarts at once. It is
// owned by one goroutine and not safe for concurrent use.
type backoff struct {
	base, max, stable time.Duration
	served            time.Duration // zero: serving never resets
	// jitter returns a value in [-1, 1]; nil means uniformly random.
	jitter func() float64

	failures int // consecutive failed runs
}

// next records a failed run that lasted ran, of which it served for served, and returns
// how long to wait before the next attempt.
func (b *backoff) next(ran, served time.Duration) time.Duration {
	if ran >= b.stable || b.served > 0 && served >= b.served {
		b.failures = 0
	}
	d := b.base
	for i := 0; i < b.failures && d < b.max; i++ {
		d *= 2
	}
	d = min(d, b.max)
	b.failures++

	j := b.jitter
	if j == nil {
		j = func() float64 { return rand.Float64()*2 - 1 }
	}
	return time.Duration(float64(d) * (1 + jitterFraction*j()))
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
