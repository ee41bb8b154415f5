package manager

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// maxErrorLen bounds, in bytes, what the manager keeps of an error as a plugin's last
// error or a device's health reason: both reach every ListPlugins answer, and the last
// error every UNAVAILABLE answer naming the plugin, and the log line of each such call.
const maxErrorLen = 300

// maxErrorScan bounds how much of an error text errorLine looks at.
const maxErrorScan = 16 << 10

// errorLine renders s on one line of at most maxErrorLen bytes: line breaks become "; ",
// other control and non-printing characters and invalid UTF-8 become spaces, runs of
// blanks collapse, blank lines go, and a longer text is cut at a character boundary
// ending in "...".
func errorLine(s string) string {
	if len(s) > maxErrorScan {
		s = s[:maxErrorScan]
	}
	s = strings.ToValidUTF8(s, " ")
	var b strings.Builder
	for line := range strings.FieldsFuncSeq(s, func(r rune) bool { return r == '\n' || r == '\r' }) {
		line = strings.Join(strings.Fields(strings.Map(func(r rune) rune {
			if !unicode.IsPrint(r) {
				return ' '
			}
			return r
		}, line)), " ")
		if line == "" {
			continue
		}
		if b.Len() > 0 {
			b.WriteString("; ")
		}
		b.WriteString(line)
		if b.Len() > maxErrorLen {
			break
		}
	}
	out := b.String()
	if len(out) <= maxErrorLen {
		return out
	}
	cut := maxErrorLen - len("...")
	for cut > 0 && !utf8.RuneStart(out[cut]) {
		cut--
	}
	return out[:cut] + "..."
}

// repeats collapses a message seen again and again in a row into one log line and a
// count: see says whether a message is new (to be logged) and, when it replaces one seen
// more than once, how many times that one came. Owned by one goroutine.
type repeats struct {
	last  string
	count int // times last came in a row
}

// see records msg; isNew is whether it differs from the previous one, and when it
// does, prev and times are the previous message and its count in a row.
func (r *repeats) see(msg string) (isNew bool, prev string, times int) {
	if r.count > 0 && msg == r.last {
		r.count++
		return false, "", 0
	}
	prev, times = r.last, r.count
	r.last, r.count = msg, 1
	return true, prev, times
}

// reset forgets the current message (the condition ended) and returns it with its
// count in a row.
func (r *repeats) reset() (prev string, times int) {
	prev, times = r.last, r.count
	r.last, r.count = "", 0
	return prev, times
}
