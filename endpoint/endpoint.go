// Package endpoint parses host API addresses and opens them for the agent (Listen) and
// for clients (Dial) under devicehost's transport policy: unix:///path.sock (mode 0660, a
// stale socket replaced, a live one never taken over) or tcp://host:port with mutual
// TLS, plaintext on loopback only; both sides get matching keepalive settings. A
// malformed address or refused TLS settings are a *ConfigError, so a command line can
// tell a usage mistake from a failure to connect. See docs/configuration.md#api-addresses.
package endpoint

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// DefaultSocket is the agent's socket path when none is configured.
const DefaultSocket = "/run/devicehost/devicehost.sock"

// DefaultAddress is DefaultSocket as an address.
const DefaultAddress = "unix://" + DefaultSocket

// Modes of what Listen creates for a unix address.
const (
	SocketMode os.FileMode = 0o660
	DirMode    os.FileMode = 0o750
)

// ClientKeepalive is what Dial sets: with streams open, an idle connection is pinged
// every Time and given up Timeout after an unanswered ping. A unary-only client sends no
// pings (nothing waits on the connection).
var ClientKeepalive = keepalive.ClientParameters{
	Time:                30 * time.Second,
	Timeout:             10 * time.Second,
	PermitWithoutStream: false,
}

// ClientStreamWindow and ClientConnWindow are the flow-control windows Dial sets, fixed.
// gRPC's default is a window that grows by estimate: each time data arrives and no
// estimate is under way, the client sends the server a PING and a WINDOW_UPDATE, which
// the server reads and acknowledges. Every answer and every watch message made the
// agent read and write once more (a fifth of its CPU in a Fingerprint change going to
// 1,000 watchers; see docs/benchmarks.md, "Fixed flow-control windows"). Over a local
// socket or a LAN a fixed 1 MiB is room enough: a Fingerprint of 232 devices is 51 KB,
// and a larger message still flows, with a WINDOW_UPDATE each quarter of the window read.
const (
	ClientStreamWindow = 1 << 20
	ClientConnWindow   = 1 << 20
)

// ServerKeepalivePolicy is the enforcement policy a server for Dial's clients needs
// (server.New's default): it lets clients ping as often as ClientKeepalive does, with
// room to spare. A server with gRPC's
// default policy (5 minutes) would answer ClientKeepalive's pings on an idle stream with
// GOAWAY "too_many_pings" after a few minutes.
var ServerKeepalivePolicy = keepalive.EnforcementPolicy{
	MinTime:             ClientKeepalive.Time / 2,
	PermitWithoutStream: true,
}

// ConfigError is an address or transport setting that is wrong in itself: a malformed
// address, or TLS settings the transport policy refuses. It is a mistake of
// configuration, unlike a file that cannot be read or a peer that cannot be reached.
type ConfigError struct{ Err error }

// Error returns the wrapped error's text.
func (e *ConfigError) Error() string { return e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *ConfigError) Unwrap() error { return e.Err }

func configErrorf(format string, args ...any) error {
	return &ConfigError{Err: fmt.Errorf(format, args...)}
}

// Address is a parsed host API address.
type Address struct {
	Network string // "unix" or "tcp"
	Path    string // the socket path (unix), absolute
	Host    string // host:port (tcp)
}

// Parse reads "unix:///path.sock" (a relative path is made absolute) or
// "tcp://host:port". A malformed address is a *ConfigError.
func Parse(s string) (Address, error) {
	switch {
	case strings.HasPrefix(s, "unix://"):
		p := strings.TrimPrefix(s, "unix://")
		if p == "" {
			return Address{}, configErrorf("address %q: no socket path (want unix:///path.sock)", s)
		}
		abs, err := filepath.Abs(p)
		if err != nil {
			return Address{}, fmt.Errorf("address %q: %w", s, err)
		}
		return Address{Network: "unix", Path: abs}, nil
	case strings.HasPrefix(s, "tcp://"):
		hp := strings.TrimPrefix(s, "tcp://")
		host, port, err := net.SplitHostPort(hp)
		if err != nil {
			return Address{}, configErrorf("address %q: want tcp://host:port: %w", s, err)
		}
		if port == "" {
			return Address{}, configErrorf("address %q: no port (want tcp://host:port)", s)
		}
		return Address{Network: "tcp", Host: net.JoinHostPort(host, port)}, nil
	default:
		return Address{}, configErrorf("address %q: want unix:///path.sock or tcp://host:port", s)
	}
}

// String renders the address in the form Parse reads.
func (a Address) String() string {
	if a.Network == "unix" {
		return "unix://" + a.Path
	}
	return "tcp://" + a.Host
}

// Target is the address as a gRPC client target.
func (a Address) Target() string {
	if a.Network == "unix" {
		return "unix://" + a.Path
	}
	return "passthrough:///" + a.Host
}

// IsLoopback reports whether a tcp address names a loopback interface ("localhost" or a
// loopback IP). An empty host (all interfaces) is not loopback.
func (a Address) IsLoopback() bool {
	host, _, err := net.SplitHostPort(a.Host)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// TLS names the PEM files for a tcp address. The agent uses Cert and Key as its server
// certificate and CA to verify client certificates; a client uses Cert and Key as its
// client certificate and CA to verify the agent.
type TLS struct {
	Cert, Key, CA string
	// Insecure allows plaintext tcp, on a loopback address only.
	Insecure bool
}

func (t TLS) anySet() bool { return t.Cert != "" || t.Key != "" || t.CA != "" }

// Check applies the transport policy to t for a without reading any file: TLS settings
// on a unix address, tcp without mutual TLS or insecure, insecure off loopback, and
// insecure with TLS files are a *ConfigError.
func (t TLS) Check(a Address) error {
	if a.Network == "unix" {
		if t.anySet() || t.Insecure {
			return configErrorf("%s: TLS settings and insecure apply to tcp addresses only", a)
		}
		return nil
	}
	if t.Insecure {
		if t.anySet() {
			return configErrorf("%s: insecure and TLS files are mutually exclusive", a)
		}
		if !a.IsLoopback() {
			return configErrorf("%s: insecure (plaintext) tcp is refused on a non-loopback address; use TLS with a certificate, key and CA", a)
		}
		return nil
	}
	if t.Cert == "" || t.Key == "" || t.CA == "" {
		return configErrorf("%s: tcp needs mutual TLS: a certificate, a key and a CA (or insecure, on a loopback address only)", a)
	}
	return nil
}

// config checks the policy for a and loads the TLS files. Nil means plaintext.
func (t TLS) config(a Address, server bool) (*tls.Config, error) {
	if err := t.Check(a); err != nil {
		return nil, err
	}
	if a.Network == "unix" || t.Insecure {
		return nil, nil
	}
	cert, err := tls.LoadX509KeyPair(t.Cert, t.Key)
	if err != nil {
		return nil, fmt.Errorf("load TLS certificate %s and key %s: %w", t.Cert, t.Key, err)
	}
	caPEM, err := os.ReadFile(t.CA)
	if err != nil {
		return nil, fmt.Errorf("read TLS CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("TLS CA %s: no PEM certificate in it", t.CA)
	}
	cfg := &tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   tls.VersionTLS13,
	}
	if server {
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	} else {
		cfg.RootCAs = pool
		host, _, _ := net.SplitHostPort(a.Host)
		cfg.ServerName = host
	}
	return cfg, nil
}

// Listener is an open host API endpoint.
type Listener struct {
	net.Listener
	// Address is where it listens; for tcp port 0, the port chosen.
	Address Address
	creds   credentials.TransportCredentials
	tls     *tls.Config // the server side of creds; nil for plaintext

	closeOnce sync.Once
	closeErr  error
	madeDirs  []string // directories Listen created for a unix socket, deepest first
}

// ServerOptions are the gRPC server options the endpoint needs: TLS credentials for tcp
// (none for unix). Keepalive is the server's (ServerKeepalivePolicy).
func (l *Listener) ServerOptions() []grpc.ServerOption {
	if l.creds == nil {
		return nil
	}
	return []grpc.ServerOption{grpc.Creds(l.creds)}
}

// TLSConfig returns a copy of the listener's TLS server configuration (mutual TLS 1.3,
// client certificates verified against the CA), or nil when the address is served in
// plaintext (unix, or Insecure tcp). A server that is not gRPC (e.g. HTTP) wraps the
// listener with tls.NewListener and it, and so applies the same transport policy.
func (l *Listener) TLSConfig() *tls.Config {
	if l.tls == nil {
		return nil
	}
	return l.tls.Clone()
}

// Close stops listening (gRPC's Serve calls it on stop). For a unix address it removes
// the socket and then the directories Listen created for it, deepest first, as long as
// they are empty: a directory something else has put a file in stays. Safe to call more
// than once.
func (l *Listener) Close() error {
	l.closeOnce.Do(func() {
		l.closeErr = l.Listener.Close()
		removeDirs(l.madeDirs)
	})
	return l.closeErr
}

// removeDirs removes dirs, deepest first, stopping at the first that cannot be removed
// (not empty: its parents are not empty either).
func removeDirs(dirs []string) {
	for _, d := range dirs {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			return
		}
	}
}

// Listen opens a for the agent under the transport policy (see the package comment).
// Closing the listener (gRPC's Serve does on stop) removes a unix socket, and the
// directories Listen created for it.
func Listen(a Address, t TLS) (*Listener, error) {
	cfg, err := t.config(a, true)
	if err != nil {
		return nil, err
	}
	var lis net.Listener
	var made []string
	switch a.Network {
	case "unix":
		lis, made, err = listenUnix(a.Path)
	case "tcp":
		lis, err = net.Listen("tcp", a.Host)
		if err == nil {
			a.Host = lis.Addr().String()
		}
	default:
		err = fmt.Errorf("unknown network %q", a.Network)
	}
	if err != nil {
		return nil, err
	}
	l := &Listener{Listener: lis, Address: a, madeDirs: made}
	if cfg != nil {
		l.creds = credentials.NewTLS(cfg)
		l.tls = cfg
	}
	return l, nil
}

// listenUnix binds path, replacing a stale socket but never a live one or a file that is
// not a socket. It returns the directories it created for path, deepest first; on error
// it has removed them again.
func listenUnix(path string) (_ net.Listener, made []string, err error) {
	dir := filepath.Dir(path)
	made, err = makeDirs(dir)
	defer func() {
		if err != nil {
			removeDirs(made)
			made = nil
		}
	}()
	if err != nil {
		return nil, made, err
	}
	// Binding fails with EADDRINUSE when anything exists at path. The directory lock makes
	// check-remove-bind one step, so two hosts starting at once cannot both get the socket.
	unlock, err := lockDir(dir)
	if err != nil {
		return nil, made, err
	}
	defer unlock()
	lis, err := ListenUnix(path)
	if errors.Is(err, ErrSocketInUse) {
		return nil, made, fmt.Errorf("another devicehost is listening on %s", path)
	} else if err != nil {
		return nil, made, err
	}
	if err := os.Chmod(path, SocketMode); err != nil {
		lis.Close()
		return nil, made, fmt.Errorf("set socket mode: %w", err)
	}
	return lis, made, nil
}

// makeDirs creates dir and its missing parents, each mode DirMode exactly, and returns
// the ones it created, deepest first. A directory another process creates at the same
// moment is not counted as made here.
func makeDirs(dir string) ([]string, error) {
	var missing []string // shallowest last
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			break
		}
		missing = append(missing, d)
		if filepath.Dir(d) == d {
			break
		}
	}
	var made []string
	for i := len(missing) - 1; i >= 0; i-- {
		d := missing[i]
		err := os.Mkdir(d, DirMode)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err == nil {
			made = append([]string{d}, made...)
			// Mkdir's mode is reduced by the umask; the directory gets exactly DirMode.
			err = os.Chmod(d, DirMode)
		}
		if err != nil {
			return made, fmt.Errorf("create socket directory: %w", err)
		}
	}
	return made, nil
}

// ErrSocketInUse is wrapped by ListenUnix's error when a process accepts connections on
// the socket.
var ErrSocketInUse = errors.New("a process is listening on the socket")

// ListenUnix binds a Unix socket at path. A socket left there by a process that died
// (nothing accepts connections on it) is replaced; a live one is not (the error wraps
// ErrSocketInUse), nor a file that is not a socket, nor a socket of which it cannot be
// told (a connect that is neither accepted nor refused).
func ListenUnix(path string) (*net.UnixListener, error) {
	lis, err := net.Listen("unix", path)
	if errors.Is(err, syscall.EADDRINUSE) {
		if err := removeStaleSocket(path); err != nil {
			return nil, err
		}
		lis, err = net.Listen("unix", path)
	}
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	return lis.(*net.UnixListener), nil
}

// removeStaleSocket removes the socket at path for ListenUnix when nothing accepts
// connections on it, and returns an error otherwise.
func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", path, err)
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("listen on %s: the path exists and is not a socket; not removing it", path)
	}
	conn, err := net.DialTimeout("unix", path, 2*time.Second)
	if err == nil {
		conn.Close()
		return fmt.Errorf("listen on %s: %w", path, ErrSocketInUse)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("listen on %s: cannot tell whether the socket is stale: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	return nil
}

// clientBufferPool is the clients' pool of buffers for the messages they decode:
// grpc-go's default one has no size between 32 KiB and 1 MiB, so every message in
// between (a Fingerprint of 8 GPUs with on-demand MIG is 51 KB) took a 1 MiB buffer,
// cleared whole at each use and allocated again after each garbage collection: 170 µs
// and 1 MiB of the collector's budget per Fingerprint in a watcher that collects every
// few (BenchmarkReceive). This one has every power of two from 256 B to 1 MiB.
var clientBufferPool = func() mem.BufferPool {
	p, err := mem.NewBinaryTieredBufferPool(8, 12, 14, 15, 16, 17, 18, 19, 20)
	if err != nil {
		panic(err) // fixed exponents, all valid
	}
	return p
}()

// clientCodec is grpc-go's proto codec but for where a message that arrived in more
// than one piece is gathered to be decoded: grpc-go's codec always takes its default
// pool for that, whatever pool the connection has (the connection's own buffers, for
// frames of at most 16 KiB, are the same in both pools). A message in one piece is
// decoded where it lies.
type clientCodec struct {
	encoding.CodecV2
}

func newClientCodec() clientCodec {
	return clientCodec{encoding.GetCodecV2(grpcproto.Name)}
}

// Unmarshal implements encoding.CodecV2.
func (c clientCodec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return c.CodecV2.Unmarshal(data, v)
	}
	return Gathered(data, func(b []byte) error { return proto.Unmarshal(b, m) })
}

// Gathered calls decode with a received message's bytes in one piece: where they lie
// if they arrived in one, else gathered in a buffer of the clients' pool, which goes
// back to it when decode returns (decode keeps nothing of b). For a codec of one call
// (grpc.ForceCodecV2) that decodes in its own way, as the connections Dial makes do.
func Gathered(data mem.BufferSlice, decode func(b []byte) error) error {
	if len(data) == 1 {
		return decode(data[0].ReadOnlyData())
	}
	buf := data.MaterializeToBuffer(clientBufferPool)
	defer buf.Free()
	return decode(buf.ReadOnlyData())
}

// Dial makes a gRPC client for a under the transport policy, with ClientKeepalive, the
// fixed windows ClientStreamWindow and ClientConnWindow, and messages received and
// decoded in buffers of every power of two up to 1 MiB (clientBufferPool, clientCodec;
// opts come after, so they may override them). Like grpc.NewClient it does not
// connect; the first call does.
func Dial(a Address, t TLS, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	cfg, err := t.config(a, false)
	if err != nil {
		return nil, err
	}
	creds := insecure.NewCredentials()
	if cfg != nil {
		creds = credentials.NewTLS(cfg)
	}
	all := append([]grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithKeepaliveParams(ClientKeepalive),
		grpc.WithStaticStreamWindowSize(ClientStreamWindow),
		grpc.WithStaticConnWindowSize(ClientConnWindow),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(newClientCodec())),
	}, opts...)
	conn, err := grpc.NewClient(a.Target(), all...)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", a, err)
	}
	return conn, nil
}
