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
	if _, err := poll(Timeout, 50*time.Millisecond, func() (bool, string) { return cond(), "" }); err != nil {
		t.Fatalf("%s: not within %v", what, Timeout)
	}
}

// Until is WaitFor for a wait with a bound of its own (a real node's pod start, a
// cluster's) whose check says what it saw: it polls check, backing off to every 200 ms
// (a check there costs a process or an API call), until check is done, and fails t
// naming what and check's last status once limit has passed. It returns how long it
// waited.
func Until(t testing.TB, limit time.Duration, what string, check func() (done bool, status string)) time.Duration {
	t.Helper()
	d, err := Poll(limit, check)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return d
}

// Poll is Until's loop for a caller that decides itself what a timeout means: how long
// it waited, and an error with check's last status once limit has passed without
// check being done.
func Poll(limit time.Duration, check func() (done bool, status string)) (time.Duration, error) {
	return poll(limit, 200*time.Millisecond, check)
}

// poll calls check until it is done, pausing a millisecond at first and doubling up to
// maxPause, or until limit has passed after a call that was not done.
func poll(limit, maxPause time.Duration, check func() (bool, string)) (time.Duration, error) {
	start := time.Now()
	deadline := start.Add(limit)
	for pause := time.Millisecond; ; pause = min(2*pause, maxPause) {
		done, status := check()
		if done {
			return time.Since(start), nil
		}
		if time.Now().After(deadline) {
			return time.Since(start), fmt.Errorf("not within %v; last: %s", limit, status)
		}
		time.Sleep(pause)
	}
}
