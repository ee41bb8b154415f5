package textline

import (
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

func TestLine(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		limit int
		want  string
	}{
		{"plain", "plugin exited: signal: killed", 300, "plugin exited: signal: killed"},
		{"empty", "", 300, ""},
		{"lines joined, blanks collapsed", "a:\r\n\n  b\t\tc \n", 300, "a:; b c"},
		{"control characters and invalid UTF-8", "x\x00y\x1b[31mz\xff\xfe!", 300, "x y [31mz !"},
		{"only blanks", "\n\t \r", 300, ""},
		{"leading and trailing blanks", "  a b  ", 0, "a b"},
		{"bidi override and line separator", "abc\u202edef\u2028ghi\u00a0j", 0, "abc def ghi j"},
		{"a U+FFFD that was sent stays", "a\ufffdb", 0, "a\ufffdb"},
		{"ANSI escape", "\x1b]0;title\x07red\x1b[0m", 0, "]0;title red [0m"},
		{"cut at the limit", strings.Repeat("e", 301), 300, strings.Repeat("e", 297) + "..."},
		{"exactly the limit", strings.Repeat("e", 300), 300, strings.Repeat("e", 300)},
		// "é" is 2 bytes: a cut inside one moves back to its start.
		{"cut between bytes of a character", strings.Repeat("é", 300), 300, strings.Repeat("é", 148) + "..."},
		{"cut may keep the ; of a break", "abcdef\nxyz", 9, "abcdef..."},
		{"cut after the ;", "abcde\nxyz", 9, "abcde;..."},
		{"blanks at the cut do not count", "abc      \n\n\n   ", 3, "abc"},
		{"tiny limit", "abcdef", 1, "..."},
		{"no limit", strings.Repeat("ab\n", 1000), 0, strings.TrimSuffix(strings.Repeat("ab; ", 1000), "; ")},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Line(tc.in, tc.limit); got != tc.want {
				t.Errorf("Line(%q, %d) = %q, want %q", tc.in, tc.limit, got, tc.want)
			}
		})
	}
}

func TestWords(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		limit int
		want  string
	}{
		{"plain", "exit status 2", 0, "exit status 2"},
		{"lines become spaces", "exit status 2\nbad config", 0, "exit status 2 bad config"},
		{"white space collapses, Unicode spaces too", " a\t\r\n b\u00a0\u2028c\u3000 ", 0, "a b c"},
		{"control characters stay, for the caller to quote", "boom \x1b]0;owned\x07 done", 0, "boom \x1b]0;owned\x07 done"},
		{"invalid UTF-8 stays", "a\xffb", 0, "a\xffb"},
		{"bidi override stays", "a\u202eb", 0, "a\u202eb"},
		{"cut", "aaaa bbbb cccc", 10, "aaaa bb..."},
		{"cut never splits a character", "aaaaéé b", 8, "aaaa..."},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Words(tc.in, tc.limit); got != tc.want {
				t.Errorf("Words(%q, %d) = %q, want %q", tc.in, tc.limit, got, tc.want)
			}
		})
	}
}

func TestEscape(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		limit int
		want  string
	}{
		{"printable", "plain text, ünïcode ✓", 0, "plain text, ünïcode ✓"},
		{"newline", "a\nb", 0, `a\nb`},
		{"return and tab", "a\r\tb", 0, `a\r\tb`},
		{"terminal escape", "\x1b[2J", 0, `\x1b[2J`},
		{"bell", "title\x07", 0, `title\a`},
		{"NUL", "a\x00b", 0, `a\x00b`},
		{"invalid byte", "bad \xff byte", 0, `bad \xff byte`},
		{"line separator, bidi override, NEL", "line\u2028sep \u202e bidi \u0085 nel", 0, `line\u2028sep \u202e bidi \u0085 nel`},
		{"quotes and backslashes stay", `say "hi" \o/`, 0, `say "hi" \o/`},
		{"blanks stay", "  a  b  ", 0, "  a  b  "},
		{"cut at the limit", strings.Repeat("x", 11), 10, "xxxxxxx..."},
		{"cut never splits an escape", "abcdef\x1b[2J", 10, "abcdef..."},
		{"cut never splits a character", "abcdeéfgh", 9, "abcde..."},
		{"an escape that fits stays", "abcd\x1b", 10, `abcd\x1b`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Escape(tc.in, tc.limit); got != tc.want {
				t.Errorf("Escape(%q, %d) = %q, want %q", tc.in, tc.limit, got, tc.want)
			}
		})
	}
}

// TestHugeInput: hundreds of kilobytes of lines, blanks, NULs or escapes come out as one
// bounded line.
func TestHugeInput(t *testing.T) {
	for name, in := range map[string]string{
		"lines":             strings.Repeat("a\n", 1<<17),
		"blanks, then text": strings.Repeat(" \t\r\n", 1<<16) + "the end",
		"NULs":              strings.Repeat("\x00", 1<<18),
		"ANSI":              strings.Repeat("\x1b[31mred\x1b[0m", 1<<14),
		"invalid":           strings.Repeat("\xff\xfe", 1<<17),
	} {
		for _, limit := range []int{300, 16 << 10} {
			checkLine(t, name+" Line", Line(in, limit), limit, true)
			checkLine(t, name+" Escape", Escape(in, limit), limit, false)
			if w := Words(in, limit); len(w) > limit || strings.ContainsAny(w, "\n\r\t") || strings.Contains(w, "  ") {
				t.Errorf("%s Words: %d bytes %.60q, want one line of at most %d bytes", name, len(w), w, limit)
			}
		}
	}
	if got := Line(strings.Repeat(" \t\r\n", 1<<16)+"the end", 300); got != "the end" {
		t.Errorf("Line of 256 KiB of blanks, then text = %q, want the text", got)
	}
}

// checkLine fails t unless s is one valid, printable line within limit bytes; joined
// says s is Line's (no double spaces, no blanks at the ends).
func checkLine(t *testing.T, what, s string, limit int, joined bool) {
	t.Helper()
	if limit > 0 && len(s) > limit {
		t.Errorf("%s: %d bytes, want at most %d", what, len(s), limit)
	}
	if !utf8.ValidString(s) {
		t.Errorf("%s: %.60q is not UTF-8", what, s)
	}
	if i := strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }); i >= 0 {
		t.Errorf("%s: a character that is not printable at byte %d: %.60q", what, i, s[i:])
	}
	if joined && (strings.Contains(s, "  ") || strings.HasPrefix(s, " ") || strings.HasSuffix(s, " ")) {
		t.Errorf("%s: %.60q has uncollapsed blanks", what, s)
	}
}

// cutAt is how a limit cuts an unbounded line that is made of single characters: at
// the start of the character that would end past limit-3, then "...".
func cutAt(s string, limit int) string {
	if len(s) <= limit {
		return s
	}
	n := limit - len(ellipsis)
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + ellipsis
}

func FuzzLine(f *testing.F) {
	for _, s := range []string{
		"", "a", "a:\r\n\n  b\t\tc \n", "x\x00y\x1b[31mz\xff\xfe!", "abc\u202edef", "\xe2\x80", "é\x80é",
		"\u2028\u2029\u0085\u00a0", "\\x1b", strings.Repeat("é", 200), "tab\there",
	} {
		f.Add(s, 0)
		f.Add(s, 10)
		f.Add(s, 300)
	}
	f.Fuzz(func(t *testing.T, s string, limit int) {
		limit %= 1 << 12
		line, esc, words := Line(s, limit), Escape(s, limit), Words(s, limit)
		l := bound(limit)
		checkLine(t, "Line", line, l, true)
		checkLine(t, "Escape", esc, l, false)

		// A limit only cuts: the bounded line is the unbounded one, cut.
		full := Line(s, 0)
		if want := full; l > 0 {
			want = cutAt(full, l)
			if line != want {
				t.Errorf("Line(%q, %d) = %q, want %q (Line(s, 0) cut)", s, limit, line, want)
			}
		}
		// Words is strings.Fields joined by spaces, cut (at a rune start: cutAt
		// assumes valid UTF-8 there, so only then).
		fields := strings.Join(strings.Fields(s), " ")
		if got := Words(s, 0); got != fields {
			t.Errorf("Words(%q, 0) = %q, want %q", s, got, fields)
		}
		if utf8.ValidString(s) && l > 0 && words != cutAt(fields, l) {
			t.Errorf("Words(%q, %d) = %q, want %q", s, limit, words, cutAt(fields, l))
		}
		if l > 0 && len(words) > l {
			t.Errorf("Words(%q, %d) = %d bytes, want at most %d", s, limit, len(words), l)
		}

		fullEsc := Escape(s, 0)
		if l > 0 && len(fullEsc) > l {
			if !strings.HasSuffix(esc, ellipsis) || !strings.HasPrefix(fullEsc, strings.TrimSuffix(esc, ellipsis)) {
				t.Errorf("Escape(%q, %d) = %q, want a prefix of %q and ...", s, limit, esc, fullEsc)
			}
		} else if esc != fullEsc {
			t.Errorf("Escape(%q, %d) = %q, want %q (nothing to cut)", s, limit, esc, fullEsc)
		}

		// Nothing printable is lost: Escape keeps every printable character, Line
		// every one but the spaces.
		if utf8.ValidString(s) && strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) < 0 {
			if fullEsc != s {
				t.Errorf("Escape(%q) = %q, want it unchanged (all printable)", s, fullEsc)
			}
			if want := strings.Join(strings.Fields(s), " "); full != want {
				t.Errorf("Line(%q) = %q, want %q", s, full, want)
			}
		}
		// Line is idempotent.
		if again := Line(line, limit); again != line {
			t.Errorf("Line(Line(%q)) = %q, want %q", s, again, line)
		}
	})
}

// Printable is true for text every character of which Line would keep as it is, and
// false for any control or format character, any space but ' ', and any byte that is
// not UTF-8.
func TestPrintable(t *testing.T) {
	for _, s := range []string{"", "GPU-8f3a 0", "NVIDIA H100 80GB HBM3", "naïve ✓ 日本", "a~b"} {
		if !Printable(s) {
			t.Errorf("Printable(%q) = false, want true", s)
		}
		if got := Line(s, 0); got != strings.TrimSpace(s) && s != "" {
			t.Errorf("Line(%q) = %q: Line does not keep what Printable accepts", s, got)
		}
	}
	for _, s := range []string{"a\nb", "tab\there", "\x1b[31mred", "bidi\u202eevil", "nbsp\u00a0x", "bad\xffutf8", "nul\x00", "del\x7f"} {
		if Printable(s) {
			t.Errorf("Printable(%q) = true, want false", s)
		}
	}
}
