// Package steps marks the steps of the agent's calls (a Reserve's validation, its plugin
// call, its ledger commit, ...) so that benchmarks can say where a call's time goes. A
// step is a runtime/trace region while the process is being traced, and is timed into
// its call's record while timing is on (SetTiming: a benchmark build of the agent turns
// it on; see docs/benchmarks.md#where-a-reserve-goes). Tracing costs the agent more than
// the steps it measures (an event for every goroutine hand-off, with its stack), so the
// timed records say what the steps cost untraced. With neither on, a step costs two
// atomic loads.
//
// The server begins a record when a call's headers arrive (Begin) and ends it when its
// status is sent (End); the steps on the call's context in between are timed into it,
// those of a group commit the caller leads included. Ended records are kept, up to
// maxRecords, until Take.
package steps

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime/trace"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// timing says whether calls are timed.
var timing atomic.Bool

// SetTiming turns the timing of calls on or off, for the whole process. Records already
// kept stay until Take.
func SetTiming(on bool) { timing.Store(on) }

type callKey struct{}

// Record is one call as timed: its method, when it began and ended (headers to status),
// and its steps in the order they ended.
type Record struct {
	Method     string
	Begin, End time.Time
	Steps      []Span
}

// Span is one step of a call.
type Span struct {
	Name       string
	Begin, End time.Time
	// Nested says it began while another step of the call was open (a group commit's
	// steps inside the handler's "ledger commit").
	Nested bool
}

// call is a record being made.
type call struct {
	mu   sync.Mutex
	r    Record
	open int // steps begun and not ended
}

// Begin returns ctx carrying a new record of a call of method while timing is on, and
// ctx itself otherwise. End ends it.
func Begin(ctx context.Context, method string) context.Context {
	if !timing.Load() {
		return ctx
	}
	return context.WithValue(ctx, callKey{}, &call{r: Record{Method: method, Begin: time.Now()}})
}

// End ends the record ctx carries, if any, and keeps it for Take.
func End(ctx context.Context) {
	c, ok := ctx.Value(callKey{}).(*call)
	if !ok {
		return
	}
	c.mu.Lock()
	c.r.End = time.Now()
	r := c.r
	c.mu.Unlock()
	keep(r)
}

// Step is a step begun by Start; End ends it.
type Step struct {
	region *trace.Region
	c      *call
	span   Span
}

// Start begins the step name of the call ctx belongs to.
func Start(ctx context.Context, name string) Step {
	var s Step
	if trace.IsEnabled() {
		s.region = trace.StartRegion(ctx, name)
	}
	if timing.Load() {
		if c, ok := ctx.Value(callKey{}).(*call); ok {
			c.mu.Lock()
			s.c, s.span = c, Span{Name: name, Nested: c.open > 0, Begin: time.Now()}
			c.open++
			c.mu.Unlock()
		}
	}
	return s
}

// End ends the step.
func (s Step) End() {
	if s.region != nil {
		s.region.End()
	}
	if s.c != nil {
		s.span.End = time.Now()
		s.c.mu.Lock()
		s.c.open--
		s.c.r.Steps = append(s.c.r.Steps, s.span)
		s.c.mu.Unlock()
	}
}

// maxRecords bounds the records kept until Take: later ones are counted, not kept.
const maxRecords = 1 << 17

var kept struct {
	mu      sync.Mutex
	records []Record
	dropped int
}

func keep(r Record) {
	kept.mu.Lock()
	defer kept.mu.Unlock()
	if len(kept.records) >= maxRecords {
		kept.dropped++
		return
	}
	kept.records = append(kept.records, r)
}

// Take returns the records kept since the last Take, and how many ended past
// maxRecords and were not kept.
func Take() (records []Record, dropped int) {
	kept.mu.Lock()
	defer kept.mu.Unlock()
	records, dropped = kept.records, kept.dropped
	kept.records, kept.dropped = nil, 0
	return records, dropped
}

// Write writes records as text, a line each: the method, the call's begin and end in
// Unix ns, then for each step its name, begin and end in ns from the call's begin and
// "n" when nested, all tab-separated. Read reads it back.
func Write(w io.Writer, records []Record) error {
	bw := bufio.NewWriter(w)
	for _, r := range records {
		fmt.Fprintf(bw, "%s\t%d\t%d", r.Method, r.Begin.UnixNano(), r.End.UnixNano())
		for _, s := range r.Steps {
			nested := "-"
			if s.Nested {
				nested = "n"
			}
			fmt.Fprintf(bw, "\t%s\t%d\t%d\t%s", s.Name, s.Begin.Sub(r.Begin), s.End.Sub(r.Begin), nested)
		}
		bw.WriteByte('\n')
	}
	return bw.Flush()
}

// Read reads what Write wrote.
func Read(r io.Reader) ([]Record, error) {
	var out []Record
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for line := 1; sc.Scan(); line++ {
		f := strings.Split(sc.Text(), "\t")
		if len(f) < 3 || (len(f)-3)%4 != 0 {
			return nil, fmt.Errorf("line %d: %d fields, want 3 and 4 a step", line, len(f))
		}
		var ns [2]int64
		for i := range ns {
			v, err := strconv.ParseInt(f[1+i], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("line %d: %w", line, err)
			}
			ns[i] = v
		}
		rec := Record{Method: f[0], Begin: time.Unix(0, ns[0]), End: time.Unix(0, ns[1])}
		for i := 3; i < len(f); i += 4 {
			b, err1 := strconv.ParseInt(f[i+1], 10, 64)
			e, err2 := strconv.ParseInt(f[i+2], 10, 64)
			if err := errors.Join(err1, err2); err != nil {
				return nil, fmt.Errorf("line %d, step %q: %w", line, f[i], err)
			}
			rec.Steps = append(rec.Steps, Span{Name: f[i], Begin: rec.Begin.Add(time.Duration(b)), End: rec.Begin.Add(time.Duration(e)), Nested: f[i+3] == "n"})
		}
		out = append(out, rec)
	}
	return out, sc.Err()
}
