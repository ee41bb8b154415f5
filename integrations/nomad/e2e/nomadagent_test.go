package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/integrations/nomad/shim"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/agenttest"
	"github.com/devicehost/devicehost/tools/testwait"
)

// nomadCache is where a Nomad v1.6.3 binary built here is kept between runs (see
// docs/nomad.md#a-real-nomad-agent); DEVICEHOST_E2E_NOMAD names another.
const nomadCache = "/var/cache/devicehost-e2e/nomad-v1.6.3/bin/nomad"

// nomadBinary returns the Nomad v1.6.3 binary, or skips the test when there is none.
func nomadBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("DEVICEHOST_E2E_NOMAD")
	if bin == "" {
		bin = nomadCache
	}
	out, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Skipf("no Nomad binary at %s (set DEVICEHOST_E2E_NOMAD): %v", bin, err)
	}
	if !strings.HasPrefix(string(out), "Nomad v1.6.3") {
		t.Skipf("%s is %q, not Nomad v1.6.3", bin, strings.TrimSpace(string(out)))
	}
	return bin
}

// envInt is the integer in the environment variable name, else def.
func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// A real Nomad v1.6.3 agent (server and client) with nomad-device-devicehost in its
// plugin_dir runs batch jobs on two GPUs of `devicehost agent -dev`: while a job runs its
// reservation is named after its task; when it completes, or after `nomad alloc stop`,
// `nomad job stop` or a node drain, its devices are free again release_grace after its
// task ended; a client restart keeps it; while the shim cannot reach Nomad's API (a proxy in between is shut)
// nothing is released under a running job. It logs
// the times measured; DEVICEHOST_E2E_NOMAD_RUNS (default 2) sets the runs of each,
// DEVICEHOST_E2E_NOMAD_OUTAGE the outage in seconds (default 10),
// DEVICEHOST_E2E_NOMAD_GRACE the shim's release_grace in seconds (default 5).
func TestNomadAgent(t *testing.T) {
	nomadBin := nomadBinary(t)
	runs := envInt("DEVICEHOST_E2E_NOMAD_RUNS", 2)
	outage := time.Duration(envInt("DEVICEHOST_E2E_NOMAD_OUTAGE", 10)) * time.Second
	grace := time.Duration(envInt("DEVICEHOST_E2E_NOMAD_GRACE", 5)) * time.Second
	bins := build(t)
	tmp := tempDir(t, "dhna")
	address := "unix://" + filepath.Join(tmp, "dh.sock")
	startAgent(t, bins[agentName], tmp, "agent", "-dev", "-listen", address, "-log-json")
	c := dial(t, address)
	waitDevices(t, c, "8 GPUs", func(s *pb.FingerprintResponse) bool {
		return len(s.GetGroups()) == 1 && len(s.GetGroups()[0].GetDevices()) == 8
	})

	ports := freePorts(t, 3)
	nomadAddr := "http://127.0.0.1:" + ports[0]
	proxy := startProxy(t, "127.0.0.1:"+ports[0])
	cfg := writeNomadConfig(t, tmp, ports, bins[shim.BinaryName], address, proxy.addr, grace, nomadOptions{})
	startNomad := func() *agenttest.Process {
		return startAgent(t, nomadBin, tmp, "agent", "-config", cfg, "-log-level", "debug")
	}
	nomad := startNomad()
	n := &nomadHTTP{t: t, addr: nomadAddr}
	// Before the agents are killed (at cleanup, after this returns): Nomad's executors
	// run apart from the agent's process group and outlive it, so stop every job.
	defer n.stopAll()
	nodeID := n.waitNodeWithGPUs(8)
	t.Logf("Nomad node %s ready with 8 GPUs", nodeID)

	job := func(name, script string) string { return n.runBatchJob(nomadBin, tmp, name, script, "nvidia/gpu", 2) }
	// named waits until the allocation's reservation is named after its task, and
	// returns it.
	named := func(jobID, allocID string) *pb.Reservation {
		t.Helper()
		owner := "nomad/default/" + jobID + "/" + allocID + "/train"
		var r *pb.Reservation
		testwait.WaitFor(t, "a reservation of "+owner, func() bool {
			rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: owner})
			if err == nil && len(rs) == 1 && rs[0].GetState() == pb.ReservationState_RESERVATION_STATE_ACTIVE {
				r = rs[0]
			}
			return r != nil
		})
		return r
	}
	// released waits until r is released and returns when.
	released := func(r *pb.Reservation) time.Time {
		t.Helper()
		var at time.Time
		testwait.WaitFor(t, "the release of "+r.GetReservationId(), func() bool {
			rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: r.GetOwnerId()})
			if err == nil && len(rs) == 1 && rs[0].GetState() == pb.ReservationState_RESERVATION_STATE_RELEASED {
				at = rs[0].GetReleasedAt().AsTime()
			}
			return !at.IsZero()
		})
		return at
	}

	t.Run("completes", func(t *testing.T) {
		var took []time.Duration
		for i := range runs {
			name := fmt.Sprintf("train-%d", i)
			allocID := job(name, "sleep 3")
			r := named(name, allocID)
			if st := n.alloc(allocID); st.ClientStatus == "complete" {
				t.Logf("%s: named only after it completed", name)
			}
			if i == 0 {
				t.Logf("owner while it runs: %s on %s", r.GetOwnerId(), strings.Join(r.GetDeviceIds(), ","))
			}
			finished := n.waitFinished(allocID, "complete")
			free := released(r)
			took = append(took, free.Sub(finished))
		}
		t.Logf("completion to devices free (release_grace %v), %d runs: median %v, worst %v (all %v)",
			grace, runs, median(took), slices.Max(took), took)
	})

	t.Run("alloc stop", func(t *testing.T) {
		var took []time.Duration // released by the shim
		takenOver := 0
		for i := range runs {
			name := fmt.Sprintf("serve-%d", i)
			allocID := job(name, "sleep 3600")
			r := named(name, allocID)
			stopped := time.Now()
			n.post("/v1/allocation/" + allocID + "/stop")
			free := released(r)
			finished := n.waitFinished(allocID, "complete")
			how := "released by the shim"
			if rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{}); err == nil {
				for _, o := range rs {
					if o.GetCreatedAt().AsTime().Equal(free) {
						how = "taken over by " + o.GetOwnerId() + " (Nomad placed a replacement on its devices)"
					}
				}
			}
			if how == "released by the shim" {
				took = append(took, free.Sub(finished))
			} else {
				takenOver++
			}
			t.Logf("%s: stop to free %v, task end to free %v: %s", name, free.Sub(stopped).Round(time.Millisecond),
				free.Sub(finished).Round(time.Millisecond), how)
			n.deleteJob(name) // and the replacement Nomad placed
			testwait.WaitFor(t, "the job's devices free", func() bool {
				rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
				return err == nil && !slices.ContainsFunc(rs, func(o *pb.Reservation) bool {
					return strings.HasPrefix(o.GetOwnerId(), "nomad/default/"+name+"/") || !strings.Contains(strings.TrimPrefix(o.GetOwnerId(), "nomad/"), "/")
				})
			})
		}
		if len(took) > 0 {
			t.Logf("after nomad alloc stop, task end to devices free: released by the shim in %d of %d runs, median %v, worst %v; taken over by Nomad's replacement in %d",
				len(took), runs, median(took), slices.Max(took), takenOver)
		} else {
			t.Logf("after nomad alloc stop: taken over by Nomad's replacement in all %d runs", runs)
		}
	})

	t.Run("Nomad unreachable", func(t *testing.T) {
		name := "long"
		allocID := job(name, "sleep 3600")
		r := named(name, allocID)
		proxy.shut()
		deadline := time.Now().Add(outage)
		for time.Now().Before(deadline) {
			rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: r.GetOwnerId()})
			if err != nil || len(rs) != 1 || rs[0].GetState() != pb.ReservationState_RESERVATION_STATE_ACTIVE {
				t.Fatalf("during the outage: %v, %v; want %s active", rs, err, r.GetReservationId())
			}
			time.Sleep(time.Second)
		}
		proxy.open()
		time.Sleep(2 * grace)
		if rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: r.GetOwnerId()}); err != nil || len(rs) != 1 ||
			rs[0].GetState() != pb.ReservationState_RESERVATION_STATE_ACTIVE {
			t.Fatalf("after the outage: %v, %v; want %s active", rs, err, r.GetReservationId())
		}
		var warnings []string
		for l := range strings.Lines(nomad.Stdout.String()) {
			if strings.Contains(l, "[WARN]") && strings.Contains(l, "cannot read this node's allocations from Nomad:") {
				warnings = append(warnings, strings.TrimSpace(l[:min(len(l), 400)]))
			}
		}
		t.Logf("Nomad API unreachable for %v under a running job: nothing released (%s still active, owner %s); the shim warned %d time(s): %q",
			outage, r.GetReservationId(), r.GetOwnerId(), len(warnings), warnings)
		n.deleteJob(name)
		released(r)
	})
	t.Run("job stop", func(t *testing.T) {
		name := "stopme"
		allocID := job(name, "sleep 3600")
		r := named(name, allocID)
		stopped := time.Now()
		n.deleteJob(name)
		free := released(r)
		finished := n.waitFinished(allocID, "complete")
		t.Logf("nomad job stop: stop to free %v, task end to free %v", free.Sub(stopped).Round(time.Millisecond), free.Sub(finished).Round(time.Millisecond))
	})

	t.Run("client restart", func(t *testing.T) {
		name := "survivor"
		allocID := job(name, "sleep 3600")
		r := named(name, allocID)
		n.waitStatus(allocID, "running")
		old := nomad
		if err := old.Cmd.Process.Signal(syscall.SIGINT); err != nil {
			t.Fatal(err)
		}
		<-old.Exited()
		nomad = startNomad()
		n.waitNodeWithGPUs(8)
		n.waitStatus(allocID, "running")
		time.Sleep(3 * grace) // a released reservation would be released by now
		rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: r.GetOwnerId()})
		if err != nil || len(rs) != 1 || rs[0].GetReservationId() != r.GetReservationId() ||
			rs[0].GetState() != pb.ReservationState_RESERVATION_STATE_ACTIVE {
			t.Fatalf("after the client restart: %v, %v; want %s kept", rs, err, r.GetReservationId())
		}
		t.Logf("Nomad client restart (same allocation %s): %s kept, owner %s", allocID, r.GetReservationId(), r.GetOwnerId())
		n.deleteJob(name)
		released(r)
	})

	// Last: the node stays ineligible after its drain.
	// A GPU cordoned at the agent (devicehost cordon) is unhealthy to Nomad: a job that
	// needs it is not placed, and is once the GPU is uncordoned.
	t.Run("cordon", func(t *testing.T) {
		ctx := context.Background()
		fp, err := c.Devices(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, d := range fp.GetGroups()[0].GetDevices() {
			ids = append(ids, d.GetId())
		}
		start := time.Now()
		for _, id := range ids[:7] {
			if _, err := c.Cordon(ctx, id, "e2e: ECC storm", false); err != nil {
				t.Fatal(err)
			}
		}
		uncordon := func() {
			for _, id := range ids[:7] {
				if _, err := c.Uncordon(ctx, id); err != nil {
					t.Error(err)
				}
			}
		}
		defer uncordon()
		n.waitNodeWithGPUs(1)
		dGone := time.Since(start)
		name := "cordoned"
		n.submitBatchJob(nomadBin, tmp, name, "sleep 3600", "nvidia/gpu", 2)
		defer n.deleteJob(name)
		n.waitPlacementFailed(name)
		var allocs []allocStub
		if err := n.get("/v1/job/"+name+"/allocations", &allocs); err != nil || len(allocs) != 0 {
			t.Fatalf("allocations of a job for 2 GPUs with 7 of 8 cordoned: %v (%v), want none", allocs, err)
		}
		start = time.Now()
		uncordon()
		n.waitNodeWithGPUs(8)
		dBack := time.Since(start)
		// Nomad v1.6.3 does not unblock a blocked evaluation when a node's devices turn
		// healthy (only on changes of node status or class, or allocations ending): ask
		// for one, as an operator would with nomad job eval.
		cmd := exec.Command(nomadBin, "job", "eval", "-detach", name)
		cmd.Env = append(os.Environ(), "NOMAD_ADDR="+nomadAddr)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("nomad job eval: %v\n%s", err, out)
		}
		allocID := n.waitAlloc(name)
		r := named(name, allocID)
		t.Logf("7 GPUs cordoned: Nomad sees 1 healthy %v after the cordon, places no job for 2; uncordoned: 8 healthy %v after, the job placed on %v",
			dGone.Round(time.Millisecond), dBack.Round(time.Millisecond), r.GetDeviceIds())
		n.deleteJob(name)
		released(r)
	})

	t.Run("drain", func(t *testing.T) {
		name := "drained"
		allocID := job(name, "sleep 3600")
		r := named(name, allocID)
		cmd := exec.Command(nomadBin, "node", "drain", "-enable", "-yes", "-detach", "-deadline", "10s", nodeID)
		cmd.Env = append(os.Environ(), "NOMAD_ADDR="+nomadAddr)
		drained := time.Now()
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("nomad node drain: %v\n%s", err, out)
		}
		free := released(r)
		finished := n.waitFinished(allocID, "complete")
		t.Logf("nomad node drain (deadline 10s: Nomad stops batch allocations at the deadline): drain to free %v, task end to free %v",
			free.Sub(drained).Round(time.Millisecond), free.Sub(finished).Round(time.Millisecond))
	})
	if t.Failed() {
		t.Logf("nomad output:\n%s", nomad.Stdout)
	}
}

// writeNomadConfig installs the shim in a plugin_dir under tmp and writes the config of
// a Nomad agent that is server and client (not -dev: a dev agent keeps no state and
// stops its tasks when it stops, and a client restart needs both) on the three ports
// (http, rpc, serf) with raw_exec and the shim's config block: the devicehost agent at
// address, Nomad's API at nomadAPI (host:port) and release_grace, and opts. It returns
// the config's path.
func writeNomadConfig(t *testing.T, tmp string, ports []string, shimBin, address, nomadAPI string, grace time.Duration, opts nomadOptions) string {
	t.Helper()
	pluginDir := filepath.Join(tmp, "plugins")
	if err := os.Mkdir(pluginDir, 0o755); err != nil {
		t.Fatal(err)
	}
	install(t, shimBin, pluginDir, shim.BinaryName)
	cfg := filepath.Join(tmp, "nomad.hcl")
	writeFile(t, cfg, fmt.Sprintf(`
data_dir  = %q
bind_addr = "127.0.0.1"
advertise {
  http = "127.0.0.1"
  rpc  = "127.0.0.1"
  serf = "127.0.0.1"
}
ports {
  http = %s
  rpc  = %s
  serf = %s
}
server {
  enabled          = true
  bootstrap_expect = 1
}
client {
  enabled = true
%s}
plugin "raw_exec" {
  config {
    enabled    = true
    no_cgroups = %t
  }
}
plugin_dir = %q
plugin "nomad-device-devicehost" {
  config {
    address       = %q
    nomad_address = "http://%s"
    release_grace = %q
  }
}
`, filepath.Join(tmp, "nomad-data"), ports[0], ports[1], ports[2], opts.chrootBlock(), opts.rawExecNoCgroups, pluginDir, address, nomadAPI, grace))
	return cfg
}

// nomadOptions are the optional settings of writeNomadConfig; the zero value keeps
// Nomad's defaults.
type nomadOptions struct {
	// chrootEnv, when not nil, is the client's chroot_env: what exec tasks find in
	// their chroot (host path to path in the chroot) instead of Nomad's default
	// (/bin, /etc, /lib, /usr... hard-linked file by file, many seconds a task).
	chrootEnv map[string]string
	// rawExecNoCgroups puts raw_exec tasks in no cgroup (on cgroup v2 Nomad's cgroup
	// lets them open only runc's default devices).
	rawExecNoCgroups bool
}

// chrootBlock is the chroot_env block of the client, "" when chrootEnv is nil.
func (o nomadOptions) chrootBlock() string {
	if o.chrootEnv == nil {
		return ""
	}
	var b strings.Builder
	b.WriteString("  chroot_env {\n")
	for _, host := range slices.Sorted(maps.Keys(o.chrootEnv)) {
		fmt.Fprintf(&b, "    %q = %q\n", host, o.chrootEnv[host])
	}
	b.WriteString("  }\n")
	return b.String()
}

func lastLines(s string, n int) string {
	lines := strings.Split(s, "\n")
	return strings.Join(lines[max(len(lines)-n, 0):], "\n")
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func writeFile(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
}

// freePorts returns n TCP ports free on 127.0.0.1 now.
func freePorts(t *testing.T, n int) []string {
	t.Helper()
	var ports []string
	var lns []net.Listener
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		ports = append(ports, strconv.Itoa(ln.Addr().(*net.TCPAddr).Port))
	}
	for _, ln := range lns {
		ln.Close()
	}
	return ports
}

// tcpProxy forwards connections to target; shut makes its port refuse them (and ends
// those open), open accepts again.
type tcpProxy struct {
	t      *testing.T
	addr   string
	target string
	mu     sync.Mutex
	ln     net.Listener
	conns  map[net.Conn]bool
	wg     sync.WaitGroup
}

func startProxy(t *testing.T, target string) *tcpProxy {
	p := &tcpProxy{t: t, addr: "127.0.0.1:" + freePorts(t, 1)[0], target: target, conns: map[net.Conn]bool{}}
	p.open()
	t.Cleanup(func() {
		p.shut()
		p.wg.Wait()
	})
	return p
}

func (p *tcpProxy) open() {
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		p.t.Fatal(err)
	}
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", p.target)
			if err != nil {
				in.Close()
				continue
			}
			p.mu.Lock()
			p.conns[in], p.conns[out] = true, true
			p.mu.Unlock()
			p.wg.Add(2)
			pipe := func(dst, src net.Conn) {
				defer p.wg.Done()
				_, _ = io.Copy(dst, src)
				dst.Close()
				src.Close()
			}
			go pipe(in, out)
			go pipe(out, in)
		}
	}()
}

func (p *tcpProxy) shut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		c.Close()
		delete(p.conns, c)
	}
}

// nomadHTTP reads the test's Nomad agent.
type nomadHTTP struct {
	t    *testing.T
	addr string
}

func (n *nomadHTTP) get(path string, v any) error {
	resp, err := http.Get(n.addr + path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("GET %s: %s: %s", path, resp.Status, b)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

func (n *nomadHTTP) send(method, path string) {
	n.t.Helper()
	req, err := http.NewRequest(method, n.addr+path, strings.NewReader("{}"))
	if err != nil {
		n.t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		n.t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		n.t.Fatalf("%s %s: %s: %s", method, path, resp.Status, b)
	}
}

func (n *nomadHTTP) post(path string) { n.send(http.MethodPost, path) }

func (n *nomadHTTP) deleteJob(name string) { n.send(http.MethodDelete, "/v1/job/"+name) }

// stopAll stops every job and waits up to 30 s for their allocations to stop, so
// that no task outlives the test (best effort: failures are logged).
func (n *nomadHTTP) stopAll() {
	var jobs []struct{ ID string }
	if err := n.get("/v1/jobs", &jobs); err != nil {
		n.t.Logf("cleanup: list Nomad's jobs: %v", err)
		return
	}
	for _, j := range jobs {
		req, err := http.NewRequest(http.MethodDelete, n.addr+"/v1/job/"+j.ID, nil)
		if err != nil {
			continue
		}
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var allocs []allocStub
		if err := n.get("/v1/allocations", &allocs); err != nil {
			return
		}
		if !slices.ContainsFunc(allocs, func(a allocStub) bool { return a.ClientStatus == "running" || a.ClientStatus == "pending" }) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	n.t.Logf("cleanup: Nomad's tasks still run after 30 s")
}

// waitNodeWithGPUs waits for the node to report count healthy nvidia/gpu devices and
// returns its ID.
func (n *nomadHTTP) waitNodeWithGPUs(count int) string {
	n.t.Helper()
	var id string
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var nodes []struct{ ID, Status string }
		if err := n.get("/v1/nodes", &nodes); err == nil && len(nodes) == 1 && nodes[0].Status == "ready" {
			id = nodes[0].ID
			var node struct {
				NodeResources struct {
					Devices []struct {
						Vendor, Type string
						Instances    []struct{ Healthy bool }
					}
				}
			}
			if err := n.get("/v1/node/"+id, &node); err == nil {
				for _, d := range node.NodeResources.Devices {
					healthy := 0
					for _, in := range d.Instances {
						if in.Healthy {
							healthy++
						}
					}
					if d.Vendor == "nvidia" && d.Type == "gpu" && healthy == count {
						return id
					}
				}
			}
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("no Nomad node with %d healthy GPUs", count)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// allocStub is what the test reads of an allocation.
type allocStub struct {
	ID, ClientStatus string
	TaskStates       map[string]struct {
		State      string
		StartedAt  time.Time
		FinishedAt time.Time
	}
}

// waitAlloc waits for the job's one allocation and returns its ID.
func (n *nomadHTTP) waitAlloc(job string) string {
	n.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		var allocs []allocStub
		if err := n.get("/v1/job/"+job+"/allocations", &allocs); err == nil && len(allocs) > 0 {
			return allocs[0].ID
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("no allocation of %s", job)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (n *nomadHTTP) alloc(id string) allocStub {
	n.t.Helper()
	var a allocStub
	if err := n.get("/v1/allocation/"+id, &a); err != nil {
		n.t.Fatal(err)
	}
	return a
}

// waitStatus waits until the allocation has client status status.
func (n *nomadHTTP) waitStatus(id, status string) {
	n.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for a := n.alloc(id); a.ClientStatus != status; a = n.alloc(id) {
		if time.Now().After(deadline) {
			n.t.Fatalf("allocation %s is %s, not %s", id, a.ClientStatus, status)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitFinished waits until the allocation has client status status and returns when
// its task finished, by Nomad.
func (n *nomadHTTP) waitFinished(id, status string) time.Time {
	n.t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		a := n.alloc(id)
		if a.ClientStatus == status {
			return a.TaskStates["train"].FinishedAt
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("allocation %s is %s, not %s", id, a.ClientStatus, status)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// runBatchJob submits (detached, with the nomad binary bin) a batch job called name,
// written to dir/<name>.hcl: one raw_exec task "train" that runs script with /bin/sh
// and asks for count devices of device, never restarted or rescheduled, so a test sees
// each allocation's own end. It returns the job's allocation once there is one.
func (n *nomadHTTP) runBatchJob(bin, dir, name, script, device string, count int) string {
	n.t.Helper()
	n.submitBatchJob(bin, dir, name, script, device, count)
	return n.waitAlloc(name)
}

// waitPlacementFailed waits until an evaluation of job says Nomad could not place it.
func (n *nomadHTTP) waitPlacementFailed(job string) {
	n.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		var evals []struct {
			Status         string
			FailedTGAllocs map[string]any
			BlockedEval    string
		}
		if err := n.get("/v1/job/"+job+"/evaluations", &evals); err == nil {
			for _, e := range evals {
				if len(e.FailedTGAllocs) > 0 || e.Status == "blocked" {
					return
				}
			}
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("no evaluation of %s failed to place it", job)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// submitBatchJob is runBatchJob without waiting for an allocation; deviceBody, if
// given, goes into the device block after its count (constraints, affinities).
func (n *nomadHTTP) submitBatchJob(bin, dir, name, script, device string, count int, deviceBody ...string) {
	t := n.t
	t.Helper()
	path := filepath.Join(dir, name+".hcl")
	writeFile(t, path, fmt.Sprintf(`
job %q {
  type        = "batch"
  datacenters = ["dc1"]
  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }
    reschedule {
      attempts  = 0
      unlimited = false
    }
    task "train" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args    = ["-c", %q]
      }
      resources {
        cpu    = 100
        memory = 32
        device %q {
          count = %d
%s
        }
      }
    }
  }
}
`, name, script, device, count, strings.Join(deviceBody, "\n")))
	n.runJobFile(bin, path, name)
}

// runJobFile submits the job file path (detached) with the nomad binary bin.
func (n *nomadHTTP) runJobFile(bin, path, name string) {
	n.t.Helper()
	cmd := exec.Command(bin, "job", "run", "-detach", path)
	cmd.Env = append(os.Environ(), "NOMAD_ADDR="+n.addr)
	if out, err := cmd.CombinedOutput(); err != nil {
		n.t.Fatalf("nomad job run %s: %v\n%s", name, err, out)
	}
}
