package shim

import (
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/nomad/structs"

	dev "github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/integrations/nomad/nomadapi/nomadtest"
	"github.com/devicehost/devicehost/tools/logtest"
	"github.com/devicehost/devicehost/tools/testwait"
)

// fakeClock is a clock that moves only when Advance is called: Now is the real time
// plus what was advanced (so the agent's creation times, real, stay in order with
// it), and a timer fires when Advance reaches its deadline.
type fakeClock struct {
	mu     sync.Mutex
	offset time.Duration
	timers []*fakeTimer
}

type fakeTimer struct {
	at      time.Time
	c       chan time.Time
	stopped bool
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return time.Now().Add(c.offset)
}

func (c *fakeClock) NewTimer(d time.Duration) (<-chan time.Time, func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{at: time.Now().Add(c.offset + d), c: make(chan time.Time, 1)}
	c.timers = append(c.timers, t)
	return t.c, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		t.stopped = true
	}
}

// Advance moves the clock by d and fires the timers due by then.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.offset += d
	now := time.Now().Add(c.offset)
	kept := c.timers[:0]
	for _, t := range c.timers {
		switch {
		case t.stopped:
		case !t.at.After(now):
			t.c <- now
		default:
			kept = append(kept, t)
		}
	}
	c.timers = kept
}

// events records the follower's steps for a test to wait on, in order.
type events struct {
	mu      sync.Mutex
	evs     []followEvent
	next    int           // the first event a wait has not consumed
	changed chan struct{} // closed and replaced at every event
}

func newEvents() *events { return &events{changed: make(chan struct{})} }

func (e *events) add(ev followEvent) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.evs = append(e.evs, ev)
	close(e.changed)
	e.changed = make(chan struct{})
}

// wait consumes events until one satisfies ok, and returns it and those before it.
func (e *events) wait(t *testing.T, what string, ok func(followEvent) bool) (followEvent, []followEvent) {
	t.Helper()
	deadline := time.After(testwait.Timeout)
	for {
		e.mu.Lock()
		for i := e.next; i < len(e.evs); i++ {
			if ev := e.evs[i]; ok(ev) {
				before := slices.Clone(e.evs[e.next:i])
				e.next = i + 1
				e.mu.Unlock()
				return ev, before
			}
		}
		changed := e.changed
		e.mu.Unlock()
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("the follower did not report %s", what)
		}
	}
}

// followed is a shim following a Nomad stand-in, against a fake agent's ledger.
type followed struct {
	p     *Plugin
	nomad *nomadtest.Server
	l     *fakeLedger
	clock *fakeClock
	ev    *events
	log   *logtest.Recorder
}

// followShim starts a fake agent with the H100s ids and a Nomad stand-in, and a shim
// following it with the given extra config, closed at cleanup. It returns once the
// follower's first pass is done.
func followShim(t *testing.T, extra map[string]any, ids ...string) *followed {
	t.Helper()
	f := &followed{nomad: nomadtest.New(t, nil), l: newFakeLedger(), clock: &fakeClock{}, ev: newEvents(), log: &logtest.Recorder{}}
	path := socketPath(t)
	startAgent(t, fake(newSnapshots(snapshot(ids...)), f.l), path)
	f.p = New(hclog.New(&hclog.LoggerOptions{Output: f.log, Level: hclog.Debug}))
	f.p.clock, f.p.observe = f.clock, f.ev.add
	t.Cleanup(f.p.Close)
	cfg := map[string]any{"address": "unix://" + path, "follow_allocations": true, "nomad_address": f.nomad.URL()}
	for k, v := range extra {
		cfg[k] = v
	}
	if err := setConfig(f.p, cfg); err != nil {
		t.Fatal(err)
	}
	return f
}

// settle waits until the follower has seen the stand-in's allocations as they are now
// and made its pass by them, and returns that pass.
func (f *followed) settle(t *testing.T) followEvent {
	t.Helper()
	idx := f.nomad.AllocationsIndex()
	f.ev.wait(t, "an answer at the current index", func(ev followEvent) bool { return ev.kind == evFetched && ev.index >= idx })
	ev, _ := f.ev.wait(t, "a pass", func(ev followEvent) bool { return ev.kind == evPass })
	return ev
}

// advance moves the clock by d and waits for the pass it causes.
func (f *followed) advance(t *testing.T, d time.Duration) followEvent {
	t.Helper()
	f.clock.Advance(d)
	ev, _ := f.ev.wait(t, "a pass after the clock moved", func(ev followEvent) bool { return ev.kind == evPass })
	return ev
}

// place puts an allocation of namespace/job with task "main" holding ids on the node,
// running, reserves its devices as Nomad's device hook does, and waits for the
// follower to name the reservation. It returns the allocation's ID and reservation.
func (f *followed) place(t *testing.T, namespace, job string, ids ...string) (string, dev.Reservation) {
	t.Helper()
	a := nomadtest.Alloc(namespace, job, "main", h100.Name, ids...)
	id := f.nomad.Place(a)
	if _, err := f.p.Reserve(ids); err != nil {
		t.Fatalf("Reserve %v: %v", ids, err)
	}
	owner := AllocOwner(namespace, job, id, "main")
	f.ev.wait(t, "the reservation named "+owner, func(ev followEvent) bool {
		return ev.kind == evPass && len(ev.reowned) > 0 && strings.HasSuffix(ev.reowned[0], "="+owner)
	})
	f.nomad.SetClientStatus(id, structs.AllocClientStatusRunning)
	f.settle(t)
	return id, f.reservationOf(t, owner)
}

// reservationOf returns owner's one live reservation.
func (f *followed) reservationOf(t *testing.T, owner string) dev.Reservation {
	t.Helper()
	active, _ := f.l.state()
	for _, r := range active {
		if r.OwnerID == owner {
			return r
		}
	}
	t.Fatalf("no live reservation of %s in %+v", owner, active)
	return dev.Reservation{}
}

// released reports whether the reservation id was released.
func (f *followed) released(id string) bool {
	_, rel := f.l.state()
	for _, r := range rel {
		if r == id {
			return true
		}
	}
	return false
}
