package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"

	bolt "go.etcd.io/bbolt"
)

// The write-ahead log of devicehost c9e8f1f: from that version to this one, a batch
// was durable once its record was in the log file beside the state file
// (<state file>-wal), and the state file got the batches at checkpoints. This version
// writes no log: each batch is a bbolt commit. A state dir that version left after a
// stop that was not clean holds acknowledged writes only in its log; Open applies them
// once (replayLog), in one commit, then removes the log, durably, so that it can never
// be replayed over later state.
//
// The log file's records start at offset 0, each
//
//	length u32 | crc32c u32 | generation u64 | seq u64 | payload (length bytes)
//
// big-endian, the checksum over generation, seq and payload. The log is the records from
// offset 0 that read whole, of the first record's generation, with seqs one apart. A
// checkpoint stored in the state file (meta key log_applied) the generation and seq of
// the last record written; the next record went at offset 0 in a new random generation.
// Replay applies the records after the stored one: all of a generation other than the
// stored one's, those of the stored one's generation with higher seqs. A record torn by
// a crash fails its checksum and ends the log: its batch was never acknowledged, since
// its fdatasync did not return; it was the last one written, so a record of its
// generation that reads whole after it means damage, not a tear, and Open refuses the
// log rather than drop the acknowledged writes after it.
//
// A payload is its operations, each
//
//	kind byte (opPut or opDelete) | bucket | key | value (opPut only)
//
// each of bucket, key and value a uvarint length and its bytes.

// logSize is the most of a log file that was ever written.
const logSize = 4 << 20

const logHeader = 24

const (
	opPut    = 1
	opDelete = 2
)

// LogSuffix names the log file: the state file's path and this.
const LogSuffix = "-wal"

// logOp is one write of a batch: key of bucket set to val, or deleted.
type logOp struct {
	del              bool
	bucket, key, val []byte
}

// logPos names a record of the log: its generation and seq.
type logPos struct{ gen, seq uint64 }

func (p logPos) encode() []byte {
	return binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64(nil, p.gen), p.seq)
}

// readLog returns the payloads of the log in data (a log file's first logSize bytes at
// most) after the record applied, oldest first, and the position of the last: the
// records from offset 0 that read whole, of the first one's generation, with seqs one
// apart, less those of applied's generation up to its seq. Where the records end at one
// that does not read whole, yet a whole record of the same generation with a later seq
// follows it, the log is damaged, not torn: damaged names the record.
func readLog(data []byte, applied logPos) (payloads [][]byte, last logPos, damaged error) {
	var gen, seq uint64
	n0 := 0 // records read, applied or not
	off := 0
	for ; len(data)-off >= logHeader; off += logHeader + int(binary.BigEndian.Uint32(data[off:])) {
		g, s, ok := wholeRecord(data, off)
		if !ok || n0 > 0 && (g != gen || s != seq+1) || n0 == 0 && s == 0 {
			break // torn, another generation's, or a zeroed header's (records start at seq 1)
		}
		gen, seq = g, s
		n0++
		if g != applied.gen || s > applied.seq {
			n := int(binary.BigEndian.Uint32(data[off:]))
			payloads = append(payloads, data[off+logHeader:off+logHeader+n])
		}
	}
	if len(data)-off >= logHeader && (n0 > 0 || binary.BigEndian.Uint64(data[off+8:]) != 0) {
		want := gen // the generation a later record of this log would have
		if n0 == 0 {
			want = binary.BigEndian.Uint64(data[off+8:])
		}
		for o := off; len(data)-o >= logHeader; o++ {
			if binary.BigEndian.Uint64(data[o+8:]) != want {
				continue
			}
			if g, s, ok := wholeRecord(data, o); ok && g == want && s > seq {
				return nil, applied, fmt.Errorf("record %d (at byte %d) does not read whole, yet record %d of its generation does after it: "+
					"the log is damaged, and the acknowledged writes after it would be lost", n0+1, off, s)
			}
		}
	}
	if len(payloads) == 0 {
		return nil, applied, nil
	}
	return payloads, logPos{gen, seq}, nil
}

// wholeRecord reads the header of the record at off in data: its generation and seq,
// and whether the record fits in data and its checksum matches.
func wholeRecord(data []byte, off int) (gen, seq uint64, ok bool) {
	h := data[off : off+logHeader]
	n := int(binary.BigEndian.Uint32(h[0:4]))
	if n > len(data)-off-logHeader {
		return 0, 0, false
	}
	if binary.BigEndian.Uint32(h[4:8]) != crc32.Checksum(data[off+8:off+logHeader+n], castagnoli) {
		return 0, 0, false
	}
	return binary.BigEndian.Uint64(h[8:16]), binary.BigEndian.Uint64(h[16:24]), true
}

// decodeOps decodes a record's payload.
func decodeOps(p []byte) ([]logOp, error) {
	var ops []logOp
	field := func() ([]byte, error) {
		n, k := binary.Uvarint(p)
		if k <= 0 || n > uint64(len(p)-k) {
			return nil, errors.New("a length past the record's end")
		}
		b := p[k : k+int(n)]
		p = p[k+int(n):]
		return b, nil
	}
	for len(p) > 0 {
		kind := p[0]
		p = p[1:]
		if kind != opPut && kind != opDelete {
			return nil, fmt.Errorf("unknown operation %d", kind)
		}
		op := logOp{del: kind == opDelete}
		var err error
		if op.bucket, err = field(); err == nil {
			op.key, err = field()
		}
		if err == nil && !op.del {
			op.val, err = field()
		}
		if err != nil {
			return nil, err
		}
		if len(op.bucket) == 0 || len(op.key) == 0 {
			return nil, errors.New("an operation without a bucket or key")
		}
		ops = append(ops, op)
	}
	return ops, nil
}

// applyOps makes ops in tx, in order.
func applyOps(tx *bolt.Tx, ops []logOp) error {
	for _, op := range ops {
		if op.del {
			if b := tx.Bucket(op.bucket); b != nil {
				if err := b.Delete(op.key); err != nil {
					return fmt.Errorf("delete %q from %s: %w", op.key, op.bucket, err)
				}
			}
			continue
		}
		b, err := tx.CreateBucketIfNotExists(op.bucket)
		if err != nil {
			return fmt.Errorf("bucket %s: %w", op.bucket, err)
		}
		if err := b.Put(op.key, op.val); err != nil {
			return fmt.Errorf("put %q in %s: %w", op.key, op.bucket, err)
		}
	}
	return nil
}

// keyLogApplied, in the meta bucket, is the log's last record the state file holds
// (logPos.encode).
var keyLogApplied = []byte("log_applied")

// loggedTo returns the state file's log_applied, zero when it has none.
func loggedTo(tx *bolt.Tx, path string) (logPos, error) {
	meta := tx.Bucket(BucketMeta)
	if meta == nil {
		return logPos{}, nil
	}
	v := meta.Get(keyLogApplied)
	switch len(v) {
	case 0:
		return logPos{}, nil
	case 16:
		return logPos{binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:])}, nil
	}
	return logPos{}, CorruptError(path, fmt.Sprintf("its %s record is %d bytes, want 16", keyLogApplied, len(v)), nil)
}

// replayLog applies what the log beside the state file at path holds after the file's
// log_applied to db, in one commit, before the file is read, then removes the log,
// durably (its directory synced), and returns how many records it applied. A state file
// with no buckets (new, or deleted by hand with its log left behind) gets none of it,
// and the log is removed; one written by another schema gets none either, the log left
// in place (loadOrInit then refuses the file). A damaged log (a record that reads whole but does not decode, or one
// that does not read whole with a whole one of its generation after it) is a
// *StateFileError naming the log, both files left as they were.
func replayLog(db *bolt.DB, path string, opts Options) (replayed int, err error) {
	lp := path + LogSuffix
	var fresh, apply bool
	var pos logPos
	err = db.View(func(tx *bolt.Tx) error {
		if k, _ := tx.Cursor().First(); k == nil {
			fresh = true
			return nil
		}
		if checkSchema(tx, path, opts) != nil {
			return nil
		}
		apply = true
		pos, err = loggedTo(tx, path)
		return err
	})
	if err != nil || !apply && !fresh {
		return 0, err
	}
	f, err := os.Open(lp)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err == nil && fresh {
		// The log of a state file deleted by hand: its writes are not this file's.
		_ = f.Close()
		return 0, removeLog(lp)
	}
	if err != nil {
		return 0, fmt.Errorf("open the log %s: %w", lp, err)
	}
	data, err := io.ReadAll(io.LimitReader(f, logSize))
	_ = f.Close()
	if err != nil {
		return 0, fmt.Errorf("read the log %s: %w", lp, err)
	}
	payloads, to, damaged := readLog(data, pos)
	if damaged != nil {
		return 0, logError(lp, damaged.Error(), damaged)
	}
	var ops []logOp
	for i, p := range payloads {
		o, err := decodeOps(p)
		if err != nil {
			return 0, logError(lp, fmt.Sprintf("record %d of the log to replay: %v", i+1, err), err)
		}
		ops = append(ops, o...)
	}
	if len(ops) > 0 {
		err = db.Update(func(tx *bolt.Tx) error {
			if err := applyOps(tx, ops); err != nil {
				return err
			}
			return tx.Bucket(BucketMeta).Put(keyLogApplied, to.encode())
		})
		if err != nil {
			return 0, fmt.Errorf("replay the log %s into %s: %w", lp, path, err)
		}
	}
	// The file holds every write of the log now: the log goes, for good, before
	// anything else is written, so that it is never replayed over a later state.
	return len(payloads), removeLog(lp)
}

// removeLog removes the log at lp, durably.
func removeLog(lp string) error {
	if err := os.Remove(lp); err != nil {
		return fmt.Errorf("remove the log %s: %w", lp, err)
	}
	if err := SyncDir(filepath.Dir(lp)); err != nil {
		return fmt.Errorf("remove the log %s: %w", lp, err)
	}
	return nil
}

// logError is a *StateFileError for a damaged log at lp.
func logError(lp, problem string, err error) *StateFileError {
	return &StateFileError{
		Path:    lp,
		Kind:    ErrCorrupt,
		Problem: problem,
		Recovery: fmt.Sprintf("both files were left untouched: restore the state dir from a backup, or move the log aside "+
			"(mv %s %s.corrupt) to start from the state file alone (the writes only the log holds will be forgotten)", lp, lp),
		Err: err,
	}
}
