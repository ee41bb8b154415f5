package server

import (
	"fmt"
	"net"
)

// peerListener is a listener whose unix connections carry their client's credentials:
// the RemoteAddr of each is a peerAddr with the uid and pid the kernel recorded when
// the client connected, where the platform tells them (peerCred). A unix client binds
// no name, so without them its address is "@" or "" and the call log could not say
// who called. Other connections pass unchanged.
type peerListener struct {
	net.Listener
}

// Accept implements net.Listener.
func (l peerListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return c, err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return c, nil
	}
	if addr, ok := peerCred(uc); ok {
		return &peerConn{UnixConn: uc, remote: addr}, nil
	}
	return c, nil
}

// peerConn is a unix connection whose RemoteAddr is its client's credentials.
type peerConn struct {
	*net.UnixConn
	remote peerAddr
}

// RemoteAddr implements net.Conn.
func (c *peerConn) RemoteAddr() net.Addr { return c.remote }

// peerAddr is a unix socket client named by its credentials.
type peerAddr struct {
	uid uint32
	pid int32
}

// Network implements net.Addr.
func (peerAddr) Network() string { return "unix" }

// String implements net.Addr.
func (a peerAddr) String() string { return fmt.Sprintf("uid=%d,pid=%d", a.uid, a.pid) }
