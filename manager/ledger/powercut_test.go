package ledger

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/tools/cutfs"
)

// Power cuts, not only SIGKILL: a SIGKILL keeps the page cache, a power cut does not,
// and only a power cut tests what the ledger's fsyncs promise. TestPowerCut runs a
// ledger in a child process on a cutfs mount (a FUSE file system that remembers what no
// fsync covered), under a load of Reserve, Release, Reown, take-over and the GC's
// writes (cleanups recorded done, deletions) from several
// goroutines and a watcher of the trail, each printing what it was acknowledged; at a
// random fsync the power goes: that fsync and everything after it fails, the child is
// killed, and the backing directory is rewritten to what the disk holds (every unsynced
// write dropped, or, one cut in two, a random half of the unsynced blocks kept, as a
// disk that reorders writes may). A new ledger then opens what is left and must hold
// every acknowledged change, nothing refused, no device twice, and every event a
// watcher saw, under the same position. The next round runs on that state.
//
// DEVICEHOST_POWERCUTS sets the number of cuts (default 30; scripts/powercut runs 200
// or more) and DEVICEHOST_POWERCUT_SEED the seed (default: random, logged).
const powerCutHelperEnv = "DEVICEHOST_LEDGER_POWERCUT_HELPER"

// powerCutTimeout bounds a round's wait for its cut: the load makes hundreds of fsyncs
// a second, so only a hung helper reaches it.
const powerCutTimeout = time.Minute

// powerCutDevices is the device pool of the load: few enough for conflicts and
// take-overs to happen.
const powerCutDevices = 12

// TestHelperPowerCut is not a test: TestPowerCut runs the test binary again with only
// this test selected, on the ledger named by powerCutHelperEnv ("SEED:PATH"). It prints
// one line per acknowledged outcome (see TestPowerCut's checks) until it is killed.
func TestHelperPowerCut(t *testing.T) {
	arg := os.Getenv(powerCutHelperEnv)
	if arg == "" {
		t.Skip("helper process for TestPowerCut")
	}
	seedText, path, _ := strings.Cut(arg, ":")
	seed, _ := strconv.ParseUint(seedText, 10, 64)
	var mu sync.Mutex
	say := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(os.Stdout, format+"\n", args...) // unbuffered: one write per line
	}
	l, err := Open(path, Options{MaxEvents: 1 << 20})
	if err != nil {
		say("open-failed %v", strings.ReplaceAll(err.Error(), "\n", " "))
		select {} // until killed: the parent decides
	}
	say("opened")
	ctx := context.Background()
	go powerCutGC(l) // the garbage collector's writes (manager/gc makes the same ones)
	l.ev.mu.Lock()
	start := l.ev.next - 1 // the watcher is shown this round's events
	l.ev.mu.Unlock()
	go func() { // the watcher
		after := start
		for {
			wake := l.EventsAfter(after)
			ev, err := l.Events(ctx, device.EventFilter{After: after})
			if err != nil {
				return
			}
			for _, e := range ev.Events {
				say("event %d %s", e.Seq, eventSig(e))
			}
			after = max(after, ev.Through)
			if len(ev.Events) == 0 {
				<-wake
			}
		}
	}()
	// The live reservations of earlier rounds are the workers' to release and reown.
	adopted := make([][]string, 4)
	for i, r := range l.Live() {
		adopted[i%4] = append(adopted[i%4], r.ID)
	}
	for w := range 4 {
		go func() {
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			mine := adopted[w] // this worker's reservations, acknowledged
			refused := false   // the last Reserve was: release one of ours next
			for i := 0; ; i++ {
				var err error
				op := rng.IntN(10)
				if refused && len(mine) > 0 {
					op = 5
				}
				refused = false
				switch {
				case op < 5 && len(mine) < 3 || len(mine) == 0:
					owner := fmt.Sprintf("w%d-%08x-%d", w, uint32(seed), i) // unique across rounds
					var takeOver []string
					if rng.IntN(3) == 0 {
						owner = "tk/" + owner // may be taken over
					}
					if rng.IntN(4) == 0 {
						takeOver = []string{"tk/"}
					}
					devs := []string{fmt.Sprintf("GPU-%d", rng.IntN(powerCutDevices))}
					if rng.IntN(4) == 0 {
						if d := fmt.Sprintf("GPU-%d", rng.IntN(powerCutDevices)); d != devs[0] {
							devs = append(devs, d)
						}
					}
					var r device.Reservation
					r, _, err = l.Reserve(ctx, res(owner, devs...), takeOver, nil)
					switch {
					case err == nil:
						say("reserve %s %s %s %s", r.ID, owner, strings.Join(r.DeviceIDs, ","), strings.Join(r.TakenOver, ","))
						mine = append(mine, r.ID)
					case errors.Is(err, device.ErrDeviceHeld):
						say("refused %s", owner)
						err, refused = nil, true
						if len(mine) == 0 { // nothing of ours to free: wait for the trail to move
							l.ev.mu.Lock()
							wake := l.ev.wake
							l.ev.mu.Unlock()
							<-wake
						}
					}
				case op < 8 || op < 5:
					k := rng.IntN(len(mine))
					id := mine[k]
					mine = slices.Delete(mine, k, k+1)
					if _, _, err = l.Release(ctx, device.ReleaseRequest{ReservationID: id}, time.Time{}); err == nil {
						say("release %s", id)
					} else if errors.Is(err, device.ErrNotFound) {
						err = nil // taken over and deleted meanwhile
					}
				default:
					id := mine[rng.IntN(len(mine))]
					r, gerr := l.Get(id)
					if gerr != nil || r.State != device.ReservationActive {
						continue // taken over meanwhile
					}
					newOwner := r.OwnerID + "r"
					var got device.Reservation
					if got, err = l.Reown(ctx, device.ReownRequest{ReservationID: id, OwnerID: r.OwnerID, NewOwnerID: newOwner}); err == nil {
						say("reown %s %s", got.ID, newOwner)
					} else if errors.Is(err, device.ErrNotFound) || errors.Is(err, device.ErrDeviceHeld) || errors.Is(err, device.ErrInvalidRequest) {
						err = nil // released by a take-over meanwhile
					}
				}
				if err != nil {
					return // the power is gone
				}
			}
		}()
	}
	select {} // until killed
}

// powerCutGC makes the writes the garbage collector makes (manager/gc, which this
// package's tests cannot import), as deferred writes 5 ms after each change of a
// released reservation: its cleanup recorded done, then, past 24 reservations, its
// deletion. It runs until the process is killed.
func powerCutGC(l *Ledger) {
	f, _ := l.Subscribe(24)
	queued := map[string]bool{} // written or waiting: not asked again
	for range f.Wake() {
		f.Drain()
		over := l.Counts().Total - 24
		for _, id := range l.ReleasedIDs() {
			r := l.Lookup(id)
			switch {
			case r == nil || queued[id+"/delete"]:
			case r.CleanupPending && !queued[id]:
				queued[id] = true
				l.DeferCleanupDone(5*time.Millisecond, id, func(error) {})
			case !r.CleanupPending && over > 0:
				over--
				queued[id+"/delete"] = true
				l.DeferDelete(5*time.Millisecond, id, false, "gc", func(error) {})
			}
		}
	}
}

// eventSig is what TestPowerCut compares of an event seen before a cut and read after.
func eventSig(e device.Event) string {
	return fmt.Sprintf("%s|%s|%s|%s|%s", e.Kind, e.Owner, e.NewOwner, strings.Join(e.Reservations, ","), strings.Join(e.Devices, ","))
}

// powerCutAcks is what the child process was acknowledged in one round.
type powerCutAcks struct {
	reserved map[string]string // reservation ID -> owner
	released map[string]bool
	reowned  map[string]string // reservation ID -> its last acknowledged owner
	refused  []string          // owners whose Reserve was refused
	events   map[uint64]string // seq -> eventSig, as the watcher saw them
	opened   bool
	openErr  string
}

func (a *powerCutAcks) count() int {
	return len(a.reserved) + len(a.released) + len(a.reowned) + len(a.refused) + len(a.events)
}

func parseAcks(t *testing.T, lines []string) *powerCutAcks {
	t.Helper()
	a := &powerCutAcks{reserved: map[string]string{}, released: map[string]bool{}, reowned: map[string]string{}, events: map[uint64]string{}}
	for _, line := range lines {
		f := strings.Fields(line)
		switch {
		case len(f) == 0:
		case f[0] == "opened":
			a.opened = true
		case f[0] == "open-failed":
			a.openErr = line
		case f[0] == "reserve" && len(f) >= 4:
			a.reserved[f[1]] = f[2]
		case f[0] == "release" && len(f) == 2:
			a.released[f[1]] = true
		case f[0] == "reown" && len(f) == 3:
			a.reowned[f[1]] = f[2]
		case f[0] == "refused" && len(f) == 2:
			a.refused = append(a.refused, f[1])
		case f[0] == "event" && len(f) == 3:
			seq, err := strconv.ParseUint(f[1], 10, 64)
			if err != nil {
				t.Fatalf("helper line %q: %v", line, err)
			}
			a.events[seq] = f[2]
		default:
			t.Fatalf("helper line %q not understood", line)
		}
	}
	return a
}

func TestPowerCut(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes and a FUSE file system")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a FUSE file system (CI runs as root)")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("no FUSE: %v", err)
	}
	cuts := 30
	if v := os.Getenv("DEVICEHOST_POWERCUTS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("DEVICEHOST_POWERCUTS=%q: want a count", v)
		}
		cuts = n
	}
	seed := rand.Uint64()
	if v := os.Getenv("DEVICEHOST_POWERCUT_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("DEVICEHOST_POWERCUT_SEED=%q: %v", v, err)
		}
	}
	t.Logf("seed %d (DEVICEHOST_POWERCUT_SEED=%d repeats this run)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	backing, mnt := t.TempDir(), t.TempDir()
	seen := map[uint64]string{} // every event any watcher saw, across rounds
	var checked, rounds, keptBlocks, droppedBlocks int
	for round := range cuts {
		mode := cutfs.DropUnsynced
		if round%2 == 1 {
			mode = cutfs.KeepRandom
		}
		acks, stats := powerCutRound(t, backing, mnt, rng.Uint64(), 1+rng.IntN(400), mode, rand.New(rand.NewPCG(seed, uint64(round)+1)))
		keptBlocks += stats.KeptBlocks
		droppedBlocks += stats.DroppedBlocks
		checked += checkAfterCut(t, round, filepath.Join(backing, DefaultFileName), acks, seen)
		rounds++
		if t.Failed() {
			t.Fatalf("round %d (mode %v) failed; seed %d", round, mode, seed)
		}
	}
	fmt.Printf("power cuts: %d run, %d acknowledged outcomes checked, 0 lost; %d unsynced blocks dropped, %d kept at random\n",
		rounds, checked, droppedBlocks, keptBlocks)
}

// powerCutRound mounts backing at mnt, runs the helper on it until the power is cut at
// sync number at (counted from the mount) or after a random number of its lines, kills it, and returns what it was
// acknowledged. The backing dir then holds what the disk holds after the cut.
func powerCutRound(t *testing.T, backing, mnt string, seed uint64, at int, mode cutfs.Mode, cutRng *rand.Rand) (*powerCutAcks, cutfs.CutStats) {
	t.Helper()
	fsys, err := cutfs.Mount(backing, mnt, cutfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := fsys.Unmount(); err != nil {
			t.Error(err)
		}
	}()
	// The power also goes after the helper's cutAfter-th line, whatever the fsyncs: a
	// ledger that made none must not escape the cut. Drawn before cutRng is handed over.
	cutAfter := 1 + cutRng.IntN(2*at)
	lineRng := rand.New(rand.NewPCG(uint64(at), uint64(cutAfter)))
	if err := fsys.CutAtSync(at, mode, cutRng); err != nil {
		t.Fatal(err)
	}
	cmd, stdout, stderr := startHelper(t, "TestHelperPowerCut", powerCutHelperEnv, fmt.Sprintf("%d:%s", seed, filepath.Join(mnt, DefaultFileName)))
	lines := make(chan []string, 1)
	go func() {
		var out []string
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if out = append(out, sc.Text()); len(out) == cutAfter {
				_, _ = fsys.Cut(mode, lineRng) // ErrCut: the fsync came first
			}
		}
		lines <- out
	}()
	select {
	case <-fsys.CutDone():
	case <-time.After(powerCutTimeout):
		t.Fatalf("no cut after %v (sync %d armed, %d so far); helper stderr: %s", powerCutTimeout, at, fsys.Syncs(), stderr)
	}
	_ = cmd.Process.Kill() // the power is off: the process is gone too
	_ = cmd.Wait()
	acks := parseAcks(t, <-lines)
	stats, err := fsys.CutResult()
	if err != nil {
		t.Fatalf("the cut: %v", err)
	}
	return acks, stats
}

// checkAfterCut opens the ledger the cut left at path, as a new agent would, checks it
// against what was acknowledged before the cut and what watchers saw in every round,
// and returns how many acknowledged outcomes it checked.
func checkAfterCut(t *testing.T, round int, path string, a *powerCutAcks, seen map[uint64]string) int {
	t.Helper()
	l, err := Open(path, Options{MaxEvents: 1 << 20})
	if err != nil {
		// A damaged file must be refused with the recovery text, never guessed at;
		// with bbolt's two fsyncs per commit none is expected.
		t.Fatalf("round %d: the ledger does not open after the cut: %v", round, err)
	}
	defer func() {
		if err := l.Close(); err != nil {
			t.Error(err)
		}
	}()
	if a.openErr != "" {
		t.Errorf("round %d: the helper could not open the ledger: %s", round, a.openErr)
	}
	all := listAll(t, l)
	byID := make(map[string]device.Reservation, len(all))
	held := map[string]string{}
	for _, r := range all {
		byID[r.ID] = r
		if r.State != device.ReservationActive {
			continue
		}
		for _, d := range r.DeviceIDs {
			if other, ok := held[d]; ok {
				t.Errorf("round %d: %s held by %s and %s", round, d, other, r.ID)
			}
			held[d] = r.ID
		}
	}
	// The trail explains every reservation gone: a release or take-over, then the GC's
	// deletion.
	events := map[uint64]device.Event{}
	var after uint64
	for {
		ev, err := l.Events(context.Background(), device.EventFilter{After: after})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ev.Events {
			events[e.Seq] = e
		}
		if ev.Through == after {
			break
		}
		after = ev.Through
	}
	deleted, ended := map[string]bool{}, map[string]bool{}
	for _, e := range events {
		for _, id := range e.Reservations {
			switch e.Kind {
			case device.EventDelete:
				deleted[id] = true
			case device.EventRelease, device.EventTakeOver:
				ended[id] = true
			}
		}
	}
	for id, owner := range a.reserved {
		r, ok := byID[id]
		switch {
		case !ok && !(deleted[id] && ended[id]):
			t.Errorf("round %d: acknowledged reservation %s of %s is gone, and the trail neither released nor deleted it", round, id, owner)
		case ok && a.released[id] && r.State != device.ReservationReleased:
			t.Errorf("round %d: acknowledged release of %s lost: %s", round, id, r.State)
		case ok && a.reowned[id] != "" && strings.TrimRight(r.OwnerID, "r") != strings.TrimRight(a.reowned[id], "r"):
			t.Errorf("round %d: acknowledged reown of %s to %s lost: owner %s", round, id, a.reowned[id], r.OwnerID)
		}
	}
	owners := map[string]bool{}
	for _, r := range all {
		owners[strings.TrimRight(r.OwnerID, "r")] = true // reowned: "r" added each time
	}
	for _, o := range a.refused {
		if owners[o] {
			t.Errorf("round %d: the refused Reserve of %s is in the ledger", round, o)
		}
	}
	// Every event a watcher saw is durable, under the same position, and no position
	// the trail holds was shown with another event, in this round or an earlier one.
	for seq, sig := range a.events {
		e, ok := events[seq]
		if !ok {
			t.Errorf("round %d: event %d (%s) was shown to a watcher and is gone", round, seq, sig)
			continue
		}
		if got := eventSig(e); got != sig {
			t.Errorf("round %d: event %d was shown as %s, reads %s", round, seq, sig, got)
		}
	}
	for seq, e := range events {
		if sig, ok := seen[seq]; ok && sig != eventSig(e) {
			t.Errorf("round %d: event position %d reused: shown as %s in an earlier round, reads %s", round, seq, sig, eventSig(e))
		}
		seen[seq] = eventSig(e)
	}
	return a.count()
}
