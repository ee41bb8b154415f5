package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

const eventsUsage = `[-follow] [-owner ID] [-device ID] [-after SEQ] [-json] [-address ADDR]

Shows the audit trail: every change to the reservations and the cordons (and every
Reserve, Release and Reown the agent refused), with who made it (listener and peer),
oldest first, from what the ledger keeps (event_max_count, event_max_age). -follow goes
on with each new event; -after resumes after the last SEQ seen. An -owner ending in /
matches every owner under it.`

// runEvents is `devicehost events`.
func runEvents(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "events", eventsUsage)
	follow := fs.Bool("follow", false, "go on with new events until interrupted (or -timeout)")
	owner := fs.String("owner", "", "only events of this owner `ID` (ending in /: a prefix)")
	dev := fs.String("device", "", "only events of this device `ID`")
	after := fs.Uint64("after", 0, "only events after this `SEQ`")
	asJSON := fs.Bool("json", false, "one JSON object per event and line")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	timeoutSet := false
	fs.Visit(func(f *flag.Flag) { timeoutSet = timeoutSet || f.Name == "timeout" })
	if *follow && !timeoutSet {
		cf.timeout = 0 // until interrupted
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if cf.timeout > 0 {
		ctx, cancel = context.WithTimeout(ctx, cf.timeout)
		defer cancel()
	}
	cl, err := cf.connect(ctx)
	if err != nil {
		return err
	}
	defer cl.Close()
	stream, err := pb.NewDeviceHostClient(cl.Conn()).WatchEvents(ctx, &pb.WatchEventsRequest{AfterSeq: *after, Follow: *follow, OwnerId: *owner, DeviceId: *dev})
	if err != nil {
		return callError("events", err)
	}
	header := true
	last := *after
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			if header && !*asJSON {
				fmt.Fprintln(env.stdout, "no events")
			}
			return nil
		}
		if err != nil {
			// Watched for -timeout, as asked (the agent may end the call at its deadline
			// before the context here says so).
			if *follow && cf.timeout > 0 && (ctx.Err() != nil || status.Code(err) == codes.DeadlineExceeded) {
				return nil
			}
			return callError("events", err)
		}
		if resp.GetOldestSeq() > last+1 && last > 0 {
			fmt.Fprintf(env.stderr, "events %d to %d are no longer kept (event_max_count, event_max_age)\n", last+1, resp.GetOldestSeq()-1)
		}
		if err := printEvents(env.stdout, resp.GetEvents(), header, *asJSON); err != nil {
			return err
		}
		header = false
		if n := len(resp.GetEvents()); n > 0 {
			last = resp.GetEvents()[n-1].GetSeq()
		}
	}
}

// printEvents writes events as table rows (the header first when header) or JSON lines.
func printEvents(w io.Writer, events []*pb.Event, header, asJSON bool) error {
	if asJSON {
		for _, e := range events {
			if err := printJSONLine(w, e); err != nil {
				return err
			}
		}
		return nil
	}
	cols := []string{"SEQ", "TIME", "KIND", "BY", "OWNER", "DEVICES", "RESERVATIONS", "DETAIL"}
	t := newTable(w, cols...)
	if !header {
		t = newTableNoHeader(w)
	}
	for _, e := range events {
		kind := e.GetKind()
		if e.GetCall() != "" {
			kind += " " + e.GetCall()
		}
		owner := e.GetOwnerId()
		if e.GetNewOwnerId() != "" {
			owner += " -> " + e.GetNewOwnerId()
		}
		t.rowEscaped(strconv.FormatUint(e.GetSeq(), 10), cell(e.GetTime().AsTime().UTC().Format(time.RFC3339)), cell(kind),
			cell(e.GetBy()), cell(owner), cell(strings.Join(e.GetDeviceIds(), ",")), cell(strings.Join(e.GetReservationIds(), ",")), cell(e.GetDetail()))
	}
	return t.flush()
}
