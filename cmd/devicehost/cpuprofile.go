//go:build cpuprofile

package main

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"runtime/trace"
	"syscall"

	"github.com/devicehost/devicehost/internal/steps"
)

// A devicehost built with -tags cpuprofile (for tools/hostbench, never shipped)
// profiles itself on request: SIGUSR1 starts a CPU profile into $DEVICEHOST_CPUPROFILE
// and an execution trace into $DEVICEHOST_TRACE (each only when set), SIGUSR2 stops
// them. With $DEVICEHOST_STEPS set it times its calls' steps from the start
// (internal/steps), and SIGUSR2 also writes the calls timed since the last SIGUSR2 into
// that file. Each file is written under a temporary name and renamed once complete, so
// a reader waits for the name. Without any of the variables nothing is started. The
// goroutine lives as long as the process: there is nothing to clean up at exit but
// unfinished files.
func init() {
	cpuPath, tracePath, stepsPath := os.Getenv("DEVICEHOST_CPUPROFILE"), os.Getenv("DEVICEHOST_TRACE"), os.Getenv("DEVICEHOST_STEPS")
	if cpuPath == "" && tracePath == "" && stepsPath == "" {
		return
	}
	steps.SetTiming(stepsPath != "")
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1, syscall.SIGUSR2)
	go func() {
		var cpuF, traceF *os.File
		for s := range sig {
			var err error
			switch {
			case s == syscall.SIGUSR1 && cpuF == nil && traceF == nil:
				if cpuPath != "" {
					if cpuF, err = os.Create(cpuPath + ".tmp"); err == nil {
						err = pprof.StartCPUProfile(cpuF)
					}
				}
				if err == nil && tracePath != "" {
					if traceF, err = os.Create(tracePath + ".tmp"); err == nil {
						err = trace.Start(traceF)
					}
				}
			case s == syscall.SIGUSR2:
				if cpuF != nil {
					pprof.StopCPUProfile()
					err = finish(cpuF, cpuPath)
					cpuF = nil
				}
				if traceF != nil {
					trace.Stop()
					err = errors.Join(err, finish(traceF, tracePath))
					traceF = nil
				}
				if stepsPath != "" {
					err = errors.Join(err, writeSteps(stepsPath))
				}
			}
			if err != nil {
				fmt.Fprintf(os.Stderr, "cpuprofile: %v\n", err)
			}
		}
	}()
}

// writeSteps writes the calls timed since the last call into path.
func writeSteps(path string) error {
	records, dropped := steps.Take()
	if dropped > 0 {
		fmt.Fprintf(os.Stderr, "cpuprofile: %d timed calls past the records kept\n", dropped)
	}
	f, err := os.Create(path + ".tmp")
	if err != nil {
		return err
	}
	if err := steps.Write(f, records); err != nil {
		f.Close()
		return err
	}
	return finish(f, path)
}

// finish closes f and gives it its final name.
func finish(f *os.File, path string) error {
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}
