package main

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/devicehost/devicehost/tools/calltrace"
)

// printBreakdown prints the breakdown of calls of method and returns its rows; the agent's own part is the
// whole call less the time spent in the external regions (the plugin, the ledger's
// commit; once where they overlap).
func printBreakdown(w io.Writer, method string, calls []calltrace.Call, external ...string) []calltrace.Row {
	rows := calltrace.Breakdown(calls, external...)
	if len(rows) == 0 {
		fmt.Fprintf(w, "  %s: no traced calls\n", method)
		return nil
	}
	fmt.Fprintf(w, "  %-58s %8s %8s\n", fmt.Sprintf("%s (%d calls), µs", method, len(calls)), "p50", "p99")
	for _, r := range rows {
		name := r.Name
		if name == calltrace.Own {
			name = fmt.Sprintf("%s (total less time in %s)", name, strings.Join(external, " or "))
		}
		fmt.Fprintf(w, "    %-56s %8.1f %8.1f\n", name, float64(r.P50)/1e3, float64(r.P99)/1e3)
	}
	return rows
}

// durableWrite names the steps in which the ledger waits for the disk: bbolt's commit,
// and, in agents with a write-ahead log (f5edf7d..c9e8f1f), the log's record and a
// checkpoint, so that scripts/bench -compare against such an agent computes its own part
// alike.
var durableWrite = []string{"ledger: log write", "ledger: checkpoint", "ledger: bolt commit"}

// breakdownRows prints the breakdown of the Reserve and Release calls of calls (the
// agent's own part: less the plugin and the ledger's durable write; goal p50 <= 100 µs
// for a Reserve) and makes each step a row named after view ("traced", "timed"), so
// that scripts/bench -compare shows every step before and after.
func breakdownRows(calls map[string][]calltrace.Call, view string) {
	for _, r := range printBreakdown(os.Stdout, "Reserve", calls["/devicehost.v1.DeviceHost/Reserve"], append([]string{"plugin"}, durableWrite...)...) {
		row("Reserve "+view+": "+r.Name+" p50", float64(r.P50)/1e3, "µs")
	}
	for _, r := range printBreakdown(os.Stdout, "Release", calls["/devicehost.v1.DeviceHost/Release"], durableWrite...) {
		row("Release "+view+": "+r.Name+" p50", float64(r.P50)/1e3, "µs")
	}
}
