package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/mattn/go-isatty"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

const statsUsage = `[-interval D] [-once] [-json] [-timeout D] [-vendor V] [-type T] [-name N]

Shows device statistics, refreshed every -interval until interrupted (a table that
redraws in place on a terminal; one JSON object per line with -json), or until
-timeout has passed. With -once, prints one sample and exits; a -vendor, -type or
-name that matches no device group is an error.`

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
	redraw := !*asJSON && !*once && isTerminal(env.stdout)
	shown := 0
	for u := range updates {
		if u.Disconnected() {
			// The CLI does not wait for the agent to come back: say why it went.
			return callError("stats", u.Err)
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
		if *asJSON {
			err = printJSONLine(env.stdout, resp)
		} else {
			if redraw {
				fmt.Fprint(env.stdout, clearScreen)
			}
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

// printStatsTable prints one table per group: a row per device, a column per metric.
func printStatsTable(w io.Writer, resp *pb.StatsResponse) error {
	fmt.Fprintf(w, "%s\n", formatTime(resp.GetTimestamp()))
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
		fmt.Fprintf(w, "\n%s (plugin %s)\n", cell(groupName(g.GetVendor(), g.GetType(), g.GetName())), cell(g.GetPlugin()))
		t := newTable(w, append([]string{"DEVICE"}, metrics...)...)
		for _, d := range g.GetDevices() {
			row := []string{d.GetDeviceId()}
			for _, m := range metrics {
				row = append(row, formatValue(d.GetValues()[m]))
			}
			t.row(row...)
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	return nil
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && isatty.IsTerminal(f.Fd())
}
