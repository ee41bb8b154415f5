package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	bolt "go.etcd.io/bbolt"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	pluginpb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// The plugin agent -dev runs and its config (as cmd/devicehost's devPluginName and
// devPluginConfig), launched by the floor scenario too.
const (
	floorPlugin       = "nvidia-example"
	floorPluginConfig = `{"simulate":"dgxh100"}`
)

// floorSteps are the figures of one floor run, each in the order measured.
type floorSteps struct {
	reserve, unary, logged, plugin, commit []time.Duration
}

// floor is the floor scenario (see docs/benchmarks.md#hostbench): it takes turns between
// -floor-block Reserve+Release cycles (the Reserve timed) and as many floor measurements,
// each of which times, in turn, a health Check, a ListPlugins (a unary call the agent
// logs at INFO, as it does Reserve), the plugin's Reserve called directly and a bare
// bbolt commit.
func (b *bench) floor(ctx context.Context) error {
	sess, err := b.open(ctx, 0, append([]string{"-state-dir", "$DIR/state"}, b.agentFlags...)...)
	if err != nil {
		return err
	}
	defer sess.close()
	a, conn, c, d := sess.a, sess.conn, sess.c, sess.d
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
	if err := db.Update(func(tx *bolt.Tx) error { _, err := tx.CreateBucket([]byte("b")); return err }); err != nil {
		return err
	}
	value := make([]byte, 300) // about a reservation record

	var s floorSteps
	i := 0
	floorStep := func() error {
		i++
		start := time.Now()
		if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "devicehost.v1.DeviceHost"}); err != nil {
			return fmt.Errorf("health check: %w", err)
		}
		s.unary = append(s.unary, time.Since(start))

		start = time.Now()
		if _, err := c.ListPlugins(ctx, &pb.ListPluginsRequest{}); err != nil {
			return fmt.Errorf("list plugins: %w", err)
		}
		s.logged = append(s.logged, time.Since(start))

		start = time.Now()
		if _, err := p.Client().Reserve(ctx, &pluginpb.ReserveRequest{DeviceIds: []string{d.id}}); err != nil {
			return fmt.Errorf("plugin reserve: %w", err)
		}
		s.plugin = append(s.plugin, time.Since(start))

		start = time.Now()
		err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("b")).Put(fmt.Appendf(nil, "k%d", i), value) })
		if err != nil {
			return fmt.Errorf("bbolt commit: %w", err)
		}
		s.commit = append(s.commit, time.Since(start))
		return nil
	}
	cycle := func() error {
		start := time.Now()
		r, err := c.Reserve(ctx, &pb.ReserveRequest{
			OwnerId: benchOwner, Vendor: d.group.GetVendor(), Type: d.group.GetType(), Name: d.group.GetName(),
			DeviceIds: []string{d.id},
		})
		if err != nil {
			return fmt.Errorf("reserve: %w", err)
		}
		s.reserve = append(s.reserve, time.Since(start))
		if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: r.GetReservationId()}}); err != nil {
			return fmt.Errorf("release: %w", err)
		}
		return nil
	}
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
	s = floorSteps{}

	stopPerf := func() error { return nil }
	if b.perf != "" {
		if stopPerf, err = startPerf(a.cmd.Process.Pid, b.perf); err != nil {
			return err
		}
	}
	if b.cpuProfile != "" || b.trace != "" {
		for _, p := range []string{b.cpuProfile, b.trace} {
			if err := os.Remove(p); p != "" && err != nil && !errors.Is(err, os.ErrNotExist) {
				return err // a file left from before would read as this run's
			}
		}
		if err := a.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
			return err
		}
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
	if err := stopPerf(); err != nil {
		return err
	}
	if b.cpuProfile != "" || b.trace != "" {
		if err := a.stopProfiles(b.cpuProfile, b.trace); err != nil {
			return err
		}
	}

	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	n := len(s.reserve)
	res, un, pl, co := percentile(s.reserve, 50), percentile(s.unary, 50), percentile(s.plugin, 50), percentile(s.commit, 50)
	fl := un + pl + co
	fmt.Printf("Reserve end-to-end p50 %.0f µs; floor %.0f µs (unary %.0f + plugin %.0f + commit %.0f): x%.2f (goal <= 1.3)\n",
		us(res), us(fl), us(un), us(pl), us(co), float64(res)/float64(fl))
	fmt.Printf("  p99: Reserve %.0f µs; unary %.0f, plugin %.0f, commit %.0f; ListPlugins (a unary the agent logs) p50 %.0f µs; %d cycles in %v; agent CPU %.0f µs a cycle (Reserve+Release+health+ListPlugins)\n",
		us(percentile(s.reserve, 99)), us(percentile(s.unary, 99)), us(percentile(s.plugin, 99)), us(percentile(s.commit, 99)),
		us(percentile(s.logged, 50)), n, took.Round(time.Millisecond), us(cpu1-cpu0)/float64(n))
	return nil
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
