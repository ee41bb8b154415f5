// Command soak runs devicehost under kills and load (the plugin SIGKILLed under client
// load, then the agent itself) and prints what a user would want to know: kills,
// acknowledged reservations against those listed, recovery time, client errors and peak
// memory; it exits 1 if an acknowledged reservation was lost. It is not part of CI.
//
//	go run ./tools/soak [-duration 1m] [-kill-every 10s] [-clients 8]
//
// See docs/benchmarks.md#soak.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/proc"
)

func main() {
	duration := flag.Duration("duration", time.Minute, "length of each phase")
	killEvery := flag.Duration("kill-every", 10*time.Second, "time between kills")
	clients := flag.Int("clients", 8, "concurrent reserving clients (each its own connection)")
	bin := flag.String("bin", "", "devicehost binary to run (default: build ./cmd/devicehost)")
	flag.Parse()
	if err := run(*duration, *killEvery, *clients, *bin); err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		os.Exit(1)
	}
}

func run(duration, killEvery time.Duration, clients int, bin string) error {
	work, err := os.MkdirTemp("", "dhsoak")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	if bin == "" {
		bin = filepath.Join(work, "devicehost")
		fmt.Println("building ./cmd/devicehost ...")
		cmd := exec.Command("go", "build", "-o", bin, "./cmd/devicehost")
		cmd.Env = append(os.Environ(), "CGO_CFLAGS=-O2 -g -Wno-deprecated-declarations")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("build: %v\n%s", err, out)
		}
	}
	fmt.Printf("devicehost soak: 2 phases of %v; %d reserving clients, 2 watchers, 2 listers; a kill every %v\n\n",
		duration, clients, killEvery)
	ok1, err := phase(work, bin, "1", "plugin SIGKILL under concurrent clients", duration, killEvery, clients, killPlugin)
	if err != nil {
		return err
	}
	ok2, err := phase(work, bin, "2", "agent SIGKILL under Reserve load", duration, killEvery, clients, killAgent)
	if err != nil {
		return err
	}
	if !ok1 || !ok2 {
		return errors.New("acknowledged reservations were lost or not released: see above")
	}
	return nil
}

// agent is the running devicehost process of a phase, restarted on the same state dir.
type agent struct {
	bin, dir, sock string
	mu             sync.Mutex
	cmd            *exec.Cmd
	exited         chan struct{}
	peakAgentKiB   atomic.Int64
	peakPlugKiB    atomic.Int64
}

func (a *agent) start() error {
	cfg := filepath.Join(a.dir, "agent.hcl")
	// No garbage collection during the soak, so every released reservation stays listed.
	if err := os.WriteFile(cfg, []byte("gc_interval = \"24h\"\ngc_max_reservations = 1000000\n"), 0o600); err != nil {
		return err
	}
	cmd := exec.Command(a.bin, "agent", "-dev", "-config", cfg, "-state-dir", filepath.Join(a.dir, "state"),
		"-listen", "unix://"+a.sock, "-log-level", "warn")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Env = append(os.Environ(), "TMPDIR="+a.dir)
	logf, err := os.OpenFile(filepath.Join(a.dir, "agent.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return err
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); logf.Close(); close(exited) }()
	a.mu.Lock()
	a.cmd, a.exited = cmd, exited
	a.mu.Unlock()
	return nil
}

func (a *agent) pid() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.cmd.Process.Pid
}

// stop ends the agent (SIGTERM, then SIGKILL to its group) and waits for it.
func (a *agent) stop() {
	a.mu.Lock()
	cmd, exited := a.cmd, a.exited
	a.mu.Unlock()
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(15 * time.Second):
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
	}
}

// sampleRSS records the peak resident memory (VmHWM) of the agent and its plugin until
// ctx ends.
func (a *agent) sampleRSS(ctx context.Context) {
	for {
		pid := a.pid()
		a.peakAgentKiB.Store(max(a.peakAgentKiB.Load(), vmHWM(pid)))
		if p := childPID(pid, "plugin"); p != 0 {
			a.peakPlugKiB.Store(max(a.peakPlugKiB.Load(), vmHWM(p)))
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// killFunc kills part of the host once and returns when it is on its way back.
type killFunc func(a *agent) error

// killPlugin SIGKILLs the agent's plugin process; the agent restarts it.
func killPlugin(a *agent) error {
	p := childPID(a.pid(), "plugin")
	if p == 0 {
		return errors.New("no plugin process to kill")
	}
	return syscall.Kill(p, syscall.SIGKILL)
}

// killAgent SIGKILLs the agent (its plugin dies with it) and starts it again on the
// same state dir and socket.
func killAgent(a *agent) error {
	a.mu.Lock()
	cmd, exited := a.cmd, a.exited
	a.mu.Unlock()
	a.peakAgentKiB.Store(max(a.peakAgentKiB.Load(), vmHWM(cmd.Process.Pid)))
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	<-exited
	return a.start()
}

// tally counts errors by gRPC code and ErrorInfo reason.
type tally struct {
	mu sync.Mutex
	n  map[string]int
}

func (t *tally) add(err error) {
	key := status.Code(err).String()
	if r := client.Reason(err); r != "" {
		key += "/" + r
	}
	t.mu.Lock()
	t.n[key]++
	t.mu.Unlock()
}

func (t *tally) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.n) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(t.n)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, t.n[k]))
	}
	return strings.Join(parts, ", ")
}

// ledgerLog is what the clients were told: reservations acknowledged, releases
// acknowledged.
type ledgerLog struct {
	mu       sync.Mutex
	reserved map[string]bool // acknowledged reservation IDs
	released map[string]bool // of those, the ones whose release was acknowledged
	acks     []ack           // every acknowledged Reserve: when it was sent and answered
}

type ack struct{ sent, answered time.Time }

// firstAckSentAfter returns when the first Reserve sent after t was acknowledged.
func (l *ledgerLog) firstAckSentAfter(t time.Time) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var first time.Time
	for _, a := range l.acks {
		if a.sent.After(t) && (first.IsZero() || a.answered.Before(first)) {
			first = a.answered
		}
	}
	return first, !first.IsZero()
}

func phase(work, bin, num, title string, duration, killEvery time.Duration, clients int, kill killFunc) (bool, error) {
	dir := filepath.Join(work, "phase"+num)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return false, err
	}
	a := &agent{bin: bin, dir: dir, sock: filepath.Join(dir, "dh.sock")}
	if err := a.start(); err != nil {
		return false, err
	}
	defer a.stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rssCtx, stopRSS := context.WithCancel(ctx)
	var rssDone sync.WaitGroup
	rssDone.Add(1)
	go func() { defer rssDone.Done(); a.sampleRSS(rssCtx) }()
	defer func() { stopRSS(); rssDone.Wait() }()

	address := "unix://" + a.sock
	ctl, err := client.Dial(ctx, address, client.WithoutReachCheck())
	if err != nil {
		return false, err
	}
	defer ctl.Close()
	startCtx, cancelStart := context.WithTimeout(ctx, 3*time.Minute)
	group, gpus, err := healthyGroup(startCtx, ctl)
	cancelStart()
	if err != nil {
		return false, fmt.Errorf("phase %s: %w (log: %s)", num, err, filepath.Join(dir, "agent.log"))
	}

	errs := &tally{n: map[string]int{}}
	book := &ledgerLog{reserved: map[string]bool{}, released: map[string]bool{}}
	loadCtx, stopLoad := context.WithCancel(ctx)
	var load sync.WaitGroup
	defer func() { stopLoad(); load.Wait() }()
	var watchDrops, statsDrops, listCalls atomic.Int64
	for w := range clients {
		load.Add(1)
		go func() {
			defer load.Done()
			reserver(loadCtx, address, group, gpus[w%len(gpus)], fmt.Sprintf("soak-%s-%d", num, w), book, errs)
		}()
	}
	for range 2 {
		load.Add(2)
		go func() { defer load.Done(); watcher(loadCtx, address, &watchDrops, &statsDrops) }()
		go func() { defer load.Done(); lister(loadCtx, address, &listCalls, errs) }()
	}

	// Kill every killEvery until the phase ends, then once more: the last kill, whose
	// recovery is measured.
	kills := 0
	deadline := time.Now().Add(duration)
	for time.Now().Add(killEvery).Before(deadline) {
		time.Sleep(killEvery)
		if err := kill(a); err != nil {
			return false, fmt.Errorf("phase %s: kill: %w", num, err)
		}
		kills++
	}
	time.Sleep(time.Until(deadline))
	lastKill := time.Now()
	if err := kill(a); err != nil {
		return false, fmt.Errorf("phase %s: kill: %w", num, err)
	}
	kills++
	healthyAfter, firstReserveAfter, err := recovery(ctx, ctl, book, lastKill)
	if err != nil {
		return false, fmt.Errorf("phase %s: no recovery after the last kill: %w", num, err)
	}
	stopLoad()
	load.Wait()

	// One device at a time, to keep each answer small.
	state := map[string]pb.ReservationState{}
	for _, dev := range gpus {
		listed, err := ctl.Reservations(ctx, &pb.ListReservationsRequest{DeviceId: dev})
		if err != nil {
			return false, fmt.Errorf("phase %s: list: %w", num, err)
		}
		for _, r := range listed {
			state[r.GetReservationId()] = r.GetState()
		}
	}
	book.mu.Lock()
	missing, notReleased := 0, 0
	for id := range book.reserved {
		st, ok := state[id]
		switch {
		case !ok:
			missing++
		case book.released[id] && st != pb.ReservationState_RESERVATION_STATE_RELEASED:
			notReleased++
		}
	}
	acked, ackedReleases := len(book.reserved), len(book.released)
	book.mu.Unlock()

	stopRSS()
	rssDone.Wait()
	fmt.Printf("phase %s: %s (%v)\n", num, title, duration)
	fmt.Printf("  kills:                          %d\n", kills)
	fmt.Printf("  reserves acknowledged:          %d (releases acknowledged: %d)\n", acked, ackedReleases)
	fmt.Printf("  listed after the phase:         %d of %d acknowledged (%d missing, %d acknowledged releases not released); %d listed in all\n",
		acked-missing, acked, missing, notReleased, len(state))
	fmt.Printf("  recovery after the last kill:   %v to %d healthy devices, %v to the first Reserve sent after it acknowledged\n",
		healthyAfter.Round(time.Millisecond), len(gpus), firstReserveAfter.Round(time.Millisecond))
	fmt.Printf("  watch disconnections seen:      %d (devices), %d (stats); list/plugin calls: %d\n",
		watchDrops.Load(), statsDrops.Load(), listCalls.Load())
	fmt.Printf("  errors by code/reason:          %s\n", errs)
	fmt.Printf("  peak RSS:                       agent %.1f MiB, plugin %.1f MiB\n\n",
		float64(a.peakAgentKiB.Load())/1024, float64(a.peakPlugKiB.Load())/1024)
	return missing == 0 && notReleased == 0, nil
}

// healthyGroup waits for the agent to serve its 8 GPUs healthy and returns their group
// and IDs.
func healthyGroup(ctx context.Context, c *client.Client) (*pb.DeviceGroup, []string, error) {
	for u := range c.WatchDevices(ctx) {
		if u.Disconnected() {
			continue
		}
		if g, ids := allHealthy(u.Snapshot); g != nil {
			return g, ids, nil
		}
	}
	return nil, nil, fmt.Errorf("no healthy devices: %w", ctx.Err())
}

// allHealthy returns the first group and its device IDs when every device is healthy.
func allHealthy(fp *pb.FingerprintResponse) (*pb.DeviceGroup, []string) {
	if len(fp.GetGroups()) == 0 {
		return nil, nil
	}
	var ids []string
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetHealth() != pb.Health_HEALTH_HEALTHY {
				return nil, nil
			}
			ids = append(ids, d.GetId())
		}
	}
	return fp.GetGroups()[0], ids
}

// recovery measures, from the last kill, the time to every device healthy again (seen
// by a watch that reconnects by itself) and to the first Reserve of the load that was
// sent after the kill and acknowledged.
func recovery(ctx context.Context, c *client.Client, book *ledgerLog, lastKill time.Time) (healthy, reserved time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	sawDown := false
	for u := range c.WatchDevices(ctx) {
		if u.Disconnected() {
			sawDown = true
			continue
		}
		if h, _ := allHealthy(u.Snapshot); h == nil {
			sawDown = true
			continue
		}
		// A snapshot from before the kill took effect does not count.
		if sawDown || time.Since(lastKill) > 30*time.Second {
			healthy = time.Since(lastKill)
			break
		}
	}
	if healthy == 0 {
		return 0, 0, fmt.Errorf("devices not healthy again: %w", ctx.Err())
	}
	for ctx.Err() == nil {
		if at, ok := book.firstAckSentAfter(lastKill); ok {
			return healthy, at.Sub(lastKill), nil
		}
		time.Sleep(5 * time.Millisecond)
	}
	return 0, 0, fmt.Errorf("no Reserve acknowledged: %w", ctx.Err())
}

// reserver reserves dev for a fresh owner and releases it, over and over, recording
// what was acknowledged. A device held by a reservation of its own whose answer was
// lost to a kill is released (the holder comes from IsHeld).
func reserver(ctx context.Context, address string, g *pb.DeviceGroup, dev, prefix string, book *ledgerLog, errs *tally) {
	c, err := client.Dial(ctx, address, client.WithoutReachCheck())
	if err != nil {
		errs.add(err)
		return
	}
	defer c.Close()
	for i := 0; ctx.Err() == nil; i++ {
		sent := time.Now()
		res, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: fmt.Sprintf("%s-%d", prefix, i), Vendor: g.GetVendor(),
			Type: g.GetType(), Name: g.GetName(), DeviceIds: []string{dev}})
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			errs.add(err)
			if held, ok := client.IsHeld(err); ok {
				for _, h := range held.GetConflicts() {
					if strings.HasPrefix(h.GetOwnerId(), prefix+"-") && h.GetReservationId() != "" {
						c.ReleaseReservation(ctx, h.GetReservationId()) // unacknowledged, ours: free it
					}
				}
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		id := res.GetReservationId()
		book.mu.Lock()
		book.reserved[id] = true
		book.acks = append(book.acks, ack{sent, time.Now()})
		book.mu.Unlock()
		for ctx.Err() == nil { // Release is idempotent: retry until acknowledged
			if _, err := c.ReleaseReservation(ctx, id); err != nil {
				if ctx.Err() == nil {
					errs.add(err)
				}
				time.Sleep(10 * time.Millisecond)
				continue
			}
			book.mu.Lock()
			book.released[id] = true
			book.mu.Unlock()
			break
		}
	}
}

// watcher reads the device and stats watches until ctx ends, counting disconnections.
func watcher(ctx context.Context, address string, devDrops, statsDrops *atomic.Int64) {
	c, err := client.Dial(ctx, address, client.WithoutReachCheck())
	if err != nil {
		return
	}
	defer c.Close()
	devices, stats := c.WatchDevices(ctx), c.WatchStats(ctx, 0)
	for devices != nil || stats != nil {
		select {
		case u, ok := <-devices:
			if !ok {
				devices = nil
			} else if u.Disconnected() {
				devDrops.Add(1)
			}
		case u, ok := <-stats:
			if !ok {
				stats = nil
			} else if u.Disconnected() {
				statsDrops.Add(1)
			}
		}
	}
}

// lister lists reservations and plugins every 50ms until ctx ends.
func lister(ctx context.Context, address string, calls *atomic.Int64, errs *tally) {
	c, err := client.Dial(ctx, address, client.WithoutReachCheck())
	if err != nil {
		return
	}
	defer c.Close()
	for ctx.Err() == nil {
		_, err1 := c.Reservations(ctx, &pb.ListReservationsRequest{State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
		_, err2 := c.Plugins(ctx)
		for _, err := range []error{err1, err2} {
			if err != nil && ctx.Err() == nil {
				errs.add(err)
			}
		}
		calls.Add(2)
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// childPID returns the child of parent whose command line contains arg, or 0.
func childPID(parent int, arg string) int {
	kids, _ := proc.Children(parent)
	for _, p := range kids {
		if slices.Contains(p.Argv, arg) {
			return p.PID
		}
	}
	return 0
}

// vmHWM returns a process's peak resident set size in KiB, or 0.
func vmHWM(pid int) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n
		}
	}
	return 0
}
