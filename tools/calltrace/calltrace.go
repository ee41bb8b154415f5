// Package calltrace reads what an agent's execution trace (runtime/trace) says of its
// gRPC calls: while it is traced, the server makes each call a task named after its
// method, from its headers to its status (server/tracetask.go), and the handler marks its
// steps as regions in it (Server.Reserve, manager.Manager.Reserve and Release). Breakdown
// turns the calls of one method into the p50 and p99 of each step; tools/hostbench prints
// it (docs/benchmarks.md#where-a-reserve-goes).
package calltrace

import (
	"cmp"
	"errors"
	"io"
	"slices"
	"time"

	"golang.org/x/exp/trace"

	"github.com/devicehost/devicehost/internal/steps"
)

// The rows Breakdown adds to the regions' own.
const (
	GRPCIn  = "gRPC in (headers to handler)"
	Between = "between steps"
	GRPCOut = "gRPC out (reply to status sent)"
	Total   = "total, server side"
	Own     = "agent's own part"
	// Outside follows a region's name for the row of its time in none of its nested
	// regions (the ledger commit less its steps: the group commit's own work).
	Outside = " (outside its steps)"
)

// Call is one gRPC call of the agent as its execution trace shows it: the task the
// server's stats handler makes of each call while tracing (server/tracetask.go), from
// its headers to its status, and the regions its handler marked in it.
type Call struct {
	Begin, End trace.Time
	Regions    []Span // its regions, in the order they began
}

// Span is one region of a call.
type Span struct {
	Name       string
	Begin, End trace.Time
	// Goroutine is the one the region ran on: the handler's, or another that worked
	// for the call (a write's group commit, led by another caller).
	Goroutine trace.GoID
	// Nested says it began inside another region of the same goroutine (a group
	// commit's steps inside the handler's "ledger commit", when the handler leads it).
	Nested bool
}

// Read reads an execution trace and returns its complete calls by method (the
// task's type): those whose task began and ended within the trace.
func Read(r io.Reader) (map[string][]Call, error) {
	type open struct {
		method string
		c      Call
	}
	tasks := make(map[trace.TaskID]*open)
	// Regions nest per goroutine: a stack of the open ones on each.
	stacks := make(map[trace.GoID][]Span)
	out := make(map[string][]Call)
	err := eachEvent(r, func(ev trace.Event) bool {
		switch ev.Kind() {
		case trace.EventTaskBegin:
			t := ev.Task()
			tasks[t.ID] = &open{method: t.Type, c: Call{Begin: ev.Time()}}
		case trace.EventTaskEnd:
			t := ev.Task()
			if o, ok := tasks[t.ID]; ok {
				o.c.End = ev.Time()
				// Appended as they ended: put them in the order they began.
				slices.SortStableFunc(o.c.Regions, func(a, b Span) int { return cmp.Compare(a.Begin, b.Begin) })
				out[o.method] = append(out[o.method], o.c)
				delete(tasks, t.ID)
			}
		case trace.EventRegionBegin:
			g := ev.Goroutine()
			stacks[g] = append(stacks[g], Span{Name: ev.Region().Type, Begin: ev.Time(), Goroutine: g, Nested: len(stacks[g]) > 0})
		case trace.EventRegionEnd:
			g, reg := ev.Goroutine(), ev.Region()
			st := stacks[g]
			if len(st) == 0 {
				return true // began before the trace did
			}
			sp := st[len(st)-1]
			stacks[g] = st[:len(st)-1]
			sp.End = ev.Time()
			if o, ok := tasks[reg.Task]; ok {
				o.c.Regions = append(o.c.Regions, sp)
			}
		}
		return true
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// eachEvent reads the execution trace in r and calls f with each event, in order, until
// f returns false or the trace ends.
func eachEvent(r io.Reader, f func(trace.Event) bool) error {
	rd, err := trace.NewReader(r)
	if err != nil {
		return err
	}
	for {
		ev, err := rd.ReadEvent()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if !f(ev) {
			return nil
		}
	}
}

// Row is one line of a breakdown: a step's p50 and p99 over the calls.
type Row struct {
	Name     string
	P50, P99 time.Duration
}

// Breakdown works out, over calls, the p50 and p99 of: the time from the call's headers
// to its first region ("gRPC in"), each region (summed within a call when it recurs),
// the time between regions ("between steps"), from the last region to the status
// ("gRPC out"), the whole call ("total, server side"), and the whole call less the
// regions named in external, the time any of them ran counted once ("agent's own part"). A region holding nested regions
// also gets a row of its time outside them (its name and Outside). Steps are in the
// order they first appear. Nested regions, and regions on another goroutine than the call's first region
// (work done for the call elsewhere, inside one of the handler's steps), get rows of
// their own but are not counted in "between steps".
func Breakdown(calls []Call, external ...string) []Row {
	var order []string
	per := make(map[string][]time.Duration)
	add := func(name string, d time.Duration) {
		if _, ok := per[name]; !ok {
			order = append(order, name)
		}
		per[name] = append(per[name], d)
	}
	const in, between, out, total, own = GRPCIn, Between, GRPCOut, Total, Own
	for _, c := range calls {
		if len(c.Regions) == 0 {
			continue
		}
		sums := make(map[string]time.Duration)
		var names []string
		var inRegions time.Duration
		handler := c.Regions[0].Goroutine
		first, last := c.Regions[0].Begin, c.Regions[0].End
		for _, r := range c.Regions {
			d := time.Duration(r.End - r.Begin)
			if _, ok := sums[r.Name]; !ok {
				names = append(names, r.Name)
			}
			sums[r.Name] += d
			if r.Goroutine == handler && !r.Nested {
				inRegions += d
				last = max(last, r.End)
			}
		}
		whole := time.Duration(c.End - c.Begin)
		gapIn, gapOut := time.Duration(first-c.Begin), time.Duration(c.End-last)
		add(in, gapIn)
		for _, n := range names {
			add(n, sums[n])
			if d, ok := outside(c.Regions, n); ok {
				add(n+Outside, d)
			}
		}
		add(between, whole-gapIn-gapOut-inRegions)
		add(out, gapOut)
		add(total, whole)
		add(own, whole-covered(c.Regions, external))
	}
	// Keep the summary rows last, whatever order the steps came in.
	for _, n := range []string{between, out, total, own} {
		if i := slices.Index(order, n); i >= 0 {
			order = append(slices.Delete(order, i, i+1), n)
		}
	}
	rows := make([]Row, 0, len(order))
	for _, n := range order {
		rows = append(rows, Row{Name: n, P50: Percentile(per[n], 50), P99: Percentile(per[n], 99)})
	}
	return rows
}

// covered is how long, in all, at least one of the regions named in names ran: steps
// that overlap (a Reserve's plugin call and its commit) count once.
func covered(regions []Span, names []string) time.Duration {
	var spans [][2]trace.Time
	for _, r := range regions {
		if slices.Contains(names, r.Name) {
			spans = append(spans, [2]trace.Time{r.Begin, r.End})
		}
	}
	slices.SortFunc(spans, func(a, b [2]trace.Time) int { return cmp.Compare(a[0], b[0]) })
	var sum time.Duration
	var end trace.Time
	for i, s := range spans {
		switch {
		case i == 0 || s[0] >= end:
			sum += time.Duration(s[1] - s[0])
			end = s[1]
		case s[1] > end:
			sum += time.Duration(s[1] - end)
			end = s[1]
		}
	}
	return sum
}

// outside sums, over the call's regions named name on its handler's goroutine that
// hold nested regions, the time in none of those; false when none holds any.
func outside(regions []Span, name string) (time.Duration, bool) {
	handler := regions[0].Goroutine
	var sum time.Duration
	found := false
	for _, r := range regions {
		if r.Name != name || r.Goroutine != handler || r.Nested {
			continue
		}
		var inner []Span
		for _, n := range regions {
			if n.Nested && n.Goroutine == handler && n.Begin >= r.Begin && n.End <= r.End {
				inner = append(inner, n)
			}
		}
		if len(inner) == 0 {
			continue
		}
		found = true
		// The union of the nested spans (one may hold another), in begin order.
		covered, end := time.Duration(0), r.Begin
		for _, n := range inner {
			if n.End <= end {
				continue
			}
			covered += time.Duration(n.End - max(n.Begin, end))
			end = n.End
		}
		sum += time.Duration(r.End-r.Begin) - covered
	}
	return sum, found
}

// Percentile is the p-th percentile of ds (nearest rank); 0 for none.
func Percentile(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := (len(s)*p + 99) / 100
	return s[max(i-1, 0)]
}

// FromSteps returns the calls an agent timed (internal/steps: a build with -tags
// cpuprofile and DEVICEHOST_STEPS set) by method, as Read returns them from a trace, for
// Breakdown: the same steps, measured without the trace's own cost. The steps of a
// call are taken as its handler's (true of an isolated call: it leads its own commit).
func FromSteps(records []steps.Record) map[string][]Call {
	out := make(map[string][]Call)
	for _, r := range records {
		c := Call{Begin: trace.Time(r.Begin.UnixNano()), End: trace.Time(r.End.UnixNano())}
		for _, s := range r.Steps {
			c.Regions = append(c.Regions, Span{Name: s.Name, Begin: trace.Time(s.Begin.UnixNano()), End: trace.Time(s.End.UnixNano()), Nested: s.Nested})
		}
		// Kept as they ended: put them in the order they began.
		slices.SortStableFunc(c.Regions, func(a, b Span) int { return cmp.Compare(a.Begin, b.Begin) })
		out[r.Method] = append(out[r.Method], c)
	}
	return out
}
