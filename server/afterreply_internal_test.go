package server

import (
	"context"
	"net"
	"path/filepath"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/internal/h2test"
)

// TestAfterReplyRunsOnceTheReplyIsWritten checks that what a unary handler defers past
// its reply (device.AfterReply: the watchers' snapshot, the garbage collector's wake-up
// after a Release) runs after the reply went out on the connection, not before: on one
// thread (the agent's default), work run first would hold the reply back, and a
// deferred wake-up would run the goroutine it wakes ahead of the connection's writer.
func TestAfterReplyRunsOnceTheReplyIsWritten(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	raw, err := net.Listen("unix", filepath.Join(t.TempDir(), "s.sock"))
	if err != nil {
		t.Fatal(err)
	}
	// The connection's writes as counted below the server's own listener wrapper,
	// which afterReplies reads.
	l := &h2test.Listener{Listener: raw}
	var before, atRun atomic.Int64
	ran := make(chan struct{}, 1)
	srv := grpc.NewServer(grpc.Creds(listenerCreds{}), grpc.StatsHandler(afterReplies{}), grpc.ChainUnaryInterceptor(afterReplies{}.unary))
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "test.After",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Call", Handler: func(_ any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			var in emptypb.Empty
			if err := dec(&in); err != nil {
				return nil, err
			}
			handler := func(ctx context.Context, _ any) (any, error) {
				before.Store(l.Writes.Load())
				device.AfterReply(ctx, func() {
					atRun.Store(l.Writes.Load())
					ran <- struct{}{}
				})
				return &emptypb.Empty{}, nil
			}
			return interceptor(ctx, &in, &grpc.UnaryServerInfo{FullMethod: "/test.After/Call"}, handler)
		}}},
	}, struct{}{})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(taggedListener{Listener: l, l: &Listener{Name: "test"}}) }()
	defer func() {
		srv.Stop()
		<-served
	}()
	conn, err := grpc.NewClient("unix://"+raw.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
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
		if atRun.Load() == before.Load() {
			t.Fatalf("call %d: the deferred work ran before the reply was written to the connection", i)
		}
	}
}
