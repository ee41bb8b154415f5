// Package endpoint parses host API addresses and opens them for the agent (Listen) and
// for clients (Dial), applying devicehost's transport policy:
//
//   - unix:///path.sock (the default): the socket is created mode 0660 in a directory
//     created 0750, so access is granted by file ownership. A stale socket left by a dead
//     host is replaced; a live one is never taken over.
//   - tcp://host:port: mutual TLS (server certificate, client certificates verified
//     against a CA). Plaintext (Insecure) is allowed on loopback addresses only.
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
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
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

// Address is a parsed host API address.
type Address struct {
	Network string // "unix" or "tcp"
	Path    string // the socket path (unix), absolute
	Host    string // host:port (tcp)
}

// Parse reads "unix:///path.sock" (a relative path is made absolute) or
// "tcp://host:port".
func Parse(s string) (Address, error) {
	switch {
	case strings.HasPrefix(s, "unix://"):
		p := strings.TrimPrefix(s, "unix://")
		if p == "" {
			return Address{}, fmt.Errorf("address %q: no socket path (want unix:///path.sock)", s)
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
			return Address{}, fmt.Errorf("address %q: want tcp://host:port: %w", s, err)
		}
		if port == "" {
			return Address{}, fmt.Errorf("address %q: no port (want tcp://host:port)", s)
		}
		return Address{Network: "tcp", Host: net.JoinHostPort(host, port)}, nil
	default:
		return Address{}, fmt.Errorf("address %q: want unix:///path.sock or tcp://host:port", s)
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

// config checks the policy for a and loads the TLS files. Nil means plaintext.
func (t TLS) config(a Address, server bool) (*tls.Config, error) {
	if a.Network == "unix" {
		if t.anySet() || t.Insecure {
			return nil, fmt.Errorf("%s: TLS settings and insecure apply to tcp addresses only", a)
		}
		return nil, nil
	}
	if t.Insecure {
		if t.anySet() {
			return nil, fmt.Errorf("%s: insecure and TLS files are mutually exclusive", a)
		}
		if !a.IsLoopback() {
			return nil, fmt.Errorf("%s: insecure (plaintext) tcp is refused on a non-loopback address; use TLS with a certificate, key and CA", a)
		}
		return nil, nil
	}
	if t.Cert == "" || t.Key == "" || t.CA == "" {
		return nil, fmt.Errorf("%s: tcp needs mutual TLS: a certificate, a key and a CA (or insecure, on a loopback address only)", a)
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
}

// ServerOptions are the gRPC server options the endpoint needs (TLS credentials for
// tcp; none otherwise).
func (l *Listener) ServerOptions() []grpc.ServerOption {
	if l.creds == nil {
		return nil
	}
	return []grpc.ServerOption{grpc.Creds(l.creds)}
}

// Listen opens a for the agent under the transport policy (see the package comment).
// Closing the listener (gRPC's Serve does on stop) removes a unix socket.
func Listen(a Address, t TLS) (*Listener, error) {
	cfg, err := t.config(a, true)
	if err != nil {
		return nil, err
	}
	var lis net.Listener
	switch a.Network {
	case "unix":
		lis, err = listenUnix(a.Path)
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
	l := &Listener{Listener: lis, Address: a}
	if cfg != nil {
		l.creds = credentials.NewTLS(cfg)
	}
	return l, nil
}

// listenUnix binds path, replacing a stale socket but never a live one or a file that is
// not a socket.
func listenUnix(path string) (net.Listener, error) {
	dir := filepath.Dir(path)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		if err := os.MkdirAll(dir, DirMode); err != nil {
			return nil, fmt.Errorf("create socket directory: %w", err)
		}
		// MkdirAll's mode is reduced by the umask; the directory gets exactly DirMode.
		if err := os.Chmod(dir, DirMode); err != nil {
			return nil, fmt.Errorf("create socket directory: %w", err)
		}
	}
	// Binding fails with EADDRINUSE when anything exists at path. The directory lock makes
	// check-remove-bind one step, so two hosts starting at once cannot both get the socket.
	unlock, err := lockDir(dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	lis, err := net.Listen("unix", path)
	if errors.Is(err, syscall.EADDRINUSE) {
		if err := removeStale(path); err != nil {
			return nil, err
		}
		lis, err = net.Listen("unix", path)
	}
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, SocketMode); err != nil {
		lis.Close()
		return nil, fmt.Errorf("set socket mode: %w", err)
	}
	return lis, nil
}

// removeStale removes the socket at path if nothing accepts connections on it.
func removeStale(path string) error {
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
		return fmt.Errorf("another devicehost is listening on %s", path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("listen on %s: cannot tell whether the socket is stale: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	return nil
}

// Dial makes a gRPC client for a under the transport policy. Like grpc.NewClient it does
// not connect; the first call does.
func Dial(a Address, t TLS, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	cfg, err := t.config(a, false)
	if err != nil {
		return nil, err
	}
	creds := insecure.NewCredentials()
	if cfg != nil {
		creds = credentials.NewTLS(cfg)
	}
	all := append([]grpc.DialOption{grpc.WithTransportCredentials(creds)}, opts...)
	conn, err := grpc.NewClient(a.Target(), all...)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", a, err)
	}
	return conn, nil
}
