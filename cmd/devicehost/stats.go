package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/mattn/go-isatty"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

const statsUsage = `[-interval D] [-once] [-json] [-timeout D] [-vendor V] [-type T] [-name N]

Shows device statistics, refreshed every -interval until interrupted (a table that
redraws in place on a terminal; one JSON object per line with -json), or until
-timeout has passed. With -once, prints one sample and exits; a -vendor, -type or
-name that matches no device group is an error.

On a terminal (without -once or -json) each device's last minute of utilization,
memory (used, as a share of the total) and power is drawn as a sparkline before the
value, and the table stays through a disconnection, retrying, with a gap in the
lines. Into a pipe, the tables are printed one after another, without sparklines,
and a disconnection ends the command.`

// clearScreen moves the cursor home and clears the terminal.
const clearScreen = "\x1b[H\x1b[2J"

// onceTimeout is how long stats -once waits for its sample when -timeout is not given.
const onceTimeout = 30 * time.Second

// runStats is `devicehost stats`.
func runStats(ctx context.Context, env *cmdEnv, args []string) error {
	fs := newFlagSet(env, "stats", statsUsage)
	var cf clientFlags
	cf.register(fs, env)
	fs.DurationVar(&cf.timeout, "timeout", 0, "stop after this long, exit 0 if a sample was shown (0: until interrupted; with -once: how long to wait for the sample, default 30s)")
	interval := fs.Duration("interval", 0, "how often to refresh (0: the agent's sampling interval)")
	once := fs.Bool("once", false, "print one sample and exit")
	asJSON := fs.Bool("json", false, "print each sample as one line of JSON")
	vendor := fs.String("vendor", "", "only groups of this vendor")
	typ := fs.String("type", "", "only groups of this type")
	name := fs.String("name", "", "only groups of this name")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *interval < 0 {
		return usagef("-interval must not be negative")
	}
	if cf.timeout < 0 {
		return usagef("-timeout must not be negative")
	}
	if *once && cf.timeout == 0 {
		cf.timeout = onceTimeout
	}
	c, err := cf.connect(ctx)
	if err != nil {
		return err
	}
	defer c.Close()

	interrupted := ctx
	if cf.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cf.timeout)
		defer cancel()
	}
	var filters []*pb.GroupFilter
	if *vendor != "" || *typ != "" || *name != "" {
		filters = []*pb.GroupFilter{{Vendor: *vendor, Type: *typ, Name: *name}}
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	updates := c.WatchStats(watchCtx, *interval, filters...)
	var live *liveStats
	if width, ok := env.terminalOf(env.stdout); ok && !*asJSON && !*once {
		live = &liveStats{env: env, width: width, hist: newStatsHistory(*interval)}
	}
	shown := 0
	for u := range updates {
		if u.Disconnected() {
			if live == nil || !client.IsUnavailable(u.Err) {
				// Without a live view the CLI does not wait for the agent to come
				// back, nor for an error that waiting would not cure: say why it went.
				return callError("stats", u.Err)
			}
			live.hist.disconnected()
			if err := live.draw(fmt.Sprintf("agent unreachable, retrying in %v: %v", displayDuration(u.RetryIn), callError("stats", u.Err))); err != nil {
				return err
			}
			continue
		}
		resp := u.Snapshot
		if len(resp.GetGroups()) == 0 && filters != nil {
			// Nothing matched in this sample: a filter that matches no group of the
			// inventory is a mistake to report; a group not sampled yet is waited for.
			if err := checkFilterMatches(ctx, c, filters[0]); err != nil {
				return err
			}
			if *once {
				continue
			}
		}
		switch {
		case *asJSON:
			err = printJSONLine(env.stdout, resp)
		case live != nil:
			live.add(ctx, c, resp)
			err = live.draw("")
		default:
			err = printStatsTable(env.stdout, resp)
		}
		shown++
		if err != nil || *once {
			return err
		}
	}
	// The channel closes only when ctx ends: interrupted, or -timeout passed.
	switch {
	case interrupted.Err() != nil:
		return nil // interrupted: the normal way to stop
	case shown > 0:
		return nil // -timeout: watched for as long as asked
	case *once:
		return fmt.Errorf("stats: no sample within -timeout %v", cf.timeout)
	default:
		return fmt.Errorf("stats: no sample within -timeout %v (the agent samples every stats_interval; a longer -interval waits longer)", cf.timeout)
	}
}

// checkFilterMatches returns an error when no device group of the agent's inventory
// matches f (empty fields match anything), naming the groups there are.
func checkFilterMatches(ctx context.Context, c *client.Client, f *pb.GroupFilter) error {
	fp, err := c.Devices(ctx)
	if err != nil {
		return callError("fingerprint", err)
	}
	var names []string
	for _, g := range fp.GetGroups() {
		if (f.GetVendor() == "" || g.GetVendor() == f.GetVendor()) && (f.GetType() == "" || g.GetType() == f.GetType()) &&
			(f.GetName() == "" || g.GetName() == f.GetName()) {
			return nil
		}
		names = append(names, groupName(g.GetVendor(), g.GetType(), g.GetName()))
	}
	have := "the agent reports no device groups"
	if len(names) > 0 {
		have = "the agent's groups: " + strings.Join(names, ", ")
	}
	var asked []string
	for _, kv := range [][2]string{{"vendor", f.GetVendor()}, {"type", f.GetType()}, {"name", f.GetName()}} {
		if kv[1] != "" {
			asked = append(asked, fmt.Sprintf("-%s %q", kv[0], kv[1]))
		}
	}
	return fmt.Errorf("stats: no device group matches %s; %s", strings.Join(asked, " "), have)
}

// attrsTimeout bounds the live table's look-up of a new group's attributes.
const attrsTimeout = 2 * time.Second

// liveStats is the live stats table on a terminal: redrawn in place at each sample, with
// a sparkline of each device's last minute of utilization, memory and power. Owned by
// the stats loop.
type liveStats struct {
	env   *cmdEnv
	width int // the terminal's columns (0: unknown), asked again at each draw
	hist  *statsHistory
	last  *pb.StatsResponse // the latest sample, drawn again while disconnected
}

// add records a sample, looking up the attributes of groups new to the history (for the
// maximum a stat is drawn to) in the inventory; a failed look-up leaves the sparklines
// scaled to what they show.
func (l *liveStats) add(ctx context.Context, c *client.Client, resp *pb.StatsResponse) {
	l.last = resp
	if l.hist.needsAttrs(resp) {
		ctx, cancel := context.WithTimeout(ctx, attrsTimeout)
		fp, err := c.Devices(ctx)
		cancel()
		if err != nil {
			fp = nil
		}
		l.hist.setAttrs(resp, fp)
	}
	l.hist.add(resp)
}

// draw clears the screen and draws the latest sample with its sparklines, and status
// after the time when not empty, in one write.
func (l *liveStats) draw(status string) error {
	if width, ok := l.env.terminalOf(l.env.stdout); ok {
		l.width = width
	}
	var b bytes.Buffer
	b.WriteString(clearScreen)
	if err := writeStatsTables(&b, l.last, status, l.hist, l.width); err != nil {
		return err
	}
	_, err := l.env.stdout.Write(b.Bytes())
	return err
}

// printStatsTable prints one table per group: a row per device, a column per stat.
func printStatsTable(w io.Writer, resp *pb.StatsResponse) error {
	return writeStatsTables(w, resp, "", nil, 0)
}

// writeStatsTables is printStatsTable with status after the time line's time (when
// not empty) and, with h, h's sparkline in the cell of each charted stat (see
// chartsFor), as wide as lets the table fit termWidth columns (0: unknown,
// fixedSparkWidth), at least minSparkWidth.
func writeStatsTables(w io.Writer, resp *pb.StatsResponse, status string, h *statsHistory, termWidth int) error {
	line := formatTime(resp.GetTimestamp())
	if status != "" {
		line = strings.TrimSpace(line + "  " + cell(status))
	}
	fmt.Fprintln(w, line)
	if resp == nil {
		return nil // disconnected before the first sample
	}
	if len(resp.GetGroups()) == 0 {
		fmt.Fprintln(w, "no device stats (no device group has reported any yet)")
	}
	for _, g := range resp.GetGroups() {
		metricSet := map[string]bool{}
		for _, d := range g.GetDevices() {
			for m := range d.GetValues() {
				metricSet[m] = true
			}
		}
		metrics := make([]string, 0, len(metricSet))
		for m := range metricSet {
			metrics = append(metrics, m)
		}
		sort.Strings(metrics)
		header := append([]string{"DEVICE"}, metrics...)
		rows := make([][]string, 0, len(g.GetDevices()))
		for _, d := range g.GetDevices() {
			row := []string{cell(d.GetDeviceId())}
			for _, m := range metrics {
				row = append(row, cell(formatValue(d.GetValues()[m])))
			}
			rows = append(rows, row)
		}
		group := groupName(g.GetVendor(), g.GetType(), g.GetName())
		title := fmt.Sprintf("%s (plugin %s)", cell(group), cell(g.GetPlugin()))
		if charts := chartsFor(g); h != nil && len(charts) > 0 {
			budget := fixedSparkWidth
			if termWidth > 0 {
				cols := make([]int, len(charts))
				for i, c := range charts {
					cols[i] = 1 + slices.Index(metrics, c.column)
				}
				// Leave the last column free: a line that fills the terminal may wrap.
				budget = sparkBudget(header, rows, cols, termWidth-1)
			}
			l := h.layout(budget)
			title += fmt.Sprintf("  sparklines: the last %v, %v a character", displayDuration(l.span), displayDuration(l.char))
			for _, c := range charts {
				col := 1 + slices.Index(metrics, c.column)
				for i, d := range g.GetDevices() {
					rows[i][col] = h.spark(group, d.GetDeviceId(), c, l) + " " + rows[i][col]
				}
			}
		}
		fmt.Fprintf(w, "\n%s\n", title)
		t := newTable(w, header...)
		for _, row := range rows {
			t.rowEscaped(row...)
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	return nil
}

// sparkBudget is the widest sparkline (up to maxTicks characters; 0: none) that, put
// with a space before the cell of each of the columns cols, keeps a table of header and
// rows (escaped cells) within width columns.
func sparkBudget(header []string, rows [][]string, cols []int, width int) int {
	widths := make([]int, len(header)) // each column's widest cell
	for _, row := range append([][]string{header}, rows...) {
		for j, c := range row {
			widths[j] = max(widths[j], utf8.RuneCountInString(c))
		}
	}
	widest := func(j int) int { // column j's widest data cell
		w := 0
		for _, row := range rows {
			w = max(w, utf8.RuneCountInString(row[j]))
		}
		return w
	}
	for spark := maxTicks; spark > 0; spark-- {
		total := 2 * (len(widths) - 1) // two spaces between columns
		grown := slices.Clone(widths)
		for _, j := range cols {
			grown[j] = max(widths[j], widest(j)+1+spark)
		}
		for _, w := range grown {
			total += w
		}
		if total <= width {
			return spark
		}
	}
	return 0
}

// displayDuration rounds d for people: to a tenth of a second from a second up, else to
// a millisecond.
func displayDuration(d time.Duration) time.Duration {
	if d >= time.Second {
		return d.Round(time.Second / 10)
	}
	return d.Round(time.Millisecond)
}

// terminalOf reports whether w is a terminal and its width in columns (0: unknown).
func (env *cmdEnv) terminalOf(w io.Writer) (width int, ok bool) {
	if env.terminal != nil {
		return env.terminal(w)
	}
	f, ok := w.(*os.File)
	if !ok || !isatty.IsTerminal(f.Fd()) {
		return 0, false
	}
	return terminalWidth(f), true
}
