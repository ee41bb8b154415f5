package nvidia

import "time"

// clock is the plugin's source of time. Every wait in the plugin (fingerprint period,
// health quiet period, stats interval, simulated faults) goes through it, so tests drive
// time with a fake clock instead of sleeping.
type clock interface {
	Now() time.Time
	// TimerAt returns a timer whose channel receives once the clock reaches at; at
	// once when at is not in the future. Stop releases it.
	TimerAt(at time.Time) timer
}

// timer is a one-shot timer made by a clock.
type timer interface {
	C() <-chan time.Time
	Stop()
}

// realClock is the wall clock.
type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) TimerAt(at time.Time) timer {
	return realTimer{time.NewTimer(time.Until(at))}
}

type realTimer struct{ t *time.Timer }

func (r realTimer) C() <-chan time.Time { return r.t.C }
func (r realTimer) Stop()               { r.t.Stop() }
