package shim

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/nomad/structs"

	"github.com/devicehost/devicehost/integrations/nomad/nomadapi/nomadtest"
	"github.com/devicehost/devicehost/tools/logtest"
)

const grace = DefaultReleaseGrace

// Reserve's reservation is handed to the task Nomad gave the devices to, as soon as
// Nomad is asked afresh after it; the follower asks by blocking queries on the index
// Nomad last answered.
func TestFollowNamesTheTask(t *testing.T) {
	f := followShim(t, nil, "GPU-a", "GPU-b", "GPU-c")
	id, r := f.place(t, "ml", "train", "GPU-a", "GPU-b")
	if want := "nomad/ml/train/" + id + "/main"; r.OwnerID != want || !slices.Equal(r.DeviceIDs, []string{"GPU-a", "GPU-b"}) {
		t.Errorf("reservation %+v; want owner %s on GPU-a, GPU-b", r, want)
	}
	if f.released(r.ID) {
		t.Error("a running allocation's reservation was released")
	}
	reqs := f.nomad.Requests()
	// A Reserve's nudge may supersede the first fetch before it has the node, and the
	// next one asks agent/self again: agent/self first, however many times, then the
	// node's allocations at once (no index).
	first := slices.IndexFunc(reqs, func(q nomadtest.Request) bool { return q.Path != "/v1/agent/self" })
	if first < 1 || reqs[first].Path != "/v1/node/"+f.nomad.NodeID()+"/allocations" || reqs[first].Index != "" {
		t.Fatalf("first requests %+v; want agent/self, then the node's allocations at once", reqs[:min(len(reqs), first+2)])
	}
	blocking := 0
	for _, q := range reqs[first+1:] {
		if q.Index != "" {
			blocking++
			if q.Wait != "5m0s" {
				t.Errorf("blocking query %+v; want wait 5m0s", q)
			}
		}
	}
	if blocking == 0 {
		t.Errorf("requests %+v; want blocking queries", reqs)
	}
	if f.log.Count("[WARN]") != 0 {
		t.Errorf("warnings with Nomad readable:\n%s", f.log)
	}
}

// An allocation that ends on the client (complete, failed, lost) has its reservation
// released once the grace period has passed since the follower saw it end, and not
// before.
func TestFollowReleasesEndedAllocations(t *testing.T) {
	for _, status := range []string{structs.AllocClientStatusComplete, structs.AllocClientStatusFailed, structs.AllocClientStatusLost} {
		t.Run(status, func(t *testing.T) {
			f := followShim(t, nil, "GPU-a", "GPU-b")
			id, r := f.place(t, "ml", "train", "GPU-a", "GPU-b")
			f.nomad.SetClientStatus(id, status)
			if ev := f.settle(t); len(ev.released) != 0 {
				t.Fatalf("released at once: %v", ev.released)
			}
			f.clock.Advance(grace / 2)
			if f.released(r.ID) {
				t.Fatal("released before the grace period ended")
			}
			ev := f.advance(t, grace/2)
			if !slices.Equal(ev.released, []string{r.ID}) || !f.released(r.ID) {
				t.Fatalf("after the grace period: released %v; want %s", ev.released, r.ID)
			}
			if n := f.log.Count("released a reservation no running Nomad allocation holds"); n != 1 {
				t.Errorf("%d release lines, want 1:\n%s", n, f.log)
			}
		})
	}
}

// nomad alloc stop: the allocation is marked to stop (still running: kept), then the
// client reports it complete: released after the grace period.
func TestFollowAllocStop(t *testing.T) {
	f := followShim(t, nil, "GPU-a", "GPU-b")
	id, r := f.place(t, "default", "train", "GPU-a")
	other, keep := f.place(t, "default", "infer", "GPU-b")
	f.nomad.Update(id, func(a *structs.Allocation) { a.DesiredStatus = structs.AllocDesiredStatusStop })
	f.settle(t)
	f.clock.Advance(2 * grace)
	f.nomad.SetClientStatus(other, structs.AllocClientStatusRunning) // any change: a pass
	f.settle(t)
	if f.released(r.ID) {
		t.Fatal("released while the client still runs the stopping allocation")
	}
	f.nomad.SetClientStatus(id, structs.AllocClientStatusComplete)
	f.settle(t)
	if ev := f.advance(t, grace); !slices.Equal(ev.released, []string{r.ID}) {
		t.Fatalf("released %v after the stop; want %s", ev.released, r.ID)
	}
	if f.released(keep.ID) {
		t.Error("the other job's reservation was released")
	}
}

// nomad job stop: every allocation of the job ends and each reservation is released;
// another job's stays.
func TestFollowJobStop(t *testing.T) {
	f := followShim(t, nil, "GPU-a", "GPU-b", "GPU-c")
	_, r1 := f.place(t, "default", "train", "GPU-a")
	_, r2 := f.place(t, "default", "train", "GPU-b")
	_, keep := f.place(t, "default", "infer", "GPU-c")
	f.nomad.StopJob("default", "train")
	f.settle(t)
	ev := f.advance(t, grace)
	slices.Sort(ev.released)
	if want := []string{r1.ID, r2.ID}; !slices.Equal(ev.released, want) {
		t.Fatalf("released %v, want the job's %v", ev.released, want)
	}
	if f.released(keep.ID) {
		t.Error("the other job's reservation was released")
	}
}

// A drain marks the allocations to migrate; the client runs them until it stops them:
// nothing is released until then, everything after the grace period.
func TestFollowDrain(t *testing.T) {
	f := followShim(t, nil, "GPU-a", "GPU-b")
	_, r1 := f.place(t, "default", "train", "GPU-a")
	_, r2 := f.place(t, "default", "infer", "GPU-b")
	f.nomad.StartDrain()
	f.settle(t)
	f.clock.Advance(3 * grace)
	f.p.follow.f.Nudge() // a pass with the clock moved
	f.ev.wait(t, "a pass after the nudge", func(ev followEvent) bool { return ev.kind == evPass })
	if f.released(r1.ID) || f.released(r2.ID) {
		t.Fatal("released while the drain still runs the allocations")
	}
	f.nomad.FinishDrain()
	f.settle(t)
	ev := f.advance(t, grace)
	slices.Sort(ev.released)
	want := []string{r1.ID, r2.ID}
	slices.Sort(want)
	if !slices.Equal(ev.released, want) {
		t.Fatalf("released %v after the drain, want %v", ev.released, want)
	}
}

// A Nomad client restart: the agent is down a while, then back with the same
// allocations: nothing is released, the owner stays, and the outage is logged once.
func TestFollowClientRestart(t *testing.T) {
	f := followShim(t, nil, "GPU-a", "GPU-b")
	_, r := f.place(t, "ml", "train", "GPU-a", "GPU-b")
	f.nomad.Stop()
	f.ev.wait(t, "a failed read", func(ev followEvent) bool { return ev.kind == evFailed })
	for range 4 { // retries while it is down, over 2 minutes
		f.clock.Advance(40 * time.Second)
		f.ev.wait(t, "another failed read", func(ev followEvent) bool { return ev.kind == evFailed })
	}
	f.nomad.Start()
	f.clock.Advance(40 * time.Second)
	ev := f.settle(t)
	if len(ev.released) != 0 || f.released(r.ID) {
		t.Fatalf("released %v after the restart", ev.released)
	}
	if got := f.reservationOf(t, r.OwnerID); got.ID != r.ID {
		t.Errorf("reservation %+v after the restart; want %s kept", got, r.ID)
	}
	if n := f.log.Count("cannot read this node's allocations from Nomad"); n != 1 {
		t.Errorf("%d warnings about the outage, want 1:\n%s", n, f.log)
	}
	if n := f.log.Count("reading this node's allocations from Nomad again"); n != 1 {
		t.Errorf("%d recoveries logged, want 1", n)
	}
}

// While Nomad cannot be read, nothing is released, even a reservation whose allocation
// had ended; once it answers again, that one is.
func TestFollowReleasesNothingWhileUnreadable(t *testing.T) {
	f := followShim(t, nil, "GPU-a", "GPU-b")
	_, running := f.place(t, "default", "serve", "GPU-a")
	done, ended := f.place(t, "default", "batch", "GPU-b")
	f.nomad.SetClientStatus(done, structs.AllocClientStatusComplete)
	f.settle(t)
	f.nomad.Fail(&nomadtest.Failure{Code: 500, Body: "No cluster leader"})
	f.ev.wait(t, "a failed read", func(ev followEvent) bool { return ev.kind == evFailed })
	f.clock.Advance(20 * time.Second)
	f.ev.wait(t, "another failed read", func(ev followEvent) bool { return ev.kind == evFailed })
	f.clock.Advance(40 * time.Second) // past the grace period, with the grace timer due
	f.ev.wait(t, "another failed read", func(ev followEvent) bool { return ev.kind == evFailed })
	if f.released(running.ID) || f.released(ended.ID) {
		t.Fatal("released while Nomad answered 500")
	}
	f.nomad.Fail(nil)
	f.clock.Advance(40 * time.Second)
	ev := f.settle(t)
	if !slices.Equal(ev.released, []string{ended.ID}) || f.released(running.ID) {
		t.Errorf("released %v once Nomad answered; want only the ended %s", ev.released, ended.ID)
	}
}

// Without access (403: a token without the policy) the shim keeps working as before:
// Reserve with take-over, owners made up; the reason is logged once at WARN, and again
// only when it changes.
func TestFollowWithoutAccess(t *testing.T) {
	f := followShim(t, map[string]any{"nomad_token": "weak"}, "GPU-a")
	f.nomad.Fail(&nomadtest.Failure{Code: 403, Body: "Permission denied"})
	f.ev.wait(t, "a refused read", func(ev followEvent) bool { return ev.kind == evFailed && strings.Contains(ev.err.Error(), "403") })
	for range 3 {
		f.clock.Advance(time.Minute)
		f.ev.wait(t, "another refused read", func(ev followEvent) bool { return ev.kind == evFailed })
	}
	if _, err := f.p.Reserve([]string{"GPU-a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.p.Reserve([]string{"GPU-a"}); err != nil {
		t.Fatalf("a second allocation's Reserve (take-over): %v", err)
	}
	active, released := f.l.state()
	if len(active) != 1 || !isReserveOwner(active[0].OwnerID) || len(released) != 1 {
		t.Errorf("ledger %+v, released %v; want one reservation of a made-up owner, the first taken over", active, released)
	}
	if n := f.log.Count("[WARN]"); n != 1 || !strings.Contains(f.log.String(), "namespace") {
		t.Errorf("%d warnings, want 1 with the policy hint:\n%s", n, f.log)
	}
	f.nomad.Fail(&nomadtest.Failure{Code: 502, Body: "Bad Gateway"})
	f.clock.Advance(time.Minute)
	f.ev.wait(t, "a 502", func(ev followEvent) bool { return ev.kind == evFailed && strings.Contains(ev.err.Error(), "502") })
	if n := f.log.Count("[WARN]"); n != 2 {
		t.Errorf("%d warnings after the reason changed, want 2:\n%s", n, f.log)
	}
	for _, r := range f.nomad.Requests() {
		if r.Token != "weak" {
			t.Fatalf("request %+v without the token", r)
		}
	}
}

// No Nomad agent at all: one WARN, and Reserve works.
func TestFollowNoAgent(t *testing.T) {
	f := followShim(t, nil, "GPU-a")
	f.nomad.Stop()
	f.ev.wait(t, "a failed read", func(ev followEvent) bool { return ev.kind == evFailed })
	for range 3 {
		f.clock.Advance(time.Minute)
		f.ev.wait(t, "another failed read", func(ev followEvent) bool { return ev.kind == evFailed })
	}
	if _, err := f.p.Reserve([]string{"GPU-a"}); err != nil {
		t.Fatal(err)
	}
	if n := f.log.Count("[WARN]"); n != 1 || !strings.Contains(f.log.String(), "is the Nomad agent running") {
		t.Errorf("%d warnings, want 1 saying the agent is not reached:\n%s", n, f.log)
	}
}

// A reservation no allocation on the node ever held (or whose allocation Nomad has
// garbage collected) is released after the grace period; one of another owner is
// never touched.
func TestFollowReleasesGone(t *testing.T) {
	f := followShim(t, nil, "GPU-a", "GPU-b", "GPU-c")
	id, r := f.place(t, "default", "train", "GPU-a")
	orphan := f.l.hold("nomad/LEFTOVER", "GPU-b")
	other := f.l.hold("k8s/ml/p/c", "GPU-c")
	f.nomad.SetClientStatus(id, structs.AllocClientStatusComplete)
	f.nomad.GC(id)
	f.p.follow.f.Nudge() // the reservations made by hand, after the query in flight was sent
	f.settle(t)
	ev := f.advance(t, grace)
	slices.Sort(ev.released)
	want := []string{r.ID, orphan}
	slices.Sort(want)
	if !slices.Equal(ev.released, want) || f.released(other) {
		t.Errorf("released %v, want %v (and never %s)", ev.released, want, other)
	}
}

// A new allocation given an ended one's devices before the grace period is over keeps
// them: its Reserve takes the old reservation over, and the new one is named after it.
func TestFollowDevicesHandedOn(t *testing.T) {
	f := followShim(t, nil, "GPU-a")
	old, r := f.place(t, "default", "train", "GPU-a")
	f.nomad.SetClientStatus(old, structs.AllocClientStatusComplete)
	f.settle(t)
	id, r2 := f.place(t, "default", "train", "GPU-a")
	if !f.released(r.ID) || f.released(r2.ID) {
		t.Fatalf("after the hand-on: %s released %v, %s released %v; want the old one taken over", r.ID, f.released(r.ID), r2.ID, f.released(r2.ID))
	}
	f.clock.Advance(2 * grace)
	f.p.follow.f.Nudge()
	f.ev.wait(t, "a pass", func(ev followEvent) bool { return ev.kind == evPass })
	if f.released(r2.ID) || r2.OwnerID != AllocOwner("default", "train", id, "main") {
		t.Errorf("the new allocation's reservation %+v released %v", r2, f.released(r2.ID))
	}
}

// Without nomad_address the shim reads NOMAD_ADDR (and NOMAD_TOKEN), as Nomad's CLI.
func TestFollowAddressFromEnv(t *testing.T) {
	s := nomadtest.New(t, nil)
	l := newFakeLedger()
	path := socketPath(t)
	startAgent(t, fake(newSnapshots(snapshot("GPU-a")), l), path)
	ev := newEvents()
	p := New(nil)
	p.clock, p.observe = &fakeClock{}, ev.add
	p.getenv = func(k string) string { return map[string]string{"NOMAD_ADDR": s.URL(), "NOMAD_TOKEN": "from-env"}[k] }
	t.Cleanup(p.Close)
	if err := setConfig(p, map[string]any{"address": "unix://" + path}); err != nil {
		t.Fatal(err)
	}
	ev.wait(t, "an answer", func(ev followEvent) bool { return ev.kind == evFetched })
	if r := s.Requests()[0]; r.Token != "from-env" {
		t.Errorf("request %+v; want NOMAD_TOKEN's token", r)
	}
}

// An owner the agent refuses (a job ID too long for an owner ID) is logged once; the
// reservation keeps its owner and its devices while the task runs.
func TestFollowOwnerRefused(t *testing.T) {
	f := followShim(t, nil, "GPU-a")
	job := strings.Repeat("j", 300)
	id := f.nomad.Place(nomadtest.Alloc("default", job, "main", h100.Name, "GPU-a"))
	if _, err := f.p.Reserve([]string{"GPU-a"}); err != nil {
		t.Fatal(err)
	}
	f.settle(t)
	f.nomad.SetClientStatus(id, structs.AllocClientStatusRunning)
	f.settle(t)
	f.p.follow.f.Nudge()
	f.ev.wait(t, "a pass", func(ev followEvent) bool { return ev.kind == evPass })
	active, released := f.l.state()
	if len(active) != 1 || !isReserveOwner(active[0].OwnerID) || len(released) != 0 {
		t.Errorf("ledger %+v, released %v; want the reservation kept with its made-up owner", active, released)
	}
	if n := f.log.Count("cannot name a reservation after the Nomad task"); n != 1 {
		t.Errorf("%d warnings, want 1:\n%s", n, f.log)
	}
}

// A Nomad agent launches its plugins before its HTTP API listens: failures in the
// follower's first 30 s, before Nomad ever answered, are no warning.
func TestFollowQuietAtStartup(t *testing.T) {
	s := nomadtest.New(t, nil)
	s.Stop()
	path := socketPath(t)
	startAgent(t, fake(newSnapshots(snapshot("GPU-a")), newFakeLedger()), path)
	ev, clk, logs := newEvents(), &fakeClock{}, &logtest.Recorder{}
	p := New(hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Debug}))
	p.clock, p.observe = clk, ev.add
	t.Cleanup(p.Close)
	if err := setConfig(p, map[string]any{"address": "unix://" + path, "nomad_address": s.URL()}); err != nil {
		t.Fatal(err)
	}
	ev.wait(t, "a failed read", func(ev followEvent) bool { return ev.kind == evFailed })
	clk.Advance(10 * time.Second)
	ev.wait(t, "another failed read", func(ev followEvent) bool { return ev.kind == evFailed })
	s.Start()
	clk.Advance(20 * time.Second)
	ev.wait(t, "an answer", func(ev followEvent) bool { return ev.kind == evFetched })
	if n := logs.Count("[WARN]"); n != 0 || logs.Count("cannot read this node's allocations from Nomad yet") == 0 {
		t.Errorf("%d warnings at startup, want none (and DEBUG lines):\n%s", n, logs)
	}
}
