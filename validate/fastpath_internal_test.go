package validate

import (
	"strings"
	"testing"
)

// fastPathInputs are strings each rule of the full checks turns on.
var fastPathInputs = []string{
	"", " ", "a", "/", "/dev/nvidia0", "dev/nvidia0", "/a/../b", "/..", "/a//b", "/a/./b", "/a/",
	"/a\x00b", "/\xff", "/é", "/a b", "\t", "NVIDIA_VISIBLE_DEVICES", "_X1", "1X", "X-Y", "LD_PRELOAD",
	"PATH", "GPU-0", "owner\x7f", "é", strings.Repeat("a", MaxNameLen), strings.Repeat("a", MaxNameLen+1),
	"/" + strings.Repeat("a", MaxPathLen), strings.Repeat("v", MaxEnvValueLen+1), "nvidia.com/gpu=GPU-0",
}

// agree checks that each fast path says "fine" exactly when its full check finds
// nothing, for s as every kind of input it judges.
func agree(t *testing.T, s string) {
	t.Helper()
	var c collector
	c.checkPath("p", s)
	if got, want := pathOK(s), len(c.errs) == 0; got != want {
		t.Errorf("pathOK(%q) = %v, but checkPath found %v", s, got, c.errs)
	}
	for _, env := range []map[string]string{{s: "v"}, {"NAME": s}} {
		var c collector
		c.checkEnvs(env)
		if got, want := allEnvsOK(env), len(c.errs) == 0; got != want {
			t.Errorf("allEnvsOK(%q) = %v, but checkEnvs found %v", env, got, c.errs)
		}
	}
	var f fields
	f.checkID("id", s)
	if got, want := idOK(s), len(f.errs) == 0; got != want {
		t.Errorf("idOK(%q) = %v, but checkID found %v", s, got, f.errs)
	}
	for _, labels := range []map[string]string{{"pod": s}, {s: "p"}} {
		var f fields
		f.checkEachOwnerLabel("owner_labels", labels)
		if got, want := ownerLabelsOK(labels), len(f.errs) == 0; got != want {
			t.Errorf("ownerLabelsOK(%q) = %v, but the full check found %v", labels, got, f.errs)
		}
	}
}

// TestFastPathsAgreeWithTheChecks: the fast paths of a valid answer or request accept
// exactly what the full checks find nothing wrong with, so skipping the full checks
// never lets anything through.
func TestFastPathsAgreeWithTheChecks(t *testing.T) {
	for _, s := range fastPathInputs {
		agree(t, s)
	}
}

func FuzzFastPathsAgreeWithTheChecks(f *testing.F) {
	for _, s := range fastPathInputs {
		f.Add(s)
	}
	f.Fuzz(agree)
}
