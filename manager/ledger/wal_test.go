package ledger

import (
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"os"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/devicehost/devicehost/device"
)

// stateFileAlone is crashImage without the log: what the state file alone holds.
func stateFileAlone(t *testing.T, path string) string {
	t.Helper()
	image := crashImage(t, path)
	if err := os.Remove(image + logSuffix); err != nil {
		t.Fatal(err)
	}
	return image
}

// TestAcknowledgedWriteIsInTheLogUntilACheckpoint: a Reserve is durable once its
// record is in the log, not yet in the state file; a stop then loses nothing (Open
// replays the log), and the checkpoint checkpointEvery later puts it in the file.
func TestAcknowledgedWriteIsInTheLogUntilACheckpoint(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		path := statePath(t)
		l := openWith(t, path, Options{MaxEvents: -1})
		r := reserve(t, l, "o1", "GPU-0")
		synctest.Wait()

		alone := openWith(t, stateFileAlone(t, path), Options{MaxEvents: -1})
		if _, err := alone.Get(r.ID); err == nil {
			t.Fatalf("the state file alone holds %s before a checkpoint: the write did not go through the log", r.ID)
		}
		logs, logger := newLogCapture()
		crashed := openWith(t, crashImage(t, path), Options{MaxEvents: -1, Logger: logger})
		if got, err := crashed.Get(r.ID); err != nil || !slices.Equal(got.DeviceIDs, r.DeviceIDs) {
			t.Fatalf("after a stop: Get(%s) = %+v, %v; want it replayed from the log", r.ID, got, err)
		}
		if got := logs.lines(t, "the last stop was not clean", true); len(got) != 1 || got[0]["records"] != float64(1) {
			t.Errorf("logged %v; want the replay of 1 record said", got)
		}

		time.Sleep(checkpointEvery)
		synctest.Wait()
		alone = openWith(t, stateFileAlone(t, path), Options{MaxEvents: -1})
		if _, err := alone.Get(r.ID); err != nil {
			t.Fatalf("the state file alone after the checkpoint: Get(%s): %v; want it there", r.ID, err)
		}
	})
}

// TestCloseLeavesTheStateFileWhole: after Close the state file alone holds every write,
// so an agent that reads no log (an older devicehost after a rollback) loses nothing.
func TestCloseLeavesTheStateFileWhole(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	a := reserve(t, l, "o1", "GPU-0")
	b := reserve(t, l, "o2", "GPU-1")
	release(t, l, a.ID, t0)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path + logSuffix); err != nil {
		t.Fatal(err)
	}
	re := openWith(t, path, Options{MaxEvents: -1})
	if got, err := re.Get(a.ID); err != nil || got.ReleasedAt.IsZero() {
		t.Errorf("Get(%s) = %+v, %v; want it released", a.ID, got, err)
	}
	if got, err := re.Get(b.ID); err != nil || !got.ReleasedAt.IsZero() {
		t.Errorf("Get(%s) = %+v, %v; want it live", b.ID, got, err)
	}
}

// TestStorageFailureKeepsTheBatchesBeforeIt: a request failing on storage rolls back
// the transaction that also holds the batches acknowledged since the last checkpoint;
// they are made again in the next one, and the failed request's write is in neither.
func TestStorageFailureKeepsTheBatchesBeforeIt(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	ctx := context.Background()
	a := reserve(t, l, "o1", "GPU-0")
	_, err := l.submit(ctx, func(w *txn) (any, error) {
		if err := w.put(bucketReattach, []byte("ghost"), seal([]byte("x"))); err != nil {
			return nil, &storageError{err}
		}
		return nil, &storageError{errors.New("disk on fire")}
	})
	if err == nil || !strings.Contains(err.Error(), "disk on fire") {
		t.Fatalf("failing request: err = %v, want the storage error", err)
	}
	b := reserve(t, l, "o2", "GPU-1")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	re := openWith(t, path, Options{MaxEvents: -1})
	for _, id := range []string{a.ID, b.ID} {
		if _, err := re.Get(id); err != nil {
			t.Errorf("after the failure and a reopen: Get(%s): %v; want it kept", id, err)
		}
	}
	if _, ok, err := re.LoadReattach("ghost"); ok || err != nil {
		t.Errorf("the failed request's write is in the file (err %v)", err)
	}
}

// TestTornLastRecordEndsTheLog: a record cut short by a crash (its fdatasync never
// returned, so its batch was never acknowledged) is left out; those before it are
// replayed.
func TestTornLastRecordEndsTheLog(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	a := reserve(t, l, "o1", "GPU-0")
	off := l.wal.off
	b := reserve(t, l, "o2", "GPU-1")
	end := l.wal.off
	image := crashImage(t, path)
	data := readFile(t, image+logSuffix)
	for i := off + (end-off)/2; i < end; i++ {
		data[i] = 0 // the second half of b's record never reached the disk
	}
	writeFile(t, image+logSuffix, data)
	re := openWith(t, image, Options{MaxEvents: -1})
	if _, err := re.Get(a.ID); err != nil {
		t.Errorf("Get(%s): %v; want the whole record replayed", a.ID, err)
	}
	if _, err := re.Get(b.ID); err == nil {
		t.Errorf("Get(%s) found the torn record's reservation", b.ID)
	}
}

// TestUndecodableRecordIsACorruptLog: a record whose checksum holds but whose
// operations do not decode is refused with an error naming the log, the state file
// left as it was.
func TestUndecodableRecordIsACorruptLog(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	reserve(t, l, "o1", "GPU-0")
	image := crashImage(t, path)
	before := readFile(t, image)
	data := readFile(t, image+logSuffix)
	gen := binary.BigEndian.Uint64(data[8:16])
	bad := []byte{9, 1, 'x', 1, 'y'} // operation kind 9
	rec := binary.BigEndian.AppendUint32(nil, uint32(len(bad)))
	rec = binary.BigEndian.AppendUint32(rec, 0)
	rec = binary.BigEndian.AppendUint64(rec, gen)
	rec = binary.BigEndian.AppendUint64(rec, 1)
	rec = append(rec, bad...)
	binary.BigEndian.PutUint32(rec[4:8], crc32.Checksum(rec[8:], castagnoli))
	copy(data, rec)
	writeFile(t, image+logSuffix, data)
	_, err := Open(image, Options{MaxEvents: -1})
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), image+logSuffix) || !strings.Contains(err.Error(), "unknown operation 9") {
		t.Fatalf("Open = %v; want ErrCorrupt naming the log and the operation", err)
	}
	if !slices.Equal(readFile(t, image), before) {
		t.Error("the state file changed")
	}
}

// TestLeftoverLogOfADeletedStateFileIsNotReplayed: an operator who deletes the state
// file to start empty gets an empty ledger, not the writes a leftover log names.
func TestLeftoverLogOfADeletedStateFileIsNotReplayed(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	reserve(t, l, "o1", "GPU-0")
	image := crashImage(t, path)
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	re := openWith(t, image, Options{MaxEvents: -1})
	if got := re.Counts().Total; got != 0 {
		t.Fatalf("%d reservations in a new state file, want 0", got)
	}
	again := openWith(t, crashImage(t, image), Options{MaxEvents: -1}) // and after a stop of that one
	if got := again.Counts().Total; got != 0 {
		t.Fatalf("%d reservations after a stop, want 0: the old log was replayed", got)
	}
}

// TestReadLogSkipsWhatTheFileHolds: the log is read from offset 0 while records are
// whole, of one generation, one seq apart; records up to the file's log_applied are
// left out, and a generation other than its own is all after it.
func TestReadLogSkipsWhatTheFileHolds(t *testing.T) {
	op := func(k string) []logOp { return []logOp{{bucket: []byte("b"), key: []byte(k), val: []byte("v")}} }
	rec := func(gen, seq uint64, k string) []byte {
		o := op(k)
		return encodeRecord(nil, gen, seq, o, payloadSize(o))
	}
	keys := func(ps [][]byte) []string {
		var out []string
		for _, p := range ps {
			ops, err := decodeOps(p)
			if err != nil {
				t.Fatal(err)
			}
			for _, o := range ops {
				out = append(out, string(o.key))
			}
		}
		return out
	}
	log := slices.Concat(rec(7, 1, "a"), rec(7, 2, "b"), rec(7, 3, "c"))
	stale := slices.Concat(rec(9, 1, "x"), rec(7, 2, "b"), rec(7, 3, "c")) // gen 9 written over gen 7's first
	gap := slices.Concat(rec(7, 1, "a"), rec(7, 3, "c"))
	for _, tc := range []struct {
		name    string
		data    []byte
		applied logPos
		want    []string
		pos     logPos
	}{
		{"nothing applied", log, logPos{}, []string{"a", "b", "c"}, logPos{7, 3}},
		{"applied to seq 2", log, logPos{7, 2}, []string{"c"}, logPos{7, 3}},
		{"all applied", log, logPos{7, 3}, nil, logPos{7, 3}},
		{"another generation applied", log, logPos{5, 9}, []string{"a", "b", "c"}, logPos{7, 3}},
		{"older generation behind a new one", stale, logPos{7, 3}, []string{"x"}, logPos{9, 1}},
		{"a seq gap ends it", gap, logPos{}, []string{"a"}, logPos{7, 1}},
		{"zeroed header", make([]byte, 100), logPos{}, nil, logPos{}},
	} {
		got, pos := readLog(tc.data, tc.applied)
		if !slices.Equal(keys(got), tc.want) || pos != tc.pos {
			t.Errorf("%s: records %q to %v, want %q to %v", tc.name, keys(got), pos, tc.want, tc.pos)
		}
	}
}

// TestBatchTooBigForTheLogIsCheckpointed: a batch whose record does not fit in the log
// is made durable by a checkpoint, in the state file itself.
func TestBatchTooBigForTheLogIsCheckpointed(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	big := make([]byte, logSize)
	_, err := l.submit(context.Background(), func(w *txn) (any, error) {
		if err := w.put(bucketReattach, []byte("big"), seal(big)); err != nil {
			return nil, &storageError{err}
		}
		return nil, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	alone := openWith(t, stateFileAlone(t, path), Options{MaxEvents: -1})
	if got, ok, err := alone.LoadReattach("big"); !ok || err != nil || len(got) != len(big) {
		t.Fatalf("the state file alone: %d bytes, %v, %v; want the big write in it", len(got), ok, err)
	}
}

// TestFailedLogWriteFallsBackToACheckpoint: a batch whose log record cannot be written
// is made durable by a checkpoint, and so is every later one until the log works
// again; nothing acknowledged is lost.
func TestFailedLogWriteFallsBackToACheckpoint(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	a := reserve(t, l, "o1", "GPU-0")
	good := l.wal.f
	ro, err := os.Open(good.Name()) // writes to it fail
	if err != nil {
		t.Fatal(err)
	}
	l.wal.f = ro
	b := reserve(t, l, "o2", "GPU-1")
	c := reserve(t, l, "o3", "GPU-2")
	alone := openWith(t, stateFileAlone(t, path), Options{MaxEvents: -1})
	for _, id := range []string{a.ID, b.ID, c.ID} {
		if _, err := alone.Get(id); err != nil {
			t.Errorf("the state file alone: Get(%s): %v; want every write acknowledged in it", id, err)
		}
	}
	l.wal.f = good
	_ = ro.Close()
	d := reserve(t, l, "o4", "GPU-3")
	if _, err := openWith(t, stateFileAlone(t, path), Options{MaxEvents: -1}).Get(d.ID); err == nil {
		t.Errorf("%s in the state file alone at once: the log is not used again after a checkpoint", d.ID)
	}
	if _, err := openWith(t, crashImage(t, path), Options{MaxEvents: -1}).Get(d.ID); err != nil {
		t.Errorf("after a stop: Get(%s): %v", d.ID, err)
	}
}

// TestEventsReadWaitsUnderItsCallersContext: Events reads the file on the writer's
// turn (the file alone lacks what the log holds); a caller whose context ends while the
// writer is busy gets its context's error, not a wait for the writer.
func TestEventsReadWaitsUnderItsCallersContext(t *testing.T) {
	l := openWith(t, statePath(t), Options{})
	release := holdLeader(t, l)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := l.Events(ctx, device.EventFilter{})
	release()
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Events with its context ended while the writer is busy: %v, want context.Canceled", err)
	}
	if _, err := l.Events(context.Background(), device.EventFilter{}); err != nil {
		t.Errorf("Events once the writer is free: %v", err)
	}
}

// TestCloseAfterAStorageFailureLeavesTheFileWhole: a storage failure drops the open
// transaction; Close's last checkpoint still puts the batches logged before it into the
// state file.
func TestCloseAfterAStorageFailureLeavesTheFileWhole(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	a := reserve(t, l, "o1", "GPU-0")
	_, err := l.submit(context.Background(), func(w *txn) (any, error) {
		return nil, &storageError{errors.New("disk on fire")}
	})
	if err == nil {
		t.Fatal("the failing request succeeded")
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path + logSuffix); err != nil {
		t.Fatal(err)
	}
	if _, err := openWith(t, path, Options{MaxEvents: -1}).Get(a.ID); err != nil {
		t.Errorf("the state file alone after Close: Get(%s): %v; want it there", a.ID, err)
	}
}
