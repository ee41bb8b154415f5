package inventory

import (
	"strings"
	"testing"
)

func TestErrorLine(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		{"plain", "plugin exited: signal: killed", "plugin exited: signal: killed"},
		{"lines joined, blanks collapsed", "a:\r\n\n  b\t\tc \n", "a:; b c"},
		{"control characters and invalid UTF-8", "x\x00y\x1b[31mz\xff\xfe!", "x y [31mz !"},
		{"only blanks", "\n\t \r", ""},
		{"cut at the limit", strings.Repeat("e", MaxErrorLen+1), strings.Repeat("e", MaxErrorLen-3) + "..."},
		{"exactly the limit", strings.Repeat("e", MaxErrorLen), strings.Repeat("e", MaxErrorLen)},
		// "é" is 2 bytes: a cut inside one moves back to its start.
		{"cut between bytes of a character", strings.Repeat("é", MaxErrorLen), strings.Repeat("é", (MaxErrorLen-4)/2) + "..."},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := ErrorLine(tc.in); got != tc.want {
				t.Errorf("ErrorLine(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
	// A huge text with a line break every byte costs a bounded scan and still fits.
	huge := strings.Repeat("a\n", 1<<20)
	if got := ErrorLine(huge); len(got) > MaxErrorLen || strings.Contains(got, "\n") {
		t.Errorf("ErrorLine of 2 MiB of lines = %d bytes %q", len(got), got)
	}
}
