// Package testwait is the one wait policy of the repository's tests, in all three
// modules: Timeout, the bound of every wait for something that should happen, and
// WaitFor, the one poll for a condition that no event announces. A test that can wait
// for an event (a message on a stream, a closed channel) waits for it, bounded by
// Timeout; a test that says something does not happen waits for an event that proves
// the moment has passed (a later message, a barrier) or runs in a testing/synctest
// bubble, never for a wall-clock window.
//
// DEVICEHOST_TEST_TIMEOUT (a Go duration, "2m") replaces Timeout's 60 s on a machine
// slower than a loaded 2-core one running the race detector.
package testwait

import (
	"fmt"
	"os"
	"testing"
	"time"
)

// Timeout bounds every wait of a test for something that should happen: a deadline a
// hang hits, generous for a loaded 2-core machine running the race detector, never a
// speed check. A test that checks a speed names its own figure.
var Timeout = timeout(os.Getenv("DEVICEHOST_TEST_TIMEOUT"))

const defaultTimeout = 60 * time.Second

// timeout is DEVICEHOST_TEST_TIMEOUT's duration, or defaultTimeout when it is unset. A
// value that is not a positive duration panics: a test run with a typo in it would
// otherwise wait for the default without saying so.
func timeout(env string) time.Duration {
	if env == "" {
		return defaultTimeout
	}
	d, err := time.ParseDuration(env)
	if err != nil || d <= 0 {
		panic(fmt.Sprintf("DEVICEHOST_TEST_TIMEOUT=%q: want a positive Go duration such as 2m", env))
	}
	return d
}

// WaitFor polls cond until it holds, and fails t (t.Fatalf: call it from the test's
// goroutine) naming what once Timeout has passed without it. It polls every
// millisecond at first, backing off to every 50 ms, so that a condition that holds
// soon costs no sleep and one that takes long (a process, an HTTP API) is not hammered.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	if !poll(Timeout, cond) {
		t.Fatalf("%s: not within %v", what, Timeout)
	}
}

// poll calls cond until it holds (true) or limit has passed after a call that did not
// (false).
func poll(limit time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(limit)
	for pause := time.Millisecond; !cond(); pause = min(2*pause, 50*time.Millisecond) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(pause)
	}
	return true
}
