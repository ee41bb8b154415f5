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
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
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
				r, _, err := l.Reserve(ctx, res(fmt.Sprintf("owner-%d-%d", w, i), dev), nil, nil)
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

// startHelper runs this test binary as the helper test name, on the ledger file at path
// (passed in the environment variable env), and returns it with its stdout and stderr.
// Cleanup kills it unless the test has waited for it.
func startHelper(t *testing.T, name, env, path string) (*exec.Cmd, io.Reader, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+name+"$", "-test.count=1", "-test.timeout=2m")
	cmd.Env = append(os.Environ(), env+"="+path)
	stderr := new(bytes.Buffer)
	cmd.Stderr = stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd, stdout, stderr
}

// TestCrashKeepsAcknowledged kills a process under Reserve load with SIGKILL and checks
// that the state file it leaves opens cleanly (no half-written record) and holds every
// acknowledged reservation exactly once, with every acknowledged release.
func TestCrashKeepsAcknowledged(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	path := statePath(t)
	cmd, stdout, stderr := startHelper(t, "TestHelperProcess", crashHelperEnv, path)

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
	err := cmd.Wait()
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

// takeOverHelperEnv names the state file TestHelperTakeOver writes to; unset, the
// helper skips.
const takeOverHelperEnv = "DEVICEHOST_LEDGER_TAKEOVER_HELPER"

// takeOverDevices is how many devices TestHelperTakeOver passes between owners.
const takeOverDevices = 8

// TestHelperTakeOver is not a test: TestCrashTakeOverKeepsDevicesHeld runs the test
// binary again with only this test selected. One goroutine per device passes it from
// owner to owner by take-over ("nomad/<device>-<i>", prefix "nomad/"), printing
// "took NEW DEVICE OLD" (OLD "-" for the first) as each is acknowledged, until the
// process is killed.
func TestHelperTakeOver(t *testing.T) {
	path := os.Getenv(takeOverHelperEnv)
	if path == "" {
		t.Skip("helper process for TestCrashTakeOverKeepsDevicesHeld")
	}
	l, err := Open(path, Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var mu sync.Mutex
	ctx := context.Background()
	for d := range takeOverDevices {
		go func() {
			dev := fmt.Sprint("GPU-", d)
			for i := 0; ; i++ {
				r, _, err := l.Reserve(ctx, res(fmt.Sprintf("nomad/%s-%d", dev, i), dev), []string{"nomad/"}, nil)
				if err != nil || len(r.TakenOver) > 1 || (i > 0) != (len(r.TakenOver) == 1) {
					fmt.Fprintln(os.Stderr, "take-over", i, "of", dev, r.TakenOver, err)
					os.Exit(3)
				}
				old := "-"
				if i > 0 {
					old = r.TakenOver[0]
				}
				mu.Lock()
				fmt.Fprintf(os.Stdout, "took %s %s %s\n", r.ID, dev, old) // unbuffered: one write per line
				mu.Unlock()
			}
		}()
	}
	select {} // until SIGKILL
}

// TestCrashTakeOverKeepsDevicesHeld kills a process passing devices from owner to owner
// by take-over with SIGKILL, and checks the file it leaves: every device is held by one
// live reservation (a take-over never leaves a device free, or its old holder released
// without the new one), every acknowledged take-over is there whole (the new
// reservation, the old one released with its cleanup pending), and the reservations of
// each device form one chain.
func TestCrashTakeOverKeepsDevicesHeld(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	path := statePath(t)
	cmd, stdout, stderr := startHelper(t, "TestHelperTakeOver", takeOverHelperEnv, path)
	type took struct{ id, dev, old string }
	var acked []took
	lines := bufio.NewScanner(stdout)
	for len(acked) < 400 && lines.Scan() {
		f := strings.Fields(lines.Text())
		if len(f) != 4 || f[0] != "took" {
			t.Fatalf("helper printed %q", lines.Text())
		}
		acked = append(acked, took{f[1], f[2], f[3]})
	}
	if len(acked) < 400 {
		t.Fatalf("helper stopped after %d take-overs (%v)\n%s", len(acked), lines.Err(), stderr.String())
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for lines.Scan() { // what it acknowledged before it died; a cut line has no newline
		if f := strings.Fields(lines.Text()); len(f) == 4 && f[0] == "took" {
			acked = append(acked, took{f[1], f[2], f[3]})
		}
	}
	_ = cmd.Wait()
	t.Logf("helper acknowledged %d take-overs before SIGKILL", len(acked))

	l := openLedger(t, path)
	holders := l.Holders()
	if len(holders) != takeOverDevices {
		t.Errorf("%d devices held after the crash, want all %d: %+v", len(holders), takeOverDevices, holders)
	}
	for _, a := range acked {
		r, err := l.Get(a.id)
		switch {
		case err != nil:
			t.Errorf("acknowledged reservation %s of %s lost: %v", a.id, a.dev, err)
		case r.State == device.ReservationActive && holders[a.dev].ReservationID != a.id:
			t.Errorf("%s live but %s held by %+v", a.id, a.dev, holders[a.dev])
		}
		if a.old == "-" {
			continue
		}
		if old, err := l.Get(a.old); err != nil || old.State != device.ReservationReleased || !old.CleanupPending || !old.ReleasedAt.Equal(r.CreatedAt) {
			t.Errorf("%s, taken over by acknowledged %s: %+v, %v; want released at its creation, cleanup pending", a.old, a.id, old, err)
		}
	}
	// Per device: one live reservation, every other one released at the creation of
	// the next (a chain with no gap).
	byDev := map[string][]device.Reservation{}
	for _, r := range listAll(t, l) {
		byDev[r.DeviceIDs[0]] = append(byDev[r.DeviceIDs[0]], r)
	}
	seq := func(r device.Reservation) int { // i of owner nomad/<device>-<i>
		n, _ := strconv.Atoi(r.OwnerID[strings.LastIndexByte(r.OwnerID, '-')+1:])
		return n
	}
	for _, rs := range byDev {
		slices.SortFunc(rs, func(a, b device.Reservation) int { return seq(a) - seq(b) })
	}
	for dev, rs := range byDev {
		for i, r := range rs {
			last := i == len(rs)-1
			switch {
			case last && r.State != device.ReservationActive:
				t.Errorf("%s: the newest reservation %s is %v", dev, r.ID, r.State)
			case !last && (r.State != device.ReservationReleased || !r.ReleasedAt.Equal(rs[i+1].CreatedAt)):
				t.Errorf("%s: %s is %v, released at %v; want released at %s's creation %v", dev, r.ID, r.State, r.ReleasedAt, rs[i+1].ID, rs[i+1].CreatedAt)
			}
		}
	}
}
