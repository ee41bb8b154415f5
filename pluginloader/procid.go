package pluginloader

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// ProcessIdentity tells one run of a plugin binary from any other process, where a PID
// alone does not: PIDs are reused, and every count starts again at a reboot. It is what
// a host records about a plugin process it may find again later (reattach after a host
// crash), and the one rule for deciding that a PID still is that process: Check. It
// reads Linux's /proc; elsewhere IdentifyProcess and Check always fail.
type ProcessIdentity struct {
	PID        int
	StartTicks uint64 // /proc/<pid>/stat starttime: clock ticks after boot at which it started
	BootID     string // /proc/sys/kernel/random/boot_id while it ran
	Path       string // the binary it was launched from
}

// IdentifyProcess describes the running process pid, launched from the binary path.
func IdentifyProcess(pid int, path string) (ProcessIdentity, error) {
	boot, err := bootID()
	if err != nil {
		return ProcessIdentity{}, err
	}
	pi, err := readProc(pid)
	if err != nil {
		return ProcessIdentity{}, err
	}
	return ProcessIdentity{PID: pid, StartTicks: pi.startTicks, BootID: boot, Path: path}, nil
}

// Check returns nil when p.PID still is the process p describes: alive and not a
// zombie, started at p.StartTicks since the boot p.BootID, and running the binary
// p.Path. Otherwise it says why not.
func (p ProcessIdentity) Check() error {
	boot, err := bootID()
	switch {
	case err != nil:
		return err
	case boot != p.BootID:
		return errors.New("the machine has rebooted since it was started")
	}
	pi, err := readProc(p.PID)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("process %d is gone", p.PID)
	case err != nil:
		return err
	case pi.state == 'Z' || pi.state == 'X':
		return fmt.Errorf("process %d has exited (state %c)", p.PID, pi.state)
	case pi.startTicks != p.StartTicks:
		return fmt.Errorf("PID %d now belongs to another process (started at tick %d, the plugin at %d)", p.PID, pi.startTicks, p.StartTicks)
	}
	want, err := filepath.EvalSymlinks(p.Path)
	if err != nil {
		return fmt.Errorf("plugin binary: %w", err)
	}
	if pi.exe != want {
		return fmt.Errorf("process %d runs %s, not the plugin binary %s", p.PID, pi.exe, want)
	}
	return nil
}

// KillIfSame SIGKILLs p's process when it still is that process (Check), and reports
// whether it did. A process that fails the check is never signalled: its PID may be
// someone else's.
func (p ProcessIdentity) KillIfSame() (bool, error) {
	if err := p.Check(); err != nil {
		return false, nil
	}
	if err := syscall.Kill(p.PID, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return false, fmt.Errorf("kill plugin process %d: %w", p.PID, err)
	}
	return true, nil
}

// procInfo is what /proc says about a process.
type procInfo struct {
	state      byte   // 'R', 'S', 'D', 'Z' (zombie), 'X' (dead)...
	startTicks uint64 // clock ticks after boot at which it started
	exe        string // its binary; empty for a zombie
}

// readProc reads /proc/<pid>/stat and, unless the process is a zombie, /proc/<pid>/exe.
// A process that does not exist is an error matching fs.ErrNotExist.
func readProc(pid int) (procInfo, error) {
	if pid <= 0 {
		return procInfo{}, fmt.Errorf("process %d: %w", pid, fs.ErrNotExist)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procInfo{}, fmt.Errorf("process %d: %w", pid, err)
	}
	// "pid (comm) state ppid ... starttime ...": comm may hold spaces and parentheses,
	// so the fields are counted from the last ')'. starttime is field 22, the 20th
	// after comm.
	i := bytes.LastIndexByte(b, ')')
	var f []string
	if i >= 0 {
		f = strings.Fields(string(b[i+1:]))
	}
	if len(f) < 20 || len(f[0]) != 1 {
		return procInfo{}, fmt.Errorf("process %d: unexpected /proc/%d/stat: %q", pid, pid, b)
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return procInfo{}, fmt.Errorf("process %d: start time in /proc/%d/stat: %w", pid, pid, err)
	}
	pi := procInfo{state: f[0][0], startTicks: start}
	if pi.state == 'Z' || pi.state == 'X' {
		return pi, nil
	}
	if pi.exe, err = os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil {
		return procInfo{}, fmt.Errorf("process %d: its binary: %w", pid, err)
	}
	return pi, nil
}

// bootID identifies the running kernel boot, so that a record from before a reboot
// never matches a process after it.
func bootID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("boot ID: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}
