package ledger

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/manager/device"
)

// crashHelperEnv names the state file the helper process writes to; unset, the helper
// test skips.
const crashHelperEnv = "DEVICEHOST_LEDGER_CRASH_HELPER"

// TestHelperProcess is not a test: TestCrashKeepsAcknowledged runs the test binary
// again with only this test selected. Sixteen goroutines reserve in a loop, each
// releasing every third of its reservations, and print a line to stdout for each
// acknowledged write ("reserved ID DEVICE" or "released ID") until the process is killed.
func TestHelperProcess(t *testing.T) {
	path := os.Getenv(crashHelperEnv)
	if path == "" {
		t.Skip("helper process for TestCrashKeepsAcknowledged")
	}
	l, err := Open(path, Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var mu sync.Mutex
	ack := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(os.Stdout, format+"\n", args...) // unbuffered: one write per line
	}
	ctx := context.Background()
	for w := range 16 {
		go func() {
			for i := 0; ; i++ {
				dev := fmt.Sprintf("GPU-%d-%d", w, i)
				r, _, err := l.Reserve(ctx, res(fmt.Sprintf("owner-%d-%d", w, i), dev))
				if err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(3)
				}
				ack("reserved %s %s", r.ID, dev)
				if i%3 == 2 {
					if _, _, err := l.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}, time.Time{}); err != nil {
						fmt.Fprintln(os.Stderr, err)
						os.Exit(4)
					}
					ack("released %s", r.ID)
				}
			}
		}()
	}
	select {} // until SIGKILL
}

// TestCrashKeepsAcknowledged kills a process under Reserve load with SIGKILL and checks
// that the state file it leaves opens cleanly (no half-written record) and holds every
// acknowledged reservation exactly once, with every acknowledged release.
func TestCrashKeepsAcknowledged(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	path := statePath(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1", "-test.timeout=2m")
	cmd.Env = append(os.Environ(), crashHelperEnv+"="+path)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}

	lines := make(chan string)
	readDone := make(chan error, 1)
	go func() {
		defer close(lines)
		r := bufio.NewReader(stdout)
		for {
			line, err := r.ReadString('\n')
			if err != nil { // a line cut off by the kill has no newline: not acknowledged
				if errors.Is(err, io.EOF) {
					err = nil
				}
				readDone <- err
				return
			}
			lines <- strings.TrimSuffix(line, "\n")
		}
	}()

	acked := map[string]string{} // reservation ID -> device
	released := map[string]bool{}
	record := func(line string) {
		f := strings.Fields(line)
		switch {
		case len(f) == 3 && f[0] == "reserved":
			if _, dup := acked[f[1]]; dup {
				t.Errorf("reservation ID %s acknowledged twice", f[1])
			}
			acked[f[1]] = f[2]
		case len(f) == 2 && f[0] == "released":
			released[f[1]] = true
		default:
			t.Errorf("helper printed %q", line)
		}
	}
	const killAfter = 400
	timeout := time.After(60 * time.Second)
	for len(acked) < killAfter {
		select {
		case line, ok := <-lines:
			if !ok {
				t.Fatalf("helper exited early after %d reservations: %v\n%s", len(acked), cmd.Wait(), stderr.String())
			}
			record(line)
		case <-timeout:
			_ = cmd.Process.Kill()
			t.Fatalf("helper acknowledged only %d reservations in time\n%s", len(acked), stderr.String())
		}
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for line := range lines { // what it acknowledged before it died
		record(line)
	}
	if err := <-readDone; err != nil {
		t.Fatalf("reading the helper's output: %v", err)
	}
	err = cmd.Wait()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("helper ended with %v, want killed by SIGKILL\n%s", err, stderr.String())
	}
	t.Logf("helper acknowledged %d reservations and %d releases before SIGKILL", len(acked), len(released))

	l := openLedger(t, path) // every record is checked here
	all := listAll(t, l)
	perOwner := map[string]int{}
	byID := map[string]device.Reservation{}
	for _, r := range all {
		perOwner[r.OwnerID]++
		byID[r.ID] = r
	}
	for owner, n := range perOwner {
		if n != 1 {
			t.Errorf("owner %s has %d reservations, want 1", owner, n)
		}
	}
	holders := l.Holders()
	for id, dev := range acked {
		r, ok := byID[id]
		switch {
		case !ok:
			t.Errorf("acknowledged reservation %s (%s) lost", id, dev)
		case len(r.DeviceIDs) != 1 || r.DeviceIDs[0] != dev:
			t.Errorf("reservation %s holds %v, want [%s]", id, r.DeviceIDs, dev)
		case released[id] && (r.State != device.ReservationReleased || !r.CleanupPending):
			t.Errorf("acknowledged release of %s lost: %+v", id, r)
		case !released[id] && r.State == device.ReservationActive && holders[dev].ReservationID != id:
			t.Errorf("live reservation %s does not hold %s: holder %+v", id, dev, holders[dev])
		}
	}
}
