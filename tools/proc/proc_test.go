package proc

import (
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// A child this test starts is listed as its child, with its executable and arguments,
// and as a zombie once it exited and before it is reaped.
func TestChildren(t *testing.T) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep(1):", err)
	}
	cmd := exec.Command(sleep, "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })

	kids, err := Children(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(kids, func(p Process) bool { return p.PID == cmd.Process.Pid })
	if i < 0 {
		t.Fatalf("children of %d = %+v, want %d among them", os.Getpid(), kids, cmd.Process.Pid)
	}
	want, _ := os.Readlink("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/exe")
	if p := kids[i]; p.PPID != os.Getpid() || p.Exe != want || !slices.Equal(p.Argv, []string{sleep, "1000"}) || p.Zombie() {
		t.Errorf("child = %+v, want parent %d, exe %s, argv [%s 1000], not a zombie", p, os.Getpid(), want, sleep)
	}

	// Killed and not yet reaped: a zombie, still our child.
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	waitZombie(t, cmd.Process.Pid)
}

func waitZombie(t *testing.T, pid int) {
	t.Helper()
	// A SIGKILLed child turns zombie as soon as the kernel has delivered the signal, and
	// stays one until Wait reaps it (at cleanup): poll its state until then; a hang is
	// bounded by go test's deadline.
	for {
		kids, err := Children(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		i := slices.IndexFunc(kids, func(p Process) bool { return p.PID == pid })
		if i < 0 {
			t.Fatalf("killed child %d no longer listed before it was reaped", pid)
		}
		if kids[i].Zombie() {
			return
		}
	}
}

// CPU counts what a process spends: this one's grows while it computes, and a process
// that does not exist is an error.
func TestCPU(t *testing.T) {
	before, err := CPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	var now time.Duration
	grew := compute(time.Minute, func() bool {
		now, err = CPU(os.Getpid())
		return err != nil || now-before >= 50*time.Millisecond
	})
	if err != nil {
		t.Fatal(err)
	}
	if !grew {
		t.Fatalf("CPU stayed at %v after a minute of computing (from %v)", now, before)
	}
	if _, err := CPU(1 << 30); err == nil {
		t.Error("CPU of a pid that cannot exist: no error")
	}
}

// RunTime counts every thread's time, to the nanosecond: computing on a thread other
// than the process's first grows it by what CPU (in ticks) sees spent, and a process
// that does not exist is an error.
func TestRunTime(t *testing.T) {
	pid := os.Getpid()
	cpu0, err := CPU(pid)
	if err != nil {
		t.Fatal(err)
	}
	run0, err := RunTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	// Computing in a goroutine locked to a thread other than the first: its time is
	// not the first thread's. (A goroutine given the first thread tries again.)
	burnt := make(chan bool)
	for first := true; first; first = !<-burnt {
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			if syscall.Gettid() == pid {
				burnt <- false
				return
			}
			compute(30*time.Second, func() bool {
				now, err := RunTime(pid)
				return err != nil || now-run0 >= 200*time.Millisecond
			})
			burnt <- true
		}()
	}
	run1, err := RunTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	cpu1, err := CPU(pid)
	if err != nil {
		t.Fatal(err)
	}
	// The ticks and the nanoseconds count the same time, but for the ticks' rounding
	// (one per thread at most) and threads that ended.
	run, cpu := run1-run0, cpu1-cpu0
	if run < 200*time.Millisecond {
		t.Fatalf("RunTime grew by %v in 30 s of computing", run)
	}
	if cpu < run-100*time.Millisecond || cpu > run+time.Second {
		t.Errorf("RunTime grew by %v, CPU by %v: not the same time", run, cpu)
	}
	if run%(10*time.Millisecond) == 0 && run0%(10*time.Millisecond) == 0 {
		t.Errorf("RunTime %v and %v: counted in ticks, not nanoseconds", run0, run1)
	}
	if _, err := RunTime(1 << 30); err == nil {
		t.Error("RunTime of a pid that cannot exist: no error")
	}
}

// computed keeps compute's work from being optimised away.
var computed atomic.Uint64

// compute keeps a CPU busy, checking done after each round of work, until done
// reports true (compute returns true) or limit has passed (false).
func compute(limit time.Duration, done func() bool) bool {
	x := uint64(1)
	defer func() { computed.Add(x) }()
	for start := time.Now(); time.Since(start) < limit; {
		for range 1 << 20 {
			x = x*6364136223846793005 + 1442695040888963407
		}
		if done() {
			return true
		}
	}
	return false
}
