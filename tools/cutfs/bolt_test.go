package cutfs_test

import (
	"bufio"
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/tools/cutfs"
)

// bbolt maps its file, so it runs in a child process (this test binary, started as a
// helper by TestMain): a page fault on the mount, served by the same process, could
// deadlock with the Go runtime stopping the world.

const (
	helperEnv    = "CUTFS_TEST_HELPER" // "commit" or "verify"
	helperDirEnv = "CUTFS_TEST_DIR"    // the directory of the database
	boltTxs      = 40                  // transactions the commit helper makes
	boltSeeds    = 20
)

func boltKey(i int) []byte { return fmt.Appendf(nil, "k%04d", i) }

// boltValue varies in size, so that the file grows and values span pages.
func boltValue(i int) []byte { return bytes.Repeat([]byte{byte('a' + i%26)}, 1+(i*997)%9000) }

// runHelper is the child process. commit opens the database, fsyncs its directory
// (bbolt never does, so a new database file's name would not survive a cut), and
// commits boltTxs transactions, printing "ok i" once Commit returned nil; it stops at
// the first error. verify opens the database and prints "have i" for each
// transaction's key present with its value, "bad i" for one present with another.
func runHelper(role, dir string) int {
	db, err := bolt.Open(filepath.Join(dir, "test.db"), 0o600, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "open:", err)
		return 2
	}
	switch role {
	case "commit":
		d, err := os.Open(dir)
		if err == nil {
			err = d.Sync()
			d.Close()
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "fsync dir:", err)
			return 2
		}
		for i := range boltTxs {
			err := db.Update(func(tx *bolt.Tx) error {
				b, err := tx.CreateBucketIfNotExists([]byte("b"))
				if err != nil {
					return err
				}
				return b.Put(boltKey(i), boltValue(i))
			})
			if err != nil {
				fmt.Fprintf(os.Stderr, "commit %d: %v\n", i, err)
				return 1
			}
			fmt.Printf("ok %d\n", i)
		}
	case "verify":
		err := db.View(func(tx *bolt.Tx) error {
			b := tx.Bucket([]byte("b"))
			if b == nil {
				return nil
			}
			return b.ForEach(func(k, v []byte) error {
				var i int
				if _, err := fmt.Sscanf(string(k), "k%d", &i); err != nil {
					return err
				}
				if bytes.Equal(v, boltValue(i)) {
					fmt.Printf("have %d\n", i)
				} else {
					fmt.Printf("bad %d\n", i)
				}
				return nil
			})
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, "view:", err)
			return 2
		}
	default:
		fmt.Fprintln(os.Stderr, "unknown helper", role)
		return 2
	}
	if err := db.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "close:", err)
		return 2
	}
	return 0
}

// helper runs the helper role on the directory dir, and returns the indices it
// printed for each word and how it ended.
func helper(t *testing.T, role, dir string) (map[string][]int, string, error) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"="+role, helperDirEnv+"="+dir,
		// A race-enabled binary sleeps a second at exit, unless told not to.
		"GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	got := map[string][]int{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var word string
		var i int
		if _, err := fmt.Sscanf(sc.Text(), "%s %d", &word, &i); err != nil {
			t.Fatalf("helper %s printed %q", role, sc.Text())
		}
		got[word] = append(got[word], i)
	}
	// The first line says why it stopped: after a cut, an EIO, or a fault where bbolt
	// read its mapping (a page the kernel had dropped could not be read again).
	first, _, _ := strings.Cut(strings.TrimSpace(stderr.String()), "\n")
	return got, first, err
}

func TestBoltSurvivesCut(t *testing.T) {
	needFUSE(t)
	// How many syncs the whole workload makes, uncut.
	e := mount(t)
	got, stderr, err := helper(t, "commit", e.mnt)
	if err != nil || len(got["ok"]) != boltTxs {
		t.Fatalf("uncut run: %d commits, %v: %s", len(got["ok"]), err, stderr)
	}
	total := e.fs.Syncs()
	t.Logf("the workload makes %d syncs", total)
	for _, mode := range []cutfs.Mode{cutfs.DropUnsynced, cutfs.KeepRandom} {
		for seed := range boltSeeds {
			t.Run(fmt.Sprint(mode, "/seed", seed), func(t *testing.T) { boltCut(t, mode, uint64(seed), total) })
		}
	}
}

// boltCut cuts the power at a sync of the workload drawn from seed, and checks that
// bbolt opens after it and that every acknowledged transaction survives.
func boltCut(t *testing.T, mode cutfs.Mode, seed uint64, total int) {
	e := mount(t)
	rng := rand.New(rand.NewPCG(seed, 0))
	at := 1 + rng.IntN(total)
	if err := e.fs.CutAtSync(at, mode, rng); err != nil {
		t.Fatal(err)
	}
	got, stderr, err := helper(t, "commit", e.mnt)
	acked := got["ok"]
	select {
	case <-e.fs.CutDone():
	default:
		t.Fatalf("no cut at sync %d of %d: %d commits, %v: %s", at, total, len(acked), err, stderr)
	}
	stats, cerr := e.fs.CutResult()
	if cerr != nil {
		t.Fatalf("cut: %v", cerr)
	}
	t.Logf("cut at sync %d of %d after %d commits (%v: %s): %+v", at, total, len(acked), err, stderr, stats)
	e.remount()
	have, stderr, err := helper(t, "verify", e.mnt)
	if err != nil {
		t.Fatalf("after the cut, bbolt: %v: %s", err, stderr)
	}
	if len(have["bad"]) > 0 {
		t.Errorf("transactions with a wrong value: %v", have["bad"])
	}
	present := map[int]bool{}
	for _, i := range have["have"] {
		present[i] = true
	}
	for _, i := range acked {
		if !present[i] {
			t.Errorf("transaction %d was acknowledged before the cut and is lost", i)
		}
	}
	for i := range present {
		if i > len(acked) { // only the one in flight may be there unacknowledged
			t.Errorf("transaction %d is present, but was never started", i)
		}
	}
}
