package idpattern

import (
	"strings"
	"testing"
)

func TestMatch(t *testing.T) {
	for _, tc := range []struct {
		p, id string
		want  bool
	}{
		{"GPU-*", "GPU-1234", true},
		{"GPU-*", "GPU-", true},
		{"GPU-*", "MIG-1", false},
		{"*-mig-*", "GPU-1-mig-1g.10gb-0", true},
		{"*-mig-*", "GPU-1", false},
		{"exact", "exact", true},
		{"exact", "exactly", false},
		{"*", "", true},
		{"a*b*c", "aXbYbZc", true},
		{"a*b*c", "aXbYbZ", false},
		{"**", "x", true},
	} {
		if got := Match(tc.p, tc.id); got != tc.want {
			t.Errorf("Match(%q, %q) = %v, want %v", tc.p, tc.id, got, tc.want)
		}
	}
}

func TestOverlap(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want bool
	}{
		{"GPU-*", "MIG-*", false},
		{"GPU-*", "GPU-1*", true},
		{"GPU-*", "*-mig-*", true}, // GPU-x-mig-y
		{"*a", "b*", true},         // ba
		{"a*", "b*", false},
		{"*x", "*y", false},
		{"abc", "a*c", true},
		{"abc", "abd", false},
		{"*", "anything", true},
	} {
		if got := Overlap(tc.a, tc.b); got != tc.want {
			t.Errorf("Overlap(%q, %q) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
		if got := Overlap(tc.b, tc.a); got != tc.want {
			t.Errorf("Overlap(%q, %q) = %v, want %v", tc.b, tc.a, got, tc.want)
		}
	}
}

// A hostile pattern or ID costs at most len(p)*len(id) steps.
func TestMatchBounded(t *testing.T) {
	p := strings.Repeat("*a", 128)
	id := strings.Repeat("a", 4096) + "b"
	if Match(p, id) {
		t.Error("matched")
	}
	if !Overlap(p, strings.Repeat("a", 128)) {
		t.Error("no overlap")
	}
}

func TestCheck(t *testing.T) {
	for _, bad := range []string{"", strings.Repeat("x", MaxLen+1), "GPU-\x1b", "\xff"} {
		if Check(bad) == nil {
			t.Errorf("Check(%q) = nil", bad)
		}
	}
	if err := Check("GPU-*"); err != nil {
		t.Error(err)
	}
}
