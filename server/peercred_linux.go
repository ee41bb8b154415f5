package server

import (
	"net"

	"golang.org/x/sys/unix"
)

// peerCred reads the credentials of c's client (SO_PEERCRED); ok is false when they
// cannot be read.
func peerCred(c *net.UnixConn) (_ peerAddr, ok bool) {
	raw, err := c.SyscallConn()
	if err != nil {
		return peerAddr{}, false
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil || credErr != nil {
		return peerAddr{}, false
	}
	return peerAddr{uid: cred.Uid, pid: cred.Pid}, true
}
