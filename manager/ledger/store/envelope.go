package store

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
)

// A record envelope is a 4-byte big-endian CRC-32C of the payload followed by the
// payload. bbolt checksums only its meta pages, so the CRC is what names a record whose
// bytes changed under us.

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Seal returns payload in a new envelope.
func Seal(payload []byte) []byte {
	b := append(make([]byte, 4, 4+len(payload)), payload...)
	binary.BigEndian.PutUint32(b, crc32.Checksum(b[4:], castagnoli))
	return b
}

// Unseal checks an envelope and returns its payload, which aliases v.
func Unseal(v []byte) ([]byte, error) {
	if len(v) < 4 {
		return nil, fmt.Errorf("%d bytes, shorter than its checksum", len(v))
	}
	stored, payload := binary.BigEndian.Uint32(v), v[4:]
	if got := crc32.Checksum(payload, castagnoli); got != stored {
		return nil, fmt.Errorf("checksum mismatch (stored %08x, computed %08x)", stored, got)
	}
	return payload, nil
}
