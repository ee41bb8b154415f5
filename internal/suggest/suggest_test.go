package suggest

import "testing"

func TestNearest(t *testing.T) {
	known := []string{"simulate", "mig", "mig_layout", "replicas", "after", "for"}
	tests := []struct {
		given string
		want  string
	}{
		{"mgi", "mig"},               // a transposition: two edits
		{"mig_layuot", "mig_layout"}, // nearer than "mig"
		{"simulat", "simulate"},      // one deletion
		{"replica", "replicas"},      // one insertion
		{"fro", "for"},               // equally close to none other
		{"mig", ""},                  // known: nothing to suggest
		{"completely_else", ""},      // too far from everything
		{"", ""},                     // three edits from the shortest
		{"fo", "for"},                // one edit from "for", two from "mig"
	}
	for _, tt := range tests {
		if got := Nearest(tt.given, known); got != tt.want {
			t.Errorf("Nearest(%q): got %q, want %q", tt.given, got, tt.want)
		}
	}
}

func TestNearestTiesGoToTheFirst(t *testing.T) {
	if got := Nearest("ab", []string{"ax", "ay"}); got != "ax" {
		t.Errorf(`Nearest("ab", ["ax", "ay"]): got %q, want "ax"`, got)
	}
	if got := Nearest("ab", nil); got != "" {
		t.Errorf(`Nearest("ab", nil): got %q, want ""`, got)
	}
}
