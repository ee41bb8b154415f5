package nvidia

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

func TestMain(m *testing.M) {
	RunSimulatedMPSIfAsked() // the tests' simulated MPS control daemon is this binary
	// Under -race, every process sleeps 1 s at exit by default: each control client
	// run would take that long.
	os.Setenv("GORACE", strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	goleak.VerifyTestMain(m)
}

// t0 is where every fake clock starts.
var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

// fakeClock is a clock that moves only when Advance is called. Safe for concurrent use.
type fakeClock struct {
	mu      sync.Mutex
	now     time.Time
	timers  []*fakeTimer
	waiting chan struct{} // closed (and replaced) when a timer is made
}

type fakeTimer struct {
	clk *fakeClock
	at  time.Time
	c   chan time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: t0, waiting: make(chan struct{})} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) TimerAt(at time.Time) timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{clk: c, at: at, c: make(chan time.Time, 1)}
	close(c.waiting)
	c.waiting = make(chan struct{})
	if at.After(c.now) {
		c.timers = append(c.timers, t)
	} else {
		t.c <- c.now
	}
	return t
}

// Advance moves the clock on by d and fires every timer that is due.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	c.timers = slices.DeleteFunc(c.timers, func(t *fakeTimer) bool {
		if t.at.After(c.now) {
			return false
		}
		t.c <- c.now
		return true
	})
}

// waitForTimerAt waits until someone waits for a timer due at at: the code under test
// has reached its select and touches nothing until the clock moves.
func (c *fakeClock) waitForTimerAt(t *testing.T, at time.Time) {
	t.Helper()
	deadline := time.NewTimer(10 * time.Second)
	defer deadline.Stop()
	for {
		c.mu.Lock()
		found := slices.ContainsFunc(c.timers, func(ft *fakeTimer) bool { return ft.at.Equal(at) })
		waiting := c.waiting
		c.mu.Unlock()
		if found {
			return
		}
		select {
		case <-waiting:
		case <-deadline.C:
			t.Fatalf("nobody waited for a timer at %s", at)
		}
	}
}

func (t *fakeTimer) C() <-chan time.Time { return t.c }

func (t *fakeTimer) Stop() {
	c := t.clk
	c.mu.Lock()
	defer c.mu.Unlock()
	c.timers = slices.DeleteFunc(c.timers, func(ft *fakeTimer) bool { return ft == t })
}

// newTestPlugin returns a plugin on a fake clock, configured with cfg, and the clock.
func newTestPlugin(t *testing.T, cfg Config) (*Plugin, *fakeClock) {
	t.Helper()
	p, clk := newUnconfigured(t)
	if cfg.Simulate != "" && cfg.SimStateFile == nil {
		cfg.SimStateFile = ptr(filepath.Join(t.TempDir(), "sim-state.json"))
	}
	if err := p.SetConfig(context.Background(), mustJSON(t, cfg)); err != nil {
		t.Fatalf("SetConfig(%+v): %v", cfg, err)
	}
	return p, clk
}

func newUnconfigured(t *testing.T) (*Plugin, *fakeClock) {
	t.Helper()
	p := New(hclog.New(&hclog.LoggerOptions{Name: t.Name(), Output: t.Output(), Level: hclog.Info}))
	clk := newFakeClock()
	p.clock = clk
	p.eventPoll = 5 * time.Millisecond
	t.Cleanup(p.Close)
	return p, clk
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("marshal %+v: %v", v, err)
	}
	return b
}

// stream runs one Fingerprint or Stats call on its own goroutine and records what it
// sends. t.Cleanup cancels the call and waits for it.
type stream[T any] struct {
	msgs   chan T
	done   chan error
	cancel context.CancelFunc
}

func startStream[T any](t *testing.T, run func(ctx context.Context, send func(T) error) error) *stream[T] {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &stream[T]{msgs: make(chan T, 64), done: make(chan error, 1), cancel: cancel}
	go func() {
		s.done <- run(ctx, func(m T) error {
			select {
			case s.msgs <- m:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-s.done:
		case <-time.After(10 * time.Second):
			t.Errorf("stream did not return after cancel")
		}
	})
	return s
}

func startFingerprint(t *testing.T, p *Plugin) *stream[*pb.FingerprintResponse] {
	t.Helper()
	return startStream(t, p.Fingerprint)
}

func startStats(t *testing.T, p *Plugin, interval time.Duration) *stream[*pb.StatsResponse] {
	t.Helper()
	return startStream(t, func(ctx context.Context, send func(*pb.StatsResponse) error) error {
		return p.Stats(ctx, interval, send)
	})
}

// next returns the next message, failing the test after 10 s without one or if the
// call returned.
func (s *stream[T]) next(t *testing.T) T {
	t.Helper()
	select {
	case m := <-s.msgs:
		return m
	case err := <-s.done:
		s.done <- err
		t.Fatalf("stream returned %v, want another message", err)
	case <-time.After(10 * time.Second):
		t.Fatalf("no message within 10 s")
	}
	var zero T
	return zero
}

// stop cancels the call and returns its result, failing after 10 s.
func (s *stream[T]) stop(t *testing.T) error {
	t.Helper()
	s.cancel()
	select {
	case err := <-s.done:
		s.done <- err // for the cleanup
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("stream did not return within 10 s of cancel")
		return nil
	}
}

// devices flattens a fingerprint into device ID -> device.
func devices(resp *pb.FingerprintResponse) map[string]*pb.Device {
	out := make(map[string]*pb.Device)
	for _, g := range resp.GetGroups() {
		for _, d := range g.GetDevices() {
			out[d.GetId()] = d
		}
	}
	return out
}

func ptr[T any](v T) *T { return &v }
