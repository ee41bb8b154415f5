package kubernetes

import "time"

// SetClock makes b take the time of its release decisions from now. Call it before
// Run.
func SetClock(b *Bridge, now func() time.Time) { b.now = now }

// SetAfterSync makes b's registrar call f after each registration pass with the
// number of kubelet.sock creations it has seen and whether the pass succeeded. Call
// it before Run.
func SetAfterSync(b *Bridge, f func(kubeletCreates int, ok bool)) { b.afterSync = f }

// SetBeforeUpdate makes b's device watch call f before it takes in each update from
// the agent. Call it before Run.
func SetBeforeUpdate(b *Bridge, f func()) { b.beforeUpdate = f }
