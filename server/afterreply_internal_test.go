package server

import (
	"bytes"
	"context"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/tools/h2test"
)

// TestReplyWrittenBeforeLogAndDeferredWork checks that a unary call's reply is out on
// the connection before its log line is written and before what its handler deferred
// (device.AfterReply: the watchers' snapshot, the garbage collector's wake-up after a
// Release) runs: on one thread (the agent's default), work done first holds the reply
// back, and a deferred wake-up runs the goroutine it wakes ahead of the connection's
// writer. The server's own stats handlers, in their order (statsHandlers).
func TestReplyWrittenBeforeLogAndDeferredWork(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	// The connection's writes as counted below the server's own listener wrapper; l is
	// set before the first call.
	var l *h2test.Listener
	var before, atLog, atRun atomic.Int64
	ran := make(chan struct{}, 1)
	logged := &writeWatcher{note: func() { atLog.Store(l.Writes.Load()) }}
	log := hclog.New(&hclog.LoggerOptions{Output: logged, Level: hclog.Info})
	opts := append([]grpc.ServerOption{grpc.Creds(listenerCreds{}), grpc.ChainUnaryInterceptor(afterReplies{}.unary)},
		statsHandlers(log, &streamLimits{max: 10, maxPerConn: 10})...)
	srv := grpc.NewServer(opts...)
	h2test.RegisterUnary(srv, "test.After", "Call", func(ctx context.Context) (proto.Message, error) {
		before.Store(l.Writes.Load())
		device.AfterReply(ctx, func() {
			atRun.Store(l.Writes.Load())
			ran <- struct{}{}
		})
		return &emptypb.Empty{}, nil
	})
	l, target := h2test.Serve(t, srv, func(lis net.Listener) net.Listener {
		return taggedListener{Listener: lis, l: &Listener{Name: "test"}}
	})
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStaticStreamWindowSize(1<<20), grpc.WithStaticConnWindowSize(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range 20 {
		if err := conn.Invoke(ctx, "/test.After/Call", &emptypb.Empty{}, &emptypb.Empty{}); err != nil {
			t.Fatal(err)
		}
		select {
		case <-ran:
		case <-ctx.Done():
			t.Fatal("the deferred work never ran")
		}
		if atLog.Load() == before.Load() {
			t.Fatalf("call %d: its log line was written before its reply", i)
		}
		if atRun.Load() == before.Load() {
			t.Fatalf("call %d: the deferred work ran before the reply was written to the connection", i)
		}
	}
	if !bytes.Contains(logged.bytes(), []byte("finished call")) {
		t.Fatalf("no call was logged: %q", logged.bytes())
	}
}

// writeWatcher is a log output that calls note at each write.
type writeWatcher struct {
	note func()
	mu   sync.Mutex
	buf  bytes.Buffer
}

func (w *writeWatcher) Write(p []byte) (int, error) {
	w.note()
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.Write(p)
}

func (w *writeWatcher) bytes() []byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	return bytes.Clone(w.buf.Bytes())
}
