package dra

import (
	"context"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
)

// maxDefer bounds how long work that no answer to the kubelet needs waits for the
// kubelet's calls in flight to end: under a steady stream of prepares it still runs
// this often.
const maxDefer = 20 * time.Millisecond

// callGrace is how long after the last call ends deferred work still waits: the
// helper's answer goes out after the call returns.
const callGrace = time.Millisecond

// calls counts the kubelet's calls in flight (NodePrepareResources and
// NodeUnprepareResources, from the helper's interceptor, and the driver's own
// PrepareResourceClaims and UnprepareResourceClaims). The agent's snapshot that a
// Reserve causes arrives while its prepare still writes the claim's CDI spec, and a
// prepare kicks the claim's status write: taking the snapshot in (about 1 ms of CPU
// for 8 GPUs with on-demand MIG) or writing the status at once takes CPU from the
// answer the kubelet waits for, on a 2-core node. Both wait with deferred instead
// (docs/benchmarks.md, "What the kubelet's answer does not need waits for it").
type calls struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed while n is 0; a new one from the moment n leaves 0
	last time.Time     // when n last went to 0
}

func newCalls() *calls {
	idle := make(chan struct{})
	close(idle)
	return &calls{idle: idle}
}

// enter counts a call in; its leave counts it out.
func (c *calls) enter() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == 0 {
		c.idle = make(chan struct{})
	}
	c.n++
}

func (c *calls) leave() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n--
	if c.n == 0 {
		c.last = time.Now()
		close(c.idle)
	}
}

// deferred returns once no call has been in flight for callGrace, max has passed,
// or ctx ended.
func (c *calls) deferred(ctx context.Context, max time.Duration) {
	deadline := time.Now().Add(max)
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for {
		c.mu.Lock()
		idle, n, last := c.idle, c.n, c.last
		c.mu.Unlock()
		now := time.Now()
		wait := deadline.Sub(now)
		if wait <= 0 {
			return
		}
		if n == 0 {
			g := last.Add(callGrace).Sub(now)
			if g <= 0 {
				return
			}
			wait, idle = min(wait, g), nil // wait out the grace
		}
		if t == nil {
			t = time.NewTimer(wait)
		} else {
			t.Reset(wait)
		}
		select {
		case <-idle:
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// interceptor counts the helper's NodePrepareResources and NodeUnprepareResources
// calls from when the kubelet's request arrives (before the helper reads the claims).
func (c *calls) interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if strings.HasSuffix(info.FullMethod, "/NodePrepareResources") || strings.HasSuffix(info.FullMethod, "/NodeUnprepareResources") {
		c.enter()
		defer c.leave()
	}
	return handler(ctx, req)
}
