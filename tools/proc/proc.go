// Package proc lists the processes of this Linux machine from /proc, for tests and
// tools that must see what an agent started (its plugins, their children) or left
// behind: one reader of /proc/<pid>/stat, cmdline and exe instead of one per test.
package proc

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Process is one process as List read it.
type Process struct {
	PID   int
	PPID  int
	State byte     // the state letter of /proc/<pid>/stat: 'R', 'S', 'Z'...
	Exe   string   // the /proc/<pid>/exe link; "" where it cannot be read
	Argv  []string // from /proc/<pid>/cmdline; nil where it cannot be read
}

// Zombie reports whether the process has exited and waits to be reaped.
func (p Process) Zombie() bool { return p.State == 'Z' }

// Cmdline is Argv joined with spaces.
func (p Process) Cmdline() string { return strings.Join(p.Argv, " ") }

// List reads every process in /proc. A process that goes away while List reads it is
// left out.
func List() ([]Process, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []Process
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		p, ok := read(pid)
		if ok {
			out = append(out, p)
		}
	}
	return out, nil
}

// Children returns the processes whose parent is ppid, zombies included.
func Children(ppid int) ([]Process, error) {
	all, err := List()
	if err != nil {
		return nil, err
	}
	var out []Process
	for _, p := range all {
		if p.PPID == ppid {
			out = append(out, p)
		}
	}
	return out, nil
}

// CPU is the user and system CPU time process pid has used so far (its threads, not
// its children), from /proc/<pid>/stat.
func CPU(pid int) (time.Duration, error) {
	fields, err := statFields(filepath.Join("/proc", strconv.Itoa(pid)))
	if err != nil {
		return 0, err
	}
	// utime and stime are the 12th and 13th after the command.
	if len(fields) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields after the command, want 13 or more", pid, len(fields))
	}
	utime, err1 := strconv.ParseUint(fields[11], 10, 64)
	stime, err2 := strconv.ParseUint(fields[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	const ticks = 100 // USER_HZ on Linux
	return time.Duration(utime+stime) * time.Second / ticks, nil
}

// RunTime is the CPU time process pid's threads have spent so far, in nanoseconds: the
// sum of /proc/<pid>/task/*/schedstat. CPU counts in ticks of 10 ms, too coarse for
// what a few changes cost; RunTime misses what threads that have exited spent (a Go
// program's threads live as long as it does, but for locked goroutines that end).
func RunTime(pid int) (time.Duration, error) {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "task")
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return 0, err
	}
	var sum time.Duration
	for _, task := range tasks {
		data, err := os.ReadFile(filepath.Join(dir, task.Name(), "schedstat"))
		if errors.Is(err, os.ErrNotExist) {
			continue // exited since the directory was read
		}
		if err != nil {
			return 0, err
		}
		first, _, _ := strings.Cut(string(data), " ")
		ns, err := strconv.ParseInt(first, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s/%s/schedstat: %w", dir, task.Name(), err)
		}
		sum += time.Duration(ns)
	}
	return sum, nil
}

// read reads one process; false when it is gone or its stat cannot be parsed.
func read(pid int) (Process, bool) {
	dir := filepath.Join("/proc", strconv.Itoa(pid))
	fields, err := statFields(dir)
	if err != nil {
		return Process{}, false
	}
	if len(fields) < 2 || len(fields[0]) != 1 {
		return Process{}, false
	}
	ppid, err := strconv.Atoi(fields[1])
	if err != nil {
		return Process{}, false
	}
	p := Process{PID: pid, PPID: ppid, State: fields[0][0]}
	p.Exe, _ = os.Readlink(filepath.Join(dir, "exe"))
	if cmdline, err := os.ReadFile(filepath.Join(dir, "cmdline")); err == nil && len(cmdline) > 0 {
		p.Argv = strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
	}
	return p, true
}

// statFields are the fields of dir's stat after "pid (comm)": state, ppid, and on. comm
// may hold spaces and parentheses, so they start after the last ')'.
func statFields(dir string) ([]string, error) {
	stat, err := os.ReadFile(filepath.Join(dir, "stat"))
	if err != nil {
		return nil, err
	}
	return strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:])), nil
}
