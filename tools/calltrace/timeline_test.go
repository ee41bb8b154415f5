package calltrace_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime/trace"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/calltrace"
)

// The timeline of the median call shows its task, its regions, a system call made in
// it, and a goroutine it woke, in time order; a method with no call is an error.
func TestTimelineShowsTheMedianCallsGoroutines(t *testing.T) {
	devNull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	var buf bytes.Buffer
	if err := trace.Start(&buf); err != nil {
		t.Fatal(err)
	}
	// Three calls of different lengths (100, 600, 300 µs or more).
	for _, d := range []time.Duration{100 * time.Microsecond, 600 * time.Microsecond, 300 * time.Microsecond} {
		ctx, task := trace.NewTask(context.Background(), "/svc/Reserve")
		woken := make(chan struct{})
		done := make(chan struct{})
		go func() { // a helper the call hands work to
			<-woken
			close(done)
		}()
		trace.WithRegion(ctx, "plugin and intent", func() {
			if _, err := devNull.Write([]byte("x")); err != nil {
				t.Error(err)
			}
			spin(d)
			close(woken)
			<-done
		})
		task.End()
	}
	trace.Stop()
	lines, err := calltrace.Timeline(buf.Bytes(), "/svc/Reserve", 50, 0)
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(lines, "\n")
	if !strings.Contains(lines[0], "/svc/Reserve at p50") || !strings.Contains(lines[0], "(3 calls)") {
		t.Errorf("header %q; want the method, p50 and the 3 calls", lines[0])
	}
	calls, err := calltrace.Read(bytes.NewReader(buf.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	var ds []time.Duration
	for _, c := range calls["/svc/Reserve"] {
		ds = append(ds, time.Duration(c.End-c.Begin))
	}
	median := fmt.Sprintf("%.1f µs", float64(calltrace.Percentile(ds, 50))/1e3)
	if !strings.Contains(lines[0], ": "+median+" ") {
		t.Errorf("header %q; want the median call's %s (calls of %v)", lines[0], median, ds)
	}
	for _, want := range []string{"task begins /svc/Reserve", "region begins plugin and intent", "Syscall", "region ends plugin and intent", "task ends /svc/Reserve", "Waiting -> Runnable"} {
		if !strings.Contains(text, want) {
			t.Errorf("timeline lacks %q:\n%s", want, text)
		}
	}
	prev := -1e9
	for _, l := range lines[1:] {
		v, err := strconv.ParseFloat(strings.Fields(l)[0], 64)
		if err != nil || v < prev {
			t.Errorf("line %q: time %v after %v; want times in order", l, v, prev)
		}
		prev = v
	}
	if first, _ := strconv.ParseFloat(strings.Fields(lines[1])[0], 64); first < 0 {
		t.Errorf("first event at %v µs; want none before the call with no margin", first)
	}
	if _, err := calltrace.Timeline(buf.Bytes(), "/svc/Release", 50, 0); err == nil || !strings.Contains(err.Error(), "/svc/Release") {
		t.Errorf("Timeline of a method with no call = %v; want an error naming it", err)
	}
}
