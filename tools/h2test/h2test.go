// Package h2test counts the PING frames and the writes of the HTTP/2 connections a
// gRPC server accepts, for tests of transport settings that exist to spare pings
// (grpc-go's window estimate pings its peer after most messages it receives) and of
// when a reply reaches the wire.
package h2test

import (
	"context"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
)

// Serve serves srv, with a health service added, on a new Unix socket until the test
// ends, and returns the listener (its counts) and the socket's gRPC target. wrap, if
// not nil, wraps the counting listener for srv (the server's own listener type).
func Serve(t testing.TB, srv *grpc.Server, wrap func(net.Listener) net.Listener) (*Listener, string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s.sock")
	raw, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l := &Listener{Listener: raw}
	var lis net.Listener = l
	if wrap != nil {
		lis = wrap(l)
	}
	healthpb.RegisterHealthServer(srv, health.NewServer())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		<-served
	})
	return l, "unix://" + sock
}

// RegisterUnary registers on srv the unary method /service/method: its request is read
// as an emptypb.Empty (what it holds is ignored) and its answer is handle's, through
// srv's interceptors.
func RegisterUnary(srv *grpc.Server, service, method string, handle func(ctx context.Context) (proto.Message, error)) {
	full := "/" + service + "/" + method
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: service,
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: method, Handler: func(_ any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			var in emptypb.Empty
			if err := dec(&in); err != nil {
				return nil, err
			}
			if interceptor == nil {
				return handle(ctx)
			}
			return interceptor(ctx, &in, &grpc.UnaryServerInfo{FullMethod: full}, func(ctx context.Context, _ any) (any, error) {
				return handle(ctx)
			})
		}}},
	}, struct{}{})
}

// Checks makes n health checks on conn and returns how many PINGs l received and sent meanwhile.
func Checks(t testing.TB, l *Listener, conn *grpc.ClientConn, n int) (received, sent int64) {
	t.Helper()
	r0, s0 := l.Received.Load(), l.Sent.Load()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := healthpb.NewHealthClient(conn)
	for range n {
		if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	return l.Received.Load() - r0, l.Sent.Load() - s0
}

// preface is what an HTTP/2 client sends before its first frame.
const preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// Listener is a listener whose connections count the PING frames (acks not counted)
// going each way.
type Listener struct {
	net.Listener
	// Received counts the PINGs the clients sent, Sent those the server sent.
	Received, Sent atomic.Int64
	// Writes counts the server's writes to its connections (each a batch of frames).
	Writes atomic.Int64
}

// Accept implements net.Listener.
func (l *Listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &conn{Conn: c, writes: &l.Writes, in: frames{skip: len(preface), pings: &l.Received}, out: frames{pings: &l.Sent}}, nil
}

type conn struct {
	net.Conn
	writes  *atomic.Int64
	in, out frames
}

func (c *conn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.in.see(p[:n])
	return n, err
}

func (c *conn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.out.see(p[:n])
	c.writes.Add(1)
	return n, err
}

// frames follows one direction of a connection: each frame's 9-byte header, its
// payload skipped.
type frames struct {
	pings *atomic.Int64

	mu   sync.Mutex
	skip int    // bytes still to skip: the preface, or a frame's payload
	head []byte // a frame header read so far
}

func (f *frames) see(b []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for len(b) > 0 {
		if f.skip > 0 {
			k := min(f.skip, len(b))
			f.skip -= k
			b = b[k:]
			continue
		}
		k := min(9-len(f.head), len(b))
		f.head = append(f.head, b[:k]...)
		b = b[k:]
		if len(f.head) < 9 {
			continue
		}
		const typePing, flagAck = 0x6, 0x1
		if f.head[3] == typePing && f.head[4]&flagAck == 0 {
			f.pings.Add(1)
		}
		f.skip = int(f.head[0])<<16 | int(f.head[1])<<8 | int(f.head[2])
		f.head = f.head[:0]
	}
}
