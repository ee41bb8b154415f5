// Package textline makes text that may come from a plugin, a connection or the operator
// (several lines, control characters, terminal escapes, bidi overrides, invalid UTF-8,
// megabytes of it) into one line of bounded length, fit for an error message, a status
// field, a table cell or a log value: Line for prose, Escape for text that must reach
// the reader as it was, Words for a caller that quotes what is not printable itself.
// All three cut at a character boundary within their limit and read no more than needed.
// It is public because the Nomad module (its API client and shim) prints untrusted text too.
// See docs/plugins.md#what-a-plugin-cannot-do-to-the-agent.
package textline

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// ellipsis ends a text that was cut.
const ellipsis = "..."

// Line returns s on one printable line of at most limit bytes (limit <= 0: no bound; a
// limit below 3 counts as 3, the length of "..."). Line breaks (each run of "\n" and
// "\r", with the blanks around it) become "; "; every other character that is not
// printable (control characters such as NUL and ESC, format characters such as bidi
// overrides, spaces other than ' ') and every byte that is not UTF-8 becomes a space;
// runs of spaces collapse into one; leading and trailing blanks and blank lines go. A
// longer result is cut at a character boundary and ends in "...".
func Line(s string, limit int) string { return collapse(s, limit, prose) }

// Words returns s with every run of white space (line breaks, tabs, Unicode spaces:
// what strings.Fields splits at) made one space, none at either end, and every other
// character kept as it is, printable or not, cut like Line. It is for text whose
// caller quotes or escapes what is not printable itself, so that the reader still sees
// it (a table cell), and must not have it blanked out first.
func Words(s string, limit int) string { return collapse(s, limit, words) }

// style is what collapse makes of a text.
type style uint8

const (
	prose style = iota // Line
	words              // Words
)

// blank reports whether st turns the rune r (decoded from size bytes) into a space.
func (st style) blank(r rune, size int) bool {
	if st == words {
		return unicode.IsSpace(r)
	}
	return r == ' ' || !printable(r, size)
}

func collapse(s string, limit int, st style) string {
	limit = bound(limit)
	if collapsed(s, st) && (limit == 0 || len(s) <= limit) {
		return s
	}
	w := newWriter(len(s), limit)
	const (
		none = iota
		space
		lineBreak
	)
	sep := none
	for i := 0; i < len(s) && !w.full(); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case st == prose && (r == '\n' || r == '\r'):
			sep = lineBreak
		case st.blank(r, size):
			sep = max(sep, space)
		default:
			if w.b.Len() > 0 {
				switch sep {
				case space:
					w.piece(" ")
				case lineBreak:
					// Byte by byte, as the text around it: a cut may keep the ';'.
					w.piece(";")
					w.piece(" ")
				}
			}
			sep = none
			w.piece(s[i : i+size])
		}
		i += size
	}
	return w.String()
}

// collapsed reports whether collapse in style st leaves s as it is: no blanks but
// single spaces between other characters.
func collapsed(s string, st style) bool {
	if s == "" {
		return true
	}
	if s[0] == ' ' || s[len(s)-1] == ' ' || strings.Contains(s, "  ") {
		return false
	}
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r != ' ' && st.blank(r, size) {
			return false
		}
		i += size
	}
	return true
}

// Escape returns s on one line of at most limit bytes (limit <= 0: no bound; below 3
// counts as 3) with every character that is not printable written as a Go escape
// ("\n", "\t", "\x1b", "\u202e"; a byte that is not UTF-8 as "\xff"), so that nothing
// is lost or hidden, nothing starts a line of its own and nothing drives the reader's
// terminal. Printable text, quotes and backslashes included, is kept as it is. A longer
// result is cut before a character or an escape and ends in "...".
func Escape(s string, limit int) string {
	limit = bound(limit)
	i := 0
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		if !printable(r, size) {
			break
		}
		i += size
	}
	if i == len(s) && (limit == 0 || len(s) <= limit) {
		return s
	}
	w := newWriter(len(s)+16, limit)
	for i := 0; i < len(s) && !w.full(); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			w.piece(`\x` + hex2(s[i]))
		case !printable(r, size):
			q := strconv.QuoteRune(r) // '\n', '\x1b', '\u2028'
			w.piece(q[1 : len(q)-1])
		default:
			w.piece(s[i : i+size])
		}
		i += size
	}
	return w.String()
}

// Printable reports whether s is valid UTF-8 and every character of it printable, as
// Line, Words and Escape take it: letters, marks, numbers, punctuation, symbols and the
// ASCII space. It is the one test of "printable" for text that must be shown as it is
// (a name the validator accepts, a label value the metrics keep).
func Printable(s string) bool {
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if !printable(r, size) {
			return false
		}
		i += size
	}
	return true
}

// printable reports whether the rune r, decoded from size bytes, is a printable
// character: letters, marks, numbers, punctuation, symbols and the ASCII space. A byte
// that is not UTF-8 is not.
func printable(r rune, size int) bool {
	if r < utf8.RuneSelf {
		return ' ' <= r && r < 0x7f
	}
	return !(r == utf8.RuneError && size == 1) && unicode.IsPrint(r)
}

func hex2(b byte) string {
	const digits = "0123456789abcdef"
	return string([]byte{digits[b>>4], digits[b&0xf]})
}

// bound is the limit Line, Words and Escape work with: 0 for none, at least len(ellipsis).
func bound(limit int) int {
	if limit <= 0 {
		return 0
	}
	return max(limit, len(ellipsis))
}

// writer builds a line from pieces (a character, an escape) that a cut never splits.
type writer struct {
	b     strings.Builder
	limit int // 0: no bound
	cut   int // where a cut line ends, before its "..."; -1 until a piece passes it
}

// newWriter returns a writer for a line of about size bytes, bounded by limit.
func newWriter(size, limit int) *writer {
	w := &writer{limit: limit, cut: -1}
	if limit > 0 {
		size = min(size, limit+utf8.UTFMax*4) // a few pieces past the limit at most
	}
	w.b.Grow(size)
	return w
}

// piece appends p. Once the line passes the limit, further pieces are not needed: it
// is cut where the last piece that leaves room for "..." ended.
func (w *writer) piece(p string) {
	if w.limit > 0 && w.cut < 0 && w.b.Len()+len(p) > w.limit-len(ellipsis) {
		w.cut = w.b.Len()
	}
	w.b.WriteString(p)
}

// full reports whether the line has passed the limit: it will be cut.
func (w *writer) full() bool { return w.limit > 0 && w.b.Len() > w.limit }

func (w *writer) String() string {
	s := w.b.String()
	if w.limit > 0 && len(s) > w.limit {
		return s[:w.cut] + ellipsis
	}
	return s
}
