package pluginloader

import (
	"os/exec"
	"syscall"
)

// setProcAttrs puts the plugin in a process group of its own, so a signal sent to the
// host's group (Ctrl-C in a terminal, `timeout`, a supervisor signalling the group) does
// not kill the plugin behind the host's back: the host stops its plugins itself, in
// order. Unless surviveHost, it also asks the kernel to SIGKILL the plugin when the host
// process dies, so a host killed with SIGKILL leaves no orphaned plugin holding devices.
//
// Pdeathsig fires when the thread that started the child exits; the Go runtime only ends
// threads whose goroutine exited while locked to them, which the launch path never does.
func setProcAttrs(cmd *exec.Cmd, surviveHost bool) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	if !surviveHost {
		cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	}
}
