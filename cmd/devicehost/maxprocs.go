package main

import (
	"os"
	"runtime"

	"github.com/hashicorp/go-hclog"
)

// defaultMaxProcs is max_procs' default: the Go runtime's choice (the cores, or the
// container's CPU limit). One thread (max_procs = 1) makes a lone Reserve about 8%
// faster on a 2-core VM (fewer thread wake-ups across its hand-offs), but holds 64
// concurrent callers to under 2x one caller's cycles: each of the ledger's commit
// syscalls gives the thread's turn away, and the committing goroutine then waits behind
// every runnable handler before its next one (docs/benchmarks.md, "Concurrent callers").
const defaultMaxProcs = 0

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
