package kubernetes

import "time"

// SetClock makes b take the time of its release decisions from now. Call it before
// Run.
func SetClock(b *Bridge, now func() time.Time) { b.now = now }
