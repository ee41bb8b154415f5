package ledger

import (
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger/store"
)

// The state dir in testdata/c9e8f1f-crash was left by devicehost c9e8f1f (the version
// with a write-ahead log) stopped without a clean shutdown: its ledger made ten Reserves
// (owners o1..o10 on GPU-0..GPU-9), released o1's, reowned o2's to o2b and cordoned
// GPU-11, and the files were copied as they were on disk then. The state file holds
// none of it; the log holds all thirteen batches, acknowledged. The log is cut after
// its last record (c9e8f1f's was 4 MiB of zeros past it).

// logSuffix names a log beside its state file, and logHeader is a log record's header
// size (store/migrate.go).
const (
	logSuffix = store.LogSuffix
	logHeader = 24
)

// fixtureDir copies the c9e8f1f state dir into a new temporary dir and returns the
// state file's path there.
func fixtureDir(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), DefaultFileName)
	for _, s := range []string{"", logSuffix} {
		writeFile(t, path+s, readFile(t, filepath.Join("testdata/c9e8f1f-crash", DefaultFileName+s)))
	}
	return path
}

// checkFixtureState checks that l holds every write the c9e8f1f agent acknowledged,
// and the live reservations of extra (device -> owner) made since.
func checkFixtureState(t *testing.T, l *Ledger, extra map[string]string) {
	t.Helper()
	rs := listAll(t, l)
	live := map[string]string{} // device -> owner
	released := 0
	for _, r := range rs {
		if r.State == device.ReservationReleased {
			released++
			if r.OwnerID != "o1" {
				t.Errorf("released %s of %s, want only o1's", r.ID, r.OwnerID)
			}
			continue
		}
		live[r.DeviceIDs[0]] = r.OwnerID
	}
	want := map[string]string{"GPU-1": "o2b"}
	for i := 2; i < 10; i++ {
		want["GPU-"+string(rune('0'+i))] = "o" + string(rune('0'+i+1))
	}
	want["GPU-9"] = "o10"
	maps.Copy(want, extra)
	if released != 1 || len(live) != len(want) {
		t.Errorf("%d live, %d released, want %d live and 1 released: %v", len(live), released, len(want), live)
	}
	for d, o := range want {
		if live[d] != o {
			t.Errorf("%s held by %q, want %q", d, live[d], o)
		}
	}
	if _, ok := l.Cordons()["GPU-11"]; !ok {
		t.Error("GPU-11 is not cordoned")
	}
}

// TestLogOfTheLastVersionIsReplayedOnceAndRemoved: every write the log version
// acknowledged before its crash is in the ledger after the upgrade, the log is gone,
// and a later open (after a clean stop, or a crash) reads the same from the file alone.
func TestLogOfTheLastVersionIsReplayedOnceAndRemoved(t *testing.T) {
	path := fixtureDir(t)
	// The state file alone holds none of it: the log is the only copy.
	alone := filepath.Join(t.TempDir(), DefaultFileName)
	writeFile(t, alone, readFile(t, path))
	if n := openWith(t, alone, Options{}).Counts().Total; n != 0 {
		t.Fatalf("the fixture's state file alone holds %d reservations, want 0", n)
	}

	l := openWith(t, path, Options{})
	checkFixtureState(t, l, nil)
	if _, err := os.Stat(path + logSuffix); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the log after the replay: %v, want it removed", err)
	}
	// A write after the upgrade, then a stop without Close: the file alone has it.
	r := reserve(t, l, "o11", "GPU-0")
	image := crashImage(t, path)
	again := openWith(t, image, Options{})
	checkFixtureState(t, again, map[string]string{"GPU-0": "o11"})
	if _, err := again.Get(r.ID); err != nil {
		t.Errorf("Get(%s) after a crash: %v", r.ID, err)
	}
}

// TestDamagedLogIsRefused: one bit changed in the log's first record is damage, not a
// torn write, since whole records of its generation follow it: Open refuses with the
// recovery text naming the log, and leaves both files as they were, rather than start
// without the twelve acknowledged batches after it.
func TestDamagedLogIsRefused(t *testing.T) {
	for _, at := range []struct {
		name string
		off  int
	}{{"payload", logHeader + 3}, {"checksum", 5}, {"length", 2}} {
		t.Run(at.name, func(t *testing.T) {
			path := fixtureDir(t)
			data := readFile(t, path+logSuffix)
			data[at.off] ^= 0x10
			writeFile(t, path+logSuffix, data)
			before := readFile(t, path)
			_, err := Open(path, Options{})
			var sfe *StateFileError
			if !errors.As(err, &sfe) || !errors.Is(err, ErrCorrupt) || sfe.Path != path+logSuffix ||
				!strings.Contains(err.Error(), "damaged") || !strings.Contains(err.Error(), "mv ") {
				t.Fatalf("Open = %v; want ErrCorrupt naming the log and how to recover", err)
			}
			if !slices.Equal(readFile(t, path), before) || !slices.Equal(readFile(t, path+logSuffix), data) {
				t.Error("a file changed")
			}
		})
	}
}

// TestTornLastRecordEndsTheLog: a last record that never reached the disk whole was
// never acknowledged: the log ends before it, the records before it are replayed.
func TestTornLastRecordEndsTheLog(t *testing.T) {
	path := fixtureDir(t)
	data := readFile(t, path+logSuffix)
	writeFile(t, path+logSuffix, data[:len(data)-10]) // the cordon's record, torn
	l := openWith(t, path, Options{})
	if n := l.Counts().Total; n != 10 {
		t.Errorf("%d reservations after the replay, want the 10 before the torn record", n)
	}
	if _, ok := l.Cordons()["GPU-11"]; ok {
		t.Error("GPU-11 cordoned: the torn record was replayed")
	}
}

// TestUndecodableRecordIsACorruptLog: a record whose checksum holds but whose
// operations do not decode is refused with an error naming the log, the state file
// left as it was.
func TestUndecodableRecordIsACorruptLog(t *testing.T) {
	path := fixtureDir(t)
	before := readFile(t, path)
	data := readFile(t, path+logSuffix)
	gen := binary.BigEndian.Uint64(data[8:16])
	bad := []byte{9, 1, 'x', 1, 'y'} // operation kind 9
	rec := binary.BigEndian.AppendUint32(nil, uint32(len(bad)))
	rec = binary.BigEndian.AppendUint32(rec, 0)
	rec = binary.BigEndian.AppendUint64(rec, gen)
	rec = binary.BigEndian.AppendUint64(rec, 1)
	rec = append(rec, bad...)
	binary.BigEndian.PutUint32(rec[4:8], crc32.Checksum(rec[8:], crc32.MakeTable(crc32.Castagnoli)))
	writeFile(t, path+logSuffix, rec)
	_, err := Open(path, Options{})
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), path+logSuffix) || !strings.Contains(err.Error(), "unknown operation 9") {
		t.Fatalf("Open = %v; want ErrCorrupt naming the log and the operation", err)
	}
	if !slices.Equal(readFile(t, path), before) {
		t.Error("the state file changed")
	}
}

// TestLeftoverLogOfADeletedStateFileIsNotReplayed: an operator who deletes the state
// file to start empty gets an empty ledger, not the writes a leftover log names, then
// or at any later start.
func TestLeftoverLogOfADeletedStateFileIsNotReplayed(t *testing.T) {
	path := fixtureDir(t)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	l := openWith(t, path, Options{})
	if got := l.Counts().Total; got != 0 {
		t.Fatalf("%d reservations in a new state file, want 0", got)
	}
	if _, err := os.Stat(path + logSuffix); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the leftover log: %v, want it removed", err)
	}
	if got := openWith(t, crashImage(t, path), Options{}).Counts().Total; got != 0 {
		t.Fatalf("%d reservations after a stop, want 0", got)
	}
}

// TestBackupAfterACleanStopRestoresExactly: the state file copied after a clean stop is
// the whole ledger: restored over a later state, the agent serves the backup's state,
// the trail's events included, nothing of what came after.
func TestBackupAfterACleanStopRestoresExactly(t *testing.T) {
	path := statePath(t)
	ctx := context.Background()
	l := openWith(t, path, Options{})
	a := reserve(t, l, "o1", "GPU-0")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	backup := readFile(t, path)

	l = openWith(t, path, Options{})
	release(t, l, a.ID, t0)
	b := reserve(t, l, "o2", "GPU-0")
	if _, err := l.Cordon(ctx, "GPU-1", device.Cordon{Reason: "test", Since: t0}); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	writeFile(t, path, backup) // the restore
	l = openWith(t, path, Options{})
	if r, err := l.Get(a.ID); err != nil || r.State != device.ReservationActive {
		t.Errorf("Get(%s) = %+v, %v; want the backup's live reservation", a.ID, r, err)
	}
	if _, err := l.Get(b.ID); !errors.Is(err, device.ErrNotFound) {
		t.Errorf("Get(%s) = %v; want not found: it came after the backup", b.ID, err)
	}
	if len(l.Cordons()) != 0 {
		t.Errorf("cordons %v, want none", l.Cordons())
	}
	ev, err := l.Events(ctx, device.EventFilter{})
	if err != nil || len(ev.Events) != 1 || ev.Events[0].Seq != 1 || ev.Events[0].Kind != device.EventReserve {
		t.Errorf("events = %+v, %v; want the backup's one reserve event", ev.Events, err)
	}
}
