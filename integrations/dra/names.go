package dra

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"unicode"
)

// maxLabel is the longest DNS label (RFC 1123), and of a label value.
const maxLabel = 63

// DeviceName returns the DRA device name of the agent's device ID: a DNS label, as
// DRA wants device names. An ID that is one already is its own name; any other (the
// NVIDIA plugin's "GPU-<uuid>") becomes its lower-case form with every character a DNS
// label does not allow turned into '-', cut to fit, and 8 hex digits of the ID's
// SHA-256 appended ("gpu-<uuid>-1a2b3c4d"), so that two IDs never share a name (say
// "GPU-A" and "gpu-a"). The same ID always gets the same name, in every process; the
// ID itself is published as the device's "id" attribute.
func DeviceName(id string) string { return label(id) }

// label maps s to a DNS label injectively (see DeviceName).
func label(s string) string {
	if isLabel(s) {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	suffix := "-" + hex.EncodeToString(sum[:4])
	var b strings.Builder
	dash := false
	for _, r := range strings.ToLower(s) {
		ok := r < unicode.MaxASCII && (r >= 'a' && r <= 'z' || r >= '0' && r <= '9')
		switch {
		case ok:
			b.WriteRune(r)
			dash = false
		case !dash && b.Len() > 0:
			b.WriteByte('-')
			dash = true
		}
	}
	base := strings.Trim(b.String(), "-")
	if len(base) > maxLabel-len(suffix) {
		base = strings.TrimRight(base[:maxLabel-len(suffix)], "-")
	}
	if base == "" {
		return "d" + suffix
	}
	return base + suffix
}

// isLabel reports whether s is a DNS label: 1 to 63 lower-case letters, digits and
// '-', starting and ending with a letter or digit.
func isLabel(s string) bool {
	if s == "" || len(s) > maxLabel {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c == '-' && i > 0 && i < len(s)-1:
		default:
			return false
		}
	}
	return true
}

// labelValue turns s into a Kubernetes label value (at most 63 letters, digits, '-',
// '_' and '.', starting and ending with a letter or digit), for a taint value: other
// characters (the '/' of owner IDs, spaces) become '.', and a long s is cut. An s with
// nothing usable gives def.
func labelValue(s, def string) string {
	b := []byte(s)
	for i, c := range b {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_', c == '.':
		default:
			b[i] = '.'
		}
	}
	if len(b) > maxLabel {
		b = b[:maxLabel]
	}
	v := strings.TrimFunc(string(b), func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9')
	})
	if v == "" {
		return def
	}
	return v
}

// attributeName turns a plugin's attribute key ("driver_version") into a DRA
// attribute name in the driver's domain ("driverVersion"): a C identifier of at most
// 32 characters, or "" when the key cannot be one.
func attributeName(key string) string {
	var b strings.Builder
	up := false
	for _, r := range key {
		switch {
		case r == '_' || r == '-' || r == '.' || r == ' ':
			up = b.Len() > 0
		case r < unicode.MaxASCII && (unicode.IsLetter(r) || unicode.IsDigit(r)):
			if b.Len() == 0 && unicode.IsDigit(r) {
				return ""
			}
			if up {
				r = unicode.ToUpper(r)
				up = false
			}
			b.WriteRune(r)
		default:
			return ""
		}
	}
	if b.Len() == 0 || b.Len() > 32 {
		return ""
	}
	return b.String()
}
