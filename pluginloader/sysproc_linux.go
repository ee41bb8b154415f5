package pluginloader

import (
	"errors"
	"os"
	"os/exec"
	"syscall"
)

// setProcAttrs puts the plugin in a process group of its own, so a signal sent to the
// host's group (Ctrl-C in a terminal, `timeout`, a supervisor signalling the group) does
// not kill the plugin behind the host's back: the host stops its plugins itself, in
// order. Unless surviveHost, it also asks the kernel to SIGKILL the plugin when the host
// process dies, so a host killed with SIGKILL leaves no orphaned plugin holding devices.
//
// The command's Cancel (run when the exec.CommandContext context ends, until the process
// has been waited for) SIGKILLs the whole group, not only the plugin's PID: a child the
// plugin started (a shell script's `sleep`, a helper daemon) would otherwise survive it
// and, holding the plugin's stdout and stderr, keep go-plugin waiting for their end. A
// descendant that leaves the group (setsid) is not reached; see Kill.
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
	cmd.Cancel = func() error { return killGroup(cmd.Process.Pid) }
}

// killGroup SIGKILLs the process group pgid (the plugin's PID, as Setpgid made it). The
// group ID is not reused while the leader is an unreaped zombie or any member lives, and
// exec calls Cancel only until Wait has reaped the leader, so the signal reaches the
// plugin's group (only a cancel racing with that reap, and a PID wraparound in the same
// instant, could miss). An empty group is os.ErrProcessDone.
func killGroup(pgid int) error {
	if pgid <= 0 {
		return os.ErrProcessDone
	}
	err := syscall.Kill(-pgid, syscall.SIGKILL)
	if errors.Is(err, syscall.ESRCH) {
		return os.ErrProcessDone
	}
	return err
}

// killReattached SIGKILLs a reattached plugin (not our child) and its process group.
// The caller has checked that the process still runs: while it does, a group with its
// PID as ID can only be its own.
func killReattached(pid int) {
	_ = syscall.Kill(-pid, syscall.SIGKILL) // ESRCH when it leads no group
	_ = syscall.Kill(pid, syscall.SIGKILL)
}
