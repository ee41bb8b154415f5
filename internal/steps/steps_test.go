package steps

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// timed runs the test with timing on and nothing kept from before, and leaves it off.
func timed(t *testing.T) {
	t.Helper()
	SetTiming(true)
	Take()
	t.Cleanup(func() { SetTiming(false); Take() })
}

// TestStepsAreTimedIntoTheirCall: the steps on a call's context go into its record when
// it ends, in the order they ended, a step begun inside another marked nested, each
// within the call.
func TestStepsAreTimedIntoTheirCall(t *testing.T) {
	timed(t)
	ctx := Begin(context.Background(), "/svc/Reserve")
	outer := Start(ctx, "ledger commit")
	inner := Start(ctx, "ledger: bolt commit")
	inner.End()
	outer.End()
	Start(ctx, "reply").End()
	Start(context.Background(), "not a call's").End()
	End(ctx)
	records, dropped := Take()
	if len(records) != 1 || dropped != 0 {
		t.Fatalf("records %d, dropped %d; want one call", len(records), dropped)
	}
	r := records[0]
	var got []string
	for _, s := range r.Steps {
		got = append(got, s.Name)
		if s.Begin.Before(r.Begin) || s.End.Before(s.Begin) || r.End.Before(s.End) {
			t.Errorf("step %q from %v to %v, outside the call's %v to %v", s.Name, s.Begin, s.End, r.Begin, r.End)
		}
	}
	if r.Method != "/svc/Reserve" || strings.Join(got, ",") != "ledger: bolt commit,ledger commit,reply" {
		t.Errorf("call %q with steps %q", r.Method, got)
	}
	if !r.Steps[0].Nested || r.Steps[1].Nested || r.Steps[2].Nested {
		t.Errorf("nested: %v %v %v; want only the bolt commit", r.Steps[0].Nested, r.Steps[1].Nested, r.Steps[2].Nested)
	}
	if r.Steps[0].Begin.Before(r.Steps[1].Begin) || r.Steps[1].End.Before(r.Steps[0].End) {
		t.Error("the nested step is not within its outer one")
	}
}

// TestNothingIsTimedWhileOff: with timing off a call carries no record and its steps
// keep nothing; a step begun after timing went off is not timed.
func TestNothingIsTimedWhileOff(t *testing.T) {
	SetTiming(false)
	Take()
	ctx := context.Background()
	if Begin(ctx, "/svc/Reserve") != ctx {
		t.Error("Begin with timing off made a new context")
	}
	Start(ctx, "plugin").End()
	End(ctx)
	timed(t)
	ctx = Begin(ctx, "/svc/Release")
	SetTiming(false)
	Start(ctx, "plugin").End()
	End(ctx)
	if records, _ := Take(); len(records) != 1 || len(records[0].Steps) != 0 {
		t.Errorf("records %+v; want the one call begun while on, with no step", records)
	}
}

// TestKeepsAtMostMaxRecords: past maxRecords calls are counted, not kept.
func TestKeepsAtMostMaxRecords(t *testing.T) {
	timed(t)
	for range maxRecords + 5 {
		End(Begin(context.Background(), "/svc/Check"))
	}
	if records, dropped := Take(); len(records) != maxRecords || dropped != 5 {
		t.Errorf("kept %d, dropped %d; want %d and 5", len(records), dropped, maxRecords)
	}
	if records, dropped := Take(); len(records) != 0 || dropped != 0 {
		t.Errorf("a second Take: %d, %d; want nothing", len(records), dropped)
	}
}

// TestWriteRead: records read back as written (to the ns); a line that is not one is
// refused, naming it.
func TestWriteRead(t *testing.T) {
	begin := time.Unix(1_800_000_000, 123)
	in := []Record{
		{Method: "/devicehost.v1.DeviceHost/Reserve", Begin: begin, End: begin.Add(900 * time.Microsecond), Steps: []Span{
			{Name: "ledger: bolt commit", Begin: begin.Add(400 * time.Microsecond), End: begin.Add(700 * time.Microsecond), Nested: true},
			{Name: "ledger commit", Begin: begin.Add(390 * time.Microsecond), End: begin.Add(720 * time.Microsecond)},
		}},
		{Method: "/grpc.health.v1.Health/Check", Begin: begin, End: begin.Add(time.Microsecond)},
	}
	var buf bytes.Buffer
	if err := Write(&buf, in); err != nil {
		t.Fatal(err)
	}
	out, err := Read(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(in) {
		t.Fatalf("read %d records, want %d", len(out), len(in))
	}
	for i := range in {
		a, b := in[i], out[i]
		if a.Method != b.Method || !a.Begin.Equal(b.Begin) || !a.End.Equal(b.End) || len(a.Steps) != len(b.Steps) {
			t.Fatalf("record %d: %+v, wrote %+v", i, b, a)
		}
		for j := range a.Steps {
			if x, y := a.Steps[j], b.Steps[j]; x.Name != y.Name || !x.Begin.Equal(y.Begin) || !x.End.Equal(y.End) || x.Nested != y.Nested {
				t.Errorf("record %d step %d: %+v, wrote %+v", i, j, y, x)
			}
		}
	}
	for _, bad := range []string{"/m\t1\n", "/m\t1\t2\tplugin\t3\n", "/m\tx\t2\n", "/m\t1\t2\tplugin\t3\tfour\t-\n"} {
		if _, err := Read(strings.NewReader("/ok\t1\t2\n" + bad)); err == nil || !strings.Contains(err.Error(), "line 2") {
			t.Errorf("Read(%q): %v; want an error naming line 2", bad, err)
		}
	}
}
