package shim

import "time"

// clock is the time the allocation follower goes by: the grace period, retry delays
// and pacing. Tests give it one they advance.
type clock interface {
	Now() time.Time
	// NewTimer returns a channel that receives once d has passed, and a func that
	// stops it (safe to call after it fired).
	NewTimer(d time.Duration) (<-chan time.Time, func())
}

// realClock is the system's clock.
type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) NewTimer(d time.Duration) (<-chan time.Time, func()) {
	t := time.NewTimer(d)
	return t.C, func() { t.Stop() }
}
