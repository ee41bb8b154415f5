package dra

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"google.golang.org/grpc"
)

// deferredDone runs c.deferred(ctx, max) in a goroutine and returns a channel that gets
// the time it returned.
func deferredDone(ctx context.Context, c *calls, max time.Duration) <-chan time.Time {
	done := make(chan time.Time, 1)
	go func() {
		c.deferred(ctx, max)
		done <- time.Now()
	}()
	return done
}

// Work that no answer needs waits while the kubelet's call is in flight, and until
// callGrace after it ends; with none in flight it does not wait at all. In a synctest
// bubble: "it waits" is checked once deferred is blocked, a minute later, not after a
// wall-clock window.
func TestDeferredWorkWaitsForTheKubeletsCalls(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := t.Context() // ends a deferred left waiting by a failure
		c := newCalls()
		done := deferredDone(ctx, c, time.Hour)
		synctest.Wait()
		select {
		case <-done:
		default:
			t.Fatal("deferred waited with no call ever made")
		}

		c.enter()
		c.enter() // two calls: the work waits for both
		done = deferredDone(ctx, c, time.Hour)
		c.leave()
		time.Sleep(time.Minute)
		synctest.Wait()
		select {
		case <-done:
			t.Fatal("deferred returned while a call was in flight")
		default:
		}
		c.leave()
		left := time.Now()
		// On the bubble's clock the wait is callGrace exactly; an hour would be max.
		if waited := (<-done).Sub(left); waited < callGrace || waited > time.Second {
			t.Errorf("deferred returned %v after the last call ended, want callGrace (%v) or a little more", waited, callGrace)
		}
	})
}

// A call that does not end delays the work by max at most; a context that ends, not at
// all.
func TestDeferredWorkWaitsAtMostMax(t *testing.T) {
	c := newCalls()
	c.enter()
	defer c.leave()
	const max = 30 * time.Millisecond
	start := time.Now()
	select {
	case at := <-deferredDone(context.Background(), c, max):
		if waited := at.Sub(start); waited < max {
			t.Errorf("deferred returned after %v with a call in flight, want %v", waited, max)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("deferred still waiting 10 s after its max")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := deferredDone(ctx, c, time.Hour)
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("deferred still waiting 10 s after its context ended")
	}
}

// The helper's interceptor counts NodePrepareResources and NodeUnprepareResources for
// as long as their handlers run, and nothing else (registration, health).
func TestKubeletCallsCountedByTheInterceptor(t *testing.T) {
	c := newCalls()
	for _, m := range []struct {
		name    string
		counted bool
	}{
		{"/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources", true},
		{"/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources", true},
		{"/pluginregistration.Registration/GetInfo", false},
	} {
		var during int
		_, err := c.interceptor(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: m.name},
			func(context.Context, any) (any, error) {
				c.mu.Lock()
				during = c.n
				c.mu.Unlock()
				return nil, nil
			})
		if err != nil {
			t.Fatal(err)
		}
		if want := map[bool]int{true: 1, false: 0}[m.counted]; during != want {
			t.Errorf("%s: %d calls in flight during its handler, want %d", m.name, during, want)
		}
		if c.n != 0 {
			t.Errorf("%s: %d calls in flight after its handler, want 0", m.name, c.n)
		}
	}
}
