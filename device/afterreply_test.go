package device_test

import (
	"context"
	"slices"
	"testing"

	"github.com/devicehost/devicehost/device"
)

// TestAfterReply: work deferred in a call's context waits for run, then runs in the
// order it was deferred; outside such a call, and after run, it runs at once.
func TestAfterReply(t *testing.T) {
	var got []string
	note := func(s string) func() { return func() { got = append(got, s) } }

	device.AfterReply(context.Background(), note("no call"))
	if !slices.Equal(got, []string{"no call"}) {
		t.Fatalf("outside a call: ran %v, want [no call] at once", got)
	}
	got = nil
	ctx, run := device.WithAfterReply(context.Background())
	device.AfterReply(ctx, note("first"))
	derived, cancel := context.WithCancel(ctx) // a context derived from the call's is the call's
	defer cancel()
	device.AfterReply(derived, note("second"))
	if len(got) != 0 {
		t.Fatalf("before run: ran %v, want nothing", got)
	}
	run()
	if !slices.Equal(got, []string{"first", "second"}) {
		t.Fatalf("run ran %v, want [first second]", got)
	}
	device.AfterReply(ctx, note("late"))
	if !slices.Equal(got, []string{"first", "second", "late"}) {
		t.Fatalf("after run: ran %v, want late at once", got)
	}
}
