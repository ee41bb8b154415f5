// Package deviceplugintest runs a deviceplugin.Plugin in-process for tests, over a real
// go-plugin gRPC connection but without a child process.
package deviceplugintest

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"

	"github.com/hashicorp/go-plugin"

	"github.com/devicehost/devicehost/deviceplugin"
)

// Connect serves impl in-process through go-plugin's TestPluginGRPCConn and returns the
// host's client for it, exactly as the loader would get it (its ExitContext ends only
// when the test ends). The connection, the server and their goroutines are stopped by
// t.Cleanup; the caller still calls SetConfig before the other RPCs, as a host does.
// Connect calls t.Fatal: call it from the test's goroutine (Serve is for any other).
func Connect(t testing.TB, impl deviceplugin.Plugin) *deviceplugin.Client {
	t.Helper()
	c, err := Serve(t, impl)
	if err != nil {
		t.Fatal(err)
	}
	return c.Client()
}

// Conn is a plugin served in-process by Serve: the host's client for it, and Exit,
// which stands in for the plugin process dying. Safe for concurrent use.
type Conn struct {
	client *deviceplugin.Client
	gc     *plugin.GRPCClient
	server *plugin.GRPCServer
	exited context.Context // the client's ExitContext
	exit   context.CancelFunc

	mu     sync.Mutex
	reason string // set before exited ends

	exitOnce, closeOnce sync.Once
}

// Serve serves impl in-process through go-plugin's TestPluginGRPCConn, as Connect does,
// and returns the connection, whose client's ExitContext ends on Exit, as go-plugin's
// does when a plugin process exits. It may be called from any goroutine: it never calls
// t.Fatal, and returns an error when the connection cannot be set up. Close, which
// t.Cleanup calls at the latest, stops the server and the connection and waits for
// their goroutines.
func Serve(t testing.TB, impl deviceplugin.Plugin) (*Conn, error) {
	set := deviceplugin.VersionedPlugins(deviceplugin.NewServer(impl))[deviceplugin.HandshakeVersion]
	setup := &setupTB{TB: t}
	var gc *plugin.GRPCClient
	var server *plugin.GRPCServer
	done := make(chan struct{})
	go func() { // TestPluginGRPCConn fails with t.Fatal: give it a goroutine to end
		defer close(done)
		gc, server = plugin.TestPluginGRPCConn(setup, false, set)
	}()
	<-done
	if setup.err != nil {
		return nil, fmt.Errorf("deviceplugintest: serve %q: %w", deviceplugin.PluginKey, setup.err)
	}
	exited, exit := context.WithCancel(context.Background())
	// The SDK's own glue makes the client, with this connection's exit as its done
	// context, where go-plugin's Dispense would give one that never ends.
	raw, err := (&deviceplugin.GRPCPlugin{}).GRPCClient(exited, nil, gc.Conn)
	client, ok := raw.(*deviceplugin.Client)
	if err == nil && !ok {
		err = fmt.Errorf("got %T, want *deviceplugin.Client", raw)
	}
	c := &Conn{client: client, gc: gc, server: server, exited: exited, exit: exit}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("deviceplugintest: client for %q: %w", deviceplugin.PluginKey, err)
	}
	t.Cleanup(c.Close)
	return c, nil
}

// Client is the host's client for the plugin.
func (c *Conn) Client() *deviceplugin.Client { return c.client }

// ExitContext ends once Exit was called (it is the client's ExitContext).
func (c *Conn) ExitContext() context.Context { return c.exited }

// ExitReason is the reason Exit was first called with; "" before then.
func (c *Conn) ExitReason() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reason
}

// Exit makes the plugin "die" with reason, as a process exit would: ExitContext ends and
// the server stops at once, failing the RPCs in flight. Later calls do nothing.
func (c *Conn) Exit(reason string) {
	c.exitOnce.Do(func() {
		c.mu.Lock()
		c.reason = reason
		c.mu.Unlock()
		c.exit()
		c.server.Stop()
	})
}

// Close exits the plugin (reason "killed" unless Exit came first), closes the
// connection and returns once the server's and the connection's goroutines have ended.
// Safe to call more than once.
func (c *Conn) Close() {
	c.closeOnce.Do(func() {
		// Server first: the client's Close would ask it to stop over the connection,
		// and that handler's Stop would race with ours.
		c.Exit("killed")
		<-c.server.DoneCh
		_ = c.gc.Close()
	})
}

// setupTB is the test go-plugin's TestPluginGRPCConn gets: its Fatal ends only the
// goroutine Serve runs it on, and leaves the error for Serve to return.
type setupTB struct {
	testing.TB
	err error
}

func (s *setupTB) Fatal(args ...any) {
	s.err = errors.New(fmt.Sprint(args...))
	runtime.Goexit()
}

func (s *setupTB) Fatalf(format string, args ...any) {
	s.err = fmt.Errorf(format, args...)
	runtime.Goexit()
}

func (s *setupTB) FailNow() {
	s.err = errors.New("FailNow")
	runtime.Goexit()
}
