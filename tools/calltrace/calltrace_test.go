package calltrace_test

import (
	"bytes"
	"context"
	"runtime/trace"
	"slices"
	"testing"
	"time"

	"github.com/devicehost/devicehost/internal/steps"
	"github.com/devicehost/devicehost/tools/calltrace"
)

// traced runs f with the process traced and returns what Read makes of the trace.
func traced(t *testing.T, f func()) map[string][]calltrace.Call {
	t.Helper()
	var buf bytes.Buffer
	if err := trace.Start(&buf); err != nil {
		t.Fatal(err)
	}
	f()
	trace.Stop()
	calls, err := calltrace.Read(&buf)
	if err != nil {
		t.Fatalf("Read: %v", err)
	}
	return calls
}

// spin keeps the goroutine busy for at least d, so a step has a length the test knows
// from below.
func spin(d time.Duration) {
	for start := time.Now(); time.Since(start) < d; {
	}
}

func TestReadFindsEachCallsRegionsInOrder(t *testing.T) {
	calls := traced(t, func() {
		for range 3 {
			ctx, task := trace.NewTask(context.Background(), "/svc/Reserve")
			trace.WithRegion(ctx, "validate", func() {})
			trace.WithRegion(ctx, "plugin", func() {
				trace.WithRegion(ctx, "nested", func() { spin(100 * time.Microsecond) })
			})
			trace.WithRegion(ctx, "commit", func() {})
			task.End()
		}
		// A region outside any task, and a task never ended: neither is a call.
		trace.WithRegion(context.Background(), "loose", func() {})
		_, open := trace.NewTask(context.Background(), "/svc/Open")
		_ = open
		ctx, task := trace.NewTask(context.Background(), "/svc/Release")
		trace.WithRegion(ctx, "commit", func() {})
		task.End()
	})
	if got := len(calls["/svc/Reserve"]); got != 3 {
		t.Fatalf("Reserve calls = %d, want 3 (all: %v)", got, calls)
	}
	if got := len(calls["/svc/Release"]); got != 1 {
		t.Fatalf("Release calls = %d, want 1", got)
	}
	if _, ok := calls["/svc/Open"]; ok {
		t.Error("a task that never ended was read as a call")
	}
	for _, c := range calls["/svc/Reserve"] {
		var names []string
		for _, r := range c.Regions {
			names = append(names, r.Name)
			if r.Begin < c.Begin || r.End > c.End || r.End < r.Begin {
				t.Errorf("region %s [%d, %d] outside its call [%d, %d]", r.Name, r.Begin, r.End, c.Begin, c.End)
			}
			if r.Nested != (r.Name == "nested") {
				t.Errorf("region %s: Nested = %v", r.Name, r.Nested)
			}
		}
		if want := []string{"validate", "plugin", "nested", "commit"}; !slices.Equal(names, want) {
			t.Errorf("regions = %v, want %v (in the order they began)", names, want)
		}
	}
}

func TestBreakdownSplitsTheCallAndLeavesTheExternalStepsOut(t *testing.T) {
	calls := traced(t, func() {
		ctx, task := trace.NewTask(context.Background(), "/svc/Reserve")
		spin(50 * time.Microsecond) // before the handler's first step
		trace.WithRegion(ctx, "validate", func() { spin(20 * time.Microsecond) })
		trace.WithRegion(ctx, "plugin", func() { spin(300 * time.Microsecond) })
		spin(40 * time.Microsecond) // between steps
		trace.WithRegion(ctx, "commit", func() {
			// Work done for the call on another goroutine, within one of its steps.
			done := make(chan struct{})
			go func() {
				defer close(done)
				trace.WithRegion(ctx, "worker", func() { spin(50 * time.Microsecond) })
			}()
			<-done
			spin(100 * time.Microsecond)
			// A step of the commit made on the handler itself (a group commit it leads).
			trace.WithRegion(ctx, "inner", func() { spin(100 * time.Microsecond) })
		})
		trace.WithRegion(ctx, "plugin", func() { spin(100 * time.Microsecond) }) // a step made twice
		spin(60 * time.Microsecond)                                              // after the last step
		task.End()
	})["/svc/Reserve"]
	if len(calls) != 1 {
		t.Fatalf("calls = %d, want 1", len(calls))
	}
	rows := calltrace.Breakdown(calls, "plugin", "commit")
	got := map[string]time.Duration{}
	var names []string
	for _, r := range rows {
		names = append(names, r.Name)
		got[r.Name] = r.P50
		if r.P50 != r.P99 {
			t.Errorf("%s: p50 %v != p99 %v over one call", r.Name, r.P50, r.P99)
		}
	}
	want := []string{calltrace.GRPCIn, "validate", "plugin", "commit", "commit" + calltrace.Outside, "worker", "inner", calltrace.Between, calltrace.GRPCOut, calltrace.Total, calltrace.Own}
	if !slices.Equal(names, want) {
		t.Fatalf("rows = %q, want %q", names, want)
	}
	atLeast := map[string]time.Duration{
		calltrace.GRPCIn: 50 * time.Microsecond, "validate": 20 * time.Microsecond,
		"plugin": 400 * time.Microsecond, "commit": 250 * time.Microsecond, "worker": 50 * time.Microsecond, "inner": 100 * time.Microsecond,
		calltrace.Between: 40 * time.Microsecond, calltrace.GRPCOut: 60 * time.Microsecond,
		"commit" + calltrace.Outside: 100 * time.Microsecond,
	}
	for name, min := range atLeast {
		if got[name] < min {
			t.Errorf("%s = %v, want at least %v (what it spun)", name, got[name], min)
		}
	}
	// The handler's parts add up to the whole (the worker's step is inside the commit),
	// and the agent's own part is the whole less the external steps, exactly.
	c := calls[0]
	whole := time.Duration(c.End - c.Begin)
	if got[calltrace.Total] != whole {
		t.Errorf("total = %v, want the task's span %v", got[calltrace.Total], whole)
	}
	sum := got[calltrace.GRPCIn] + got["validate"] + got["plugin"] + got["commit"] + got[calltrace.Between] + got[calltrace.GRPCOut]
	for _, in := range []string{"worker", "inner"} {
		if got[in] > got["commit"] {
			t.Errorf("%s %v longer than the commit %v it ran in", in, got[in], got["commit"])
		}
	}
	if sum != whole {
		t.Errorf("the rows add up to %v, want the whole %v", sum, whole)
	}
	// The commit outside its steps: less its step on the handler, not the worker's.
	if out := got["commit"] - got["inner"]; got["commit"+calltrace.Outside] != out {
		t.Errorf("commit outside its steps = %v, want %v (the commit less inner)", got["commit"+calltrace.Outside], out)
	}
	if own := whole - got["plugin"] - got["commit"]; got[calltrace.Own] != own {
		t.Errorf("own part = %v, want %v (the whole less plugin and commit)", got[calltrace.Own], own)
	}
}

// TestBreakdownCountsOverlappingExternalStepsOnce: a Reserve asks its plugin while its
// commit runs; its own part is the whole less the time either ran, not less both.
func TestBreakdownCountsOverlappingExternalStepsOnce(t *testing.T) {
	calls := traced(t, func() {
		ctx, task := trace.NewTask(context.Background(), "/svc/Reserve")
		spin(30 * time.Microsecond)
		started, committed, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
		go func() {
			defer close(done)
			trace.WithRegion(ctx, "plugin", func() {
				close(started)
				<-committed // the commit runs wholly inside the plugin call
				spin(50 * time.Microsecond)
			})
		}()
		<-started
		trace.WithRegion(ctx, "commit", func() { spin(200 * time.Microsecond) })
		close(committed)
		<-done
		spin(30 * time.Microsecond)
		task.End()
	})["/svc/Reserve"]
	if len(calls) != 1 {
		t.Fatalf("calls = %d, want 1", len(calls))
	}
	got := map[string]time.Duration{}
	for _, r := range calltrace.Breakdown(calls, "plugin", "commit") {
		got[r.Name] = r.P50
	}
	whole := time.Duration(calls[0].End - calls[0].Begin)
	if got["commit"] < 200*time.Microsecond || got["plugin"] < got["commit"] {
		t.Fatalf("plugin %v, commit %v: want the commit (200µs spun) inside the plugin call", got["plugin"], got["commit"])
	}
	if own := whole - got["plugin"]; got[calltrace.Own] != own {
		t.Errorf("own part = %v, want %v (the whole less the plugin call, the commit inside it); less both would be %v",
			got[calltrace.Own], own, whole-got["plugin"]-got["commit"])
	}
}

func TestBreakdownOfNoCallsIsEmpty(t *testing.T) {
	if rows := calltrace.Breakdown(nil, "plugin"); len(rows) != 0 {
		t.Errorf("rows = %v, want none", rows)
	}
}

func TestPercentile(t *testing.T) {
	ds := []time.Duration{5, 1, 4, 2, 3}
	for _, tc := range []struct {
		p    int
		want time.Duration
	}{{50, 3}, {99, 5}, {1, 1}, {100, 5}} {
		if got := calltrace.Percentile(ds, tc.p); got != tc.want {
			t.Errorf("p%d = %v, want %v", tc.p, got, tc.want)
		}
	}
	if got := calltrace.Percentile(nil, 50); got != 0 {
		t.Errorf("p50 of none = %v, want 0", got)
	}
	if !slices.Equal(ds, []time.Duration{5, 1, 4, 2, 3}) {
		t.Error("Percentile sorted its argument in place")
	}
}

// TestFromStepsBreaksDownAsATraceDoes: a call the agent timed (internal/steps), written
// and read back as hostbench does, breaks down into the same rows as a traced one, its
// own part the whole less the external steps, exactly.
func TestFromStepsBreaksDownAsATraceDoes(t *testing.T) {
	steps.SetTiming(true)
	defer steps.SetTiming(false)
	steps.Take()
	ctx := steps.Begin(context.Background(), "/svc/Reserve")
	spin(50 * time.Microsecond)
	s := steps.Start(ctx, "validate")
	spin(20 * time.Microsecond)
	s.End()
	s = steps.Start(ctx, "plugin")
	spin(300 * time.Microsecond)
	s.End()
	spin(40 * time.Microsecond)
	s = steps.Start(ctx, "commit")
	spin(100 * time.Microsecond)
	inner := steps.Start(ctx, "inner")
	spin(100 * time.Microsecond)
	inner.End()
	s.End()
	spin(60 * time.Microsecond)
	steps.End(ctx)
	records, dropped := steps.Take()
	var buf bytes.Buffer
	if err := steps.Write(&buf, records); err != nil {
		t.Fatal(err)
	}
	read, err := steps.Read(&buf)
	if err != nil || dropped != 0 {
		t.Fatalf("Read: %v (%d dropped)", err, dropped)
	}
	calls := calltrace.FromSteps(read)["/svc/Reserve"]
	if len(calls) != 1 {
		t.Fatalf("calls = %d, want 1", len(calls))
	}
	got := map[string]time.Duration{}
	var names []string
	for _, r := range calltrace.Breakdown(calls, "plugin", "commit") {
		names = append(names, r.Name)
		got[r.Name] = r.P50
	}
	want := []string{calltrace.GRPCIn, "validate", "plugin", "commit", "commit" + calltrace.Outside, "inner", calltrace.Between, calltrace.GRPCOut, calltrace.Total, calltrace.Own}
	if !slices.Equal(names, want) {
		t.Fatalf("rows = %q, want %q", names, want)
	}
	for name, min := range map[string]time.Duration{calltrace.GRPCIn: 50 * time.Microsecond, "plugin": 300 * time.Microsecond, "inner": 100 * time.Microsecond, calltrace.GRPCOut: 60 * time.Microsecond} {
		if got[name] < min {
			t.Errorf("%s = %v, want at least %v (what it spun)", name, got[name], min)
		}
	}
	whole := time.Duration(calls[0].End - calls[0].Begin)
	if got[calltrace.Total] != whole || got[calltrace.Own] != whole-got["plugin"]-got["commit"] {
		t.Errorf("total %v, own part %v; want %v and the whole less plugin and commit", got[calltrace.Total], got[calltrace.Own], whole)
	}
}
