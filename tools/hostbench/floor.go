package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	bolt "go.etcd.io/bbolt"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/internal/steps"
	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	pluginpb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/calltrace"
)

// The plugin agent -dev runs and its config (as cmd/devicehost's devPluginName and
// devPluginConfig), launched by the floor scenario too.
const (
	floorPlugin       = "nvidia-example"
	floorPluginConfig = `{"simulate":"dgxh100"}`
)

// floorSteps are the figures of one floor run, each in the order measured.
type floorSteps struct {
	reserve, release, unary, logged, plugin, commit []time.Duration
}

// floor is the floor scenario (see docs/benchmarks.md#reserve-end-to-end). The floor of a
// Reserve is a unary round trip to the agent, the plugin's Reserve called directly and
// one bbolt commit, the one the ledger makes (its record and its event, in a file opened
// with the ledger's bbolt options); of a Release, the round trip and the commit. It
// measures three views:
//
//   - alone: each part in a phase of its own, nothing else running (-floor-cycles
//     Reserve+Release cycles, both timed; as many health Checks, plugin Reserves and
//     bare commits);
//   - cold: as alone, with -floor-gap of idle before each call timed. Inside a Reserve
//     each part comes after such a pause (the plugin and the disk idle since the last
//     cycle, the caller asleep through the call), and on a VM a thread or vCPU woken
//     from idle costs far more than one kept busy by a tight loop: this view says how
//     much of a Reserve's excess over the alone floor is that;
//   - interleaved: -floor-block Reserve+Release cycles back to back (the Reserve timed)
//     taking turns with as many floor measurements, each of which times, in turn, a
//     health Check, a ListPlugins (a unary call the agent logs at INFO, as it does
//     Reserve), the plugin's Reserve and a bare commit;
//
// then, with an agent built with -tags cpuprofile, where a Reserve's time goes inside
// the agent (breakdown).
func (b *bench) floor(ctx context.Context) error {
	trace := b.trace
	if trace == "" && b.breakdown {
		f, err := os.CreateTemp("", "hostbench-trace")
		if err != nil {
			return err
		}
		trace = f.Name()
		f.Close()
		defer os.Remove(trace)
	}
	bb := *b
	bb.trace = trace // the agent's DEVICEHOST_TRACE
	if b.breakdown {
		f, err := os.CreateTemp("", "hostbench-steps")
		if err != nil {
			return err
		}
		bb.steps = f.Name() // the agent's DEVICEHOST_STEPS
		f.Close()
		defer os.Remove(bb.steps)
	}
	sess, err := bb.open(ctx, 0, append([]string{"-state-dir", "$DIR/state"}, b.agentFlags...)...)
	if err != nil {
		return err
	}
	defer sess.close()
	a, conn, c, d := sess.a, sess.conn, sess.c, sess.d
	// The cycles take turns over two devices, as a node's allocations take turns over
	// its GPUs: a Reserve of the device released the moment before waits for the
	// plugin's cleanup of it (docs/reservations.md), which is no part of the agent's.
	devs := [2]device{sess.d, sess.alt}
	turn := 0
	hc := healthpb.NewHealthClient(conn)

	bin, err := filepath.Abs(b.bin)
	if err != nil {
		return err
	}
	p, err := pluginloader.Launch(ctx, pluginloader.Binary{Name: floorPlugin, Path: bin, Args: []string{"plugin", floorPlugin}},
		pluginloader.Options{Logger: hclog.NewNullLogger(), ConfigJSON: []byte(floorPluginConfig)})
	if err != nil {
		return fmt.Errorf("launch the plugin for the floor: %w", err)
	}
	defer p.Kill(context.Background())

	// The same file system as the agent's state: a file beside its state dir.
	db, err := bolt.Open(filepath.Join(a.dir, "floor.db"), 0o600, nil)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := db.Update(func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucket([]byte("b")); err != nil {
			return err
		}
		_, err := tx.CreateBucket([]byte("e"))
		return err
	}); err != nil {
		return err
	}
	value := make([]byte, 300) // about a reservation record
	event := make([]byte, 200) // about its event

	var s floorSteps
	i := 0
	unary := func() error {
		start := time.Now()
		if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "devicehost.v1.DeviceHost"}); err != nil {
			return fmt.Errorf("health check: %w", err)
		}
		s.unary = append(s.unary, time.Since(start))
		return nil
	}
	logged := func() error {
		start := time.Now()
		if _, err := c.ListPlugins(ctx, &pb.ListPluginsRequest{}); err != nil {
			return fmt.Errorf("list plugins: %w", err)
		}
		s.logged = append(s.logged, time.Since(start))
		return nil
	}
	plugin := func() error {
		start := time.Now()
		if _, err := p.Client().Reserve(ctx, &pluginpb.ReserveRequest{DeviceIds: []string{d.id}}); err != nil {
			return fmt.Errorf("plugin reserve: %w", err)
		}
		s.plugin = append(s.plugin, time.Since(start))
		return nil
	}
	commit := func() error {
		i++
		start := time.Now()
		err := db.Update(func(tx *bolt.Tx) error {
			if err := tx.Bucket([]byte("b")).Put(fmt.Appendf(nil, "k%d", i%64), value); err != nil {
				return err
			}
			e := tx.Bucket([]byte("e"))
			e.FillPercent = 1
			return e.Put(binary.BigEndian.AppendUint64(nil, uint64(i)), event)
		})
		if err != nil {
			return fmt.Errorf("bbolt commit: %w", err)
		}
		s.commit = append(s.commit, time.Since(start))
		return nil
	}
	floorStep := func() error {
		for _, f := range []func() error{unary, logged, plugin, commit} {
			if err := f(); err != nil {
				return err
			}
		}
		return nil
	}
	// gappedCycle is one Reserve+Release, both timed, each after gap of idle.
	gappedCycle := func(gap time.Duration) error {
		dev := devs[turn%2]
		turn++
		time.Sleep(gap)
		start := time.Now()
		r, err := c.Reserve(ctx, &pb.ReserveRequest{
			OwnerId: benchOwner, Vendor: dev.group.GetVendor(), Type: dev.group.GetType(), Name: dev.group.GetName(),
			DeviceIds: []string{dev.id},
		})
		if err != nil {
			return fmt.Errorf("reserve: %w", err)
		}
		s.reserve = append(s.reserve, time.Since(start))
		time.Sleep(gap)
		start = time.Now()
		if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: r.GetReservationId()}}); err != nil {
			return fmt.Errorf("release: %w", err)
		}
		s.release = append(s.release, time.Since(start))
		return nil
	}
	cycle := func() error { return gappedCycle(0) }
	// A step is b.floorBlock Reserve+Release cycles back to back, as a caller making
	// them one after another does (each Release's plugin cleanup then overlaps the next
	// Reserve), then as many floor measurements.
	step := func() error {
		for range b.floorBlock {
			if err := cycle(); err != nil {
				return err
			}
		}
		for range b.floorBlock {
			if err := floorStep(); err != nil {
				return err
			}
		}
		return nil
	}
	for range max(50/b.floorBlock, 1) { // warm up
		if err := step(); err != nil {
			return err
		}
	}
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	p50, p99 := func(ds []time.Duration) float64 { return us(calltrace.Percentile(ds, 50)) }, func(ds []time.Duration) float64 { return us(calltrace.Percentile(ds, 99)) }

	// Alone: each part in its own phase.
	phase := func(f func() error) error {
		end := time.Now().Add(b.floorTime)
		for n := 0; n < b.floorCycles && (n < 100 || time.Now().Before(end)); n++ {
			if err := f(); err != nil {
				return err
			}
		}
		return nil
	}
	// phases runs each part in a phase of its own (the cycle, health Checks, the plugin's
	// Reserve, bare commits), each call timed after gap of idle.
	phases := func(gap time.Duration) (floorSteps, error) {
		s = floorSteps{}
		idle := func(f func() error) func() error {
			return func() error {
				time.Sleep(gap)
				return f()
			}
		}
		for _, f := range []func() error{func() error { return gappedCycle(gap) }, idle(unary), idle(plugin), idle(commit)} {
			if err := phase(f); err != nil {
				return floorSteps{}, err
			}
		}
		return s, nil
	}
	if bb.steps != "" {
		if _, err := a.takeSteps(bb.steps); err != nil { // from the warm-up: discarded
			fmt.Printf("timed steps: none (%v)\n", err)
			bb.steps = ""
		}
	}
	alone, err := phases(0)
	if err != nil {
		return err
	}
	fl := p50(alone.unary) + p50(alone.plugin) + p50(alone.commit)
	relFl := p50(alone.unary) + p50(alone.commit)
	row("Reserve p50, alone", p50(alone.reserve), "µs")
	row("Release p50, alone", p50(alone.release), "µs")
	row("Reserve over its floor, alone", p50(alone.reserve)/fl, "x")
	row("Release over its floor, alone", p50(alone.release)/relFl, "x")
	fmt.Printf("alone:       Reserve p50 %.0f µs; floor %.0f µs (unary %.0f + plugin %.0f + commit %.0f): x%.2f (goal <= 1.3)\n",
		p50(alone.reserve), fl, p50(alone.unary), p50(alone.plugin), p50(alone.commit), p50(alone.reserve)/fl)
	fmt.Printf("             Release p50 %.0f µs; floor %.0f µs (unary + commit): x%.2f; p99: Reserve %.0f, Release %.0f, unary %.0f, plugin %.0f, commit %.0f µs; %d of each\n",
		p50(alone.release), relFl, p50(alone.release)/relFl,
		p99(alone.reserve), p99(alone.release), p99(alone.unary), p99(alone.plugin), p99(alone.commit), len(alone.reserve))
	// The agent's steps, timed untraced through the alone phase's cycles.
	if bb.steps != "" {
		records, err := a.takeSteps(bb.steps)
		if err != nil {
			return err
		}
		calls := calltrace.FromSteps(records)
		fmt.Printf("timed: the alone phase's Reserve+Release cycles, the agent timing its steps untraced (Reserve p50 %.0f µs, Release %.0f µs seen by the caller)\n",
			p50(alone.reserve), p50(alone.release))
		breakdownRows(calls, "timed")
	}

	// Cold: each part alone again, after an idle gap.
	if b.floorGap > 0 {
		cold, err := phases(b.floorGap)
		if err != nil {
			return err
		}
		fl := p50(cold.unary) + p50(cold.plugin) + p50(cold.commit)
		relFl := p50(cold.unary) + p50(cold.commit)
		row("Reserve p50, cold", p50(cold.reserve), "µs")
		row("Reserve over its floor, cold", p50(cold.reserve)/fl, "x")
		row("Release over its floor, cold", p50(cold.release)/relFl, "x")
		fmt.Printf("cold:        Reserve p50 %.0f µs; floor %.0f µs (unary %.0f + plugin %.0f + commit %.0f): x%.2f (%s idle before each call)\n",
			p50(cold.reserve), fl, p50(cold.unary), p50(cold.plugin), p50(cold.commit), p50(cold.reserve)/fl, b.floorGap)
		fmt.Printf("             Release p50 %.0f µs; floor %.0f µs (unary + commit): x%.2f; %d of each\n",
			p50(cold.release), relFl, p50(cold.release)/relFl, len(cold.reserve))
	}

	// Interleaved: taking turns, in blocks.
	s = floorSteps{}
	stopProfiling, err := b.profile(a)
	if err != nil {
		return err
	}
	cpu0, err := a.cpu()
	if err != nil {
		return err
	}
	begin := time.Now()
	end := begin.Add(b.floorTime)
	for len(s.reserve) < b.floorCycles && (len(s.reserve) < 100 || time.Now().Before(end)) {
		if err := step(); err != nil {
			return err
		}
	}
	took := time.Since(begin)
	cpu1, err := a.cpu()
	if err != nil {
		return err
	}
	if err := stopProfiling(); err != nil {
		return err
	}
	n := len(s.reserve)
	fl = p50(s.unary) + p50(s.plugin) + p50(s.commit)
	row("Reserve p50, interleaved", p50(s.reserve), "µs")
	row("Reserve over its floor, interleaved", p50(s.reserve)/fl, "x")
	fmt.Printf("interleaved: Reserve p50 %.0f µs; floor %.0f µs (unary %.0f + plugin %.0f + commit %.0f): x%.2f (goal <= 1.3)\n",
		p50(s.reserve), fl, p50(s.unary), p50(s.plugin), p50(s.commit), p50(s.reserve)/fl)
	fmt.Printf("  p99: Reserve %.0f µs; unary %.0f, plugin %.0f, commit %.0f; ListPlugins (a unary the agent logs) p50 %.0f µs; %d cycles in %v; agent CPU %.0f µs a cycle (Reserve+Release+health+ListPlugins)\n",
		p99(s.reserve), p99(s.unary), p99(s.plugin), p99(s.commit),
		p50(s.logged), n, took.Round(time.Millisecond), us(cpu1-cpu0)/float64(n))

	if trace == "" {
		return nil
	}
	// Breakdown: the agent traced through Reserve+Release cycles made alone.
	if err := os.Remove(trace); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := a.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
		return err
	}
	s = floorSteps{}
	if err := phase(cycle); err != nil {
		return err
	}
	if err := a.stopProfiles(trace); err != nil {
		fmt.Printf("breakdown: none (%v)\n", err)
		return nil
	}
	data, err := os.ReadFile(trace)
	if err != nil {
		return err
	}
	calls, err := calltrace.Read(bytes.NewReader(data))
	if err != nil {
		return fmt.Errorf("read the agent's trace: %w", err)
	}
	fmt.Printf("breakdown: %d Reserve+Release cycles alone with the agent traced (Reserve p50 %.0f µs, Release %.0f µs seen by the caller)\n",
		len(s.reserve), p50(s.reserve), p50(s.release))
	breakdownRows(calls, "traced")
	if b.timeline {
		for _, method := range []string{pb.DeviceHost_Reserve_FullMethodName, pb.DeviceHost_Release_FullMethodName} {
			lines, err := calltrace.Timeline(data, method, 50, 300*time.Microsecond)
			if err != nil {
				return fmt.Errorf("timeline: %w", err)
			}
			fmt.Printf("timeline: %s\n", strings.Join(lines, "\n  "))
		}
	}
	return nil
}

// profile starts what b was asked to profile the agent with, -perf and -cpuprofile,
// and returns what stops them (once their files are written).
func (b *bench) profile(a *agent) (stop func() error, err error) {
	stopPerf := func() error { return nil }
	if b.perf != "" {
		if stopPerf, err = startPerf(a.cmd.Process.Pid, b.perf); err != nil {
			return nil, err
		}
	}
	if b.cpuProfile != "" {
		if err := os.Remove(b.cpuProfile); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, errors.Join(err, stopPerf()) // a file left from before would read as this run's
		}
		if err := a.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
			return nil, errors.Join(err, stopPerf())
		}
	}
	return func() error {
		if err := stopPerf(); err != nil {
			return err
		}
		if b.cpuProfile != "" {
			return a.stopProfiles(b.cpuProfile)
		}
		return nil
	}, nil
}

// startPerf runs `perf record -g` on process pid into out; stop ends it and waits until
// the file is written.
func startPerf(pid int, out string) (stop func() error, err error) {
	cmd := exec.Command("perf", "record", "-g", "-F", "4999", "-p", strconv.Itoa(pid), "-o", out)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("perf: %w", err)
	}
	time.Sleep(500 * time.Millisecond) // perf attaching; not a test
	return func() error {
		_ = cmd.Process.Signal(syscall.SIGINT)
		err := cmd.Wait()
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() <= 0 { // ended by the signal
			err = nil
		}
		return err
	}, nil
}

// takeSteps has an agent built with -tags cpuprofile and DEVICEHOST_STEPS=path write the
// calls it timed since it last did (SIGUSR2), and reads them. An agent without step
// timing writes nothing: an error after 5 s.
func (a *agent) takeSteps(path string) ([]steps.Record, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	if err := a.cmd.Process.Signal(syscall.SIGUSR2); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		f, err := os.Open(path)
		if err == nil {
			defer f.Close()
			return steps.Read(f)
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no timed steps from the agent after 5s (an agent without them, or not built with -tags cpuprofile)")
		}
		time.Sleep(10 * time.Millisecond) // polling for a file another process writes; not a test
	}
}

// stopProfiles ends the profiles an agent built with -tags cpuprofile took since
// SIGUSR1, and waits until their files (the paths not empty) are written.
func (a *agent) stopProfiles(paths ...string) error {
	if err := a.cmd.Process.Signal(syscall.SIGUSR2); err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, p := range paths {
		for p != "" {
			if _, err := os.Stat(p); err == nil {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("no %s from the agent after 30s (built with -tags cpuprofile?); its log: %s", p, a.log.Name())
			}
			time.Sleep(10 * time.Millisecond) // polling for a file another process writes; not a test
		}
	}
	return nil
}
