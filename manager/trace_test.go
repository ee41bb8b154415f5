package manager

import (
	"bytes"
	"context"
	"runtime/trace"
	"slices"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/tools/calltrace"
)

// TestReserveAndReleaseMarkTheirSteps: traced, a Reserve and a Release show their steps as
// regions of the caller's task, in the order they run (the group commit's inside the
// caller's "ledger commit"; a Reserve's commit, of its intent, while it asks the
// plugin), which is what hostbench's breakdown and `go tool trace` show an operator.
func TestReserveAndReleaseMarkTheirSteps(t *testing.T) {
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1")))
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	var buf bytes.Buffer
	if err := trace.Start(&buf); err != nil {
		t.Fatal(err)
	}
	rctx, task := trace.NewTask(ctx, "Reserve")
	r, err := m.Reserve(rctx, device.ReserveRequest{OwnerID: "alloc-1", Group: device.GroupKey{Vendor: "acme", Type: "gpu", Name: "A1"}, DeviceIDs: []string{"a0"}})
	task.End()
	if err == nil {
		rctx, task = trace.NewTask(ctx, "Release")
		_, err = m.Release(rctx, device.ReleaseRequest{ReservationID: r.ID})
		task.End()
	}
	trace.Stop()
	if err != nil {
		t.Fatal(err)
	}
	calls, err := calltrace.Read(&buf)
	if err != nil {
		t.Fatal(err)
	}
	// The handler's steps, in order, and those of the goroutine that records the intent
	// while the handler asks the plugin, all inside "plugin and intent".
	for method, want := range map[string][2][]string{
		"Reserve": {
			{"claim", "ledger check", "route", "plugin and intent", "plugin", "validate answer", "ledger answer", "refresh"},
			{"ledger commit", "ledger: apply", "ledger: log write", "ledger: index"},
		},
		"Release": {{"ledger commit", "ledger: apply", "ledger: log write", "ledger: index", "refresh"}, nil},
	} {
		if len(calls[method]) != 1 {
			t.Fatalf("%s: %d traced calls, want 1", method, len(calls[method]))
		}
		regions := calls[method][0].Regions
		handler := regions[0].Goroutine
		var onHandler, elsewhere []string
		var both calltrace.Span
		for _, r := range regions {
			if r.Name == "ledger: begin" {
				continue // only where no transaction is open since the last checkpoint
			}
			if r.Goroutine == handler {
				onHandler = append(onHandler, r.Name)
			} else {
				elsewhere = append(elsewhere, r.Name)
			}
			if r.Name == "plugin and intent" {
				both = r
			}
		}
		if !slices.Equal(onHandler, want[0]) || !slices.Equal(elsewhere, want[1]) {
			t.Errorf("%s's steps = %q on the handler and %q elsewhere, want %q and %q", method, onHandler, elsewhere, want[0], want[1])
		}
		for _, r := range regions {
			if r.Goroutine != handler && (r.Begin < both.Begin || r.End > both.End) {
				t.Errorf("%s's step %q ran outside \"plugin and intent\"", method, r.Name)
			}
		}
	}
}
