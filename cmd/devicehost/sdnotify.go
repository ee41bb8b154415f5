package main

import (
	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/hashicorp/go-hclog"
)

// sdNotify tells systemd the agent's state (daemon.SdNotifyReady, SdNotifyStopping)
// over $NOTIFY_SOCKET, as a Type=notify unit expects. Without NOTIFY_SOCKET (not under
// systemd) it does nothing; a failure is logged, never fatal: systemd then times the
// start out, which says more than an agent that refuses to run.
//
// go-systemd's daemon package is the notify protocol as containerd, etcd and the
// kubelet send it (one datagram, abstract socket names included) in a few lines of
// stdlib code; we use it rather than keep our own copy.
func sdNotify(log hclog.Logger, state string) {
	sent, err := daemon.SdNotify(false, state)
	switch {
	case err != nil:
		log.Warn("could not notify systemd", "state", state, "error", err)
	case sent:
		log.Debug("notified systemd", "state", state)
	}
}
