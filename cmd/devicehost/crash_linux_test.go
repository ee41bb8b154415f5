package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// The crash tests run the built binary as `agent -dev` on a state dir that outlives the
// agent, SIGKILL it, and start it again on the same state dir.

// noGCConfig puts garbage collection off for the length of a test, so every released
// reservation is still listed after the restart and can be checked.
const noGCConfig = `
gc_interval         = "24h"
gc_max_reservations = 1000000
`

// loadAcksBeforeKill is how many Reserves the load must have had acknowledged before
// the agent is killed.
const loadAcksBeforeKill = 500

// agentSetup is a socket, config file and state dir that agents can be started on one
// after the other.
type agentSetup struct {
	addr     endpoint.Address
	stateDir string
	args     []string
}

// newAgentSetup writes config to a config file in a fresh directory and returns the
// `agent -dev` command line that uses it, a state dir beside it (which -dev keeps: only
// its own temporary directory is removed on exit) and a socket there.
func newAgentSetup(t *testing.T, config string) agentSetup {
	t.Helper()
	dir := tempDir(t, "dhcrash")
	cfgPath := filepath.Join(dir, "agent.hcl")
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	s := agentSetup{
		addr:     endpoint.Address{Network: "unix", Path: filepath.Join(dir, "devicehost.sock")},
		stateDir: filepath.Join(dir, "state"),
	}
	s.args = []string{"agent", "-dev", "-log-json", "-config", cfgPath, "-state-dir", s.stateDir, "-listen", s.addr.String()}
	return s
}

func (s agentSetup) start(t *testing.T) *agentProcess {
	t.Helper()
	return startAgentProcess(t, s.addr, s.args...)
}

// kill SIGKILLs the agent alone (not its process group) and waits until it has exited.
func (a *agentProcess) kill(t *testing.T, ctx context.Context) {
	t.Helper()
	if err := a.Cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := a.Wait(ctx); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("agent exit after SIGKILL: %v", err)
	}
}

// healthyGPUs waits until the agent reports 8 healthy GPUs and returns their group and
// IDs.
func healthyGPUs(t *testing.T, ctx context.Context, c pb.DeviceHostClient) (*pb.DeviceGroup, []string) {
	t.Helper()
	fp := currentFingerprint(t, ctx, c, "8 healthy GPUs", func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)) == 8
	})
	return fp.GetGroups()[0], devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)
}

// currentFingerprint opens a Fingerprint stream and returns the first snapshot ok
// accepts.
func currentFingerprint(t *testing.T, ctx context.Context, c pb.DeviceHostClient, what string, ok func(*pb.FingerprintResponse) bool) *pb.FingerprintResponse {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return waitFingerprint(t, what, stream, ok)
}

func reserveRequest(g *pb.DeviceGroup, owner string, devices ...string) *pb.ReserveRequest {
	return &pb.ReserveRequest{OwnerId: owner, Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName(), DeviceIds: devices}
}

// watchedProcess follows one process through a pidfd. A pidfd names that process and
// no other, so a reused PID cannot fool it, and it reports the exit of a process that
// is not the test's child (a plugin whose agent died is reparented, and may stay a
// zombie that nobody reaps).
type watchedProcess struct {
	pid int
	fd  int
}

// watchProcess opens a pidfd on pid, which must be running. Cleanup SIGKILLs the
// process if it is still running and closes the pidfd.
func watchProcess(t *testing.T, pid int) *watchedProcess {
	t.Helper()
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatalf("pidfd_open(%d): %v", pid, err)
	}
	p := &watchedProcess{pid: pid, fd: fd}
	t.Cleanup(func() {
		if !p.exited(0) {
			t.Logf("process %d still running at the end of the test: killing it", pid)
			if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil {
				t.Errorf("kill process %d: %v", pid, err)
			}
		}
		unix.Close(fd)
	})
	return p
}

// exited waits up to d for the process to end and reports whether it has.
func (p *watchedProcess) exited(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		fds := []unix.PollFd{{Fd: int32(p.fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, int(max(time.Until(deadline), 0)/time.Millisecond))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err == nil && n > 0
	}
}

// ackedReservation is a reservation as a load worker last saw it acknowledged.
type ackedReservation struct {
	id, owner, device string
	container         *pb.ContainerReservation
	released          bool // a Release of it was acknowledged
}

// loadCall is the call a load worker had sent when its connection broke; its outcome
// is unknown.
type loadCall struct {
	op    string // "reserve", "retry" (of an acknowledged Reserve) or "release"
	owner string // of a reserve or retry
	id    string // of a release
}

// workerLog is what one load worker saw.
type workerLog struct {
	device   string
	acked    []*ackedReservation // in the order they were acknowledged
	pending  loadCall            // the call that failed
	err      error               // its error
	killed   bool                // whether the agent had been killed when the call failed
	problems []string            // answers that broke the API's promises
}

// reserveLoad is one worker per device, each in a loop: reserve its device for a new
// owner, reserve it again as a retried call would (the same reservation must come
// back), release it. A worker stops at its first failed call.
type reserveLoad struct {
	acks     atomic.Int64
	progress chan struct{} // gets a value (non-blocking) after each acknowledged Reserve
	killed   atomic.Bool   // set by the test just before it kills the agent
	logs     []workerLog   // one per worker, each written by its worker only
	finished chan struct{} // closed when every worker has returned
}

// startReserveLoad starts the workers. Cleanup stops them (they end at their next
// call) and waits for them.
func startReserveLoad(t *testing.T, ctx context.Context, c pb.DeviceHostClient, g *pb.DeviceGroup, devices []string) *reserveLoad {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	l := &reserveLoad{progress: make(chan struct{}, 1), logs: make([]workerLog, len(devices)), finished: make(chan struct{})}
	var wg sync.WaitGroup
	for i, dev := range devices {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.work(ctx, c, g, i, dev, &l.logs[i])
		}()
	}
	go func() {
		wg.Wait()
		close(l.finished)
	}()
	t.Cleanup(func() {
		cancel()
		<-l.finished
	})
	return l
}

func (l *reserveLoad) work(ctx context.Context, c pb.DeviceHostClient, g *pb.DeviceGroup, worker int, dev string, out *workerLog) {
	out.device = dev
	fail := func(call loadCall, err error) {
		out.pending, out.err, out.killed = call, err, l.killed.Load()
	}
	for n := 0; ; n++ {
		owner := fmt.Sprintf("load%d-%d", worker, n)
		req := reserveRequest(g, owner, dev)
		resp, err := c.Reserve(ctx, req)
		if err != nil {
			fail(loadCall{op: "reserve", owner: owner}, err)
			return
		}
		a := &ackedReservation{id: resp.GetReservationId(), owner: owner, device: dev, container: resp.GetReservation()}
		out.acked = append(out.acked, a)
		l.acks.Add(1)
		select {
		case l.progress <- struct{}{}:
		default:
		}
		again, err := c.Reserve(ctx, req)
		if err != nil {
			fail(loadCall{op: "retry", owner: owner}, err)
			return
		}
		if again.GetReservationId() != a.id || !proto.Equal(again.GetReservation(), a.container) {
			out.problems = append(out.problems, fmt.Sprintf("retried Reserve of %s gave reservation %s, want %s as the first time", owner, again.GetReservationId(), a.id))
		}
		rel, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: a.id}})
		if err != nil {
			fail(loadCall{op: "release", id: a.id}, err)
			return
		}
		if got := rel.GetReleasedReservationIds(); !slices.Equal(got, []string{a.id}) {
			out.problems = append(out.problems, fmt.Sprintf("Release of %s released %v", a.id, got))
		}
		a.released = true
	}
}

// waitAcks waits until at least n Reserves have been acknowledged.
func (l *reserveLoad) waitAcks(ctx context.Context, n int64) error {
	for l.acks.Load() < n {
		select {
		case <-l.progress:
		case <-l.finished:
			if l.acks.Load() < n {
				return errors.New("every worker stopped")
			}
		case <-ctx.Done():
			return fmt.Errorf("%d of %d acknowledged: %w", l.acks.Load(), n, ctx.Err())
		}
	}
	return nil
}

// results waits for every worker to stop and returns what they saw.
func (l *reserveLoad) results(ctx context.Context) ([]workerLog, error) {
	select {
	case <-l.finished:
		return l.logs, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("load workers still running: %w", ctx.Err())
	}
}

// expectedReservation is what the ledger must hold for an acknowledged reservation.
type expectedReservation struct {
	*ackedReservation
	states []pb.ReservationState // the states it may be in
}

// expectations turns what the clients saw into what the restarted agent must list:
// every acknowledged reservation, released when its Release was acknowledged, active
// when no Release of it was sent, either when one was in flight. maybe holds the
// owners whose Reserve was in flight: each may or may not have a reservation, of the
// worker's device.
func expectations(logs []workerLog) (want map[string]expectedReservation, maybe map[string]string) {
	want, maybe = map[string]expectedReservation{}, map[string]string{}
	for _, w := range logs {
		for _, a := range w.acked {
			e := expectedReservation{ackedReservation: a, states: []pb.ReservationState{pb.ReservationState_RESERVATION_STATE_ACTIVE}}
			switch {
			case a.released:
				e.states = []pb.ReservationState{pb.ReservationState_RESERVATION_STATE_RELEASED}
			case w.pending.op == "release" && w.pending.id == a.id:
				e.states = append(e.states, pb.ReservationState_RESERVATION_STATE_RELEASED)
			}
			want[a.id] = e
		}
		if w.pending.op == "reserve" {
			maybe[w.pending.owner] = w.device
		}
	}
	return want, maybe
}

// checkComplete reports what a listed reservation lacks: every field a Reserve sets,
// and the container reservation the plugin gave for its device.
func checkComplete(r *pb.Reservation, g *pb.DeviceGroup) []string {
	var missing []string
	check := func(ok bool, what string) {
		if !ok {
			missing = append(missing, what)
		}
	}
	check(r.GetReservationId() != "", "reservation ID")
	check(r.GetOwnerId() != "", "owner")
	check(r.GetVendor() == g.GetVendor() && r.GetType() == g.GetType() && r.GetName() == g.GetName(),
		fmt.Sprintf("group %s/%s/%s (has %s/%s/%s)", g.GetVendor(), g.GetType(), g.GetName(), r.GetVendor(), r.GetType(), r.GetName()))
	check(r.GetPlugin() == devPluginName, "plugin "+devPluginName)
	check(len(r.GetDeviceIds()) == 1, fmt.Sprintf("one device (has %v)", r.GetDeviceIds()))
	check(r.GetCreatedAt() != nil && r.GetCreatedAt().AsTime().After(time.Now().Add(-time.Hour)), "created-at")
	if len(r.GetDeviceIds()) == 1 {
		visible := r.GetReservation().GetEnvs()["NVIDIA_VISIBLE_DEVICES"]
		check(strings.Contains(visible, r.GetDeviceIds()[0]), fmt.Sprintf("container env NVIDIA_VISIBLE_DEVICES naming its device (has %q)", visible))
	}
	switch r.GetState() {
	case pb.ReservationState_RESERVATION_STATE_ACTIVE:
		check(r.GetReleasedAt() == nil, "no released-at while active")
	case pb.ReservationState_RESERVATION_STATE_RELEASED:
		check(r.GetReleasedAt() != nil, "released-at")
	default:
		check(false, "state (has "+r.GetState().String()+")")
	}
	return missing
}

func TestAgentSIGKILLUnderReserveLoadKeepsAcknowledgedReservations(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	setup := newAgentSetup(t, noGCConfig)
	first := setup.start(t)
	client := first.client(t, ctx)
	group, gpus := healthyGPUs(t, ctx, client)

	// Two devices held throughout by owners that never release, so that held devices
	// are checked after the restart however the load stood at the kill.
	var keepers []*ackedReservation
	for i, dev := range gpus[:2] {
		owner := fmt.Sprintf("keep-%d", i)
		resp, err := client.Reserve(ctx, reserveRequest(group, owner, dev))
		if err != nil {
			t.Fatalf("Reserve for %s: %v", owner, err)
		}
		keepers = append(keepers, &ackedReservation{id: resp.GetReservationId(), owner: owner, device: dev, container: resp.GetReservation()})
	}

	pluginPID := childPID(t, first.Cmd.Process.Pid, "plugin", devPluginName)
	plugin := watchProcess(t, pluginPID)

	load := startReserveLoad(t, ctx, client, group, gpus[2:])
	if err := load.waitAcks(ctx, loadAcksBeforeKill); err != nil {
		t.Fatalf("load: %v", err)
	}
	load.killed.Store(true)
	first.kill(t, ctx)
	logs, err := load.results(ctx)
	if err != nil {
		t.Fatal(err)
	}
	logs = append(logs, workerLog{device: "keepers", acked: keepers})

	// The load ran until the kill: every worker's last call was cut off by it.
	var acked, released int
	cutOff := map[string]int{} // calls cut off by the kill, by kind
	for _, w := range logs[:len(logs)-1] {
		cutOff[w.pending.op]++
		for _, p := range w.problems {
			t.Error(p)
		}
		if !w.killed || status.Code(w.err) != codes.Unavailable {
			t.Errorf("worker on %s stopped at %s %s%s: %v (agent killed by then: %v), want Unavailable after the kill",
				w.device, w.pending.op, w.pending.owner, w.pending.id, w.err, w.killed)
		}
		for _, a := range w.acked {
			acked++
			if a.released {
				released++
			}
		}
	}

	// The killed agent's plugin goes with it (parent-death signal), not left holding
	// the GPUs.
	if !plugin.exited(10 * time.Second) {
		t.Errorf("plugin process %d of the killed agent still running 10s after the kill", pluginPID)
	}

	second := setup.start(t)
	client = second.client(t, ctx) // SERVING
	healthyGPUs(t, ctx, client)
	list, err := client.ListReservations(ctx, &pb.ListReservationsRequest{})
	if err != nil {
		t.Fatalf("ListReservations after the restart: %v", err)
	}

	want, maybe := expectations(logs)
	seen := map[string]bool{}
	active := map[string]*pb.Reservation{} // by device
	var unacked int
	for _, r := range list.GetReservations() {
		id := r.GetReservationId()
		if seen[id] {
			t.Errorf("reservation %s listed twice", id)
			continue
		}
		seen[id] = true
		if missing := checkComplete(r, group); len(missing) > 0 {
			t.Errorf("reservation %s (owner %s) half-written: lacks %s", id, r.GetOwnerId(), strings.Join(missing, "; "))
		}
		if r.GetState() == pb.ReservationState_RESERVATION_STATE_ACTIVE {
			for _, dev := range r.GetDeviceIds() {
				if other, dup := active[dev]; dup {
					t.Errorf("device %s held by two live reservations: %s (owner %s) and %s (owner %s)",
						dev, other.GetReservationId(), other.GetOwnerId(), id, r.GetOwnerId())
				}
				active[dev] = r
			}
		}
		e, ok := want[id]
		switch {
		case ok:
			if r.GetOwnerId() != e.owner || !slices.Equal(r.GetDeviceIds(), []string{e.device}) || !proto.Equal(r.GetReservation(), e.container) {
				t.Errorf("reservation %s after the restart: owner %s, devices %v, container %v; acknowledged as owner %s, device %s, container %v",
					id, r.GetOwnerId(), r.GetDeviceIds(), r.GetReservation(), e.owner, e.device, e.container)
			}
			if !slices.Contains(e.states, r.GetState()) {
				t.Errorf("reservation %s of %s is %v after the restart; the client last saw it acknowledged as %v", id, e.owner, r.GetState(), e.states)
			}
		case maybe[r.GetOwnerId()] != "":
			// A Reserve cut off by the kill that had been committed: it must hold the
			// device it asked for.
			unacked++
			if !slices.Equal(r.GetDeviceIds(), []string{maybe[r.GetOwnerId()]}) || r.GetState() != pb.ReservationState_RESERVATION_STATE_ACTIVE {
				t.Errorf("unacknowledged reservation %s of %s: devices %v, state %v; want %s, active",
					id, r.GetOwnerId(), r.GetDeviceIds(), r.GetState(), maybe[r.GetOwnerId()])
			}
		default:
			t.Errorf("reservation %s of owner %s was never asked for", id, r.GetOwnerId())
		}
	}
	for id, e := range want {
		if !seen[id] {
			t.Errorf("acknowledged reservation %s of %s (device %s) missing after the restart", id, e.owner, e.device)
		}
	}

	// Fingerprint shows each live reservation's holder on its device, and nothing on
	// the others; the keepers' devices certainly among the held.
	fp := currentFingerprint(t, ctx, client, "8 GPUs", func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)) == 8
	})
	for _, d := range fp.GetGroups()[0].GetDevices() {
		h, r := d.GetHolder(), active[d.GetId()]
		if (h == nil) != (r == nil) || (r != nil && (h.GetReservationId() != r.GetReservationId() || h.GetOwnerId() != r.GetOwnerId())) {
			t.Errorf("device %s holder %v in Fingerprint, want the live reservation %v", d.GetId(), h, r)
		}
	}
	for _, k := range keepers {
		if r := active[k.device]; r == nil || r.GetReservationId() != k.id {
			t.Errorf("device %s not held by %s's reservation %s after the restart (live: %v)", k.device, k.owner, k.id, r)
		}
	}
	// Another owner is refused every held device, with the holder named.
	for dev, r := range active {
		_, err := client.Reserve(ctx, reserveRequest(group, "intruder", dev))
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), r.GetReservationId()) || !strings.Contains(err.Error(), r.GetOwnerId()) {
			t.Errorf("Reserve of held %s by another owner: %v, want FailedPrecondition naming reservation %s of %s", dev, err, r.GetReservationId(), r.GetOwnerId())
		}
	}

	t.Logf("before the SIGKILL: %d Reserves acknowledged by %d workers (%d of them released, acknowledged), plus %d kept; cut off by the kill: %v; after the restart: %d listed (%d live), %d of them from Reserves cut off by the kill",
		acked, len(logs)-1, released, len(keepers), cutOff, len(list.GetReservations()), len(active), unacked)
	if acked < loadAcksBeforeKill {
		t.Errorf("%d Reserves acknowledged before the kill, want at least %d", acked, loadAcksBeforeKill)
	}

	checkReservationCLI(t, ctx, second.addr, client, keepers, len(list.GetReservations())-len(active))
}

// checkReservationCLI runs the operator's commands against the restarted agent: who
// holds what, the ledger by owner, device and state, and releasing the keepers' two
// reservations, one by ID and one by owner.
func checkReservationCLI(t *testing.T, ctx context.Context, addr endpoint.Address, client pb.DeviceHostClient, keepers []*ackedReservation, released int) {
	t.Helper()
	address := addr.String()
	k0, k1 := keepers[0], keepers[1]

	devices := mustRunCLI(t, "devices", "-address", address)
	if !containsLine(devices, k0.device, "healthy", fmt.Sprintf("%s (%s)", k0.owner, k0.id)) {
		t.Errorf("devices does not show %s held by %s (%s):\n%s", k0.device, k0.owner, k0.id, devices)
	}
	table := mustRunCLI(t, "reservations", "-address", address, "-owner", k0.owner)
	if lines := strings.Split(strings.TrimSpace(table), "\n"); len(lines) != 2 || !containsLine(table, k0.id, k0.owner, k0.device, "active") {
		t.Errorf("reservations -owner %s: want the header and one active row for %s:\n%s", k0.owner, k0.id, table)
	}
	byDevice := listCLI(t, "reservations", "-address", address, "-device", k1.device, "-state", "active", "-json")
	if got := byDevice.GetReservations(); len(got) != 1 || got[0].GetReservationId() != k1.id || got[0].GetOwnerId() != k1.owner {
		t.Errorf("reservations -device %s -state active: %v, want only %s of %s", k1.device, got, k1.id, k1.owner)
	}
	if got := listCLI(t, "reservations", "-address", address, "-state", "released", "-json").GetReservations(); len(got) != released {
		t.Errorf("reservations -state released lists %d, want the %d released ones", len(got), released)
	}

	if out := mustRunCLI(t, "release", "-address", address, "-reservation", k0.id); out != "released "+k0.id+"\n" {
		t.Errorf("release -reservation %s printed %q", k0.id, out)
	}
	if out := mustRunCLI(t, "release", "-address", address, "-owner", k1.owner); out != "released "+k1.id+"\n" {
		t.Errorf("release -owner %s printed %q", k1.owner, out)
	}
	releasedAt := map[string]string{}
	for _, k := range keepers {
		got := listCLI(t, "reservations", "-address", address, "-owner", k.owner, "-json").GetReservations()
		if len(got) != 1 || got[0].GetState() != pb.ReservationState_RESERVATION_STATE_RELEASED || got[0].GetReleasedAt() == nil {
			t.Errorf("reservations -owner %s after release: %v, want %s released", k.owner, got, k.id)
			continue
		}
		releasedAt[k.id] = got[0].GetReleasedAt().AsTime().String()
	}
	// Releasing again is no error and does not release a second time.
	mustRunCLI(t, "release", "-address", address, "-owner", k1.owner)
	if got := listCLI(t, "reservations", "-address", address, "-owner", k1.owner, "-json").GetReservations(); len(got) != 1 || got[0].GetReleasedAt().AsTime().String() != releasedAt[k1.id] {
		t.Errorf("after a second release -owner %s: %v, want %s still released at %s", k1.owner, got, k1.id, releasedAt[k1.id])
	}
	// The devices are free: Fingerprint says so, and another owner gets them.
	currentFingerprint(t, ctx, client, "the released devices without holder", func(fp *pb.FingerprintResponse) bool {
		for _, d := range fp.GetGroups()[0].GetDevices() {
			if (d.GetId() == k0.device || d.GetId() == k1.device) && d.GetHolder() != nil {
				return false
			}
		}
		return true
	})
	if out := mustRunCLI(t, "reserve", "-address", address, "-owner", "after-release", "-device", k0.device); !strings.HasPrefix(out, "RESERVATION  ") {
		t.Errorf("reserve of the released %s printed %q", k0.device, out)
	}
}

// listCLI runs a `reservations ... -json` command line and decodes its output.
func listCLI(t *testing.T, args ...string) *pb.ListReservationsResponse {
	t.Helper()
	out := mustRunCLI(t, args...)
	var resp pb.ListReservationsResponse
	if err := protojson.Unmarshal([]byte(out), &resp); err != nil {
		t.Fatalf("devicehost %s: not a ListReservationsResponse: %v\n%s", strings.Join(args, " "), err, out)
	}
	return &resp
}

// containsLine reports whether some line of out holds every one of words as a
// whitespace-separated field (or run of fields).
func containsLine(out string, words ...string) bool {
	for _, line := range strings.Split(out, "\n") {
		padded := " " + strings.Join(strings.Fields(line), " ") + " "
		all := true
		for _, w := range words {
			all = all && strings.Contains(padded, " "+w+" ")
		}
		if all {
			return true
		}
	}
	return false
}

func TestAgentRefusesACorruptStateFile(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	tests := []struct {
		name     string
		contents []byte
	}{
		{"garbage", []byte(strings.Repeat("this is not a bbolt file\n", 400))},
		{"truncated", []byte("devicehost")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			setup := newAgentSetup(t, "")
			if err := os.MkdirAll(setup.stateDir, 0o700); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(setup.stateDir, "devicehost.db")
			if err := os.WriteFile(path, tt.contents, 0o600); err != nil {
				t.Fatal(err)
			}
			agent := setup.start(t)
			err := agent.Wait(ctx)
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 1 {
				t.Fatalf("agent on a corrupt state file: %v, want exit status 1", err)
			}
			// One line that says which file, what is wrong, and how to recover.
			wantParts := []string{"state file " + path + ": ", "not a readable bbolt database",
				"the file was left untouched", "restore it from a backup", "mv " + path + " " + path + ".corrupt"}
			line, _ := agent.Stderr.Wait(ctx, func(l string) bool { return strings.HasPrefix(l, "devicehost: ") })
			for _, part := range wantParts {
				if !strings.Contains(line, part) {
					t.Errorf("error line %q does not say %q", line, part)
				}
			}
			if got, err := os.ReadFile(path); err != nil || !slices.Equal(got, tt.contents) {
				t.Errorf("state file changed by the agent (read: %v)", err)
			}
			if entries, err := os.ReadDir(setup.stateDir); err != nil || len(entries) != 1 {
				t.Errorf("state dir holds %v (%v), want the state file alone", entries, err)
			}
			if _, err := os.Stat(setup.addr.Path); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("socket %s left behind (%v)", setup.addr.Path, err)
			}
		})
	}
}

// reattachConfig keeps the bundled plugin across agent crashes.
const reattachConfig = `
plugin "nvidia-example" {
  reattach = true
  config {
    simulate = "dgxh100"
  }
}
`

func TestAgentSIGKILLLeavesAKeptPluginToReattach(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	setup := newAgentSetup(t, reattachConfig)
	first := setup.start(t)
	client := first.client(t, ctx)
	group, gpus := healthyGPUs(t, ctx, client)
	held, err := client.Reserve(ctx, reserveRequest(group, "keep", gpus[0]))
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	pluginPID := childPID(t, first.Cmd.Process.Pid, "plugin", devPluginName)
	plugin := watchProcess(t, pluginPID)
	// The kept plugin listens on a Unix socket in the state dir, in a dir only the
	// agent's user may enter: with AutoMTLS off, that is its only protection.
	sockets := filepath.Join(setup.stateDir, "sockets")
	if fi, err := os.Stat(sockets); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("plugin socket dir %s: %v, mode %v; want mode 0700", sockets, err, fi.Mode().Perm())
	}
	if entries, _ := os.ReadDir(sockets); len(entries) == 0 {
		t.Errorf("no plugin socket in %s", sockets)
	}

	first.kill(t, ctx)
	second := setup.start(t)
	client = second.client(t, ctx)
	if _, err := second.Stderr.Wait(ctx, func(l string) bool {
		return strings.Contains(l, "reattached to the plugin process left running by the previous host") &&
			strings.Contains(l, fmt.Sprintf(`"pid":%d`, pluginPID))
	}); err != nil {
		t.Errorf("no log line saying the restarted agent reattached to plugin process %d: %v", pluginPID, err)
	}
	if plugin.exited(0) {
		t.Fatalf("kept plugin process %d did not outlive the agent", pluginPID)
	}
	if pid, err := findChildPID(second.Cmd.Process.Pid, "plugin", devPluginName); pid != 0 || err != nil {
		t.Errorf("the restarted agent started plugin process %d (%v) instead of reattaching to %d", pid, err, pluginPID)
	}

	// It serves through the plugin it reattached to, and the hold survived.
	healthyGPUs(t, ctx, client)
	if _, err := client.Reserve(ctx, reserveRequest(group, "after-restart", gpus[1])); err != nil {
		t.Errorf("Reserve through the reattached plugin: %v", err)
	}
	_, err = client.Reserve(ctx, reserveRequest(group, "intruder", gpus[0]))
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), held.GetReservationId()) {
		t.Errorf("Reserve of the held %s by another owner: %v, want FailedPrecondition naming %s", gpus[0], err, held.GetReservationId())
	}

	// A clean stop stops the kept plugin as well.
	if err := second.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := second.Wait(ctx); err != nil {
		t.Errorf("agent exit after SIGTERM: %v, want exit status 0", err)
	}
	if !plugin.exited(15 * time.Second) {
		t.Errorf("kept plugin process %d still running 15s after the agent stopped cleanly", pluginPID)
	}
}
