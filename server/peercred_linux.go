package server

import (
	"net"

	"golang.org/x/sys/unix"
)

// peerCred reads the credentials of c's client (SO_PEERCRED); ok is false when they
// cannot be read.
func peerCred(c *net.UnixConn) (_ peerCredentials, ok bool) {
	raw, err := c.SyscallConn()
	if err != nil {
		return peerCredentials{}, false
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil || credErr != nil {
		return peerCredentials{}, false
	}
	return peerCredentials{uid: cred.Uid, gid: cred.Gid, pid: cred.Pid}, true
}
