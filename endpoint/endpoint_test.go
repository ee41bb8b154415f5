package endpoint_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/tools/h2test"
	"github.com/devicehost/devicehost/tools/testpki"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestParse(t *testing.T) {
	cwd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		in      string
		want    endpoint.Address
		wantErr string
	}{
		{in: "unix:///run/devicehost/devicehost.sock", want: endpoint.Address{Network: "unix", Path: "/run/devicehost/devicehost.sock"}},
		{in: "unix://dh.sock", want: endpoint.Address{Network: "unix", Path: filepath.Join(cwd, "dh.sock")}},
		{in: "tcp://127.0.0.1:7070", want: endpoint.Address{Network: "tcp", Host: "127.0.0.1:7070"}},
		{in: "tcp://[::1]:7070", want: endpoint.Address{Network: "tcp", Host: "[::1]:7070"}},
		{in: "tcp://:7070", want: endpoint.Address{Network: "tcp", Host: ":7070"}},
		{in: "unix://", wantErr: "no socket path"},
		{in: "tcp://localhost", wantErr: "want tcp://host:port"},
		{in: "tcp://localhost:", wantErr: "no port"},
		{in: "/run/devicehost.sock", wantErr: "want unix:///path.sock or tcp://host:port"},
		{in: "http://localhost:80", wantErr: "want unix:///path.sock or tcp://host:port"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := endpoint.Parse(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Parse(%q) error = %v, want one containing %q", tt.in, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse(%q): %v", tt.in, err)
			}
			if got != tt.want {
				t.Errorf("Parse(%q) = %+v, want %+v", tt.in, got, tt.want)
			}
			if again, err := endpoint.Parse(got.String()); err != nil || again != got {
				t.Errorf("Parse(%q.String()) = %+v, %v; want a round trip", tt.in, again, err)
			}
		})
	}
}

// socketDir returns a fresh directory short enough for socket paths.
func socketDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ep")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// listen calls endpoint.Listen and closes the listener at cleanup.
func listen(t *testing.T, a endpoint.Address, tlsFiles endpoint.TLS) *endpoint.Listener {
	t.Helper()
	l, err := endpoint.Listen(a, tlsFiles)
	if err != nil {
		t.Fatalf("Listen(%s): %v", a, err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func TestListenUnixModes(t *testing.T) {
	dir := filepath.Join(socketDir(t), "run", "devicehost")
	a := endpoint.Address{Network: "unix", Path: filepath.Join(dir, "devicehost.sock")}
	l := listen(t, a, endpoint.TLS{})

	for _, tt := range []struct {
		path string
		want os.FileMode
	}{{dir, endpoint.DirMode}, {a.Path, endpoint.SocketMode}} {
		fi, err := os.Stat(tt.path)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != tt.want {
			t.Errorf("%s mode = %v, want %v", tt.path, got, tt.want)
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a.Path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket still there after Close: %v", err)
	}
}

func TestListenUnixReplacesStaleSocket(t *testing.T) {
	a := endpoint.Address{Network: "unix", Path: filepath.Join(socketDir(t), "dh.sock")}
	// A host that died leaves its socket file behind with nobody accepting on it.
	dead, err := net.ListenUnix("unix", &net.UnixAddr{Name: a.Path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	dead.SetUnlinkOnClose(false)
	dead.Close()
	if _, err := os.Stat(a.Path); err != nil {
		t.Fatalf("stale socket not left behind: %v", err)
	}

	l := listen(t, a, endpoint.TLS{})
	conn, err := net.Dial("unix", a.Path)
	if err != nil {
		t.Fatalf("dial the new socket: %v", err)
	}
	conn.Close()
	accepted, err := l.Accept()
	if err != nil {
		t.Fatalf("the new listener did not get the connection: %v", err)
	}
	accepted.Close()
}

func TestListenUnixDoesNotStealLiveSocket(t *testing.T) {
	a := endpoint.Address{Network: "unix", Path: filepath.Join(socketDir(t), "dh.sock")}
	listen(t, a, endpoint.TLS{})

	_, err := endpoint.Listen(a, endpoint.TLS{})
	want := "another devicehost is listening on " + a.Path
	if err == nil || err.Error() != want {
		t.Errorf("second Listen: %v, want %q", err, want)
	}
}

func TestListenUnixKeepsNonSocketFile(t *testing.T) {
	a := endpoint.Address{Network: "unix", Path: filepath.Join(socketDir(t), "dh.sock")}
	if err := os.WriteFile(a.Path, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := endpoint.Listen(a, endpoint.TLS{})
	if err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("Listen over a regular file: %v, want a 'not a socket' error", err)
	}
	if data, err := os.ReadFile(a.Path); err != nil || string(data) != "precious" {
		t.Errorf("the file was touched: %q, %v", data, err)
	}
}

func TestTransportPolicy(t *testing.T) {
	files := writeTestPKI(t)
	tests := []struct {
		name    string
		addr    string
		tls     endpoint.TLS
		wantErr string
	}{
		{"tcp without TLS", "tcp://127.0.0.1:0", endpoint.TLS{}, "needs mutual TLS"},
		{"tcp with a cert but no CA", "tcp://127.0.0.1:0", endpoint.TLS{Cert: files.serverCert, Key: files.serverKey}, "needs mutual TLS"},
		{"insecure on all interfaces", "tcp://:0", endpoint.TLS{Insecure: true}, "refused on a non-loopback address"},
		{"insecure on a routable IP", "tcp://10.1.2.3:0", endpoint.TLS{Insecure: true}, "refused on a non-loopback address"},
		{"insecure on a hostname", "tcp://example.com:0", endpoint.TLS{Insecure: true}, "refused on a non-loopback address"},
		{"insecure and TLS", "tcp://127.0.0.1:0", endpoint.TLS{Insecure: true, CA: files.ca}, "mutually exclusive"},
		{"TLS on unix", "unix:///tmp/x.sock", endpoint.TLS{CA: files.ca}, "tcp addresses only"},
		{"a CA that is not PEM", "tcp://127.0.0.1:0", endpoint.TLS{Cert: files.serverCert, Key: files.serverKey, CA: files.serverKey}, "no PEM certificate"},
		{"insecure on IPv4 loopback", "tcp://127.0.0.1:0", endpoint.TLS{Insecure: true}, ""},
		{"insecure on localhost", "tcp://localhost:0", endpoint.TLS{Insecure: true}, ""},
		{"mutual TLS anywhere", "tcp://127.0.0.1:0", endpoint.TLS{Cert: files.serverCert, Key: files.serverKey, CA: files.ca}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, err := endpoint.Parse(tt.addr)
			if err != nil {
				t.Fatal(err)
			}
			l, err := endpoint.Listen(a, tt.tls)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Listen: %v, want success", err)
				}
				l.Close()
				return
			}
			if err == nil {
				l.Close()
				t.Fatalf("Listen succeeded, want an error containing %q", tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("Listen: %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestMutualTLSRoundTrip(t *testing.T) {
	files := writeTestPKI(t)
	a, err := endpoint.Parse("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := listen(t, a, endpoint.TLS{Cert: files.serverCert, Key: files.serverKey, CA: files.ca})
	srv := grpc.NewServer(l.ServerOptions()...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	t.Cleanup(func() {
		srv.Stop()
		<-served
	})

	check := func(t *testing.T, tlsFiles endpoint.TLS) error {
		t.Helper()
		conn, err := endpoint.Dial(l.Address, tlsFiles)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	t.Run("client with a certificate from the CA", func(t *testing.T) {
		if err := check(t, endpoint.TLS{Cert: files.clientCert, Key: files.clientKey, CA: files.ca}); err != nil {
			t.Errorf("Check: %v", err)
		}
	})
	t.Run("client with a certificate from another CA", func(t *testing.T) {
		if err := check(t, endpoint.TLS{Cert: files.strangerCert, Key: files.strangerKey, CA: files.ca}); err == nil {
			t.Error("Check succeeded, want the server to refuse a certificate it did not issue")
		}
	})
	t.Run("client that does not trust the server", func(t *testing.T) {
		if err := check(t, endpoint.TLS{Cert: files.clientCert, Key: files.clientKey, CA: files.strangerCA}); err == nil {
			t.Error("Check succeeded, want the client to refuse the server's certificate")
		}
	})
}

// pki holds the paths of PEM files made for one test.
type pki struct {
	ca, serverCert, serverKey, clientCert, clientKey string
	strangerCA, strangerCert, strangerKey            string
}

// writeTestPKI makes two CAs, a server certificate for 127.0.0.1 and localhost and a
// client certificate from the first, a client certificate from the second, and writes
// them as PEM files into a temporary directory.
func writeTestPKI(t *testing.T) pki {
	t.Helper()
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ca, stranger := testpki.NewCA(t, "devicehost test CA"), testpki.NewCA(t, "stranger CA")
	server, client, other := ca.Server(t, "localhost", "127.0.0.1"), ca.Client(t, "runtime"), stranger.Client(t, "stranger")
	return pki{
		ca: write("ca.pem", ca.PEM), strangerCA: write("stranger-ca.pem", stranger.PEM),
		serverCert: write("server.pem", server.Cert), serverKey: write("server-key.pem", server.Key),
		clientCert: write("runtime.pem", client.Cert), clientKey: write("runtime-key.pem", client.Key),
		strangerCert: write("stranger.pem", other.Cert), strangerKey: write("stranger-key.pem", other.Key),
	}
}

// Agents that start together over a stale socket must not both get it: the one that
// loses the race would otherwise remove the winner's live socket and bind its own, and
// the first agent would serve on a path nobody can reach any more.
func TestListenUnixStaleSocketOneWinner(t *testing.T) {
	a := endpoint.Address{Network: "unix", Path: filepath.Join(socketDir(t), "dh.sock")}
	dead, err := net.ListenUnix("unix", &net.UnixAddr{Name: a.Path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	dead.SetUnlinkOnClose(false)
	dead.Close()
	const racers = 8
	for round := 0; round < 300; round++ {
		start := make(chan struct{})
		got := make(chan *endpoint.Listener, racers)
		for range racers {
			go func() {
				<-start
				l, err := endpoint.Listen(a, endpoint.TLS{})
				if err != nil {
					l = nil
				}
				got <- l
			}()
		}
		close(start)
		var won []*endpoint.Listener
		for range racers {
			if l := <-got; l != nil {
				won = append(won, l)
			}
		}
		for _, l := range won {
			// Keep the file for the next round: it is stale again once closed.
			l.Listener.(*net.UnixListener).SetUnlinkOnClose(false)
			l.Close()
		}
		if len(won) != 1 {
			t.Fatalf("round %d: %d of %d concurrent Listens over a stale socket succeeded, want 1", round, len(won), racers)
		}
	}
}

func TestListenUnixRemovesTheDirectoriesItMade(t *testing.T) {
	base := socketDir(t)
	deep := filepath.Join(base, "nonexistent-dir", "deep")
	a := endpoint.Address{Network: "unix", Path: filepath.Join(deep, "x.sock")}
	l, err := endpoint.Listen(a, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{filepath.Join(base, "nonexistent-dir"), deep} {
		if fi, err := os.Stat(d); err != nil || fi.Mode().Perm() != endpoint.DirMode {
			t.Errorf("%s: %v, %v; want a directory mode %v", d, fi, err, endpoint.DirMode)
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(base, "nonexistent-dir")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a directory Listen created is still there after Close: %v", err)
	}
	if _, err := os.Stat(base); err != nil {
		t.Errorf("the directory that was there before Listen is gone: %v", err)
	}
}

func TestListenUnixKeepsMadeDirectoriesSomeoneUses(t *testing.T) {
	base := socketDir(t)
	top := filepath.Join(base, "a")
	a := endpoint.Address{Network: "unix", Path: filepath.Join(top, "b", "x.sock")}
	l, err := endpoint.Listen(a, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	// Someone else keeps a file beside b: a stays, b (empty) goes.
	if err := os.WriteFile(filepath.Join(top, "notes"), []byte("mine"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(top, "b")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("empty made directory b still there: %v", err)
	}
	if _, err := os.Stat(filepath.Join(top, "notes")); err != nil {
		t.Errorf("another's file was removed: %v", err)
	}
}

func TestListenUnixFailureLeavesNoDirectories(t *testing.T) {
	base := socketDir(t)
	// A path too long for a socket name: the bind fails after the directories were made.
	deep := filepath.Join(base, "made", strings.Repeat("d", 100))
	a := endpoint.Address{Network: "unix", Path: filepath.Join(deep, "x.sock")}
	if l, err := endpoint.Listen(a, endpoint.TLS{}); err == nil {
		l.Close()
		t.Fatal("Listen on a 200-byte socket path succeeded")
	}
	if _, err := os.Stat(filepath.Join(base, "made")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("directory made for a failed Listen is still there: %v", err)
	}
}

func TestConfigErrors(t *testing.T) {
	files := writeTestPKI(t)
	check := func(name string, err error, want bool) {
		t.Helper()
		var ce *endpoint.ConfigError
		if got := errors.As(err, &ce); got != want || err == nil {
			t.Errorf("%s: %v: ConfigError = %v, want %v", name, err, got, want)
		}
	}
	_, err := endpoint.Parse("localhost:80")
	check("address without scheme", err, true)
	_, err = endpoint.Parse("tcp://localhost")
	check("tcp without port", err, true)
	tcp, _ := endpoint.Parse("tcp://127.0.0.1:1")
	_, err = endpoint.Dial(tcp, endpoint.TLS{})
	check("tcp without TLS flags", err, true)
	wide, _ := endpoint.Parse("tcp://10.0.0.1:1")
	_, err = endpoint.Dial(wide, endpoint.TLS{Insecure: true})
	check("insecure off loopback", err, true)
	_, err = endpoint.Dial(tcp, endpoint.TLS{Cert: "/nonexistent/cert.pem", Key: files.clientKey, CA: files.ca})
	check("a certificate file that is missing", err, false)
}

func TestServerKeepalivePolicyAllowsClientPings(t *testing.T) {
	// A client pinging more often than the server's MinTime is sent GOAWAY
	// "too_many_pings"; Dial's pings must stay within Listen's policy.
	if endpoint.ServerKeepalivePolicy.MinTime > endpoint.ClientKeepalive.Time {
		t.Errorf("server MinTime %v > client ping interval %v", endpoint.ServerKeepalivePolicy.MinTime, endpoint.ClientKeepalive.Time)
	}
	if endpoint.ClientKeepalive.PermitWithoutStream && !endpoint.ServerKeepalivePolicy.PermitWithoutStream {
		t.Error("clients ping without streams but the server does not permit it")
	}
}

// TestDialMakesNoFlowControlPings checks that a client from Dial sends the server no
// PING frames while calls answer it (gRPC's default window estimate sends one after
// most answers, which the agent must read and acknowledge), and that a message larger
// than a quarter of its window still arrives. The same calls through a client with
// gRPC's defaults must show the pings, or the frame count is not seeing them.
func TestDialMakesNoFlowControlPings(t *testing.T) {
	srv := grpc.NewServer()
	big := strings.Repeat("x", 3*endpoint.ClientStreamWindow/2)
	h2test.RegisterUnary(srv, "test.Big", "Get", func(context.Context) (proto.Message, error) {
		return &healthpb.HealthCheckRequest{Service: big}, nil
	})
	l, target := h2test.Serve(t, srv, nil)
	a, err := endpoint.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	calls := func(conn *grpc.ClientConn) int64 {
		t.Helper()
		defer conn.Close()
		pings, _ := h2test.Checks(t, l, conn, 20)
		before := l.Received.Load()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var out healthpb.HealthCheckRequest
		if err := conn.Invoke(ctx, "/test.Big/Get", &healthpb.HealthCheckRequest{}, &out); err != nil {
			t.Fatal(err)
		}
		if len(out.Service) != len(big) {
			t.Fatalf("a %d-byte answer arrived as %d bytes", len(big), len(out.Service))
		}
		return pings + l.Received.Load() - before
	}
	defaults, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	if n := calls(defaults); n == 0 {
		t.Fatal("a client with gRPC's defaults sent no PING in 21 calls: the count does not see them")
	}
	conn, err := endpoint.Dial(a, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	if n := calls(conn); n != 0 {
		t.Errorf("a client from Dial sent %d PINGs in 21 calls, want none", n)
	}
}
