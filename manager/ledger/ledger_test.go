package ledger

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger/store"
)

func TestReopenKeepsEverything(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a := reserve(t, l, "alloc-a", "GPU-1", "GPU-2")
	b := reserve(t, l, "alloc-b", "GPU-3")
	c := reserve(t, l, "alloc-c", "GPU-4")
	release(t, l, b.ID, t0.Add(time.Minute))
	release(t, l, c.ID, t0.Add(2*time.Minute))
	if err := l.CleanupDone(ctx, c.ID); err != nil {
		t.Fatal(err)
	}
	if err := l.SaveReattach(ctx, "nvidia-example", []byte(`{"pid":42}`)); err != nil {
		t.Fatal(err)
	}
	wantList, wantHolders, wantCounts := listAll(t, l), l.Holders(), l.Counts()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	l = openLedger(t, path)
	if got := listAll(t, l); !reflect.DeepEqual(got, wantList) {
		t.Errorf("List after reopen =\n%+v\nwant\n%+v", got, wantList)
	}
	if got := l.Holders(); !reflect.DeepEqual(got, wantHolders) {
		t.Errorf("Holders after reopen = %v, want %v", got, wantHolders)
	}
	if got, want := l.Counts(), (Counts{Total: 3, Live: 1, Released: 2, CleanupPending: 1}); got != want || got != wantCounts {
		t.Errorf("Counts after reopen = %+v, want %+v (before close %+v)", got, want, wantCounts)
	}
	if got, err := l.Get(a.ID); err != nil || !reflect.DeepEqual(got, a) {
		t.Errorf("Get(%s) after reopen = %+v, %v; want %+v", a.ID, got, err, a)
	}
	data, ok, err := l.LoadReattach("nvidia-example")
	if err != nil || !ok || string(data) != `{"pid":42}` {
		t.Errorf("LoadReattach after reopen = %q, %v, %v", data, ok, err)
	}
	// The reopened ledger enforces what it loaded.
	if _, _, err := l.Reserve(ctx, res("alloc-x", "GPU-1"), nil, nil); !errors.Is(err, device.ErrDeviceHeld) {
		t.Errorf("Reserve of a device held before the reopen: err = %v, want ErrDeviceHeld", err)
	}
}

// mutateFile applies fn to the bbolt file at path directly, as a damaged disk or another
// program might.
func mutateFile(t *testing.T, path string, fn func(tx *bolt.Tx) error) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(fn); err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
}

// ledgerFile makes a state file holding one live reservation of owner "a" on GPU-1 and
// returns its ID.
func ledgerFile(t *testing.T, path string) string {
	t.Helper()
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := reserve(t, l, "a", "GPU-1")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return r.ID
}

// ledgerFileN makes a state file holding n live reservations.
func ledgerFileN(t *testing.T, path string, n int) {
	t.Helper()
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		reserve(t, l, fmt.Sprint("owner-", i), fmt.Sprint("GPU-", i))
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
}

// leafPage returns the number of a bbolt leaf page in use in the file at path.
func leafPage(t *testing.T, path string) int {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: time.Second, PreLoadFreelist: true})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	page := -1
	err = db.View(func(tx *bolt.Tx) error {
		for id := 2; page < 0; id++ {
			info, err := tx.Page(id)
			if err != nil {
				return err
			}
			if info == nil {
				return errors.New("no leaf page in use")
			}
			if info.Type == "leaf" {
				page = id
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return page
}

func truncateFile(t *testing.T, path string, size int) {
	t.Helper()
	if err := os.Truncate(path, int64(size)); err != nil {
		t.Fatal(err)
	}
}

// TestOpenRecoversTornMetaPage: bbolt writes its two meta pages in turn, so a crash
// that tears one leaves the other, one transaction older, and the file is not corrupt.
// A torn meta page must not be refused (it is what a crash during a commit leaves).
func TestOpenRecoversTornMetaPage(t *testing.T) {
	for _, page := range []int{0, 1} {
		t.Run(fmt.Sprint("meta page ", page), func(t *testing.T) {
			path := statePath(t)
			ledgerFileN(t, path, 20)
			b := readFile(t, path)
			// The meta's checksum: after the 16-byte page header, 64 bytes of meta fields.
			b[page*os.Getpagesize()+16+64] ^= 0xff
			writeFile(t, path, b)
			l := openLedger(t, path)
			if n := l.Counts().Live; n != 20 && n != 19 {
				t.Errorf("after a torn meta page, %d live reservations, want the last transaction's 20 or the one before's 19", n)
			}
		})
	}
}

func putSchema(version uint32) func(tx *bolt.Tx) error {
	return func(tx *bolt.Tx) error {
		var v [4]byte
		binary.BigEndian.PutUint32(v[:], version)
		return tx.Bucket(store.BucketMeta).Put(store.KeySchemaVersion, v[:])
	}
}

func TestOpenRefusesDamagedFiles(t *testing.T) {
	randomBytes := func(n int) []byte {
		b := make([]byte, n)
		_, _ = rand.Read(b)
		return b
	}
	tests := []struct {
		name string
		// make writes the damaged file at path; it returns strings the error must name
		// besides the path.
		make     func(t *testing.T, path string) []string
		wantKind error
	}{{
		name: "garbage bytes, short",
		make: func(t *testing.T, path string) []string {
			writeFile(t, path, []byte("this is not a database\n"))
			return []string{"not a readable bbolt database", "move it aside", "held devices will be forgotten"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "garbage bytes, one page",
		make: func(t *testing.T, path string) []string {
			writeFile(t, path, randomBytes(5000))
			return []string{"not a readable bbolt database", "move it aside"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "garbage bytes, many pages",
		make: func(t *testing.T, path string) []string {
			writeFile(t, path, randomBytes(64<<10))
			return []string{"not a readable bbolt database", "move it aside"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "record with a bad checksum",
		make: func(t *testing.T, path string) []string {
			id := ledgerFile(t, path)
			mutateFile(t, path, func(tx *bolt.Tx) error {
				b := tx.Bucket(bucketReservations)
				v := bytes.Clone(b.Get([]byte(id)))
				v[len(v)/2] ^= 0x20 // one flipped bit inside the JSON
				return b.Put([]byte(id), v)
			})
			return []string{`reservation record "` + id + `"`, "checksum mismatch", "move it aside"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "record cut short",
		make: func(t *testing.T, path string) []string {
			id := ledgerFile(t, path)
			mutateFile(t, path, func(tx *bolt.Tx) error {
				return tx.Bucket(bucketReservations).Put([]byte(id), []byte{1, 2})
			})
			return []string{`reservation record "` + id + `"`, "shorter than its checksum"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "record with a valid checksum but no devices",
		make: func(t *testing.T, path string) []string {
			ledgerFile(t, path)
			mutateFile(t, path, func(tx *bolt.Tx) error {
				return tx.Bucket(bucketReservations).Put([]byte("res-x"),
					seal([]byte(`{"id":"res-x","owner_id":"o","state":"active"}`)))
			})
			return []string{`reservation record "res-x"`, "no device IDs"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "record stored under another ID",
		make: func(t *testing.T, path string) []string {
			id := ledgerFile(t, path)
			mutateFile(t, path, func(tx *bolt.Tx) error {
				b := tx.Bucket(bucketReservations)
				return b.Put([]byte("res-other"), bytes.Clone(b.Get([]byte(id))))
			})
			return []string{`reservation record "res-other"`, "but its ID is"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "two live reservations hold one device",
		make: func(t *testing.T, path string) []string {
			id := ledgerFile(t, path)
			mutateFile(t, path, func(tx *bolt.Tx) error {
				r := res("b", "GPU-1")
				r.ID, r.State = "res-zz", device.ReservationActive
				v, err := encodeReservation(&r)
				if err != nil {
					return err
				}
				return tx.Bucket(bucketReservations).Put([]byte(r.ID), v)
			})
			return []string{id, "res-zz", "both hold device GPU-1"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "file cut short",
		make: func(t *testing.T, path string) []string {
			ledgerFileN(t, path, 50)
			truncateFile(t, path, 3*os.Getpagesize())
			return []string{"bbolt cannot read it", "move it aside"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "data page overwritten",
		make: func(t *testing.T, path string) []string {
			ledgerFileN(t, path, 50)
			page := leafPage(t, path)
			b := readFile(t, path)
			ps := os.Getpagesize()
			for i := page * ps; i < (page+1)*ps; i++ {
				b[i] = byte(i * 7)
			}
			writeFile(t, path, b)
			return []string{"bbolt consistency check failed", "move it aside"}
		},
		wantKind: ErrCorrupt,
	}, {
		name: "newer schema version",
		make: func(t *testing.T, path string) []string {
			ledgerFile(t, path)
			mutateFile(t, path, putSchema(7))
			return []string{"schema version 7 is newer than this devicehost understands (1)",
				"run a newer devicehost, or move the file aside to start with an empty ledger (held devices will be forgotten)"}
		},
		wantKind: ErrSchemaVersion,
	}, {
		name: "schema version zero",
		make: func(t *testing.T, path string) []string {
			ledgerFile(t, path)
			mutateFile(t, path, putSchema(0))
			return []string{"schema version 0 is not one devicehost ever wrote", "move it aside"}
		},
		wantKind: ErrSchemaVersion,
	}, {
		name: "another program's bbolt file",
		make: func(t *testing.T, path string) []string {
			mutateFile(t, path, func(tx *bolt.Tx) error {
				_, err := tx.CreateBucket([]byte("kv"))
				return err
			})
			return []string{"not a devicehost state file"}
		},
		wantKind: ErrCorrupt,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := statePath(t)
			wantIn := tt.make(t, path)
			before := readFile(t, path)

			l, err := Open(path, Options{})
			if err == nil {
				l.Close()
				t.Fatal("Open succeeded, want an error")
			}
			if !errors.Is(err, tt.wantKind) {
				t.Errorf("Open error %q does not match %v", err, tt.wantKind)
			}
			var sfe *StateFileError
			if !errors.As(err, &sfe) {
				t.Errorf("Open error %T is not a *StateFileError", err)
			}
			for _, s := range append(wantIn, path) {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("Open error %q does not contain %q", err, s)
				}
			}
			if after := readFile(t, path); !bytes.Equal(before, after) {
				t.Errorf("Open changed the refused file (%d bytes before, %d after)", len(before), len(after))
			}
			// The refused file is not left locked: opening it again says the same.
			if _, again := Open(path, Options{LockTimeout: 100 * time.Millisecond}); !errors.Is(again, tt.wantKind) {
				t.Errorf("second Open: err = %v, want %v again (not a lock left behind)", again, tt.wantKind)
			}
		})
	}
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestOpenLockedByAnotherOpen(t *testing.T) {
	path := statePath(t)
	first := openLedger(t, path)
	reserve(t, first, "a", "GPU-1")

	_, err := Open(path, Options{LockTimeout: 100 * time.Millisecond})
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("second Open: err = %v, want ErrLocked", err)
	}
	for _, s := range []string{path, "in use by another devicehost", "-state-dir"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("second Open error %q does not contain %q", err, s)
		}
	}
	// The first keeps working.
	reserve(t, first, "b", "GPU-2")
}

func TestOpenCreatesDirAndFile(t *testing.T) {
	path := t.TempDir() + "/state/sub/" + DefaultFileName
	l := openLedger(t, path)
	if got := l.Counts(); got != (Counts{}) {
		t.Errorf("Counts of a new ledger = %+v, want zero", got)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("state file: %v, %v; want mode 0600", fi, err)
	}
}

func TestClosedLedgerRefusesWrites(t *testing.T) {
	l, err := Open(statePath(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := reserve(t, l, "a", "GPU-1")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	ctx := context.Background()
	checks := map[string]error{}
	_, _, checks["Reserve"] = l.Reserve(ctx, res("b", "GPU-2"), nil, nil)
	_, _, checks["Release"] = l.Release(ctx, device.ReleaseRequest{ReservationID: r.ID}, time.Time{})
	checks["SaveReattach"] = l.SaveReattach(ctx, "p", nil)
	// Reads of the state file itself (l.read: bbolt's ErrDatabaseNotOpen) say so too.
	_, _, checks["LoadReattach"] = l.LoadReattach("p")
	_, checks["ReattachPlugins"] = l.ReattachPlugins()
	_, checks["Events"] = l.Events(ctx, device.EventFilter{})
	for name, err := range checks {
		if !errors.Is(err, ErrClosed) || !errors.Is(err, device.ErrShuttingDown) {
			t.Errorf("%s after Close: err = %v, want ErrClosed and device.ErrShuttingDown", name, err)
		}
	}
	if got, err := l.Get(r.ID); err != nil || got.ID != r.ID {
		t.Errorf("Get after Close = %v, %v; want the reservation from memory", got, err)
	}
}

func TestReattach(t *testing.T) {
	path := statePath(t)
	l := openLedger(t, path)
	ctx := context.Background()
	if _, ok, err := l.LoadReattach("p1"); ok || err != nil {
		t.Fatalf("LoadReattach of nothing = %v, %v; want false, nil", ok, err)
	}
	for _, p := range []string{"p2", "p1"} {
		if err := l.SaveReattach(ctx, p, []byte("data-"+p)); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.SaveReattach(ctx, "p1", []byte("newer")); err != nil {
		t.Fatal(err)
	}
	if err := l.SaveReattach(ctx, "empty", []byte{}); err != nil {
		t.Fatal(err)
	}
	if got, err := l.ReattachPlugins(); err != nil || !reflect.DeepEqual(got, []string{"empty", "p1", "p2"}) {
		t.Errorf("ReattachPlugins = %v, %v", got, err)
	}
	for _, tt := range []struct {
		plugin string
		want   string
		ok     bool
	}{{"p1", "newer", true}, {"p2", "data-p2", true}, {"empty", "", true}, {"p3", "", false}} {
		got, ok, err := l.LoadReattach(tt.plugin)
		if err != nil || ok != tt.ok || string(got) != tt.want {
			t.Errorf("LoadReattach(%s) = %q, %v, %v; want %q, %v", tt.plugin, got, ok, err, tt.want, tt.ok)
		}
	}
	if err := l.DeleteReattach(ctx, "p2"); err != nil {
		t.Fatal(err)
	}
	if err := l.DeleteReattach(ctx, "never-saved"); err != nil {
		t.Errorf("DeleteReattach of nothing: %v", err)
	}
	if _, ok, _ := l.LoadReattach("p2"); ok {
		t.Error("p2 still there after DeleteReattach")
	}
	if err := l.SaveReattach(ctx, "big", make([]byte, maxReattachSize+1)); !errors.Is(err, device.ErrInvalidRequest) {
		t.Errorf("SaveReattach of %d bytes: err = %v, want ErrInvalidRequest", maxReattachSize+1, err)
	}
	if err := l.SaveReattach(ctx, "", nil); !errors.Is(err, errInternal) {
		t.Errorf("SaveReattach without a plugin name: err = %v, want an internal error (no key to store it under)", err)
	}
}

func TestLoadReattachNamesCorruptData(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.SaveReattach(context.Background(), "p1", []byte("reattach config")); err != nil {
		t.Fatal(err)
	}
	l.Close()
	mutateFile(t, path, func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketReattach)
		v := bytes.Clone(b.Get([]byte("p1")))
		v[len(v)-1] ^= 1
		return b.Put([]byte("p1"), v)
	})
	l = openLedger(t, path) // reattach data is not the ledger: the agent starts
	_, ok, err := l.LoadReattach("p1")
	if !errors.Is(err, ErrCorrupt) || ok || !strings.Contains(err.Error(), `plugin "p1"`) {
		t.Errorf("LoadReattach of damaged data = %v, %v; want ErrCorrupt naming plugin p1", ok, err)
	}
}

// A Reserve's owner labels are the reservation's for good: its holder carries them,
// they survive a reopen of the file and the release (the packed form), and a Reown
// drops them, since they named the old owner's workload.
func TestOwnerLabelsAreKept(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	labels := device.OwnerLabels{Pod: "trainer-0,trainer-1", Namespace: "ml"}
	r := res("k8s-claim/ml/gpus/0d1f", "GPU-1")
	r.OwnerLabels = labels
	a, _, err := l.Reserve(ctx, r, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	reserve(t, l, "k8s-claim/ml/other/7e2a", "GPU-2")
	if h := l.Holders(); h["GPU-1"].OwnerLabels != labels || h["GPU-2"].OwnerLabels != (device.OwnerLabels{}) {
		t.Errorf("holders %+v; want GPU-1's with %+v, GPU-2's with none", h, labels)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l = openLedger(t, path)
	if got, err := l.Get(a.ID); err != nil || got.OwnerLabels != labels {
		t.Errorf("Get after reopen: %+v, %v; want owner labels %+v", got.OwnerLabels, err, labels)
	}
	if h := l.Holders(); h["GPU-1"].OwnerLabels != labels {
		t.Errorf("GPU-1's holder after reopen %+v; want owner labels %+v", h["GPU-1"], labels)
	}
	release(t, l, a.ID, t0.Add(time.Minute))
	if got, err := l.Get(a.ID); err != nil || got.OwnerLabels != labels {
		t.Errorf("Get after release: %+v, %v; want owner labels %+v", got.OwnerLabels, err, labels)
	}
	c, _, err := l.Reserve(ctx, func() device.Reservation {
		r := res("k8s-claim/ml/third/9a9a", "GPU-3")
		r.OwnerLabels = labels
		return r
	}(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := l.Reown(ctx, device.ReownRequest{ReservationID: c.ID, OwnerID: c.OwnerID, NewOwnerID: "k8s/ml/trainer-2/main"})
	if err != nil || got.OwnerLabels != (device.OwnerLabels{}) || l.Holders()["GPU-3"].OwnerLabels != (device.OwnerLabels{}) {
		t.Errorf("after Reown: %+v, holder %+v, %v; want no owner labels", got.OwnerLabels, l.Holders()["GPU-3"], err)
	}
}
