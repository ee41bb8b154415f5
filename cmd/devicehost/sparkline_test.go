package main

import (
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

func TestSparkline(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	tests := []struct {
		name   string
		points []float64
		top    float64
		want   string
	}{
		{"nothing", nil, 100, ""},
		{"each eighth", []float64{0, 12.5, 25, 37.5, 50, 62.5, 75, 87.5, 100}, 100, "▁▂▃▄▅▆▇██"},
		{"just under each eighth", []float64{12.4, 24.9, 99.9}, 100, "▁▂█"},
		{"to a maximum", []float64{0, 350, 700}, 700, "▁▅█"},
		{"gaps are spaces", []float64{nan, 50, nan, nan, 100}, 100, " ▅  █"},
		{"not finite is a gap", []float64{inf, -inf, 0}, 100, "  ▁"},
		{"out of range clamps", []float64{-5, 150}, 100, "▁█"},
		{"zero top", []float64{0, 3}, 0, "▁▁"},
		{"negative top", []float64{5}, -1, "▁"},
		{"NaN top", []float64{5}, nan, "▁"},
		{"infinite top", []float64{5}, inf, "▁"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := sparkline(tt.points, tt.top); got != tt.want {
				t.Errorf("sparkline(%v, %v) = %q, want %q", tt.points, tt.top, got, tt.want)
			}
		})
	}
}

func TestRingKeepsOnlyTheLast(t *testing.T) {
	r := newRing[int](maxTicks)
	for i := range 10_000 {
		r.push(i)
		if r.len() > maxTicks {
			t.Fatalf("after %d pushes len = %d, want at most %d", i+1, r.len(), maxTicks)
		}
	}
	if r.len() != maxTicks {
		t.Fatalf("len = %d, want %d", r.len(), maxTicks)
	}
	for i := range maxTicks {
		if got, want := r.at(i), 10_000-maxTicks+i; got != want {
			t.Fatalf("at(%d) = %d, want %d (the last %d, oldest first)", i, got, want, maxTicks)
		}
	}
}

func intVal(n int64, unit string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_IntValue{IntValue: n}, Unit: unit}
}

func floatVal(f float64, unit string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: f}, Unit: unit}
}

func TestChartsFor(t *testing.T) {
	nvidia := map[string]*pb.Value{ // what the nvidia-example plugin reports
		"gpu_utilization":        intVal(42, "%"),
		"memory_utilization":     intVal(7, "%"),
		"memory_used":            intVal(1000, "MiB"),
		"memory_total":           intVal(81920, "MiB"),
		"temperature":            intVal(50, "C"),
		"power":                  floatVal(300.5, "W"),
		"ecc_errors_corrected":   intVal(0, "count"),
		"ecc_errors_uncorrected": intVal(0, "count"),
	}
	tests := []struct {
		name    string
		devices []map[string]*pb.Value
		want    []chart
	}{
		{"nvidia-example", []map[string]*pb.Value{nvidia}, []chart{
			{column: "memory_used", unit: "MiB", of: "memory_total", percent: true},
			{column: "gpu_utilization", unit: "%", percent: true},
			{column: "power", unit: "W"},
		}},
		{"other names, by unit", []map[string]*pb.Value{{
			"zload":       intVal(3, "%"),
			"aload":       intVal(3, "%"),
			"hbm_used":    intVal(3, "GiB"),
			"hbm_free":    intVal(3, "GiB"),
			"board_power": floatVal(3, "W"),
		}}, []chart{
			{column: "hbm_used", unit: "GiB", of: "hbm_free", free: true, percent: true},
			{column: "aload", unit: "%", percent: true},
			{column: "board_power", unit: "W"},
		}},
		{"stats spread over devices", []map[string]*pb.Value{
			{"memory_used": intVal(1, "MiB")},
			{"memory_total": intVal(2, "MiB"), "power": intVal(3, "W")},
		}, []chart{
			{column: "memory_used", unit: "MiB", of: "memory_total", percent: true},
			{column: "power", unit: "W"},
		}},
		{"used and total in different units", []map[string]*pb.Value{{
			"memory_used": intVal(1, "MiB"), "memory_total": intVal(80, "GiB"),
		}}, nil},
		{"utilization not in percent, power not in watts", []map[string]*pb.Value{{
			"gpu_utilization": floatVal(0.5, ""), "power": intVal(300000, "mW"),
		}}, nil},
		{"not numbers", []map[string]*pb.Value{{
			"gpu_utilization": {Kind: &pb.Value_StringValue{StringValue: "high"}, Unit: "%"},
			"power":           {Kind: &pb.Value_BoolValue{BoolValue: true}, Unit: "W"},
		}}, nil},
		{"a percentage share is not also the utilization", []map[string]*pb.Value{{
			"x_used": intVal(1, "%"), "x_total": intVal(100, "%"),
		}}, []chart{{column: "x_used", unit: "%", of: "x_total", percent: true}}},
		{"no devices", nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := &pb.GroupStats{}
			for i, v := range tt.devices {
				g.Devices = append(g.Devices, &pb.DeviceStats{DeviceId: string(rune('a' + i)), Values: v})
			}
			got := chartsFor(g)
			if len(got) != len(tt.want) {
				t.Fatalf("chartsFor = %+v, want %+v", got, tt.want)
			}
			for i := range got {
				if got[i] != tt.want[i] {
					t.Errorf("chart %d = %+v, want %+v", i, got[i], tt.want[i])
				}
			}
		})
	}
}

func TestChartValue(t *testing.T) {
	share := chart{column: "memory_used", unit: "MiB", of: "memory_total", percent: true}
	free := chart{column: "mem_used", unit: "MiB", of: "mem_free", free: true, percent: true}
	power := chart{column: "power", unit: "W"}
	tests := []struct {
		name   string
		c      chart
		values map[string]*pb.Value
		want   float64
		ok     bool
	}{
		{"share of total", share, map[string]*pb.Value{"memory_used": intVal(20480, "MiB"), "memory_total": intVal(81920, "MiB")}, 25, true},
		{"share of used plus free", free, map[string]*pb.Value{"mem_used": intVal(30, "MiB"), "mem_free": intVal(10, "MiB")}, 75, true},
		{"no total", share, map[string]*pb.Value{"memory_used": intVal(1, "MiB")}, 0, false},
		{"zero total", share, map[string]*pb.Value{"memory_used": intVal(0, "MiB"), "memory_total": intVal(0, "MiB")}, 0, false},
		{"total in another unit", share, map[string]*pb.Value{"memory_used": intVal(1, "MiB"), "memory_total": intVal(80, "GiB")}, 0, false},
		{"plain", power, map[string]*pb.Value{"power": floatVal(301.5, "W")}, 301.5, true},
		{"missing", power, map[string]*pb.Value{}, 0, false},
		{"NaN", power, map[string]*pb.Value{"power": floatVal(math.NaN(), "W")}, 0, false},
		{"infinite", power, map[string]*pb.Value{"power": floatVal(math.Inf(1), "W")}, 0, false},
		{"this device's unit differs", power, map[string]*pb.Value{"power": intVal(300000, "mW")}, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := tt.c.value(tt.values)
			if got != tt.want || ok != tt.ok {
				t.Errorf("value = %v, %v; want %v, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}

var sparkGroup = groupName("acme", "gpu", "A1")

// statsAt is a sample of group acme/gpu/A1 at t0+at, with the given values by device ID
// (a nil map: the device is not in the sample).
func statsAt(at time.Duration, devices map[string]map[string]*pb.Value) *pb.StatsResponse {
	g := &pb.GroupStats{Vendor: "acme", Type: "gpu", Name: "A1", Plugin: "acme"}
	for id, v := range devices {
		if v != nil {
			g.Devices = append(g.Devices, &pb.DeviceStats{DeviceId: id, Values: v})
		}
	}
	return &pb.StatsResponse{Timestamp: timestamppb.New(t0.Add(at)), Groups: []*pb.GroupStats{g}}
}

func util(n int64) map[string]*pb.Value {
	return map[string]*pb.Value{"gpu_utilization": intVal(n, "%")}
}

var utilChart = chart{column: "gpu_utilization", unit: "%", percent: true}

// rightAligned pads s on the left with spaces to width characters.
func rightAligned(s string, width int) string {
	return strings.Repeat(" ", width-len([]rune(s))) + s
}

func TestHistoryDrawsTheLastMinute(t *testing.T) {
	t.Run("one character a tick, gaps where a value or the agent was missing", func(t *testing.T) {
		h := newStatsHistory(0)
		h.add(statsAt(0, map[string]map[string]*pb.Value{"d": util(0)}))
		h.add(statsAt(time.Second, map[string]map[string]*pb.Value{"d": {"temperature": intVal(40, "C")}})) // no utilization this time
		h.add(statsAt(2*time.Second, map[string]map[string]*pb.Value{"d": util(50)}))
		h.disconnected()
		h.disconnected() // retries of the same disconnection: one gap
		h.add(statsAt(3*time.Second, map[string]map[string]*pb.Value{"d": util(100)}))
		l := h.layout(200)
		if l.width != 60 || l.perChar != 1 {
			t.Fatalf("layout at 1s a tick = %+v, want 60 characters of 1 tick", l)
		}
		if got, want := h.spark(sparkGroup, "d", utilChart, l), rightAligned("▁ ▅ █", 60); got != want {
			t.Errorf("spark = %q, want %q", got, want)
		}
		if got := h.spark(sparkGroup, "other", utilChart, l); got != strings.Repeat(" ", 60) {
			t.Errorf("spark of a device with no history = %q, want spaces", got)
		}
	})

	t.Run("narrow: each character the highest of its ticks", func(t *testing.T) {
		h := newStatsHistory(0)
		// 60 ticks of 1s: utilization 100 at ticks 1, 6, 11, ... 56, else 0.
		for i := range 60 {
			v := int64(0)
			if (i+1)%5 == 1 {
				v = 100
			}
			h.add(statsAt(time.Duration(i)*time.Second, map[string]map[string]*pb.Value{"d": util(v)}))
		}
		l := h.layout(5) // under minSparkWidth: 12 characters of 5 ticks
		if l.width != 12 || l.perChar != 5 || l.span != time.Minute || l.char != 5*time.Second {
			t.Fatalf("layout = %+v, want 12 characters of 5 ticks, spanning 1m", l)
		}
		// Ticks 5..59 make 11 characters of 5, each with a 100; tick 60 (0) starts the
		// 12th; ticks 1..4 (a part character) are left out.
		if got, want := h.spark(sparkGroup, "d", utilChart, l), strings.Repeat("█", 11)+"▁"; got != want {
			t.Errorf("spark = %q, want %q", got, want)
		}
		// The next tick joins the last character instead of moving the line.
		h.add(statsAt(60*time.Second, map[string]map[string]*pb.Value{"d": util(50)}))
		if got, want := h.spark(sparkGroup, "d", utilChart, h.layout(5)), strings.Repeat("█", 11)+"▅"; got != want {
			t.Errorf("spark after one more tick = %q, want %q", got, want)
		}
		// A disconnection blanks its character, samples or not, and the line goes on.
		h.disconnected()
		h.add(statsAt(61*time.Second, map[string]map[string]*pb.Value{"d": util(50)}))
		for range 3 {
			h.add(statsAt(62*time.Second, map[string]map[string]*pb.Value{"d": util(100)}))
		}
		// Ticks 60..64 (0, 50, gap, 50, 100) and 65..66 (100, 100).
		if got, want := h.spark(sparkGroup, "d", utilChart, h.layout(5)), strings.Repeat("█", 10)+" █"; got != want {
			t.Errorf("spark after a disconnection = %q, want %q", got, want)
		}
	})

	t.Run("only the last minute, however long ago the rest was", func(t *testing.T) {
		h := newStatsHistory(0)
		h.add(statsAt(0, map[string]map[string]*pb.Value{"d": util(100), "gone": util(100)}))
		h.add(statsAt(time.Second, map[string]map[string]*pb.Value{"d": util(100), "gone": util(100)}))
		h.disconnected()
		// Back five minutes later: the samples before are older than a minute.
		h.add(statsAt(5*time.Minute, map[string]map[string]*pb.Value{"d": util(0)}))
		if got, want := h.spark(sparkGroup, "d", utilChart, h.layout(200)), rightAligned("▁", 60); got != want {
			t.Errorf("spark = %q, want %q", got, want)
		}
		if _, ok := h.series[seriesKey(sparkGroup, "gone", utilChart.column)]; ok {
			t.Errorf("a device absent for over a minute kept its history")
		}
	})

	t.Run("a device back within the minute keeps its history", func(t *testing.T) {
		h := newStatsHistory(0)
		h.add(statsAt(0, map[string]map[string]*pb.Value{"d": util(100)}))
		h.add(statsAt(time.Second, map[string]map[string]*pb.Value{"other": util(0)})) // d left (its plugin restarting)
		h.add(statsAt(2*time.Second, map[string]map[string]*pb.Value{"d": util(0)}))
		if got, want := h.spark(sparkGroup, "d", utilChart, h.layout(200)), rightAligned("█ ▁", 60); got != want {
			t.Errorf("spark = %q, want %q", got, want)
		}
	})

	t.Run("scaled to the limit the inventory reports, else to the line's highest", func(t *testing.T) {
		power := chart{column: "power", unit: "W"}
		watts := func(w float64) map[string]*pb.Value { return map[string]*pb.Value{"power": floatVal(w, "W")} }
		h := newStatsHistory(0)
		resp := statsAt(0, map[string]map[string]*pb.Value{"d": watts(70)})
		h.add(resp)
		h.add(statsAt(time.Second, map[string]map[string]*pb.Value{"d": watts(350)}))
		l := h.layout(200)
		if got, want := h.spark(sparkGroup, "d", power, l), rightAligned("▂█", 60); got != want {
			t.Errorf("without a limit: spark = %q, want %q (up to the highest, 350)", got, want)
		}
		for _, limit := range []*pb.Value{intVal(0, "W"), intVal(700000, "mW"), {Kind: &pb.Value_StringValue{StringValue: "700"}, Unit: "W"}} {
			h.setAttrs(resp, &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{{Vendor: "acme", Type: "gpu", Name: "A1",
				Attributes: map[string]*pb.Value{"power_limit": limit}}}})
			if got, want := h.spark(sparkGroup, "d", power, l), rightAligned("▂█", 60); got != want {
				t.Errorf("with a power_limit of %v: spark = %q, want %q (not a usable limit)", limit, got, want)
			}
		}
		h.setAttrs(resp, &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{{Vendor: "acme", Type: "gpu", Name: "A1",
			Attributes: map[string]*pb.Value{"power_limit": intVal(700, "W")}}}})
		if got, want := h.spark(sparkGroup, "d", power, l), rightAligned("▁▅", 60); got != want {
			t.Errorf("with power_limit 700 W: spark = %q, want %q", got, want)
		}
		if h.needsAttrs(resp) {
			t.Errorf("needsAttrs after a look-up = true, want false")
		}

		// Disconnected: the limit is looked up again, and used until then, or kept if
		// that look-up fails.
		h.disconnected()
		l = h.layout(200)
		if !h.needsAttrs(resp) {
			t.Errorf("needsAttrs after a disconnection = false, want true")
		}
		if got, want := h.spark(sparkGroup, "d", power, l), rightAligned("▁▅ ", 60); got != want {
			t.Errorf("disconnected: spark = %q, want %q", got, want)
		}
		h.setAttrs(resp, nil)
		if got, want := h.spark(sparkGroup, "d", power, l), rightAligned("▁▅ ", 60); got != want || h.needsAttrs(resp) {
			t.Errorf("after a failed look-up: spark = %q (needsAttrs %v), want %q (false)", got, h.needsAttrs(resp), want)
		}

		// A group that leaves the stats is looked up again when it comes back.
		h.add(&pb.StatsResponse{Timestamp: timestamppb.New(t0.Add(2 * time.Second))})
		if !h.needsAttrs(resp) {
			t.Errorf("needsAttrs for a group back in the stats = false, want true")
		}
	})
}

func TestHistoryIsBounded(t *testing.T) {
	// 10,000 samples 100ms apart of 3 devices, one of which changes ID every sample.
	h := newStatsHistory(0)
	for i := range 10_000 {
		h.add(statsAt(time.Duration(i)*100*time.Millisecond, map[string]map[string]*pb.Value{
			"a": util(int64(i % 101)), "b": util(0), strings.Repeat("x", i%300+1): util(1),
		}))
	}
	if h.ticks.len() != maxTicks {
		t.Errorf("ticks kept = %d, want %d", h.ticks.len(), maxTicks)
	}
	for key, s := range h.series {
		if s.len() > maxTicks {
			t.Errorf("series %q holds %d points, want at most %d", key, s.len(), maxTicks)
		}
	}
	// a, b, and the changing devices of the last maxTicks samples.
	if want := 2 + maxTicks; len(h.series) != want {
		t.Errorf("series kept = %d, want %d", len(h.series), want)
	}
	// At 100ms, 120 samples span 12s, drawn one a character.
	if l := h.layout(200); l.width != maxTicks || l.perChar != 1 || l.span != 12*time.Second {
		t.Errorf("layout at 100ms = %+v, want %d characters of one tick, spanning 12s", l, maxTicks)
	}
}

func TestHistoryPerTick(t *testing.T) {
	tests := []struct {
		name  string
		asked time.Duration
		at    []time.Duration // sample times; -1: a disconnection
		want  time.Duration
	}{
		{"nothing yet: 1s", 0, nil, time.Second},
		{"nothing yet: what was asked", 5 * time.Second, []time.Duration{0}, 5 * time.Second},
		{"steady", 0, []time.Duration{0, 2 * time.Second, 4 * time.Second, 6 * time.Second}, 2 * time.Second},
		{"the first sample comes early", 0, []time.Duration{0, 10 * time.Millisecond, 1010 * time.Millisecond, 2010 * time.Millisecond}, time.Second},
		{"a reconnection comes late", 0, []time.Duration{0, time.Second, 2 * time.Second, -1, 30 * time.Second}, time.Second},
		{"one stray", 0, []time.Duration{0, time.Second, 2 * time.Second, 3 * time.Second, 10 * time.Second}, time.Second},
		{"at least what was asked", 3 * time.Second, []time.Duration{0, time.Second, 2 * time.Second}, 3 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newStatsHistory(tt.asked)
			for _, at := range tt.at {
				if at < 0 {
					h.disconnected()
				} else {
					h.add(statsAt(at, nil))
				}
			}
			if got := h.perTick(); got != tt.want {
				t.Errorf("perTick = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestLiveTableFitsTheTerminal(t *testing.T) {
	// A minute of 1s samples; the table without sparklines is 23 columns wide:
	//   DEVICE  gpu_utilization
	//   d       42 %
	h := newStatsHistory(0)
	var resp *pb.StatsResponse
	for i := range 60 {
		resp = statsAt(time.Duration(i)*time.Second, map[string]map[string]*pb.Value{"d": util(42)})
		h.add(resp)
	}
	tests := []struct {
		termWidth int
		spark     int    // characters
		per       string // each character's time
	}{
		{200, 60, "1s"},
		{74, 60, "1s"}, // 8 + 60 + 1 + 4 = 73: fits, with the last column free
		{73, 30, "2s"}, // one short: two ticks a character
		{60, 30, "2s"},
		{40, 20, "3s"},
		{10, minSparkWidth, "5s"},  // narrower than the table: the narrowest line
		{0, fixedSparkWidth, "2s"}, // width unknown
	}
	for _, tt := range tests {
		var b strings.Builder
		if err := writeStatsTables(&b, resp, "", h, tt.termWidth); err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
		if want := "  sparklines: the last 1m0s, " + tt.per + " a character"; !strings.HasSuffix(lines[2], want) {
			t.Errorf("terminal %d: title %q, want it to end %q", tt.termWidth, lines[2], want)
		}
		if want := "d       " + strings.Repeat("▄", tt.spark) + " 42 %"; lines[4] != want {
			t.Errorf("terminal %d: row %q, want %q", tt.termWidth, lines[4], want)
		}
		for _, line := range lines[3:] {
			if n := utf8.RuneCountInString(line); tt.termWidth > 0 && tt.spark > minSparkWidth && n >= tt.termWidth {
				t.Errorf("terminal %d: line %q is %d columns, want fewer", tt.termWidth, line, n)
			}
		}
	}
}
