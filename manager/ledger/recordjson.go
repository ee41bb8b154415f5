package ledger

import (
	"fmt"
	"slices"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/devicehost/devicehost/device"
)

// encodeReservation returns r as schema version 1 stores it: a record envelope around
// the JSON of its recordV1.
//
// The JSON is written by hand rather than by encoding/json: every Reserve, Release
// and cleanup-done mark encodes one record while its caller waits for the commit, and
// the reflection-driven encoder was most of the ledger's CPU in that wait. The bytes
// are exactly those json.Marshal makes of the recordV1 (TestRecordJSONIsEncodingJSONs
// holds the two to that, on every field and on strings that need escaping), so the
// file format does not depend on which encoder wrote a record; decodeReservation still
// reads records with encoding/json.
func encodeReservation(r *device.Reservation) ([]byte, error) {
	var state string
	switch r.State {
	case device.ReservationActive:
		state = "active"
	case device.ReservationReleased:
		state = "released"
	default:
		return nil, fmt.Errorf("reservation %q: cannot store state %v", r.ID, r.State)
	}
	b := make([]byte, 4, 1024) // the envelope's checksum goes first (sealIn)
	b = append(b, `{"id":`...)
	b = appendJSONString(b, r.ID)
	b = append(b, `,"owner_id":`...)
	b = appendJSONString(b, r.OwnerID)
	b = append(b, `,"group":{"vendor":`...)
	b = appendJSONString(b, r.Group.Vendor)
	b = append(b, `,"type":`...)
	b = appendJSONString(b, r.Group.Type)
	b = append(b, `,"name":`...)
	b = appendJSONString(b, r.Group.Name)
	b = append(b, `},"plugin":`...)
	b = appendJSONString(b, r.Plugin)
	b = append(b, `,"device_ids":`...)
	b = appendJSONStrings(b, r.DeviceIDs)
	b = append(b, `,"container":{"envs":`...)
	b = appendJSONMap(b, r.Container.Envs, appendJSONString)
	b = append(b, `,"mounts":`...)
	if r.Container.Mounts == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i, m := range r.Container.Mounts {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, `{"host_path":`...)
			b = appendJSONString(b, m.HostPath)
			b = append(b, `,"container_path":`...)
			b = appendJSONString(b, m.ContainerPath)
			b = append(b, `,"read_only":`...)
			b = strconv.AppendBool(b, m.ReadOnly)
			b = append(b, '}')
		}
		b = append(b, ']')
	}
	b = append(b, `,"devices":`...)
	if r.Container.Devices == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i, d := range r.Container.Devices {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, `{"host_path":`...)
			b = appendJSONString(b, d.HostPath)
			b = append(b, `,"container_path":`...)
			b = appendJSONString(b, d.ContainerPath)
			b = append(b, `,"permissions":`...)
			b = appendJSONString(b, d.Permissions)
			b = append(b, '}')
		}
		b = append(b, ']')
	}
	b = append(b, `,"cdi_devices":`...)
	b = appendJSONStrings(b, r.Container.CDIDevices)
	b = append(b, `},"state":"`...)
	b = append(b, state...)
	b = append(b, `","created_at":`...)
	var err error
	if b, err = appendJSONTime(b, r.CreatedAt); err != nil {
		return nil, fmt.Errorf("encode reservation %q: created_at: %w", r.ID, err)
	}
	b = append(b, `,"released_at":`...)
	if b, err = appendJSONTime(b, r.ReleasedAt); err != nil {
		return nil, fmt.Errorf("encode reservation %q: released_at: %w", r.ID, err)
	}
	b = append(b, `,"cleanup_pending":`...)
	b = strconv.AppendBool(b, r.CleanupPending)
	if len(r.Consumes) > 0 {
		b = append(b, `,"consumes":[`...)
		for i, c := range r.Consumes {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, `{"set":`...)
			b = appendJSONString(b, c.Set.Name)
			b = append(b, `,"counters":`...)
			b = appendJSONMap(b, c.Counters, appendJSONInt)
			b = append(b, '}')
		}
		b = append(b, ']')
	}
	if l := r.OwnerLabels; l != (device.OwnerLabels{}) { // OwnerLabels.Map's keys, sorted
		b = append(b, `,"owner_labels":{`...)
		if l.Namespace != "" {
			b = append(b, `"namespace":`...)
			b = appendJSONString(b, l.Namespace)
			if l.Pod != "" {
				b = append(b, ',')
			}
		}
		if l.Pod != "" {
			b = append(b, `"pod":`...)
			b = appendJSONString(b, l.Pod)
		}
		b = append(b, '}')
	}
	return sealIn(append(b, '}')), nil
}

// appendJSONTime appends t as encoding/json does (time.Time's MarshalJSON: quoted RFC
// 3339 with nanoseconds), failing as it does on a year outside 0..9999.
func appendJSONTime(b []byte, t time.Time) ([]byte, error) {
	b = append(b, '"')
	b, err := t.AppendText(b)
	if err != nil {
		return nil, err
	}
	return append(b, '"'), nil
}

// appendJSONStrings appends ss as encoding/json does: null for nil.
func appendJSONStrings(b []byte, ss []string) []byte {
	if ss == nil {
		return append(b, "null"...)
	}
	b = append(b, '[')
	for i, s := range ss {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, s)
	}
	return append(b, ']')
}

// appendJSONMap appends m as encoding/json does: keys sorted, each value by value, null
// for nil.
func appendJSONMap[V any](b []byte, m map[string]V, value func([]byte, V) []byte) []byte {
	if m == nil {
		return append(b, "null"...)
	}
	var buf [8]string
	b = append(b, '{')
	for i, k := range sortedKeys(buf[:0], m) {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, k)
		b = append(b, ':')
		b = value(b, m[k])
	}
	return append(b, '}')
}

func appendJSONInt(b []byte, v int64) []byte { return strconv.AppendInt(b, v, 10) }

// sortedKeys appends m's keys to keys (a caller's buffer, so that a small map's keys
// need no allocation) and sorts them.
func sortedKeys[V any](keys []string, m map[string]V) []string {
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

const hexDigits = "0123456789abcdef"

// appendJSONString appends s quoted as encoding/json quotes a string: with the HTML
// characters <, > and & escaped, invalid UTF-8 replaced by U+FFFD, and U+2028 and
// U+2029 escaped.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		if c := s[i]; c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\b':
				b = append(b, `\b`...)
			case '\f':
				b = append(b, `\f`...)
			case '\n':
				b = append(b, `\n`...)
			case '\r':
				b = append(b, `\r`...)
			case '\t':
				b = append(b, `\t`...)
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
		case r == '\u2028' || r == '\u2029':
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
		default:
			i += size
			continue
		}
		i += size
		start = i
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
