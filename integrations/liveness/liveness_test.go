package liveness_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/integrations/liveness"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	stall = 10 * time.Second
	agent = 40 * time.Second
)

// start runs a Monitor with the test's timeouts and one loop, "work", that serves its
// token while it waits and does nothing while block holds a value it has not taken.
// Cleanup stops both.
func start(t *testing.T) (m *liveness.Monitor, block chan chan struct{}) {
	t.Helper()
	m, err := liveness.New(liveness.Config{StallTimeout: stall, AgentTimeout: agent})
	if err != nil {
		t.Fatal(err)
	}
	tokens := m.Loop("work")
	block = make(chan chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, 2)
	go func() {
		defer func() { done <- struct{}{} }()
		for {
			select {
			case <-tokens:
			case release := <-block:
				<-release // stuck in its work
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() {
		defer func() { done <- struct{}{} }()
		m.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		<-done
	})
	return m, block
}

func wantLive(t *testing.T, m *liveness.Monitor, want bool, reasonHas string) {
	t.Helper()
	live, reason := m.Live()
	if live != want || !strings.Contains(reason, reasonHas) {
		t.Fatalf("Live() = %v, %q; want %v with %q in the reason", live, reason, want, reasonHas)
	}
}

// A loop stuck in its work for the stall timeout makes the component not live; it
// is live again as soon as the loop takes its token.
func TestStuckLoop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, block := start(t)
		m.Agent(true)
		synctest.Wait()
		wantLive(t, m, true, "")

		// Waiting for input, however long, is not stuck.
		time.Sleep(10*stall + time.Millisecond) // between two checks
		wantLive(t, m, true, "")

		release := make(chan struct{})
		block <- release
		time.Sleep(stall - time.Millisecond)
		synctest.Wait()
		wantLive(t, m, true, "") // not yet: a check has seen the token sit for less than the timeout
		time.Sleep(stall/4 + 2*time.Millisecond)
		synctest.Wait()
		wantLive(t, m, false, "the work loop has made no progress")

		close(release)
		time.Sleep(stall / 4) // the next check finds the token taken
		synctest.Wait()
		wantLive(t, m, true, "")
	})
}

// Not reaching the agent for the agent timeout, from the start or after a
// disconnection, makes the component not live; reaching it again makes it live at once.
func TestAgentUnreachable(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, _ := start(t)
		synctest.Wait()
		wantLive(t, m, true, "") // not reached yet, but not for long
		time.Sleep(agent + time.Millisecond)
		synctest.Wait()
		wantLive(t, m, false, "the agent has been unreachable for")

		m.Agent(true)
		wantLive(t, m, true, "")

		m.Agent(false)
		time.Sleep(agent / 2)
		m.Agent(false) // a retry that failed again: still unreachable since the first
		time.Sleep(agent/2 + stall)
		synctest.Wait()
		wantLive(t, m, false, "unreachable")
		m.Agent(true)
		wantLive(t, m, true, "")
	})
}

func TestConfigCheck(t *testing.T) {
	_, err := liveness.New(liveness.Config{StallTimeout: -time.Second, AgentTimeout: -time.Minute})
	if err == nil || !strings.Contains(err.Error(), "stall timeout -1s is negative") || !strings.Contains(err.Error(), "agent timeout -1m0s is negative") {
		t.Fatalf("New with negative timeouts: %v; want both named", err)
	}
	if _, err := liveness.Listen(""); err == nil {
		t.Error("Listen(\"\") succeeded")
	}
}

// The answer is served as grpc.health.v1 on the socket, as grpc_health_probe asks
// for it; the socket goes away when the server stops.
func TestServe(t *testing.T) {
	m, err := liveness.New(liveness.Config{StallTimeout: time.Minute, AgentTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "h.sock")
	lis, err := liveness.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	runCtx, stop := context.WithCancel(ctx)
	served, ran := make(chan error, 1), make(chan struct{})
	go func() { served <- m.Serve(runCtx, lis) }()
	go func() { defer close(ran); m.Run(runCtx) }()

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	w, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	next := func(want healthpb.HealthCheckResponse_ServingStatus) {
		t.Helper()
		for {
			r, err := w.Recv()
			if err != nil {
				t.Fatalf("waiting for %v: %v", want, err)
			}
			if r.GetStatus() == want {
				return
			}
		}
	}
	next(healthpb.HealthCheckResponse_NOT_SERVING) // the agent never reached
	m.Agent(true)
	next(healthpb.HealthCheckResponse_SERVING)
	if r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check: %v, %v; want SERVING", r, err)
	}
	m.Agent(false)
	next(healthpb.HealthCheckResponse_NOT_SERVING)

	stop()
	if err := <-served; err != nil {
		t.Errorf("Serve: %v after its context ended, want nil", err)
	}
	<-ran
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("socket after Serve returned: %v, want it gone", err)
	}
}
