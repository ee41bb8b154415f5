// Command hostbench measures the host API of a real agent process (`devicehost agent
// -dev`: the bundled nvidia-example plugin on a simulated DGX H100) under many open
// streams, over real gRPC on a Unix socket, and prints the figures. It is run by
// scripts/bench; nothing here passes or fails on a timing. Its scenarios and what each
// figure means: docs/benchmarks.md#hostbench.
//
// Usage: hostbench -agent bin/devicehost [-limits] [-only reserve,rss,fanout,stats,floor,callers,partition,mps]
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/calltrace"
	"github.com/devicehost/devicehost/tools/proc"
	"github.com/devicehost/devicehost/tools/rawgrpc"
)

func main() {
	agentBin := flag.String("agent", "", "devicehost `binary` to run as the agent (required)")
	limits := flag.Bool("limits", false, "write max_streams and max_streams_per_connection into the agent's config (an agent that has them)")
	streams := flag.Int("streams", 10000, "Fingerprint streams open in the reserve and rss scenarios")
	conns := flag.Int("conns", 100, "client connections the streams are spread over")
	watchers := flag.String("watchers", "1000,5000", "watcher counts of the fanout scenario")
	statsStreams := flag.Int("stats-streams", 1000, "Stats streams at 1s in the stats scenario")
	cycles := flag.Int("cycles", 300, "Reserve+Release cycles per p50 (fewer when -cycle-time runs out)")
	cycleTime := flag.Duration("cycle-time", 20*time.Second, "longest time one p50 measurement may take")
	floorCycles := flag.Int("floor-cycles", 1000, "floor scenario: calls of each phase (fewer when -floor-time runs out)")
	floorTime := flag.Duration("floor-time", time.Minute, "floor scenario: longest time one phase may take")
	agentFlags := flag.String("agent-flags", "", "floor scenario: more `flags` for the agent, space-separated; $DIR is its directory (e.g. \"-metrics-listen unix://$DIR/metrics.sock\")")
	floorGap := flag.Duration("floor-gap", time.Millisecond, "floor scenario: the cold view's idle time before each call it times, about a Reserve's length (0: no cold view)")
	floorBlock := flag.Int("floor-block", 10, "floor scenario: Reserve+Release cycles back to back between floor measurements (as many)")
	perfOut := flag.String("perf", "", "floor and fanout scenarios: record the agent's CPU during the loop, or the changes (run one watcher count), with `perf record -g` into this file")
	cpuProfile := flag.String("cpuprofile", "", "floor, partition and fanout scenarios: the agent's Go CPU profile during the (49-held) loop, or the changes (run one watcher count), into this `file` (an agent built with -tags cpuprofile)")
	traceOut := flag.String("trace", "", "floor scenario: keep the agent's execution trace of the breakdown phase in this `file`; partition scenario: the agent's execution trace during the 49-held loop (an agent built with -tags cpuprofile)")
	breakdown := flag.Bool("breakdown", true, "floor scenario: trace the agent through -floor-cycles more cycles and print where a Reserve's and a Release's time goes (an agent built with -tags cpuprofile)")
	timeline := flag.Bool("timeline", false, "floor scenario, with -breakdown: also print what every goroutine of the agent did around the median traced Reserve and Release (tools/calltrace.Timeline)")
	callersTime := flag.Duration("callers-time", 5*time.Second, "callers scenario: how long each caller count runs (after a warm-up as long)")
	only := flag.String("only", "reserve,rss,fanout,stats", "scenarios to run, comma-separated (floor, callers: see above)")
	rowsOut := flag.String("rows", "", "also write each headline figure as a `file` of tab-separated name, value, unit lines (scripts/bench -compare reads them)")
	grpcWatchers := flag.Bool("grpc-watchers", false, "fanout scenario: the watchers are grpc-go client streams (a goroutine each), not frame-level readers (tools/rawgrpc.Client)")
	hold := flag.String("hold", "", "internal: hold -streams reading Fingerprint streams on this `socket` until stdin closes")
	flag.Parse()
	if *hold != "" {
		if err := holdStreams(*hold, *streams, *conns); err != nil {
			fmt.Fprintf(os.Stderr, "hostbench -hold: %v\n", err)
			os.Exit(1)
		}
		return
	}
	if *agentBin == "" {
		fmt.Fprintln(os.Stderr, "hostbench: -agent is required")
		os.Exit(2)
	}
	b := &bench{
		bin: *agentBin, limits: *limits, streams: *streams, conns: *conns,
		cycles: *cycles, cycleTime: *cycleTime, grpcWatchers: *grpcWatchers, callersTime: *callersTime,
		floorCycles: *floorCycles, floorTime: *floorTime, breakdown: *breakdown, timeline: *timeline, floorBlock: max(*floorBlock, 1), floorGap: *floorGap, agentFlags: strings.Fields(*agentFlags), perf: *perfOut, cpuProfile: *cpuProfile, trace: *traceOut,
	}
	ctx := context.Background()
	var err error
	for _, sc := range strings.Split(*only, ",") {
		switch sc {
		case "reserve":
			err = b.reserve(ctx)
		case "rss":
			err = b.rss(ctx)
		case "fanout":
			var ns []int
			for _, f := range strings.Split(*watchers, ",") {
				n, perr := strconv.Atoi(f)
				if perr != nil {
					fmt.Fprintf(os.Stderr, "hostbench: -watchers %q: %v\n", *watchers, perr)
					os.Exit(2)
				}
				ns = append(ns, n)
			}
			err = b.fanout(ctx, ns)
		case "stats":
			err = b.stats(ctx, *statsStreams)
		case "floor":
			err = b.floor(ctx)
		case "callers":
			err = b.callers(ctx)
		case "partition":
			err = b.partition(ctx)
		case "mps":
			err = b.mps(ctx)
		default:
			fmt.Fprintf(os.Stderr, "hostbench: unknown scenario %q\n", sc)
			os.Exit(2)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "hostbench: %s: %v\n", sc, err)
			os.Exit(1)
		}
	}
	if *rowsOut != "" {
		if err := os.WriteFile(*rowsOut, rows.Bytes(), 0o644); err != nil {
			fmt.Fprintf(os.Stderr, "hostbench: -rows: %v\n", err)
			os.Exit(1)
		}
	}
}

// rows holds the headline figures of the scenarios run, one "name\tvalue\tunit" line
// each, for -rows.
var rows bytes.Buffer

// row records a headline figure. Names are stable: scripts/bench -compare matches the
// rows of two agents by them.
func row(name string, v float64, unit string) {
	fmt.Fprintf(&rows, "%s\t%g\t%s\n", name, v, unit)
}

type bench struct {
	bin       string
	limits    bool
	streams   int
	conns     int
	cycles    int
	cycleTime time.Duration
	// grpcWatchers: the fanout scenario's watchers are grpc-go streams.
	grpcWatchers bool
	callersTime  time.Duration

	floorCycles int
	floorTime   time.Duration
	floorBlock  int
	floorGap    time.Duration
	breakdown   bool
	timeline    bool
	agentFlags  []string
	perf        string
	cpuProfile  string // the agent's environment gets DEVICEHOST_CPUPROFILE
	trace       string // and DEVICEHOST_TRACE (see cmd/devicehost/cpuprofile.go)
	steps       string // and DEVICEHOST_STEPS
}

// agent is a running `devicehost agent -dev` in its own temporary directory.
type agent struct {
	cmd  *exec.Cmd
	dir  string
	sock string
	log  *os.File
}

// start runs a fresh agent and waits until its health is SERVING. maxStreams, when not
// zero and -limits is set, is written into its config file. extra are more agent flags;
// "$DIR" in one stands for the agent's directory.
func (b *bench) start(ctx context.Context, maxStreams int, extra ...string) (*agent, error) {
	dir, err := os.MkdirTemp("", "hostbench")
	if err != nil {
		return nil, err
	}
	return b.startIn(ctx, dir, maxStreams, append([]string{"-dev"}, extra...)...)
}

// startIn is start in dir (removed when the agent stops), with the agent flags given:
// start gives "-dev" and its extra.
func (b *bench) startIn(ctx context.Context, dir string, maxStreams int, extra ...string) (*agent, error) {
	var err error
	a := &agent{dir: dir, sock: filepath.Join(dir, "devicehost.sock")}
	args := []string{"agent", "-listen", "unix://" + a.sock}
	for _, e := range extra {
		args = append(args, strings.ReplaceAll(e, "$DIR", dir))
	}
	if b.limits && maxStreams > 0 {
		cfg := filepath.Join(dir, "devicehost.hcl")
		body := fmt.Sprintf("max_streams = %d\nmax_streams_per_connection = %d\n", maxStreams, (maxStreams+b.conns-1)/b.conns)
		if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
			return nil, err
		}
		args = append(args, "-config", cfg)
	}
	if a.log, err = os.Create(filepath.Join(dir, "agent.log")); err != nil {
		return nil, err
	}
	a.cmd = exec.Command(b.bin, args...)
	if b.cpuProfile != "" || b.trace != "" || b.steps != "" {
		a.cmd.Env = append(os.Environ(), "DEVICEHOST_CPUPROFILE="+b.cpuProfile, "DEVICEHOST_TRACE="+b.trace, "DEVICEHOST_STEPS="+b.steps)
	}
	a.cmd.Stdout, a.cmd.Stderr = a.log, a.log
	if err := a.cmd.Start(); err != nil {
		return nil, err
	}
	conn, err := a.dial()
	if err != nil {
		a.stop()
		return nil, err
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		resp, err := hc.Check(cctx, &healthpb.HealthCheckRequest{Service: "devicehost.v1.DeviceHost"})
		cancel()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return a, nil
		}
		if time.Now().After(deadline) {
			a.stop()
			return nil, fmt.Errorf("agent not SERVING after 2m (last: %v); its log: %s", err, a.log.Name())
		}
		time.Sleep(50 * time.Millisecond) // polling a starting process; not a test
	}
}

func (a *agent) dial() (*grpc.ClientConn, error) { return dial(a.sock) }

// session is a started agent, a connection to it and the first device it reports.
// close ends the connection, then the agent.
type session struct {
	a    *agent
	conn *grpc.ClientConn
	c    pb.DeviceHostClient
	d    device
	// alt is another device of d's group (d when there is none): the floor's cycles
	// take turns over the two.
	alt device
}

// open starts an agent as start does, dials it and finds its first device; on an
// error it stops what it started.
func (b *bench) open(ctx context.Context, maxStreams int, extra ...string) (*session, error) {
	a, err := b.start(ctx, maxStreams, extra...)
	if err != nil {
		return nil, err
	}
	conn, err := a.dial()
	if err != nil {
		a.stop()
		return nil, err
	}
	c := pb.NewDeviceHostClient(conn)
	ds, err := firstDevices(ctx, c, 2)
	if err != nil {
		conn.Close()
		a.stop()
		return nil, err
	}
	sess := &session{a: a, conn: conn, c: c, d: ds[0], alt: ds[0]}
	if len(ds) > 1 {
		sess.alt = ds[1]
	}
	return sess, nil
}

func (s *session) close() {
	s.conn.Close()
	s.a.stop()
}

// dial connects to the agent's socket as the host API's clients do (endpoint.Dial: its
// keepalive and fixed flow-control windows).
func dial(sock string) (*grpc.ClientConn, error) {
	a, err := endpoint.Parse("unix://" + sock)
	if err != nil {
		return nil, err
	}
	return endpoint.Dial(a, endpoint.TLS{})
}

// stop ends the agent with SIGTERM and removes its directory.
func (a *agent) stop() {
	if a.cmd.Process != nil {
		_ = a.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = a.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = a.cmd.Process.Kill()
			<-done
		}
	}
	a.log.Close()
	os.RemoveAll(a.dir)
}

// rssKiB is the agent process's resident set (VmRSS).
func (a *agent) rssKiB() (int, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", a.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(data), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			return strconv.Atoi(f[1])
		}
	}
	return 0, errors.New("no VmRSS")
}

// cpu is the agent process's user+system CPU time so far.
func (a *agent) cpu() (time.Duration, error) { return proc.CPU(a.cmd.Process.Pid) }

// changeGap is the quiet time before each change of the fanout scenario.
const changeGap = 500 * time.Millisecond

// benchOwner owns the reservations the bench makes.
const benchOwner = "hostbench-owner"

// device is one device of the agent's inventory, to reserve.
type device struct {
	group *pb.DeviceGroup
	id    string
}

// firstDevices returns up to n devices of the agent's first group that has any.
func firstDevices(ctx context.Context, c pb.DeviceHostClient, n int) ([]device, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		return nil, err
	}
	fp, err := s.Recv()
	if err != nil {
		return nil, err
	}
	for _, g := range fp.GetGroups() {
		var out []device
		for _, d := range g.GetDevices() {
			if out = append(out, device{group: g, id: d.GetId()}); len(out) == n {
				break
			}
		}
		if len(out) > 0 {
			return out, nil
		}
	}
	return nil, errors.New("the agent has no devices")
}

// cycle reserves d and releases it again.
func cycle(ctx context.Context, c pb.DeviceHostClient, d device) error {
	r, err := c.Reserve(ctx, &pb.ReserveRequest{
		OwnerId: benchOwner, Vendor: d.group.GetVendor(), Type: d.group.GetType(), Name: d.group.GetName(),
		DeviceIds: []string{d.id},
	})
	if err != nil {
		return fmt.Errorf("reserve: %w", err)
	}
	if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: r.GetReservationId()}}); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	return nil
}

// p50Cycle runs Reserve+Release cycles (b.cycles, or as many as fit in b.cycleTime)
// and returns their median and how many ran.
func (b *bench) p50Cycle(ctx context.Context, c pb.DeviceHostClient, d device) (time.Duration, int, error) {
	var ds []time.Duration
	end := time.Now().Add(b.cycleTime)
	for len(ds) < b.cycles && (len(ds) < 10 || time.Now().Before(end)) {
		start := time.Now()
		if err := cycle(ctx, c, d); err != nil {
			return 0, 0, err
		}
		ds = append(ds, time.Since(start))
	}
	return calltrace.Percentile(ds, 50), len(ds), nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond)) }

// openStreams opens n Fingerprint streams spread over conns new connections to sock and
// waits until each has its headers (the server's handler runs). With read set, each
// stream reads every message and onMsg (if not nil) gets its bytes. closeAll cancels
// every stream and closes the connections.
func openStreams(ctx context.Context, sock string, n, conns int, read bool, onMsg func(stream int, msg []byte, at time.Time)) (closeAll func(), received *atomic.Int64, err error) {
	ctx, cancel := context.WithCancel(ctx)
	var ccs []*grpc.ClientConn
	var wg sync.WaitGroup
	received = &atomic.Int64{}
	closeAll = func() {
		cancel()
		wg.Wait()
		for _, c := range ccs {
			c.Close()
		}
	}
	nconns := min(conns, n)
	desc := &grpc.StreamDesc{ServerStreams: true}
	opened := 0
	for i := range nconns {
		conn, err := dial(sock)
		if err != nil {
			closeAll()
			return nil, nil, err
		}
		ccs = append(ccs, conn)
		per := n / nconns
		if i < n%nconns {
			per++
		}
		errs := make(chan error, per)
		for range per {
			idx := opened
			opened++
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, err := conn.NewStream(ctx, desc, "/devicehost.v1.DeviceHost/Fingerprint", grpc.ForceCodecV2(rawgrpc.Codec{}))
				if err == nil {
					empty := []byte{} // an empty FingerprintRequest
					err = errors.Join(s.SendMsg(&empty), s.CloseSend())
				}
				if err == nil {
					var md metadata.MD
					if md, err = s.Header(); err == nil && md == nil {
						// Ended without headers: refused (e.g. over a stream limit).
						var msg []byte
						if err = s.RecvMsg(&msg); err == nil {
							err = errors.New("stream ended without headers")
						}
					}
				}
				errs <- err
				if err != nil || !read {
					<-ctx.Done()
					return
				}
				for {
					var msg []byte
					if err := s.RecvMsg(&msg); err != nil {
						return
					}
					received.Add(1)
					if onMsg != nil {
						onMsg(idx, msg, time.Now())
					}
				}
			}()
		}
		for range per {
			if err := <-errs; err != nil {
				closeAll()
				return nil, nil, fmt.Errorf("open stream on connection %d: %w", i, err)
			}
		}
	}
	return closeAll, received, nil
}

// openRawStreams opens n Fingerprint streams spread over conns new connections to sock,
// each connection read by a tools/rawgrpc.Client, and waits until each has its headers
// (the server's handler runs). onMsg gets every message's bytes, valid only until it
// returns. closeAll closes the connections and waits for their readers.
func openRawStreams(ctx context.Context, sock string, n, conns int, onMsg func(stream int, msg []byte, at time.Time)) (closeAll func(), err error) {
	var clients []*rawgrpc.Client
	var wg sync.WaitGroup
	closeAll = func() {
		for _, c := range clients {
			c.Close()
		}
		wg.Wait()
	}
	nconns := min(conns, n)
	opened := 0
	for i := range nconns {
		nc, err := net.Dial("unix", sock)
		if err != nil {
			closeAll()
			return nil, err
		}
		c, err := rawgrpc.NewClient(nc)
		if err != nil {
			nc.Close()
			closeAll()
			return nil, err
		}
		clients = append(clients, c)
		per := n / nconns
		if i < n%nconns {
			per++
		}
		base := opened
		opened += per
		// Stream IDs are 1, 3, 5, ... in the order opened: stream base+(id-1)/2.
		started := make(chan error, per)
		headers := make(map[uint32]bool, per) // used by Run's goroutine alone, which calls h
		h := rawgrpc.Handler{
			Headers: func(id uint32) {
				headers[id] = true
				started <- nil
			},
			Message: func(id uint32, msg []byte) { onMsg(base+int(id-1)/2, msg, time.Now()) },
			End: func(id uint32, err error) {
				if !headers[id] { // refused (e.g. over a stream limit)
					started <- fmt.Errorf("stream %d ended before its headers: %v", id, err)
				}
			},
		}
		ended := make(chan error, 1) // the connection's reader returned
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := c.Run(h)
			if err != nil {
				fmt.Fprintf(os.Stderr, "hostbench: watcher connection %d: %v\n", i, err)
			}
			ended <- err
		}()
		for range per {
			if _, err := c.Open("/devicehost.v1.DeviceHost/Fingerprint", nil); err != nil {
				closeAll()
				return nil, err
			}
		}
		for range per {
			select {
			case err = <-started:
			case err = <-ended:
				err = fmt.Errorf("the connection ended before its streams opened: %v", err)
			case <-ctx.Done():
				err = ctx.Err()
			}
			if err != nil {
				closeAll()
				return nil, fmt.Errorf("open stream on connection %d: %w", i, err)
			}
		}
	}
	return closeAll, nil
}

// holdStreams is the -hold mode: it opens n reading streams, says "ready", and when
// stdin closes says how many messages they got.
func holdStreams(sock string, n, conns int) error {
	closeAll, received, err := openStreams(context.Background(), sock, n, conns, true, nil)
	if err != nil {
		return err
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	got := received.Load()
	closeAll()
	fmt.Println(got)
	return nil
}

// holder is a -hold child process.
type holder struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
}

// startHolder runs a -hold child with n streams on a's socket and waits until they are
// open.
func (b *bench) startHolder(a *agent, n int) (*holder, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, "-hold", a.sock, "-streams", strconv.Itoa(n), "-conns", strconv.Itoa(b.conns))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	h := &holder{cmd: cmd, stdin: stdin, out: bufio.NewReader(stdout)}
	line, err := h.out.ReadString('\n')
	if err != nil || line != "ready\n" {
		h.stop()
		return nil, fmt.Errorf("stream holder: %q, %v", line, err)
	}
	return h, nil
}

// received returns how many messages its streams have had.
func (h *holder) stop() (received int64) {
	h.stdin.Close()
	line, _ := h.out.ReadString('\n')
	_ = h.cmd.Wait()
	received, _ = strconv.ParseInt(strings.TrimSpace(line), 10, 64)
	return received
}

func (b *bench) reserve(ctx context.Context) error {
	sess, err := b.open(ctx, b.streams)
	if err != nil {
		return err
	}
	defer sess.close()
	a, c, d := sess.a, sess.c, sess.d
	for range 30 { // warm up
		if err := cycle(ctx, c, d); err != nil {
			return err
		}
	}
	base, nb, err := b.p50Cycle(ctx, c, d)
	if err != nil {
		return err
	}
	h, err := b.startHolder(a, b.streams)
	if err != nil {
		return err
	}
	loaded, nl, err := b.p50Cycle(ctx, c, d)
	received := h.stop()
	if err != nil {
		return err
	}
	fmt.Printf("%-44s %s with 0 streams (%d cycles), %s with %d reading Fingerprint streams (%d cycles; %d messages to the streams): x%.2f\n",
		"Reserve+Release p50", ms(base), nb, ms(loaded), b.streams, nl, received, float64(loaded)/float64(base))
	return nil
}

func (b *bench) rss(ctx context.Context) error {
	sess, err := b.open(ctx, b.streams)
	if err != nil {
		return err
	}
	defer sess.close()
	a, c, d := sess.a, sess.c, sess.d
	for range 30 {
		if err := cycle(ctx, c, d); err != nil {
			return err
		}
	}
	rss0, err := a.rssKiB()
	if err != nil {
		return err
	}
	closeAll, _, err := openStreams(ctx, a.sock, b.streams, b.conns, false, nil)
	if err != nil {
		return err
	}
	defer closeAll()
	// Enough changes to fill every stream's flow-control window and the server's write
	// quota: what a client that never reads makes the agent hold.
	for range 100 {
		if err := cycle(ctx, c, d); err != nil {
			return err
		}
	}
	time.Sleep(2 * time.Second) // let the fan-out settle before reading RSS
	rss1, err := a.rssKiB()
	if err != nil {
		return err
	}
	fmt.Printf("%-44s %.1f KiB (%d streams over %d connections: RSS %d MiB, %d MiB before them; 200 changes sent)\n",
		"RSS per open never-reading Fingerprint stream", float64(rss1-rss0)/float64(b.streams), b.streams, min(b.conns, b.streams), rss1/1024, rss0/1024)
	return nil
}

func (b *bench) fanout(ctx context.Context, counts []int) error {
	for _, n := range counts {
		if err := b.fanoutOnce(ctx, n); err != nil {
			return err
		}
	}
	return nil
}

func (b *bench) fanoutOnce(ctx context.Context, n int) error {
	sess, err := b.open(ctx, n)
	if err != nil {
		return err
	}
	defer sess.close()
	a, c, d := sess.a, sess.c, sess.d

	// Every message after a stream's first is a change; its latency is the time it was
	// received minus the snapshot's own timestamp (same machine, same clock). heldBy
	// records what each stream saw last, so each change waits until every watcher has
	// seen it.
	var mu sync.Mutex
	var lat []time.Duration
	heldBy := make([]atomic.Bool, n)
	var measuring atomic.Bool
	owner := []byte(benchOwner)
	onMsg := func(stream int, msg []byte, at time.Time) {
		if measuring.Load() {
			ts, err := rawgrpc.FingerprintTime(msg)
			if err != nil {
				panic(err)
			}
			mu.Lock()
			lat = append(lat, at.Sub(ts))
			mu.Unlock()
		}
		heldBy[stream].Store(bytes.Contains(msg, owner)) // only d is ever held
	}
	open := openRawStreams
	if b.grpcWatchers {
		open = func(ctx context.Context, sock string, n, conns int, onMsg func(int, []byte, time.Time)) (func(), error) {
			closeAll, _, err := openStreams(ctx, sock, n, conns, true, onMsg)
			return closeAll, err
		}
	}
	closeAll, err := open(ctx, a.sock, n, b.conns, onMsg)
	if err != nil {
		return err
	}
	defer closeAll()
	const changes = 20
	measuring.Store(true)
	waitFor := func(held bool) error {
		deadline := time.Now().Add(time.Minute)
		for {
			seen := 0
			for i := range heldBy {
				if heldBy[i].Load() == held {
					seen++
				}
			}
			if seen == n {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("after 1m, %d of %d watchers saw the change", seen, n)
			}
			time.Sleep(time.Millisecond) // polling the recorder; not a test
		}
	}
	// The CPU a change costs is counted from before its call until every watcher has it
	// (the threads' run time, in ns), not through the quiet between changes, where the
	// agent's background work would count as the fan-out's.
	var agentCPU, selfCPU time.Duration
	runTimes := func() (agent, self time.Duration, err error) {
		if agent, err = proc.RunTime(a.cmd.Process.Pid); err != nil {
			return 0, 0, err
		}
		self, err = proc.RunTime(os.Getpid())
		return agent, self, err
	}
	change := func(call func() error, held bool) error {
		a0, s0, err := runTimes()
		if err != nil {
			return err
		}
		if err := call(); err != nil {
			return err
		}
		if err := waitFor(held); err != nil {
			return err
		}
		a1, s1, err := runTimes()
		if err != nil {
			return err
		}
		agentCPU += a1 - a0
		selfCPU += s1 - s0
		return nil
	}
	// Changes are isolated events, quiet apart; under a sustained stream of changes the
	// agent paces its fan-out instead (see server/internal/fanout).
	quiet := func() { time.Sleep(changeGap) }
	stopProfiling, err := b.profile(a)
	if err != nil {
		return err
	}
	for i := range changes / 2 {
		quiet()
		var id string
		if err := change(func() error {
			r, err := c.Reserve(ctx, &pb.ReserveRequest{
				OwnerId: benchOwner, Vendor: d.group.GetVendor(), Type: d.group.GetType(), Name: d.group.GetName(),
				DeviceIds: []string{d.id},
			})
			id = r.GetReservationId()
			return err
		}, true); err != nil {
			return fmt.Errorf("reserve %d: %w", i, err)
		}
		quiet()
		if err := change(func() error {
			_, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: id}})
			return err
		}, false); err != nil {
			return fmt.Errorf("release %d: %w", i, err)
		}
	}
	measuring.Store(false)
	if err := stopProfiling(); err != nil {
		return err
	}
	mu.Lock()
	defer mu.Unlock()
	perMsg := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / float64(len(lat)) }
	msf := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	row(fmt.Sprintf("fanout %d watchers p50", n), msf(calltrace.Percentile(lat, 50)), "ms")
	row(fmt.Sprintf("fanout %d watchers p99", n), msf(calltrace.Percentile(lat, 99)), "ms")
	row(fmt.Sprintf("fanout %d watchers agent CPU per change per 1000", n), perMsg(agentCPU), "ms")
	fmt.Printf("%-44s p50 %s, p99 %s (%d changes %v apart, %d messages; agent CPU %.1f µs a message, the watchers' own %.1f µs, from each call until every watcher had it)\n",
		fmt.Sprintf("Fingerprint change -> %d watchers", n), ms(calltrace.Percentile(lat, 50)), ms(calltrace.Percentile(lat, 99)), changes, changeGap, len(lat),
		perMsg(agentCPU), perMsg(selfCPU))
	return nil
}

func (b *bench) stats(ctx context.Context, n int) error {
	a, err := b.start(ctx, n)
	if err != nil {
		return err
	}
	defer a.stop()
	const window = 10 * time.Second
	measure := func() (float64, error) {
		c0, err := a.cpu()
		if err != nil {
			return 0, err
		}
		start := time.Now()
		time.Sleep(window)
		c1, err := a.cpu()
		if err != nil {
			return 0, err
		}
		return 100 * float64(c1-c0) / float64(time.Since(start)), nil
	}
	time.Sleep(2 * time.Second)
	idle, err := measure()
	if err != nil {
		return err
	}

	sctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	var received atomic.Int64
	nconns := min(b.conns, n)
	errs := make(chan error, n)
	for i := range nconns {
		conn, err := a.dial()
		if err != nil {
			return err
		}
		defer conn.Close()
		c := pb.NewDeviceHostClient(conn)
		per := n / nconns
		if i < n%nconns {
			per++
		}
		for range per {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, err := c.Stats(sctx, &pb.StatsRequest{Interval: durationpb.New(time.Second)})
				if err == nil {
					_, err = s.Recv()
				}
				errs <- err
				if err != nil {
					return
				}
				for {
					if _, err := s.Recv(); err != nil {
						return
					}
					received.Add(1)
				}
			}()
		}
	}
	for range n {
		if err := <-errs; err != nil {
			return fmt.Errorf("open Stats stream: %w", err)
		}
	}
	time.Sleep(2 * time.Second)
	r0 := received.Load()
	busy, err := measure()
	if err != nil {
		return err
	}
	fmt.Printf("%-44s %.2f%% of a core (idle agent %.2f%%; %d messages in %v)\n",
		fmt.Sprintf("Stats agent CPU, %d streams at 1s", n), busy, idle, received.Load()-r0, window)
	return nil
}
