package calltrace

import (
	"bytes"
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"golang.org/x/exp/trace"
)

// Timeline returns what every goroutine of the traced process did around one call of
// method: the call whose whole time (task begin to end) is at percentile p of that
// method's calls (50: the median one), from margin before it began to margin after it
// ended. One line per event: its time from the call's begin in µs, the goroutine running
// when it happened ("-": none, the scheduler), and the event: the task's begin and end,
// every region's begin and end (any goroutine's), and every goroutine's change of state
// with the functions it was in (those of the runtime left out), so a hand-off
// that waits shows (a goroutine made runnable long before it runs, a system call that
// holds the only thread). What is printed is escaped text: names from the trace are
// quoted Go strings where they are not plain.
func Timeline(data []byte, method string, p int, margin time.Duration) ([]string, error) {
	calls, err := Read(bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	cs := calls[method]
	if len(cs) == 0 {
		return nil, fmt.Errorf("no complete call of %s in the trace", method)
	}
	slices.SortFunc(cs, func(a, b Call) int { return cmp.Compare(a.End-a.Begin, b.End-b.Begin) })
	c := cs[max((len(cs)*p+99)/100-1, 0)]
	from, to := c.Begin-trace.Time(margin), c.End+trace.Time(margin)
	out := []string{fmt.Sprintf("%s at p%d: %.1f µs from its headers to its status (%d calls)",
		method, p, float64(c.End-c.Begin)/1e3, len(cs))}
	err = eachEvent(bytes.NewReader(data), func(ev trace.Event) bool {
		if ev.Time() < from {
			return true
		}
		if ev.Time() > to {
			return false
		}
		var what string
		switch ev.Kind() {
		case trace.EventTaskBegin:
			what = "task begins " + plain(ev.Task().Type)
		case trace.EventTaskEnd:
			what = "task ends " + plain(ev.Task().Type)
		case trace.EventRegionBegin:
			what = "region begins " + plain(ev.Region().Type)
		case trace.EventRegionEnd:
			what = "region ends " + plain(ev.Region().Type)
		case trace.EventStateTransition:
			st := ev.StateTransition()
			if st.Resource.Kind != trace.ResourceGoroutine {
				return true
			}
			old, now := st.Goroutine()
			what = fmt.Sprintf("g%d %v -> %v", st.Resource.Goroutine(), old, now)
			if in := frames(st.Stack); in != "" {
				what += " in " + in
			}
			if by := frames(ev.Stack()); now == trace.GoRunnable && by != "" {
				what += " (by " + by + ")"
			}
		default:
			return true
		}
		on := "-" // the scheduler's own
		if g := ev.Goroutine(); g != trace.NoGoroutine {
			on = fmt.Sprintf("g%d", g)
		}
		out = append(out, fmt.Sprintf("%9.1f µs  %-7s %s", float64(ev.Time()-c.Begin)/1e3, on, what))
		return true
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// frames names the first three functions of st outside the runtime, innermost first,
// package path left out.
func frames(st trace.Stack) string {
	var names []string
	for f := range st.Frames() {
		if strings.HasPrefix(f.Func, "runtime.") || strings.HasPrefix(f.Func, "internal/") {
			continue
		}
		names = append(names, plain(f.Func[strings.LastIndex(f.Func, "/")+1:]))
		if len(names) == 3 {
			break
		}
	}
	return strings.Join(names, " < ")
}

// plain is s as it is when it is printable ASCII, else quoted.
func plain(s string) string {
	for _, r := range s {
		if r < ' ' || r > '~' {
			return fmt.Sprintf("%q", s)
		}
	}
	return s
}
