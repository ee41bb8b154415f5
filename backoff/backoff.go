// Package backoff is the one jittered exponential backoff of devicehost: the manager's
// plugin restarts and stats stream reopenings, the ledger GC's cleanup retries and the
// client's watch reconnects all wait by it; it is public because the kubelet bridge's
// registrar and the Nomad shim (module integrations/nomad) wait by it too.
//
// A delay starts at Base, doubles with every failure in a row up to Max, and is spread
// by ±Fraction (20%) of jitter, so that many waiters that failed together do not retry
// together.
package backoff

import (
	"math"
	"math/rand/v2"
	"time"
)

// Fraction is the ± spread of jitter applied to every delay.
const Fraction = 0.2

// Backoff computes delays. Its zero value waits no time at all; set Base and Max. A
// Backoff used through Next and Reset is owned by one goroutine and not safe for
// concurrent use; Delay reads only its configuration, so a Backoff that is not being
// changed may be shared.
type Backoff struct {
	// Base is the delay after the first failure.
	Base time.Duration
	// Max caps the doubling. A Max below Base means Base.
	Max time.Duration
	// HardMax makes Max a bound of the delay after jitter too. Without it, the capped
	// delay is spread like any other, so a delay may reach Max×(1+Fraction).
	HardMax bool
	// Jitter returns a value in [-1, 1], which scales the ±Fraction spread: -1 gives
	// the shortest delay, 0 the delay without jitter. Nil means uniformly random; tests
	// set it to get exact delays.
	Jitter func() float64

	failures int // in a row, since the last Reset
}

// Next records one more failure in a row and returns how long to wait before the next
// attempt: Delay of the number of failures so far.
func (b *Backoff) Next() time.Duration {
	b.failures++
	return b.Delay(b.failures)
}

// Reset forgets the failures in a row: the next delay is Base again.
func (b *Backoff) Reset() { b.failures = 0 }

// Delay is the delay after the nth failure in a row (n below 1 counts as 1): Base
// doubled n-1 times, capped at Max, with jitter. It does not change b.
func (b *Backoff) Delay(n int) time.Duration {
	limit := max(b.Max, b.Base)
	d := b.Base
	for i := 1; i < n && d < limit; i++ {
		if d > limit/2 {
			d = limit
			break
		}
		d *= 2
	}
	d = min(d, limit)

	j := b.Jitter
	if j == nil {
		j = random
	}
	if f := float64(d) * (1 + Fraction*j()); f < math.MaxInt64 {
		d = time.Duration(f)
	} else {
		d = math.MaxInt64
	}
	if b.HardMax {
		d = min(d, limit)
	}
	return d
}

func random() float64 { return rand.Float64()*2 - 1 }
