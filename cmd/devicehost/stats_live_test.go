package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// frameWriter is a terminal's stdout for the live stats table: each write (a whole
// redraw) arrives on frames.
type frameWriter struct{ frames chan string }

func (w frameWriter) Write(p []byte) (int, error) {
	select {
	case w.frames <- string(p):
		return len(p), nil
	default:
		return 0, errors.New("the test reads no more frames")
	}
}

// liveRun is devicehost running in-process with its stdout on a terminal.
type liveRun struct {
	frames chan string
	// wait waits for the run to end by itself; stop interrupts it and waits. Both
	// return its exit code and stderr.
	wait, stop func() (code int, stderr string)
}

// runLiveCLI runs devicehost with args as if stdout were a terminal of width columns.
// Cleanup stops it.
func runLiveCLI(t *testing.T, width int, args ...string) *liveRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	frames := make(chan string, 64)
	var stderr bytes.Buffer
	env := &cmdEnv{
		stdout:   frameWriter{frames},
		stderr:   &stderr,
		getenv:   func(string) string { return "" },
		terminal: func(io.Writer) (int, bool) { return width, true },
	}
	done := make(chan int, 1)
	go func() { done <- run(ctx, env, args) }()
	ended, code := false, 0
	wait := func() (int, string) {
		if !ended {
			ended = true
			code = <-done
		}
		return code, stderr.String()
	}
	stop := func() (int, string) {
		cancel()
		return wait()
	}
	t.Cleanup(func() { stop() })
	return &liveRun{frames: frames, wait: wait, stop: stop}
}

// next returns the next frame the run draws.
func (r *liveRun) next(t *testing.T) string {
	t.Helper()
	select {
	case f := <-r.frames:
		return f
	case <-time.After(10 * time.Second):
		t.Fatal("no frame drawn within 10s")
		return ""
	}
}

// statsWatch is one WatchStats call of the agent's: the test sends its samples on ch;
// done is closed once the agent has let go of the watch (its context ended).
type statsWatch struct {
	ch   chan device.StatsSnapshot
	done <-chan struct{}
}

// streamedStats is a fake manager whose stats streams the test feeds: each watch the
// agent opens arrives on streams.
func streamedStats(inventory device.Snapshot) (*devicetest.Fake, chan statsWatch) {
	streams := make(chan statsWatch, 4)
	return &devicetest.Fake{
		WatchFunc: watchOnce(inventory),
		WatchStatsFunc: func(ctx context.Context, _ time.Duration) <-chan device.StatsSnapshot {
			ch := make(chan device.StatsSnapshot)
			streams <- statsWatch{ch: ch, done: ctx.Done()}
			return ch
		},
	}, streams
}

func receive[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		var zero T
		t.Fatal("nothing received within 10s")
		return zero
	}
}

func send[T any](t *testing.T, ch chan<- T, v T) {
	t.Helper()
	select {
	case ch <- v:
	case <-time.After(10 * time.Second):
		t.Fatal("not taken within 10s")
	}
}

// gpuSample is a sample of one H100, GPU-0, at t0+at: utilization, memory used of
// 80 GiB, power.
func gpuSample(at time.Duration, util, memMiB int64, watts float64) device.StatsSnapshot {
	return device.StatsSnapshot{Time: t0.Add(at), Groups: []device.GroupStats{{
		GroupKey: h100, Plugin: "nvidia",
		Devices: []device.DeviceStats{{ID: "GPU-0", Values: map[string]device.Value{
			"gpu_utilization": {Kind: device.KindInt, Int: util, Unit: "%"},
			"memory_used":     {Kind: device.KindInt, Int: memMiB, Unit: "MiB"},
			"memory_total":    {Kind: device.KindInt, Int: 81920, Unit: "MiB"},
			"power":           {Kind: device.KindFloat, Float: watts, Unit: "W"},
		}}},
	}}}
}

// h100Inventory is one H100, GPU-0, with a power limit of 700 W.
func h100Inventory() device.Snapshot {
	return device.Snapshot{Time: t0, Inventory: device.Inventory{Groups: []device.Group{{
		GroupKey: h100, Plugin: "nvidia",
		Attributes: map[string]device.Value{"power_limit": {Kind: device.KindInt, Int: 700, Unit: "W"}},
		Devices:    []device.DeviceInfo{{ID: "GPU-0"}},
	}}}}
}

func TestStatsLiveDrawsSparklines(t *testing.T) {
	mgr, streams := streamedStats(h100Inventory())
	addr := startAgent(t, mgr)
	// Samples every 5s: a minute is 12 of them, one character each.
	live := runLiveCLI(t, 200, "stats", "-interval", "5s", "-address", addr)
	stream := receive(t, streams).ch

	// frame is what a redraw after the sample at t0+at shows.
	frame := func(at time.Duration, rows ...string) string {
		return clearScreen + formatTime(timestamppb.New(t0.Add(at))) + "\n\n" +
			"nvidia/gpu/NVIDIA H100 80GB HBM3 (plugin nvidia)  sparklines: the last 1m0s, 5s a character\n" +
			strings.Join(rows, "\n") + "\n"
	}
	steps := []struct {
		at          time.Duration
		util, mem   int64
		watts       float64
		header, row string
	}{
		// Utilization and memory (a share of memory_total) on 0-100, power up to the
		// inventory's power_limit of 700 W.
		{0, 0, 8192, 70,
			"DEVICE  gpu_utilization   memory_total  memory_used            power",
			"GPU-0              ▁ 0 %  81920 MiB                ▁ 8192 MiB             ▁ 70 W"},
		{5 * time.Second, 50, 40960, 350,
			"DEVICE  gpu_utilization    memory_total  memory_used             power",
			"GPU-0             ▁▅ 50 %  81920 MiB               ▁▅ 40960 MiB            ▁▅ 350 W"},
		{10 * time.Second, 100, 81920, 700,
			"DEVICE  gpu_utilization     memory_total  memory_used             power",
			"GPU-0            ▁▅█ 100 %  81920 MiB              ▁▅█ 81920 MiB           ▁▅█ 700 W"},
	}
	for _, s := range steps {
		send(t, stream, gpuSample(s.at, s.util, s.mem, s.watts))
		if got, want := live.next(t), frame(s.at, s.header, s.row); got != want {
			t.Fatalf("after the sample at +%v:\ngot\n%s\nwant\n%s", s.at, got, want)
		}
	}

	// The agent goes away: the table stays, saying so, with a gap after the last sample.
	close(stream)
	// Its first line is the last sample's time and the reason, with the retry's jitter.
	first, rest, _ := strings.Cut(live.next(t), "\n")
	wantFirst, wantRest, _ := strings.Cut(frame(10*time.Second,
		"DEVICE  gpu_utilization     memory_total  memory_used             power",
		"GPU-0           ▁▅█  100 %  81920 MiB             ▁▅█  81920 MiB          ▁▅█  700 W"), "\n")
	if !strings.HasPrefix(first, wantFirst+"  agent unreachable, retrying in ") || !strings.HasSuffix(first, "(Unavailable)") {
		t.Errorf("first line while disconnected = %q, want %q, then that the agent is unreachable and when it retries", first, wantFirst)
	}
	if rest != wantRest {
		t.Errorf("while disconnected:\ngot\n%s\nwant\n%s", rest, wantRest)
	}

	// It comes back: the watch reconnects by itself, and the history goes on after the gap.
	stream = receive(t, streams).ch
	send(t, stream, gpuSample(30*time.Second, 25, 20480, 175))
	if got, want := live.next(t), frame(30*time.Second,
		"DEVICE  gpu_utilization    memory_total  memory_used             power",
		"GPU-0          ▁▅█ ▃ 25 %  81920 MiB            ▁▅█ ▃ 20480 MiB         ▁▅█ ▃ 175 W"); got != want {
		t.Errorf("after reconnecting:\ngot\n%s\nwant\n%s", got, want)
	}

	if code, stderr := live.stop(); code != 0 || stderr != "" {
		t.Errorf("interrupted: exit %d, stderr %q; want 0 and nothing", code, stderr)
	}
}

func TestStatsOnATerminalWithoutSparklines(t *testing.T) {
	// -once and -json on a terminal print as they do into a pipe: one plain table, or
	// JSON lines; no sparkline, no clearing of the screen.
	mgr, streams := streamedStats(h100Inventory())
	addr := startAgent(t, mgr)

	once := runLiveCLI(t, 200, "stats", "-once", "-address", addr)
	onceWatch := receive(t, streams)
	send(t, onceWatch.ch, gpuSample(0, 42, 8192, 70))
	if code, stderr := once.wait(); code != 0 {
		t.Fatalf("stats -once: exit %d, stderr %q", code, stderr)
	}
	// The agent lets go of the -once stream's watch when that stream's handler ends,
	// after the CLI has returned. A stream opened before then joins that watch (which
	// has a value) and takes its first sample from a fresh watch of its own, ended at
	// once: the samples sent after it would go to no one. So wait for the agent to let go.
	receive(t, onceWatch.done)
	var out strings.Builder
	for len(once.frames) > 0 {
		out.WriteString(<-once.frames)
	}
	want := formatTime(timestamppb.New(t0)) + "\n\n" +
		"nvidia/gpu/NVIDIA H100 80GB HBM3 (plugin nvidia)\n" +
		"DEVICE  gpu_utilization  memory_total  memory_used  power\n" +
		"GPU-0   42 %             81920 MiB     8192 MiB     70 W\n"
	if got := out.String(); got != want {
		t.Errorf("stats -once on a terminal:\ngot\n%s\nwant\n%s", got, want)
	}

	asJSON := runLiveCLI(t, 200, "stats", "-json", "-address", addr)
	stream := receive(t, streams).ch
	for _, util := range []int64{10, 20} {
		send(t, stream, gpuSample(0, util, 8192, 70))
		got := asJSON.next(t)
		var resp pb.StatsResponse
		if err := protojson.Unmarshal([]byte(got), &resp); err != nil || strings.Count(got, "\n") != 1 {
			t.Fatalf("stats -json on a terminal printed %q (%v), want one line of JSON", got, err)
		}
		if v := resp.GetGroups()[0].GetDevices()[0].GetValues()["gpu_utilization"].GetIntValue(); v != util {
			t.Errorf("gpu_utilization = %d, want %d", v, util)
		}
	}
	if code, stderr := asJSON.stop(); code != 0 {
		t.Errorf("stats -json: exit %d, stderr %q", code, stderr)
	}
}
