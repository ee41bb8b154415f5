package pluginloader

import (
	"os/exec"
	"syscall"
)

// tieToHost asks the kernel to SIGKILL the plugin when the host process dies, so a host
// killed with SIGKILL leaves no orphaned plugin holding devices.
//
// Pdeathsig fires when the thread that started the child exits; the Go runtime only ends
// threads whose goroutine exited while locked to them, which the launch path never does.
func tieToHost(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}
