package adapter

import (
	"os/exec"
	"syscall"
)

// setProcAttrs asks the kernel to SIGKILL the Nomad plugin when the adapter dies, so an
// adapter killed with SIGKILL leaves no Nomad plugin behind holding devices. (The
// signal fires when the thread that started the child exits; the Go runtime ends a
// thread only when a goroutine locked to it exits, which the launch path never does.)
func setProcAttrs(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
