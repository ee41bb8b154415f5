// Package servertest serves the host API in-process over a real Unix socket, for the
// tests of its clients (the client package, the CLI, the bridges): the same server,
// interceptors and limits as the agent's, on a device.Manager of the test's.
package servertest

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/server"
)

// ShortTempDir returns a fresh directory removed at cleanup. Not t.TempDir: its paths
// hold the test's name, and a Unix socket path is limited to 108 bytes.
func ShortTempDir(t testing.TB, prefix string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// SocketPath returns the path of a socket in a fresh ShortTempDir.
func SocketPath(t testing.TB) string {
	return filepath.Join(ShortTempDir(t, "dhsock"), "devicehost.sock")
}

// Agent is a host API server serving on a Unix socket.
type Agent struct {
	Addr endpoint.Address
	srv  *server.Server
	done chan error
	once sync.Once
}

// Serve serves cfg (its Manager set) on the Unix socket at path until Stop, which
// cleanup calls at the latest. The socket's listener options are added to cfg's.
func Serve(t testing.TB, path string, cfg server.Config) *Agent {
	t.Helper()
	addr := endpoint.Address{Network: "unix", Path: path}
	lis, err := endpoint.Listen(addr, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	cfg.ServerOptions = append(slices.Clip(cfg.ServerOptions), lis.ServerOptions()...)
	srv, err := server.New(cfg)
	if err != nil {
		lis.Close()
		t.Fatal(err)
	}
	a := &Agent{Addr: addr, srv: srv, done: make(chan error, 1)}
	go func() { a.done <- srv.Serve(lis) }()
	t.Cleanup(a.Stop)
	return a
}

// Server is the served server, e.g. for a metrics collector.
func (a *Agent) Server() *server.Server { return a.srv }

// Stop shuts the server down as the agent does (open streams end with UNAVAILABLE,
// running calls get up to 10s) and removes the socket. Calling it again does nothing.
func (a *Agent) Stop() {
	a.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		a.srv.Shutdown(ctx)
		<-a.done
	})
}
