package pluginloader_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/pluginloader"
)

// fakeProcess stands in for a plugin process: exit ends ExitContext with a reason.
type fakeProcess struct {
	exited context.Context
	cancel context.CancelFunc
	once   sync.Once
	mu     sync.Mutex
	reason string
}

func newFakeProcess() *fakeProcess {
	ctx, cancel := context.WithCancel(context.Background())
	return &fakeProcess{exited: ctx, cancel: cancel}
}

func (p *fakeProcess) ExitContext() context.Context { return p.exited }

func (p *fakeProcess) ExitReason() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.reason
}

func (p *fakeProcess) exit(reason string) {
	p.once.Do(func() {
		p.mu.Lock()
		p.reason = reason
		p.mu.Unlock()
		p.cancel()
	})
}

var _ pluginloader.Process = (*fakeProcess)(nil)

// TestRPCErrorDoneContextRule: an Unavailable or Canceled error is the plugin's exit when
// the process is gone or goes within a second; anything else, or the caller giving up,
// is the RPC's own error. Time is synctest's, so the waits are exact.
func TestRPCErrorDoneContextRule(t *testing.T) {
	unavailable := status.Error(codes.Unavailable, "connection closed")
	canceled := status.Error(codes.Canceled, "context canceled")
	tests := []struct {
		name     string
		err      error
		exitIn   time.Duration // <0: never; 0: before the call
		cancelIn time.Duration // caller's context; <0: never, 0: before the call
		exited   bool
		waited   time.Duration
	}{
		{name: "nil", err: nil, exitIn: 0, cancelIn: -1},
		{name: "another code is the RPC's, even after an exit", err: status.Error(codes.Internal, "boom"), exitIn: 0, cancelIn: -1},
		{name: "not a status", err: errors.New("boom"), exitIn: 0, cancelIn: -1},
		{name: "unavailable, already exited", err: unavailable, exitIn: 0, cancelIn: -1, exited: true},
		{name: "canceled, already exited", err: canceled, exitIn: 0, cancelIn: -1, exited: true},
		{name: "unavailable, exits during the grace", err: unavailable, exitIn: 300 * time.Millisecond, cancelIn: -1, exited: true, waited: 300 * time.Millisecond},
		{name: "unavailable, lives", err: unavailable, exitIn: -1, cancelIn: -1, waited: time.Second},
		{name: "exits after the grace", err: unavailable, exitIn: 1500 * time.Millisecond, cancelIn: -1, waited: time.Second},
		{name: "caller gave up first", err: canceled, exitIn: 0, cancelIn: 0},
		{name: "caller gives up during the grace", err: unavailable, exitIn: -1, cancelIn: 200 * time.Millisecond, waited: 200 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := newFakeProcess()
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				at := func(d time.Duration, f func()) {
					switch {
					case d == 0:
						f()
					case d > 0:
						time.AfterFunc(d, f)
					}
				}
				at(tt.exitIn, func() { p.exit("signal: killed") })
				at(tt.cancelIn, cancel)

				start := time.Now()
				got := pluginloader.RPCError(ctx, p, tt.err)
				waited := time.Since(start)
				switch {
				case tt.exited:
					if !errors.Is(got, pluginloader.ErrExited) || got.Error() != "signal: killed: plugin process exited" {
						t.Errorf("RPCError = %v, want ErrExited with the reason", got)
					}
				case got != tt.err:
					t.Errorf("RPCError = %v, want the RPC's own error %v", got, tt.err)
				}
				if waited != tt.waited {
					t.Errorf("RPCError returned after %v, want %v", waited, tt.waited)
				}
				p.exit("test over") // ends the AfterFuncs' wait, if any
			})
		})
	}
}

// TestCallContextEndsOnExit: a call context ends with cause ErrExited when the plugin
// exits, and RPCError on it reports the exit at once; stop leaves nothing running.
func TestCallContextEndsOnExit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := newFakeProcess()
		cctx, stop := pluginloader.CallContext(t.Context(), p)
		defer stop()
		time.AfterFunc(time.Second, func() { p.exit("exit status 3") })
		<-cctx.Done()
		if cause := context.Cause(cctx); !errors.Is(cause, pluginloader.ErrExited) {
			t.Errorf("cause = %v, want ErrExited", cause)
		}
		start := time.Now()
		err := pluginloader.RPCError(cctx, p, status.Error(codes.Canceled, "context canceled"))
		if !errors.Is(err, pluginloader.ErrExited) || time.Since(start) != 0 {
			t.Errorf("RPCError on the exited call context = %v after %v, want ErrExited at once", err, time.Since(start))
		}
	})
}

// TestCallContextStop: stop ends the context with context.Canceled while the plugin
// lives, and drops the watch on the exit: a later exit changes nothing (and
// synctest.Test fails on a goroutine left blocked).
func TestCallContextStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := newFakeProcess()
		cctx, stop := pluginloader.CallContext(t.Context(), p)
		stop()
		if cause := context.Cause(cctx); cause != context.Canceled {
			t.Errorf("cause after stop = %v, want context.Canceled", cause)
		}
		p.exit("late")
		if cause := context.Cause(cctx); cause != context.Canceled {
			t.Errorf("cause after a later exit = %v, want context.Canceled still", cause)
		}
	})
}
