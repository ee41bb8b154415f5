// Package idpattern matches device IDs against the patterns an operator pins a plugin
// to (a plugin block's device_ids): a pattern is a device ID in which '*' stands for any
// run of characters, empty included, e.g. "GPU-*" or "*-mig-*". Nothing else is special.
package idpattern

import (
	"fmt"
	"unicode/utf8"

	"github.com/devicehost/devicehost/textline"
)

// MaxLen bounds a pattern's length in bytes, and MaxPatterns the patterns of one plugin.
const (
	MaxLen      = 256
	MaxPatterns = 64
)

// Check reports what is wrong with pattern p, or nil: it must be non-empty, at most
// MaxLen bytes of printable UTF-8.
func Check(p string) error {
	switch {
	case p == "":
		return fmt.Errorf("an empty pattern matches no device ID")
	case len(p) > MaxLen:
		return fmt.Errorf("pattern is %d bytes long, at most %d", len(p), MaxLen)
	case !utf8.ValidString(p):
		return fmt.Errorf("pattern %q is not valid UTF-8", p)
	case !textline.Printable(p):
		return fmt.Errorf("pattern %q has a character that is not printable", p)
	}
	return nil
}

// Match reports whether id matches pattern p.
func Match(p, id string) bool {
	// Greedy with backtracking to the last '*': linear in practice, at worst
	// len(p)*len(id).
	pi, ii := 0, 0
	star, mark := -1, 0
	for ii < len(id) {
		switch {
		case pi < len(p) && p[pi] == '*':
			star, mark = pi, ii
			pi++
		case pi < len(p) && p[pi] == id[ii]:
			pi++
			ii++
		case star >= 0:
			pi = star + 1
			mark++
			ii = mark
		default:
			return false
		}
	}
	for pi < len(p) && p[pi] == '*' {
		pi++
	}
	return pi == len(p)
}

// MatchAny reports whether id matches one of ps.
func MatchAny(ps []string, id string) bool {
	for _, p := range ps {
		if Match(p, id) {
			return true
		}
	}
	return false
}

// Overlap reports whether some device ID matches both a and b.
func Overlap(a, b string) bool {
	memo := make(map[[2]int]bool)
	seen := make(map[[2]int]bool)
	var ov func(i, j int) bool
	ov = func(i, j int) bool {
		k := [2]int{i, j}
		if seen[k] {
			return memo[k]
		}
		seen[k] = true
		var r bool
		switch {
		case i == len(a) && j == len(b):
			r = true
		case i < len(a) && a[i] == '*':
			// a's star matches nothing, or takes b's next byte (or b's star's output).
			r = ov(i+1, j) || (j < len(b) && ov(i, j+1))
		case j < len(b) && b[j] == '*':
			r = ov(i, j+1) || (i < len(a) && ov(i+1, j))
		case i == len(a) || j == len(b):
			r = false
		default:
			r = a[i] == b[j] && ov(i+1, j+1)
		}
		memo[k] = r
		return r
	}
	return ov(0, 0)
}
