package manager

import (
	"bytes"
	"context"
	"runtime/trace"
	"slices"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/tools/calltrace"
	"github.com/devicehost/devicehost/tools/testwait"
)

// TestReserveAndReleaseMarkTheirSteps: traced, a Reserve and a Release show their steps as
// regions of the caller's task, in the order they run (the group commit's inside the
// caller's "ledger commit"; a Reserve's commit, of its intent, while it asks the
// plugin), which is what hostbench's breakdown and `go tool trace` show an operator.
func TestReserveAndReleaseMarkTheirSteps(t *testing.T) {
	cfg, _ := testConfig(t)
	m, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1")))
	waitReady(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
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
	// The steps, in order, all on the handler's goroutine: the plugin is asked first,
	// then the reservation and its answer are committed (a group commit led by the
	// caller itself when no other commit runs).
	for method, want := range map[string][]string{
		"Reserve": {"claim", "ledger check", "route", "plugin", "validate answer", "ledger commit", "ledger: begin", "ledger: apply", "ledger: bolt commit", "ledger: index", "refresh"},
		"Release": {"ledger commit", "ledger: begin", "ledger: apply", "ledger: bolt commit", "ledger: index", "refresh"},
	} {
		if len(calls[method]) != 1 {
			t.Fatalf("%s: %d traced calls, want 1", method, len(calls[method]))
		}
		regions := calls[method][0].Regions
		handler := regions[0].Goroutine
		var got []string
		for _, r := range regions {
			if r.Goroutine != handler {
				t.Errorf("%s's step %q ran off the handler's goroutine", method, r.Name)
			}
			got = append(got, r.Name)
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s's steps = %q, want %q", method, got, want)
		}
	}
}
