// Package liveness decides whether a client of the agent (the kubelet bridge, the DRA
// driver) is live, and serves that answer as the standard gRPC health service
// (grpc.health.v1, service "") on a Unix socket of its own, for a Kubernetes liveness
// probe to restart a component that is stuck: NOT_SERVING while one of its loops has not
// come back to the select it waits in for StallTimeout (see Monitor.Loop), while it has
// not reached the agent for AgentTimeout, and once Run's context has ended; SERVING
// again as soon as none holds. Public for the DRA driver, a module of its own.
// See docs/kubernetes.md#install-with-helm (Probes).
package liveness

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/endpoint"
)

// Defaults of Config.
const (
	// DefaultStallTimeout is far longer than any loop takes to handle one event.
	DefaultStallTimeout = time.Minute
	// DefaultAgentTimeout outlasts an agent restart, its plugins' fingerprinting
	// included (its startup probe allows 2 minutes).
	DefaultAgentTimeout = 3 * time.Minute
)

// Config configures a Monitor. Zero durations mean the defaults.
type Config struct {
	// StallTimeout is how long a loop may hold on to its token before the component
	// is reported stuck.
	StallTimeout time.Duration
	// AgentTimeout is how long the agent may be unreachable before the component is
	// reported not live.
	AgentTimeout time.Duration
	// Logger gets a line on each change of the answer, with the reason. Nil discards.
	Logger hclog.Logger
}

// Check refuses durations a Monitor cannot keep: negative ones.
func (c Config) Check() error {
	var errs []error
	if c.StallTimeout < 0 {
		errs = append(errs, fmt.Errorf("stall timeout %v is negative", c.StallTimeout))
	}
	if c.AgentTimeout < 0 {
		errs = append(errs, fmt.Errorf("agent timeout %v is negative", c.AgentTimeout))
	}
	return errors.Join(errs...)
}

// Monitor tracks the loops of one component and its reach of the agent. Register
// loops with Loop before Run; Agent may be called from any goroutine.
type Monitor struct {
	cfg    Config
	log    hclog.Logger
	health *health.Server

	mu        sync.Mutex
	loops     []*loop
	running   bool
	agentSeen bool      // Agent has been called
	agentDown time.Time // since when the agent is unreachable; zero while reachable
	live      bool
	reason    string
}

type loop struct {
	name   string
	token  chan struct{} // capacity one; only the Monitor sends
	sentAt time.Time     // when the token now in token was put there
}

// New returns a Monitor for cfg (see Config.Check); it answers NOT_SERVING until Run
// has made its first check.
func New(cfg Config) (*Monitor, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	if cfg.StallTimeout == 0 {
		cfg.StallTimeout = DefaultStallTimeout
	}
	if cfg.AgentTimeout == 0 {
		cfg.AgentTimeout = DefaultAgentTimeout
	}
	log := cfg.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	m := &Monitor{cfg: cfg, log: log, health: health.NewServer(), reason: "not started"}
	m.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	return m, nil
}

// Loop registers a loop called name and returns its token channel: the loop must
// receive from it in the select it waits in, and do nothing else with it. Call Loop
// before Run.
func (m *Monitor) Loop(name string) <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.running {
		panic("liveness: Loop called after Run")
	}
	l := &loop{name: name, token: make(chan struct{}, 1)}
	m.loops = append(m.loops, l)
	return l.token
}

// Next waits for the next value of ch, taking the loop's tokens while it waits: the
// select a loop that only waits on ch needs. ok is false once ch is closed.
func Next[T any](tokens <-chan struct{}, ch <-chan T) (v T, ok bool) {
	for {
		select {
		case <-tokens:
		case v, ok = <-ch:
			return v, ok
		}
	}
}

// Agent records whether the component's watch of the agent is connected. Call it on
// every update of the watch.
func (m *Monitor) Agent(reachable bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.agentSeen = true
	switch {
	case reachable:
		m.agentDown = time.Time{}
	case m.agentDown.IsZero():
		m.agentDown = time.Now()
	}
	if m.running {
		m.checkLocked(time.Now())
	}
}

// Live reports the current answer and, when not live, why.
func (m *Monitor) Live() (bool, string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.live, m.reason
}

// Run checks the loops and the agent every quarter of the shorter timeout until ctx
// ends, then answers NOT_SERVING and returns. Call it once.
func (m *Monitor) Run(ctx context.Context) {
	now := time.Now()
	m.mu.Lock()
	if m.running {
		m.mu.Unlock()
		panic("liveness: Run called twice")
	}
	m.running = true
	if !m.agentSeen {
		m.agentDown = now // not reached yet
	}
	for _, l := range m.loops {
		l.token <- struct{}{}
		l.sentAt = now
	}
	m.checkLocked(now)
	m.mu.Unlock()

	t := time.NewTicker(min(m.cfg.StallTimeout, m.cfg.AgentTimeout) / 4)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			m.mu.Lock()
			m.setLocked(false, "stopping")
			m.mu.Unlock()
			return
		case now := <-t.C:
			m.mu.Lock()
			m.checkLocked(now)
			m.mu.Unlock()
		}
	}
}

// checkLocked refills the tokens loops have taken and sets the answer.
func (m *Monitor) checkLocked(now time.Time) {
	live, reason := true, ""
	for _, l := range m.loops {
		if len(l.token) == 0 {
			l.token <- struct{}{}
			l.sentAt = now
			continue
		}
		if d := now.Sub(l.sentAt); d >= m.cfg.StallTimeout && live {
			live, reason = false, fmt.Sprintf("the %s loop has made no progress for %v (stall timeout %v)", l.name, d.Round(time.Millisecond), m.cfg.StallTimeout)
		}
	}
	if !m.agentDown.IsZero() && live {
		if d := now.Sub(m.agentDown); d >= m.cfg.AgentTimeout {
			live, reason = false, fmt.Sprintf("the agent has been unreachable for %v (agent timeout %v)", d.Round(time.Millisecond), m.cfg.AgentTimeout)
		}
	}
	m.setLocked(live, reason)
}

func (m *Monitor) setLocked(live bool, reason string) {
	changed := live != m.live
	m.live, m.reason = live, reason
	if !changed {
		return
	}
	if live {
		m.log.Info("live again: health SERVING")
		m.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
		return
	}
	if reason != "stopping" {
		m.log.Error("not live: health NOT_SERVING (a liveness probe on the health socket restarts the component)", "reason", reason)
	}
	m.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
}

// Listen binds the health socket at path (replacing a stale one, never a live one).
func Listen(path string) (net.Listener, error) {
	if path == "" {
		return nil, errors.New("health socket: no path")
	}
	lis, err := endpoint.ListenUnix(path)
	if err != nil {
		return nil, fmt.Errorf("health socket: %w", err)
	}
	return lis, nil
}

// Serve serves m's answer as grpc.health.v1 on lis until ctx ends, then stops the
// server, which closes lis (removing its socket). It returns nil after ctx ended.
func (m *Monitor) Serve(ctx context.Context, lis net.Listener) error {
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, m.health)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	select {
	case <-ctx.Done():
		srv.Stop()
		<-errc
		return nil
	case err := <-errc:
		return fmt.Errorf("health socket: %w", err)
	}
}
