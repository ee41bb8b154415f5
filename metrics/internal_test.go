package metrics

import (
	"context"
	"io"
	"net"
	"testing"
	"time"
)

// A client that sends half a request and stalls (slowloris) is cut off after the
// read-header timeout instead of holding a connection.
func TestStalledClientIsCutOff(t *testing.T) {
	m, err := New(Options{Hostname: "h"})
	if err != nil {
		t.Fatal(err)
	}
	if m.srv.ReadHeaderTimeout != readHeaderTimeout || readHeaderTimeout <= 0 {
		t.Fatalf("ReadHeaderTimeout = %v, want %v", m.srv.ReadHeaderTimeout, readHeaderTimeout)
	}
	m.srv.ReadHeaderTimeout = 200 * time.Millisecond // the test's own, to be quick
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- m.Serve(lis) }()
	defer func() {
		m.Shutdown(context.Background())
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}()

	conn, err := net.Dial("tcp", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, "GET /metrics HTTP/1.1\r\nHost: x\r\n"); err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(20 * time.Second)) // only so a broken server fails the test
	b, err := io.ReadAll(conn)
	if err != nil {
		t.Fatalf("the stalled connection was not closed by the server: %v (read %q)", err, b)
	}
}
