package rawgrpc_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/tools/rawgrpc"
)

// watchServer serves /t.S/Watch: a request "COUNT SIZE [fail]" gets COUNT messages of
// SIZE bytes (each starting with its index, then a pattern of the stream's request),
// then OK, or FAILED_PRECONDITION when it says fail.
func watchServer(t *testing.T) string {
	t.Helper()
	srv := grpc.NewServer(grpc.ForceServerCodecV2(rawgrpc.Codec{}))
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "t.S",
		HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{{StreamName: "Watch", ServerStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
			var req []byte
			if err := ss.RecvMsg(&req); err != nil {
				return err
			}
			var count, size int
			var fail string
			if n, err := fmt.Sscan(string(req), &count, &size, &fail); n < 2 {
				return status.Errorf(codes.InvalidArgument, "request %q: %v", req, err)
			}
			for i := range count {
				m := message(req, i, size)
				if err := ss.SendMsg(&m); err != nil {
					return err
				}
			}
			if fail == "fail" {
				return status.Error(codes.FailedPrecondition, "nope: 100% sure")
			}
			return nil
		}}},
	}, nil)
	sock := filepath.Join(t.TempDir(), "s.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return sock
}

// dialWatch starts a watchServer and returns a Client on a connection to it. The test
// ends with no goroutine left of either.
func dialWatch(t *testing.T) *rawgrpc.Client {
	t.Helper()
	t.Cleanup(func() { goleak.VerifyNone(t) }) // runs last, after the server stops
	nc, err := net.Dial("unix", watchServer(t))
	if err != nil {
		t.Fatal(err)
	}
	c, err := rawgrpc.NewClient(nc)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// message is the i-th message the server sends for req.
func message(req []byte, i, size int) []byte {
	m := bytes.Repeat(append(req, byte(i)), size/(len(req)+1)+1)[:size]
	if size >= 4 {
		binary.BigEndian.PutUint32(m, uint32(i))
	}
	return m
}

// TestClientReadsEveryMessageOfEveryStream reads streams of small messages (many to a
// DATA frame), large ones (split over frames) and more than the stream's and the
// connection's windows hold, so that the calls finish only if the client's window
// updates keep them open; and a call's error status.
func TestClientReadsEveryMessageOfEveryStream(t *testing.T) {
	c := dialWatch(t)
	reqs := map[uint32][]byte{}
	want := map[uint32][2]int{}
	for _, r := range []string{"2000 10", "40 100000", "3 3000000", "5 7 fail", "0 0"} {
		id, err := c.Open("/t.S/Watch", []byte(r))
		if err != nil {
			t.Fatal(err)
		}
		reqs[id] = []byte(r)
		var count, size int
		fmt.Sscan(r, &count, &size)
		want[id] = [2]int{count, size}
	}

	var mu sync.Mutex
	got := map[uint32]int{}
	headers := map[uint32]bool{}
	ended := map[uint32]error{}
	var bad []string
	allEnded := make(chan struct{})
	run := make(chan error, 1)
	go func() {
		run <- c.Run(rawgrpc.Handler{
			Headers: func(id uint32) { mu.Lock(); headers[id] = true; mu.Unlock() },
			Message: func(id uint32, msg []byte) {
				mu.Lock()
				defer mu.Unlock()
				i := got[id]
				if w := message(reqs[id], i, want[id][1]); !bytes.Equal(msg, w) {
					bad = append(bad, fmt.Sprintf("stream %d message %d: %d bytes, not the %d sent", id, i, len(msg), len(w)))
				}
				got[id]++
			},
			End: func(id uint32, err error) {
				mu.Lock()
				defer mu.Unlock()
				ended[id] = err
				if len(ended) == len(reqs) {
					close(allEnded)
				}
			},
		})
	}()
	select {
	case <-allEnded:
	case err := <-run:
		t.Fatalf("Run returned %v before every stream ended", err)
	case <-time.After(time.Minute):
		mu.Lock()
		t.Fatalf("after a minute: %d of %d streams ended, messages %v", len(ended), len(reqs), got)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-run; err != nil {
		t.Fatalf("Run after Close: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("%d messages differ from what was sent, first: %s", len(bad), bad[0])
	}
	for id, r := range reqs {
		if got[id] != want[id][0] {
			t.Errorf("%q: %d messages, want %d", r, got[id], want[id][0])
		}
		// A call that sends nothing is answered trailers-only: no headers of their own.
		if headers[id] != (want[id][0] > 0) {
			t.Errorf("%q: headers seen %v", r, headers[id])
		}
		fails := strings.HasSuffix(string(r), "fail")
		if err := ended[id]; fails != (err != nil) || fails && !strings.Contains(err.Error(), "nope: 100% sure") {
			t.Errorf("%q ended with %v", r, err)
		}
	}
}

// TestClientSaysWhyAStreamWasRefused: an unknown method ends the stream with its status.
func TestClientSaysWhyAStreamWasRefused(t *testing.T) {
	c := dialWatch(t)
	if _, err := c.Open("/t.S/Nope", nil); err != nil {
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	run := make(chan error, 1)
	go func() { run <- c.Run(rawgrpc.Handler{End: func(_ uint32, err error) { ended <- err }}) }()
	select {
	case err := <-ended:
		if err == nil || !strings.Contains(err.Error(), "grpc-status 12") || !strings.Contains(err.Error(), "Nope") {
			t.Errorf("ended with %v, want UNIMPLEMENTED naming the method", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the stream did not end in a minute")
	}
	c.Close()
	if err := <-run; err != nil {
		t.Fatal(err)
	}
}

// TestClientRefusesAMessageOverItsBound: a message longer than MaxMessage ends Run with
// an error saying so, whether its prefix comes whole in one DATA frame or split.
func TestClientRefusesAMessageOverItsBound(t *testing.T) {
	for _, req := range []string{"1 3000000", "2 100"} {
		t.Run(req, func(t *testing.T) {
			c := dialWatch(t)
			c.MaxMessage = 99
			if _, err := c.Open("/t.S/Watch", []byte(req)); err != nil {
				t.Fatal(err)
			}
			err := c.Run(rawgrpc.Handler{})
			c.Close()
			if err == nil || !strings.Contains(err.Error(), "over the 99 taken") {
				t.Errorf("Run returned %v; want the message refused as over 99 bytes", err)
			}
		})
	}
}
