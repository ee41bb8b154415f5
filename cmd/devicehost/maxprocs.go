package main

import (
	"os"
	"runtime"

	"github.com/hashicorp/go-hclog"
)

// defaultMaxProcs is max_procs' default: one thread runs the agent's Go code at a time.
// The agent's calls are chains of hand-offs (the API connection, the plugin's, the
// ledger's fsync), not parallel work: with more, each hand-off wakes another thread
// (a futex call and a cross-core switch, 10 µs and more on a virtual machine), and on
// a 2-core machine a Reserve's own part cost 1.4 to 1.7 times what it costs with one
// (docs/benchmarks.md, "One thread"). Blocking system calls still run beside it (the
// Go runtime hands the thread's turn on), and so do the plugins, processes of their own.
// A host serving thousands of watchers on a many-core machine may give it more.
const defaultMaxProcs = 1

// applyMaxProcs puts max_procs in force: n > 0 threads run the agent's Go code at once,
// 0 gives the choice back to the Go runtime. The GOMAXPROCS environment variable, when
// set, wins, as it does for any Go program. It returns the value in force and whether
// the environment chose it.
func applyMaxProcs(n int) (inForce int, fromEnv bool) {
	switch {
	case os.Getenv("GOMAXPROCS") != "":
		return runtime.GOMAXPROCS(0), true
	case n == 0:
		runtime.SetDefaultGOMAXPROCS()
	default:
		runtime.GOMAXPROCS(n)
	}
	return runtime.GOMAXPROCS(0), false
}

// logMaxProcs applies max_procs, logs what is in force and returns it.
func logMaxProcs(log hclog.Logger, n int) int {
	inForce, fromEnv := applyMaxProcs(n)
	if fromEnv {
		log.Info("threads running the agent's Go code at once: set by the GOMAXPROCS environment variable; max_procs is not used", "gomaxprocs", inForce)
	} else {
		log.Debug("threads running the agent's Go code at once", "max_procs", n, "gomaxprocs", inForce)
	}
	return inForce
}
