package client

import (
	"context"
	"errors"
	"io"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/backoff"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Update is one value of a watch channel: a snapshot from the agent, or word that the
// watch is disconnected.
type Update[T any] struct {
	// Snapshot is the agent's message; the zero value (nil) while disconnected.
	Snapshot T
	// Err is set while disconnected: why the stream ended or could not be opened (a gRPC
	// status error; IsUnavailable when the agent is gone or shutting down).
	Err error
	// RetryIn is how long the watch waits before it reconnects; set with Err.
	RetryIn time.Duration
}

// Disconnected reports whether u says the watch is disconnected rather than carrying a
// snapshot.
func (u Update[T]) Disconnected() bool { return u.Err != nil }

// WatchDevices streams the agent's inventory with its state: a full snapshot at once and
// after every change, as the Fingerprint RPC sends them.
//
// The watch reconnects by itself: when the stream ends (the agent restarted, a network
// fault), the channel delivers an Update with Err set, and after a backoff (WithBackoff:
// doubling from its base up to its max, with jitter) the watch opens the stream again;
// the first snapshot after a reconnect is again the full inventory. A message the watch
// receives resets the backoff.
//
// Delivery is latest-value: the channel holds at most one update, and a reader that
// falls behind gets the newest, never a backlog, so a slow reader never holds the watch
// up. The channel is closed only when ctx ends or the Client is closed.
//
// Snapshots are read-only: a device (or counter set) that one snapshot of a stream
// carries as the previous one did is the previous one's message, the same pointer, and
// is not decoded again. A watcher can tell the devices that did not change that way.
func (c *Client) WatchDevices(ctx context.Context) <-chan Update[*pb.FingerprintResponse] {
	return watch(c, ctx, func(ctx context.Context) (func() (*pb.FingerprintResponse, error), error) {
		stream, err := c.api.Fingerprint(ctx, &pb.FingerprintRequest{}, grpc.ForceCodecV2(newSnapshotCodec()))
		if err != nil {
			return nil, err
		}
		return stream.Recv, nil
	})
}

// WatchStats streams device statistics every interval (zero or negative: the agent's
// sampling interval; the agent rounds an interval up to a multiple of it), of the groups
// that match one of groups (none: all). It reconnects and delivers like WatchDevices.
func (c *Client) WatchStats(ctx context.Context, interval time.Duration, groups ...*pb.GroupFilter) <-chan Update[*pb.StatsResponse] {
	req := &pb.StatsRequest{Interval: durationpb.New(max(interval, 0)), Groups: groups}
	return watch(c, ctx, func(ctx context.Context) (func() (*pb.StatsResponse, error), error) {
		stream, err := c.api.Stats(ctx, req)
		if err != nil {
			return nil, err
		}
		return stream.Recv, nil
	})
}

// watch runs open's stream in a goroutine, delivering its messages and disconnections
// to the returned channel, reopening it with backoff, until ctx ends or c is closed. On
// a closed Client it returns a closed channel.
func watch[T any](c *Client, ctx context.Context, open func(context.Context) (func() (T, error), error)) <-chan Update[T] {
	out := make(chan Update[T], 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.isClosed {
		close(out)
		return out
	}
	c.watches.Add(1)
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		defer c.watches.Done()
		defer close(out)
		defer cancel()
		b := c.newBackoff()
		for attempt := 0; ; attempt++ {
			if attempt > 0 {
				// The connection may sit in its own reconnect backoff: make this
				// attempt a real one, so the watch's backoff alone sets the pace.
				c.conn.ResetConnectBackoff()
			}
			err := receive(ctx, open, func(v T) {
				b.Reset()
				offer(out, Update[T]{Snapshot: v})
			})
			if ctx.Err() != nil || isDone(c.closed) {
				return
			}
			d := b.Next()
			offer(out, Update[T]{Err: err, RetryIn: d})
			if !sleep(ctx, c.closed, d) {
				return
			}
		}
	}()
	return out
}

// receive opens one stream and calls deliver with each message until it fails or ctx
// ends, and returns why it ended. Closing the Client closes the connection, which ends
// the stream too.
//
// The stream's context carries ctx's values but not its deadline, and is canceled only
// after ctx is done: a deadline sent to the agent could end the stream there a moment
// before ctx is done here, and the watch would report a disconnection for what is the
// end of the watch.
func receive[T any](ctx context.Context, open func(context.Context) (func() (T, error), error), deliver func(T)) error {
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	recv, err := open(sctx)
	if err != nil {
		return err
	}
	for {
		v, err := recv()
		if errors.Is(err, io.EOF) {
			return errStreamEnded
		}
		if err != nil {
			return err
		}
		deliver(v)
	}
}

// offer puts v in ch, a channel of capacity one that only this goroutine sends on,
// replacing a value the reader has not taken yet.
func offer[T any](ch chan T, v T) {
	for {
		select {
		case ch <- v:
			return
		default:
		}
		select {
		case <-ch: // stale: the reader gets v instead
		default:
		}
	}
}

// isDone reports whether ch is closed.
func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// sleep waits for d, and reports whether it passed (false: ctx ended or closed was
// closed first).
func sleep(ctx context.Context, closed <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	case <-closed:
		return false
	}
}

// newBackoff is the reconnect delay of a watch and of WaitServing: base, doubling to
// max, ±20% jitter, never above max (WithBackoff promises that). Owned by one goroutine.
func (c *Client) newBackoff() *backoff.Backoff {
	return &backoff.Backoff{Base: c.opts.backoffBase, Max: c.opts.backoffMax, HardMax: true}
}
