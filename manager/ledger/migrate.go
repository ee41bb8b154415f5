package ledger

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/internal/datasync"
)

// The write-ahead log: a batch is durable once its record is in the log file, one
// fdatasync of a block the file already has; the bbolt file gets the batches later, in
// one transaction, at a checkpoint (writer.go). A bbolt commit makes two fdatasyncs (its
// data pages, then its meta page) and allocates as it writes; on this project's disks
// one write of a few hundred bytes to an allocated block and its fdatasync took 155 µs
// p50 against 352 for a one-key bbolt commit (docs/benchmarks.md).
//
// The file has logSize bytes, written with zeros when it is made, so a record's write
// never extends it or allocates a block: its fdatasync has no metadata to write. Its
// records start at offset 0, each
//
//	length u32 | crc32c u32 | generation u64 | seq u64 | payload (length bytes)
//
// big-endian, the checksum over generation, seq and payload. The log is the records from
// offset 0 that read whole, of the first record's generation, with seqs one apart. A
// checkpoint's commit stores in the state file (meta key log_applied) the generation
// and seq of the last record written; the next record goes at offset 0 in a new random
// generation, so records left behind it from an older one end the log where the new
// one ends. Replay applies the records after the stored one: all of a generation other
// than the stored one's (every record of it came after the checkpoint, since its first
// record is the latest written at offset 0), those of the stored one's generation with
// higher seqs. A record torn by a crash fails its checksum and ends the log there: its
// batch was never acknowledged, since its fdatasync did not return. Open zeroes the
// first record's header (durably) once the log is replayed, or left out with a new
// file.
//
// A payload is its operations, each
//
//	kind byte (opPut or opDelete) | bucket | key | value (opPut only)
//
// each of bucket, key and value a uvarint length and its bytes.

// logSize is the log file's size: a batch whose record does not fit in what is left is
// made durable by a checkpoint instead.
const logSize = 4 << 20

const logHeader = 24

const (
	opPut    = 1
	opDelete = 2
)

// logSuffix names the log file: the state file's path and this.
const logSuffix = "-wal"

// logOp is one write of a batch: key of bucket set to val, or deleted.
type logOp struct {
	del              bool
	bucket, key, val []byte
}

// writeLog is the open log file, written only by the leader (writer.go).
type writeLog struct {
	f    *os.File
	path string
	off  int64  // where the next record goes
	gen  uint64 // the generation of the records since the last checkpoint
	seq  uint64 // the last record's seq in it; 0: none yet
	// last is the generation and seq of the last record written (or, before any, the
	// file's log_applied): what a checkpoint stores.
	last logPos
	// broken: a record's write or fdatasync failed, so what the file holds at its place
	// is unknown; no record is written until a checkpoint (reset).
	broken bool
	buf    []byte // the record being encoded, reused
}

// logPos names a record of the log: its generation and seq.
type logPos struct{ gen, seq uint64 }

func (p logPos) encode() []byte {
	return binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64(nil, p.gen), p.seq)
}

// openLog opens (or makes, logSize bytes of zeros) the log file beside the state file
// at path, whose log_applied is applied. Call it after replayLog: the log's first
// header is zeroed, its records being in the state file by now.
func openLog(path string, applied logPos) (*writeLog, error) {
	lp := path + logSuffix
	f, err := os.OpenFile(lp, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open the log %s: %w", lp, err)
	}
	l := &writeLog{f: f, path: lp, gen: newGen(applied), last: applied}
	if err := l.prepare(); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("prepare the log %s: %w", lp, err)
	}
	return l, nil
}

// prepare gives the file its logSize bytes, written, and zeroes its first header, each
// durably.
func (l *writeLog) prepare() error {
	st, err := l.f.Stat()
	if err != nil {
		return err
	}
	grew := st.Size() < logSize
	if grew {
		zeros := make([]byte, 64<<10)
		for off := st.Size(); off < logSize; off += int64(len(zeros)) {
			n := min(int64(len(zeros)), logSize-off)
			if _, err := l.f.WriteAt(zeros[:n], off); err != nil {
				return err
			}
		}
	}
	if _, err := l.f.WriteAt(make([]byte, logHeader), 0); err != nil {
		return err
	}
	if err := l.f.Sync(); err != nil {
		return err
	}
	if grew { // a new file's directory entry, or a power cut could lose the file
		return syncDir(filepath.Dir(l.path))
	}
	return nil
}

// fits says whether a record of ops can be written: it fits in what is left of the
// file, and the log is not broken.
func (l *writeLog) fits(ops []logOp) bool {
	return !l.broken && l.off+int64(logHeader+payloadSize(ops)) <= logSize
}

// append writes ops as the log's next record and waits until it is durable. The
// caller checked that it fits. When it fails the record may still reach the disk,
// whole or not: it counts as written (the next checkpoint stores it as applied, so a
// replay skips it) and the log is broken until that checkpoint.
func (l *writeLog) append(ops []logOp) error {
	n := payloadSize(ops)
	l.buf = encodeRecord(l.buf[:0], l.gen, l.seq+1, ops, n)
	l.seq++
	l.last = logPos{l.gen, l.seq}
	if _, err := l.f.WriteAt(l.buf, l.off); err != nil {
		l.broken = true
		return fmt.Errorf("write to the log %s: %w", l.path, err)
	}
	if err := datasync.File(l.f); err != nil {
		l.broken = true
		return fmt.Errorf("sync the log %s: %w", l.path, err)
	}
	l.off += int64(len(l.buf))
	if cap(l.buf) > 64<<10 {
		l.buf = nil // a big batch's buffer is not kept
	}
	return nil
}

// reset empties the log once a checkpoint stored l.last in the state file, durably: the
// next record starts a new generation at offset 0.
func (l *writeLog) reset() {
	l.off, l.gen, l.seq, l.broken = 0, newGen(l.last), 0, false
}

// newGen returns a random generation other than not's and 0.
func newGen(not logPos) uint64 {
	for {
		if g := rand.Uint64(); g != 0 && g != not.gen {
			return g
		}
	}
}

func (l *writeLog) close() error { return l.f.Close() }

func payloadSize(ops []logOp) int {
	n := 0
	for _, op := range ops {
		n += 1 + uvarintField(op.bucket) + uvarintField(op.key)
		if !op.del {
			n += uvarintField(op.val)
		}
	}
	return n
}

func uvarintField(b []byte) int {
	var tmp [binary.MaxVarintLen64]byte
	return binary.PutUvarint(tmp[:], uint64(len(b))) + len(b)
}

// encodeRecord appends the record of ops (whose payload is n bytes) to buf.
func encodeRecord(buf []byte, gen, seq uint64, ops []logOp, n int) []byte {
	buf = binary.BigEndian.AppendUint32(buf, uint32(n))
	buf = binary.BigEndian.AppendUint32(buf, 0) // the checksum, below
	buf = binary.BigEndian.AppendUint64(buf, gen)
	buf = binary.BigEndian.AppendUint64(buf, seq)
	for _, op := range ops {
		kind := byte(opPut)
		if op.del {
			kind = opDelete
		}
		buf = append(buf, kind)
		buf = binary.AppendUvarint(buf, uint64(len(op.bucket)))
		buf = append(buf, op.bucket...)
		buf = binary.AppendUvarint(buf, uint64(len(op.key)))
		buf = append(buf, op.key...)
		if !op.del {
			buf = binary.AppendUvarint(buf, uint64(len(op.val)))
			buf = append(buf, op.val...)
		}
	}
	binary.BigEndian.PutUint32(buf[4:8], crc32.Checksum(buf[8:], castagnoli))
	return buf
}

// readLog returns the payloads of the log in data (a log file's first logSize bytes at
// most) after the record applied, oldest first, and the position of the last: the
// records from offset 0 that read whole, of the first one's generation, with seqs one
// apart, less those of applied's generation up to its seq.
func readLog(data []byte, applied logPos) ([][]byte, logPos) {
	var out [][]byte
	var gen, seq uint64
	n0 := 0 // records read, applied or not
	for off := 0; len(data)-off >= logHeader; {
		h := data[off : off+logHeader]
		n := int(binary.BigEndian.Uint32(h[0:4]))
		if n > len(data)-off-logHeader {
			break
		}
		rec := data[off+8 : off+logHeader+n]
		if binary.BigEndian.Uint32(h[4:8]) != crc32.Checksum(rec, castagnoli) {
			break
		}
		g, s := binary.BigEndian.Uint64(h[8:16]), binary.BigEndian.Uint64(h[16:24])
		if n0 > 0 && (g != gen || s != seq+1) || n0 == 0 && s == 0 {
			break // another generation's, or a zeroed header's (records start at seq 1)
		}
		gen, seq = g, s
		n0++
		if g != applied.gen || s > applied.seq {
			out = append(out, data[off+logHeader:off+logHeader+n])
		}
		off += logHeader + n
	}
	if len(out) == 0 {
		return nil, applied
	}
	return out, logPos{gen, seq}
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
	meta := tx.Bucket(bucketMeta)
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
	return logPos{}, corruptError(path, fmt.Sprintf("its %s record is %d bytes, want 16", keyLogApplied, len(v)), nil)
}

// replayLog applies what the log beside the state file at path holds after the file's
// log_applied to db, in one commit, before the file is read, and returns the log
// position the file then holds. A state file with no buckets (new, or deleted by hand
// with its log left behind) gets none of it; one written by another schema gets none
// (loadOrInit then refuses it, the file left as it was). A record that reads whole but
// whose operations do not decode is a corrupt log: a *StateFileError naming the log.
func replayLog(db *bolt.DB, path string) (replayed int, pos logPos, err error) {
	lp := path + logSuffix
	apply := false
	err = db.View(func(tx *bolt.Tx) error {
		if k, _ := tx.Cursor().First(); k == nil {
			return nil
		}
		if checkSchema(tx, path) != nil {
			return nil
		}
		apply = true
		pos, err = loggedTo(tx, path)
		return err
	})
	if err != nil || !apply {
		return 0, pos, err
	}
	f, err := os.Open(lp)
	if errors.Is(err, os.ErrNotExist) {
		return 0, pos, nil
	}
	if err != nil {
		return 0, pos, fmt.Errorf("open the log %s: %w", lp, err)
	}
	data, err := io.ReadAll(io.LimitReader(f, logSize))
	_ = f.Close()
	if err != nil {
		return 0, pos, fmt.Errorf("read the log %s: %w", lp, err)
	}
	payloads, to := readLog(data, pos)
	if len(payloads) == 0 {
		return 0, pos, nil
	}
	var ops []logOp
	for i, p := range payloads {
		o, err := decodeOps(p)
		if err != nil {
			return 0, pos, corruptError(lp, fmt.Sprintf("record %d of the log to replay: %v", i+1, err), err)
		}
		ops = append(ops, o...)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		if err := applyOps(tx, ops); err != nil {
			return err
		}
		return tx.Bucket(bucketMeta).Put(keyLogApplied, to.encode())
	})
	if err != nil {
		return 0, pos, fmt.Errorf("replay the log %s into %s: %w", lp, path, err)
	}
	return len(payloads), to, nil
}
