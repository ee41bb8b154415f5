package main

import (
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// The live stats table draws each device's last minute of utilization, memory and power
// as a sparkline in the cell of that stat. These bound what it keeps and draws.
const (
	// sparkWindow is how far back a sparkline reaches.
	sparkWindow = time.Minute
	// maxTicks bounds the samples kept of every series, whatever the interval: under
	// sparkWindow/maxTicks (0.5s) a sparkline spans maxTicks samples, less than a minute.
	maxTicks = 120
	// minSparkWidth is the narrowest sparkline drawn, however narrow the terminal.
	minSparkWidth = 12
	// fixedSparkWidth is a sparkline's width when the terminal's width is unknown.
	fixedSparkWidth = 30
)

// sparkBlocks are the eight levels of a sparkline, lowest first.
var sparkBlocks = []rune("▁▂▃▄▅▆▇█")

// sparkline draws points on the scale 0 to top, one character each: the lowest block up
// to an eighth of top, the full block from seven eighths. A value below 0 or above top
// is drawn at the bottom or the top; a gap (NaN, or any value that is not finite)
// is a space. A top that is not positive and finite draws every value at the bottom.
func sparkline(points []float64, top float64) string {
	var b strings.Builder
	for _, p := range points {
		if math.IsNaN(p) || math.IsInf(p, 0) {
			b.WriteByte(' ')
			continue
		}
		level := 0
		if top > 0 && !math.IsInf(top, 0) {
			level = int(math.Floor(p / top * float64(len(sparkBlocks))))
		}
		b.WriteRune(sparkBlocks[min(max(level, 0), len(sparkBlocks)-1)])
	}
	return b.String()
}

// ring holds the last values pushed to it, up to its capacity; a push into a full ring
// drops the oldest. Not safe for concurrent use.
type ring[T any] struct {
	buf  []T // grows to cap(buf), then wraps
	next int // once full: the index of the oldest value, where the next push goes
}

func newRing[T any](capacity int) *ring[T] { return &ring[T]{buf: make([]T, 0, capacity)} }

func (r *ring[T]) push(v T) {
	if len(r.buf) < cap(r.buf) {
		r.buf = append(r.buf, v)
		return
	}
	r.buf[r.next] = v
	r.next = (r.next + 1) % len(r.buf)
}

func (r *ring[T]) len() int { return len(r.buf) }

// at returns the i-th oldest value (0 the oldest, len()-1 the newest).
func (r *ring[T]) at(i int) T { return r.buf[(r.next+i)%len(r.buf)] }

// tick is one step of the live table's history: a snapshot, or a disconnection.
type tick struct {
	n  uint64    // ticks counted from 1
	at time.Time // the snapshot's time; a disconnection has the time of the last one
	// first: the first snapshot of a stream, which the agent sends at once rather
	// than on its beat; gap: a disconnection.
	first, gap bool
}

// point is one sample of a series.
type point struct {
	tick uint64
	v    float64
}

// statsHistory is the last minute of each device's charted stats (see chartsFor), for
// the live stats table. Each snapshot added is a tick; a device that reports no value of
// a charted stat in a tick is a gap there, and so is a disconnection (one tick however
// long it lasts). A series with no sample in the last minute (its device gone, or no
// longer reporting the stat) is dropped; a device back within the minute keeps its
// history, with the gap. Memory is bounded: maxTicks points per series, series only for
// devices seen in the last minute. Not safe for concurrent use: one stats loop owns it.
type statsHistory struct {
	asked   time.Duration // the -interval asked for (0: the agent's)
	now     uint64        // the latest tick
	ticks   *ring[tick]
	series  map[string]*ring[point] // by seriesKey
	offline bool                    // a disconnection's tick is recorded and no snapshot came since

	// attrs are the attributes (by groupName) of the groups of the latest snapshot,
	// from the inventory, for the maximum a stat is drawn to (its "<stat>_limit");
	// looked up once per group, and again after a disconnection (stale).
	attrs map[string]map[string]*pb.Value
	stale bool
}

func newStatsHistory(asked time.Duration) *statsHistory {
	return &statsHistory{
		asked:  asked,
		ticks:  newRing[tick](maxTicks),
		series: make(map[string]*ring[point]),
		attrs:  make(map[string]map[string]*pb.Value),
	}
}

func seriesKey(group, device, stat string) string {
	return group + "\x00" + device + "\x00" + stat
}

// add records one snapshot.
func (h *statsHistory) add(resp *pb.StatsResponse) {
	first := h.now == 0 || h.offline
	h.offline = false
	h.now++
	h.ticks.push(tick{n: h.now, at: resp.GetTimestamp().AsTime(), first: first})
	for _, g := range resp.GetGroups() {
		group := groupName(g.GetVendor(), g.GetType(), g.GetName())
		for _, c := range chartsFor(g) {
			for _, d := range g.GetDevices() {
				v, ok := c.value(d.GetValues())
				if !ok {
					continue
				}
				key := seriesKey(group, d.GetDeviceId(), c.column)
				s := h.series[key]
				if s == nil {
					s = newRing[point](maxTicks)
					h.series[key] = s
				}
				s.push(point{tick: h.now, v: v})
			}
		}
	}
	for name := range h.attrs {
		if !slices.ContainsFunc(resp.GetGroups(), func(g *pb.GroupStats) bool {
			return groupName(g.GetVendor(), g.GetType(), g.GetName()) == name
		}) {
			delete(h.attrs, name) // looked up again if it comes back
		}
	}
	start := h.windowStart()
	for key, s := range h.series {
		if s.at(s.len()-1).tick < start {
			delete(h.series, key)
		}
	}
}

// disconnected records a disconnection as one tick without samples, once until the
// next snapshot, and marks the groups' attributes stale (the agent may come back
// changed); they are used until looked up again.
func (h *statsHistory) disconnected() {
	if h.offline || h.now == 0 {
		return
	}
	h.offline = true
	h.now++
	h.ticks.push(tick{n: h.now, at: h.ticks.at(h.ticks.len() - 1).at, gap: true})
	h.stale = true
}

// windowStart is the oldest tick within sparkWindow of the latest.
func (h *statsHistory) windowStart() uint64 {
	if h.ticks.len() == 0 {
		return 0
	}
	latest := h.ticks.at(h.ticks.len() - 1)
	start := latest.n
	for i := h.ticks.len() - 2; i >= 0; i-- {
		t := h.ticks.at(i)
		if latest.at.Sub(t.at) >= sparkWindow {
			break
		}
		start = t.n
	}
	return start
}

// perTick is the time between ticks: the upper median of the time between recent
// samples on the agent's beat (not counting the first sample of a stream, which comes at
// once, nor disconnections), at least the -interval asked for; before there is one,
// that interval or else 1s.
func (h *statsHistory) perTick() time.Duration {
	var gaps []time.Duration
	for i := 1; i < h.ticks.len(); i++ {
		prev, t := h.ticks.at(i-1), h.ticks.at(i)
		if prev.first || prev.gap || t.first || t.gap {
			continue
		}
		if d := t.at.Sub(prev.at); d > 0 {
			gaps = append(gaps, d)
		}
	}
	if len(gaps) == 0 {
		if h.asked > 0 {
			return h.asked
		}
		return time.Second
	}
	slices.Sort(gaps)
	return max(gaps[len(gaps)/2], h.asked)
}

// sparkLayout is how a group's sparklines are drawn: width characters, each the highest
// sample of perChar ticks (aligned to the tick count, so a character's ticks stay
// together as the line moves); they span span.
type sparkLayout struct {
	width, perChar int
	span, char     time.Duration
}

// layout fits a minute of ticks into budget characters (at least minSparkWidth; a
// budget of 0 or less: minSparkWidth), one tick a character when they fit.
func (h *statsHistory) layout(budget int) sparkLayout {
	every := h.perTick()
	// Rounded, not up: a clock's jitter must not make 60 ticks of 1s into 61.
	ticks := int(min(max((sparkWindow+every/2)/every, 1), maxTicks))
	width := min(max(budget, minSparkWidth), ticks)
	perChar := (ticks + width - 1) / width
	width = (ticks + perChar - 1) / perChar // no character left over
	return sparkLayout{width: width, perChar: perChar, span: time.Duration(ticks) * every, char: time.Duration(perChar) * every}
}

// points returns a series' characters under l, oldest first: the highest sample of each
// character's ticks within the window; NaN where there is none, and where one of its
// ticks is a disconnection, so that one shows however many ticks a character holds.
func (h *statsHistory) points(key string, l sparkLayout) []float64 {
	out := make([]float64, l.width)
	for i := range out {
		out[i] = math.NaN()
	}
	start, newest := h.windowStart(), h.now/uint64(l.perChar)
	// column is the character of tick n, or -1 when n is not drawn.
	column := func(n uint64) int {
		back := newest - n/uint64(l.perChar)
		if n < start || back >= uint64(l.width) {
			return -1
		}
		return l.width - 1 - int(back)
	}
	if s := h.series[key]; s != nil {
		for i := range s.len() {
			p := s.at(i)
			if j := column(p.tick); j >= 0 && (math.IsNaN(out[j]) || p.v > out[j]) {
				out[j] = p.v
			}
		}
	}
	for i := range h.ticks.len() {
		if t := h.ticks.at(i); t.gap {
			if j := column(t.n); j >= 0 {
				out[j] = math.NaN()
			}
		}
	}
	return out
}

// spark draws the sparkline of a device's charted stat c in group under l: a share or
// percentage on 0–100; any other stat up to the group's "<stat>_limit" attribute in the
// stat's unit when the inventory has one, else up to its highest value in the line.
func (h *statsHistory) spark(group, device string, c chart, l sparkLayout) string {
	pts := h.points(seriesKey(group, device, c.column), l)
	top := 100.0
	if !c.percent {
		var ok bool
		if top, ok = number(h.attrs[group][c.column+"_limit"], c.unit); !ok || top <= 0 {
			top = math.Inf(-1)
			for _, p := range pts {
				if !math.IsNaN(p) {
					top = max(top, p)
				}
			}
		}
	}
	return sparkline(pts, top)
}

// needsAttrs reports whether the groups' attributes are stale, or a group of resp has
// not had its attributes looked up.
func (h *statsHistory) needsAttrs(resp *pb.StatsResponse) bool {
	if h.stale {
		return true
	}
	for _, g := range resp.GetGroups() {
		if _, ok := h.attrs[groupName(g.GetVendor(), g.GetType(), g.GetName())]; !ok {
			return true
		}
	}
	return false
}

// setAttrs records the attributes of resp's groups from fp, the inventory, so each
// group is looked up once. A group fp lacks gets none (the highest value in a line
// scales it); when the look-up failed (fp nil), a group keeps what it had.
func (h *statsHistory) setAttrs(resp *pb.StatsResponse, fp *pb.FingerprintResponse) {
	h.stale = false
	found := make(map[string]map[string]*pb.Value)
	for _, g := range fp.GetGroups() {
		found[groupName(g.GetVendor(), g.GetType(), g.GetName())] = g.GetAttributes()
	}
	for _, g := range resp.GetGroups() {
		name := groupName(g.GetVendor(), g.GetType(), g.GetName())
		if _, known := h.attrs[name]; fp != nil || !known {
			h.attrs[name] = found[name]
		}
	}
}

// chart is a stat of a group that the live table draws a sparkline of, in the stat's
// cell.
type chart struct {
	column  string // the stat charted, whose cell the sparkline goes in
	unit    string // the unit the stat must have
	of      string // for a share: the stat holding the total (or, with free, what is free)
	free    bool
	percent bool // drawn on 0–100 (a percentage or a share), not up to a maximum
}

// chartsFor picks the stats of g to chart, by the nvidia-example plugin's names and
// else by unit, among the numeric values any device of g reports:
//   - utilization: gpu_utilization in %, else the first stat (by name) in %;
//   - memory: memory_used as a share of memory_total (or of itself plus memory_free),
//     else the first <x>_used with an <x>_total or <x>_free in the same unit;
//   - power: power in W, else the first stat in W.
func chartsFor(g *pb.GroupStats) []chart {
	units := make(map[string]string) // stat -> unit, as the first device reporting it has it
	for _, d := range g.GetDevices() {
		for name, v := range d.GetValues() {
			if _, seen := units[name]; !seen {
				if _, ok := number(v, v.GetUnit()); ok {
					units[name] = v.GetUnit()
				}
			}
		}
	}
	names := make([]string, 0, len(units))
	for name := range units {
		names = append(names, name)
	}
	sort.Strings(names)
	// Prefer the plugin's own name by trying it first.
	byPreference := func(preferred string) []string {
		return append([]string{preferred}, names...)
	}

	var charts []chart
	memory, memoryOf := "", ""
	for _, name := range byPreference("memory_used") {
		unit, ok := units[name]
		prefix, isUsed := strings.CutSuffix(name, "_used")
		if !ok || !isUsed {
			continue
		}
		if u, ok := units[prefix+"_total"]; ok && u == unit {
			charts = append(charts, chart{column: name, unit: unit, of: prefix + "_total", percent: true})
		} else if u, ok := units[prefix+"_free"]; ok && u == unit {
			charts = append(charts, chart{column: name, unit: unit, of: prefix + "_free", free: true, percent: true})
		} else {
			continue
		}
		memory, memoryOf = name, charts[0].of
		break
	}
	for _, name := range byPreference("gpu_utilization") {
		if u, ok := units[name]; ok && u == "%" && name != memory && name != memoryOf {
			charts = append(charts, chart{column: name, unit: u, percent: true})
			break
		}
	}
	for _, name := range byPreference("power") {
		if u, ok := units[name]; ok && u == "W" {
			charts = append(charts, chart{column: name, unit: u})
			break
		}
	}
	return charts
}

// value is the point c charts of a device's values: the stat, or its share in percent;
// false when the device lacks it, has it in another unit, or a share has no total.
func (c chart) value(values map[string]*pb.Value) (float64, bool) {
	v, ok := number(values[c.column], c.unit)
	if !ok || c.of == "" {
		return v, ok
	}
	total, ok := number(values[c.of], c.unit)
	if c.free {
		total += v
	}
	if !ok || total <= 0 {
		return 0, false
	}
	return 100 * v / total, true
}

// number is v as a float64 when it is a finite number in unit.
func number(v *pb.Value, unit string) (float64, bool) {
	if v == nil || v.GetUnit() != unit {
		return 0, false
	}
	var f float64
	switch k := v.GetKind().(type) {
	case *pb.Value_IntValue:
		f = float64(k.IntValue)
	case *pb.Value_FloatValue:
		f = k.FloatValue
	default:
		return 0, false
	}
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, false
	}
	return f, true
}
