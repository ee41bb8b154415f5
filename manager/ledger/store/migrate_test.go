package store

import (
	"encoding/binary"
	"hash/crc32"
	"slices"
	"testing"
)

// TestReadLog: the log is read from offset 0 while records are whole, of one
// generation, one seq apart; records up to the file's log_applied are left out, and a
// generation other than its own is all after it; a record of the log's generation
// after the end means damage.
func TestReadLog(t *testing.T) {
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
	torn := slices.Concat(rec(7, 1, "a"), rec(7, 2, "b"))
	torn = torn[:len(torn)-2]
	for _, tc := range []struct {
		name    string
		data    []byte
		applied logPos
		want    []string
		pos     logPos
		damaged bool
	}{
		{"nothing applied", log, logPos{}, []string{"a", "b", "c"}, logPos{7, 3}, false},
		{"applied to seq 2", log, logPos{7, 2}, []string{"c"}, logPos{7, 3}, false},
		{"all applied", log, logPos{7, 3}, nil, logPos{7, 3}, false},
		{"another generation applied", log, logPos{5, 9}, []string{"a", "b", "c"}, logPos{7, 3}, false},
		{"older generation behind a new one", stale, logPos{7, 3}, []string{"x"}, logPos{9, 1}, false},
		{"a torn last record ends it", torn, logPos{}, []string{"a"}, logPos{7, 1}, false},
		{"a seq gap is damage", gap, logPos{}, nil, logPos{}, true},
		{"zeroed header", make([]byte, 100), logPos{}, nil, logPos{}, false},
	} {
		got, pos, damaged := readLog(tc.data, tc.applied)
		if (damaged != nil) != tc.damaged {
			t.Errorf("%s: damaged = %v, want %v", tc.name, damaged, tc.damaged)
			continue
		}
		if !slices.Equal(keys(got), tc.want) || !tc.damaged && pos != tc.pos {
			t.Errorf("%s: records %q to %v, want %q to %v", tc.name, keys(got), pos, tc.want, tc.pos)
		}
	}
}

// payloadSize, uvarintField and encodeRecord write a log record as c9e8f1f did.
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
