package server

import "fmt"

// peerCredentials are the ids the kernel recorded for a unix socket's client process
// when it connected (SO_PEERCRED): what uid and gid grants match and the call log
// names. A unix client binds no name, so without them its address is "@" or "" and
// neither could say who called.
type peerCredentials struct {
	uid, gid uint32
	pid      int32
}

// String is "uid=U,gid=G,pid=P".
func (c peerCredentials) String() string {
	return fmt.Sprintf("uid=%d,gid=%d,pid=%d", c.uid, c.gid, c.pid)
}
