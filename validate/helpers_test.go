package validate_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/validate"
)

// found is the machine-checkable part of a violation.
type found struct {
	Item string
	Rule validate.Rule
}

// foundIn returns the item and rule of every violation in err, in order.
func foundIn(err error) []found {
	var out []found
	for _, v := range validate.Violations(err) {
		out = append(out, found{v.Item, v.Rule})
	}
	return out
}

// checkViolations fails t unless err holds exactly the violations want, in order, and
// errors.Is finds each wanted rule in err.
func checkViolations(t *testing.T, err error, want []found) {
	t.Helper()
	got := foundIn(err)
	if !slices.Equal(got, want) {
		t.Errorf("violations:\n got  %s\n want %s\nerror: %v", fmtFound(got), fmtFound(want), err)
	}
	if len(want) == 0 && err != nil {
		t.Errorf("got error %v, want nil", err)
	}
	for _, w := range want {
		if !errors.Is(err, w.Rule) {
			t.Errorf("errors.Is(err, %q) = false, want true", w.Rule)
		}
	}
}

func fmtFound(fs []found) string {
	if len(fs) == 0 {
		return "none"
	}
	var b strings.Builder
	for i, f := range fs {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(f.Item + " => " + string(f.Rule))
	}
	return b.String()
}
