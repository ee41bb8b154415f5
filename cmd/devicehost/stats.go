package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"

	"github.com/mattn/go-isatty"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

const statsUsage = `[-interval D] [-once] [-json] [-vendor V] [-type T] [-name N]

Shows device statistics, refreshed every -interval until interrupted (a table that
redraws in place on a terminal; one JSON object per line with -json).`

// clearScreen moves the cursor home and clears the terminal.
const clearScreen = "\x1b[H\x1b[2J"

// runStats is `devicehost stats`.
func runStats(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "stats", statsUsage)
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
	c, err := cf.connect(ctx)
	if err != nil {
		return err
	}
	defer c.Close()

	req := &pb.StatsRequest{Interval: durationpb.New(*interval)}
	if *vendor != "" || *typ != "" || *name != "" {
		req.Groups = []*pb.GroupFilter{{Vendor: *vendor, Type: *typ, Name: *name}}
	}
	stream, err := c.Stats(ctx, req)
	if err != nil {
		return callError("stats", err)
	}
	redraw := !*asJSON && !*once && isTerminal(env.stdout)
	for {
		resp, err := stream.Recv()
		if err != nil {
			if ctx.Err() != nil && status.Code(err) == codes.Canceled {
				return nil // interrupted: the normal way to stop
			}
			if errors.Is(err, io.EOF) {
				return nil
			}
			return callError("stats", err)
		}
		if *asJSON {
			err = printJSONLine(env.stdout, resp)
		} else {
			if redraw {
				fmt.Fprint(env.stdout, clearScreen)
			}
			err = printStatsTable(env.stdout, resp)
		}
		if err != nil || *once {
			return err
		}
	}
}

// printStatsTable prints one table per group: a row per device, a column per metric.
func printStatsTable(w io.Writer, resp *pb.StatsResponse) error {
	fmt.Fprintf(w, "%s\n", formatTime(resp.GetTimestamp()))
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
		fmt.Fprintf(w, "\n%s (plugin %s)\n", groupName(g.GetVendor(), g.GetType(), g.GetName()), g.GetPlugin())
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
