package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	"github.com/devicehost/devicehost/device"
)

// Grants, in the words of the config file (docs/configuration.md#access):
//   - "read": Fingerprint, Stats, ListReservations, ListPlugins, health and reflection;
//   - "reserve:PREFIX": Reserve, Release and ReownReservation for owners that start with
//     PREFIX ("reserve" alone: any owner);
//   - "admin": every call.
const (
	GrantRead    = "read"
	GrantReserve = "reserve"
	GrantAdmin   = "admin"
)

// Allow is what a listener's clients, or a peer, may do: a set of grants.
type Allow struct {
	read, admin bool
	reserve     []string // owner prefixes; "" is any owner
	words       []string // as given, for messages
}

// AllowAll is the admin grant: every call.
var AllowAll = Allow{read: true, admin: true, words: []string{GrantAdmin}}

// ParseAllow reads grants in the config file's words. An unknown grant, an empty list
// and "reserve:" with an empty prefix are errors that name the grant.
func ParseAllow(words []string) (Allow, error) {
	if len(words) == 0 {
		return Allow{}, fmt.Errorf("no grants: give at least one of %q, %q, %q or %q", GrantRead, GrantReserve+":PREFIX", GrantReserve, GrantAdmin)
	}
	var a Allow
	for _, w := range words {
		switch kind, prefix, scoped := strings.Cut(w, ":"); {
		case w == GrantRead:
			a.read = true
		case w == GrantAdmin:
			a.read, a.admin = true, true
		case w == GrantReserve:
			a.reserve = append(a.reserve, "")
		case kind == GrantReserve && scoped:
			if prefix == "" {
				return Allow{}, fmt.Errorf("grant %q: the owner prefix after %q is empty; write %q for any owner", w, GrantReserve+":", GrantReserve)
			}
			a.reserve = append(a.reserve, prefix)
		default:
			return Allow{}, fmt.Errorf("unknown grant %q: want %q, %q, %q or %q", w, GrantRead, GrantReserve+":PREFIX", GrantReserve, GrantAdmin)
		}
	}
	a.words = slices.Clone(words)
	return a, nil
}

// String is the grants as given, joined by ", "; "nothing" for none.
func (a Allow) String() string {
	if len(a.words) == 0 {
		return "nothing"
	}
	return strings.Join(a.words, ", ")
}

// union is what a and b together allow.
func (a Allow) union(b Allow) Allow {
	return Allow{
		read:    a.read || b.read,
		admin:   a.admin || b.admin,
		reserve: append(slices.Clip(a.reserve), b.reserve...),
		words:   append(slices.Clip(a.words), b.words...),
	}
}

// ownerPrefixes is what a may release for, as device.ReleaseRequest.OwnerPrefixes
// takes it: nil for any owner.
func (a Allow) ownerPrefixes() []string {
	if a.admin || slices.Contains(a.reserve, "") {
		return nil
	}
	return a.reserve
}

// mayOwn reports whether a allows reserving for owner.
func (a Allow) mayOwn(owner string) bool {
	return a.admin || slices.ContainsFunc(a.reserve, func(p string) bool { return strings.HasPrefix(owner, p) })
}

// Listener is one endpoint the server serves (ServeListener) and what its clients may
// do.
type Listener struct {
	// Name names the listener in logs and refusals.
	Name string
	// Allow is what every client of the listener may do; PeerGrants may add to it.
	Allow Allow
	// TLS, when set, is the listener's TLS server configuration (mutual TLS, see
	// endpoint.Listener.TLSConfig); the identity of a client's certificate is what
	// identity grants match. Nil is plaintext.
	TLS *tls.Config
}

// PeerGrant gives a peer more than its listener allows, on every listener: a unix
// socket's client by its uid or gid (the kernel's record of the connecting process,
// SO_PEERCRED: its effective ids, not supplementary groups), a TLS client by an identity
// of its verified certificate (a URI, DNS or email SAN, or the subject's common name).
// Exactly one of UID, GID and Identity is set.
type PeerGrant struct {
	UID      *uint32
	GID      *uint32
	Identity string
	Allow    Allow
}

// access is the server's access policy: the peer grants. Nil means none (every
// listener's own Allow alone).
type access struct {
	grants []PeerGrant
}

// listenerConn is a connection of a listener: its RemoteAddr is a connAddr that says
// which listener and who the client is.
type listenerConn struct {
	net.Conn
	addr *connAddr
}

// RemoteAddr implements net.Conn.
func (c *listenerConn) RemoteAddr() net.Addr { return c.addr }

// Write implements net.Conn, counting the connection's writes (connAddr.writes).
func (c *listenerConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.addr.writes.Add(1)
	return n, err
}

// connAddr is a client of one listener: for a unix socket, its credentials where the
// platform tells them; for tcp, its address.
type connAddr struct {
	listener *Listener
	remote   net.Addr // the connection's own remote address
	cred     peerCredentials
	hasCred  bool
	// writes counts the server's writes to the connection: replyWritten waits for one
	// after a unary reply is queued.
	writes atomic.Uint64
}

// Network implements net.Addr.
func (a *connAddr) Network() string { return a.remote.Network() }

// String implements net.Addr: the credentials of a unix client, the address of another.
func (a *connAddr) String() string {
	if a.hasCred {
		return a.cred.String()
	}
	return a.remote.String()
}

// taggedListener wraps each accepted connection in a listenerConn of l.
type taggedListener struct {
	net.Listener
	l *Listener
}

// Accept implements net.Listener.
func (t taggedListener) Accept() (net.Conn, error) {
	c, err := t.Listener.Accept()
	if err != nil {
		return c, err
	}
	addr := &connAddr{listener: t.l, remote: c.RemoteAddr()}
	if uc, ok := c.(*net.UnixConn); ok {
		addr.cred, addr.hasCred = peerCred(uc)
	}
	return &listenerConn{Conn: c, addr: addr}, nil
}

// listenerCreds is the server's transport security: each connection gets its
// listener's, TLS where the listener has a TLS config and none where it has not, so one
// server serves unix sockets and mutual-TLS ports side by side.
type listenerCreds struct{}

// ServerHandshake implements credentials.TransportCredentials.
func (listenerCreds) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	lc, ok := c.(*listenerConn)
	if !ok || lc.addr.listener.TLS == nil {
		return c, nil, nil
	}
	return credentials.NewTLS(lc.addr.listener.TLS).ServerHandshake(c)
}

// ClientHandshake implements credentials.TransportCredentials; a server never calls it.
func (listenerCreds) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, fmt.Errorf("server: listenerCreds is for serving only")
}

// Info implements credentials.TransportCredentials.
func (listenerCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "devicehost-listener"}
}

// Clone implements credentials.TransportCredentials.
func (listenerCreds) Clone() credentials.TransportCredentials { return listenerCreds{} }

// OverrideServerName implements credentials.TransportCredentials.
func (listenerCreds) OverrideServerName(string) error { return nil }

// caller is who makes a call and what it may do.
type caller struct {
	listener string
	peer     string
	allow    Allow
}

type callerKey struct{}

// callerFrom is the caller authorize found for ctx's call; nil where the server has no
// access policy (every call allowed).
func callerFrom(ctx context.Context) *caller {
	c, _ := ctx.Value(callerKey{}).(*caller)
	return c
}

// whoCalls finds the caller of ctx's call: its listener's grants, with the peer grants
// that match it. ok is false where the call may do everything: a connection of an
// admin listener, or of none.
func (a *access) whoCalls(ctx context.Context) (_ *caller, ok bool) {
	p, _ := peer.FromContext(ctx)
	if p == nil {
		return nil, false
	}
	addr, _ := p.Addr.(*connAddr)
	if addr == nil {
		return nil, false
	}
	if addr.listener.Allow.admin {
		return nil, false // nothing to check, and no caller to make
	}
	name, names := peerName(p, addr)
	c := &caller{listener: addr.listener.Name, peer: name, allow: addr.listener.Allow}
	for _, g := range a.grants {
		switch {
		case g.UID != nil && addr.hasCred && *g.UID == addr.cred.uid,
			g.GID != nil && addr.hasCred && *g.GID == addr.cred.gid,
			g.Identity != "" && slices.Contains(names, g.Identity):
			c.allow = c.allow.union(g.Allow)
		}
	}
	return c, true
}

// peerName names p, a client of addr's listener: its credentials or address, and the
// first identity of its verified client certificate, if any; names are all of the
// certificate's identities (certIdentities).
func peerName(p *peer.Peer, addr *connAddr) (name string, names []string) {
	name = addr.String()
	if info, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(info.State.VerifiedChains) > 0 && len(info.State.VerifiedChains[0]) > 0 {
		names = certIdentities(info.State.VerifiedChains[0][0])
		if len(names) > 0 {
			name += fmt.Sprintf(" (certificate %q)", names[0])
		}
	}
	return name, names
}

// certIdentities are the names a client certificate proves: its URI, DNS and email
// SANs, then its subject's common name.
func certIdentities(cert *x509.Certificate) []string {
	var out []string
	for _, u := range cert.URIs {
		out = append(out, u.String())
	}
	out = append(out, cert.DNSNames...)
	out = append(out, cert.EmailAddresses...)
	if cert.Subject.CommonName != "" {
		out = append(out, cert.Subject.CommonName)
	}
	return out
}

// methodGrants is the grant each method of the server's services needs at least;
// Reserve, Release and ReownReservation check the owners they touch too. A method not
// listed (one a later version adds, or none the server serves) needs admin.
var methodGrants = map[string]string{
	"/devicehost.v1.DeviceHost/Fingerprint":                          GrantRead,
	"/devicehost.v1.DeviceHost/Stats":                                GrantRead,
	"/devicehost.v1.DeviceHost/ListReservations":                     GrantRead,
	"/devicehost.v1.DeviceHost/ListPlugins":                          GrantRead,
	"/devicehost.v1.DeviceHost/Reserve":                              GrantReserve,
	"/devicehost.v1.DeviceHost/Release":                              GrantReserve,
	"/devicehost.v1.DeviceHost/ReownReservation":                     GrantReserve,
	"/devicehost.v1.DeviceHost/CordonDevice":                         GrantAdmin,
	"/devicehost.v1.DeviceHost/WatchEvents":                          GrantRead,
	"/devicehost.v1.DeviceHost/UncordonDevice":                       GrantAdmin,
	"/grpc.health.v1.Health/Check":                                   GrantRead,
	"/grpc.health.v1.Health/List":                                    GrantRead,
	"/grpc.health.v1.Health/Watch":                                   GrantRead,
	"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo":      GrantRead,
	"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": GrantRead,
}

// allows reports whether a has what method needs at least.
func (a Allow) allows(method string) (need string, ok bool) {
	need = methodGrants[method]
	switch need {
	case GrantRead:
		return need, a.read
	case GrantReserve:
		return need, a.admin || len(a.reserve) > 0
	default:
		return GrantAdmin, a.admin
	}
}

// deny is the refusal of c's call: what it asked and the grant it lacked.
func (c *caller) deny(call, lacks string) error {
	return &device.PermissionError{Listener: c.listener, Peer: c.peer, Call: call, Lacks: lacks, Has: c.has()}
}

// has is c's grants in the config's words, for a refusal.
func (c *caller) has() []string {
	if c.allow.words == nil {
		return []string{}
	}
	return c.allow.words
}

// authorize finds the caller of ctx's call, refuses a method its grants do not allow,
// and hands the caller on for the owner checks of Reserve, Release and
// ReownReservation.
func (a *access) authorize(ctx context.Context, method string) (context.Context, error) {
	c, ok := a.whoCalls(ctx)
	if !ok {
		return ctx, nil
	}
	if need, ok := c.allow.allows(method); !ok {
		lacks := need
		if need == GrantReserve {
			lacks = GrantReserve + ":OWNER"
		}
		return ctx, toStatus(c.deny("call "+method, lacks))
	}
	return context.WithValue(ctx, callerKey{}, c), nil
}

// interceptors are the unary and stream interceptors that authorize every call.
func (a *access) interceptors() (grpc.UnaryServerInterceptor, grpc.StreamServerInterceptor) {
	unary := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		ctx, err := a.authorize(ctx, info.FullMethod)
		if err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
	stream := func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx, err := a.authorize(ss.Context(), info.FullMethod)
		if err != nil {
			return err
		}
		return handler(srv, &callerStream{ServerStream: ss, ctx: ctx})
	}
	return unary, stream
}

// callerStream is a stream whose context carries its caller.
type callerStream struct {
	grpc.ServerStream
	ctx context.Context
}

// Context implements grpc.ServerStream.
func (s *callerStream) Context() context.Context { return s.ctx }

// mayOwn refuses a call of ctx's caller for an owner its grants do not cover; call says
// what was asked. Nil without a caller (no access policy, or Serve's listener).
func mayOwn(ctx context.Context, call, owner string) error {
	c := callerFrom(ctx)
	if c == nil || c.allow.mayOwn(owner) {
		return nil
	}
	return c.deny(call, GrantReserve+":"+owner)
}

// ownerPrefixes is what ctx's caller may release for (device.ReleaseRequest's
// OwnerPrefixes): nil for any owner.
func ownerPrefixes(ctx context.Context) []string {
	c := callerFrom(ctx)
	if c == nil {
		return nil
	}
	return c.allow.ownerPrefixes()
}

// withCaller completes a *device.PermissionError of the ledger's (which knows the
// owner, not the caller) with ctx's caller.
func withCaller(ctx context.Context, err error) error {
	c := callerFrom(ctx)
	var pe *device.PermissionError
	if c == nil || !errors.As(err, &pe) {
		return err
	}
	return c.deny(pe.Call, pe.Lacks)
}

// mayReserve refuses a Reserve of ctx's caller for an owner, or a take-over of owners,
// its grants do not cover.
func mayReserve(ctx context.Context, req device.ReserveRequest) error {
	if err := mayOwn(ctx, fmt.Sprintf("reserve for owner %q", req.OwnerID), req.OwnerID); err != nil {
		return err
	}
	for _, p := range req.TakeOverOwnerPrefixes {
		// A take-over releases every owner under p: each must be the caller's.
		if err := mayOwn(ctx, fmt.Sprintf("reserve for owner %q taking over owners under %q", req.OwnerID, p), p); err != nil {
			return err
		}
	}
	return nil
}

// describeCaller names the caller of ctx's call for a record of what it did (a
// cordon's By): its listener and peer, e.g. `listener "main" uid=0,gid=0,pid=42`, the
// peer's address where it is no listener's, "unknown" where there is no peer.
func describeCaller(ctx context.Context) string {
	p, _ := peer.FromContext(ctx)
	if p == nil || p.Addr == nil {
		return "unknown"
	}
	addr, ok := p.Addr.(*connAddr)
	if !ok {
		return p.Addr.String()
	}
	out, _ := peerName(p, addr)
	if addr.listener.Name != "" {
		out = fmt.Sprintf("listener %q %s", addr.listener.Name, out)
	}
	return out
}
