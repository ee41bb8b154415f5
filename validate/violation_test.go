package validate_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/devicehost/devicehost/validate"
)

func TestViolationError(t *testing.T) {
	tests := []struct {
		v    validate.Violation
		want string
	}{
		{validate.Violation{Item: `env "PATH"`, Rule: validate.RuleEnvDenied}, `env "PATH": env name denied`},
		{validate.Violation{Item: "devices", Rule: validate.RuleTooMany, Detail: "5000, limit 4096"}, "devices: too many (5000, limit 4096)"},
		{validate.Violation{Rule: validate.RuleTruncated, Detail: "3 more"}, "more violations not shown (3 more)"},
	}
	for _, tt := range tests {
		if got := tt.v.Error(); got != tt.want {
			t.Errorf("Error() = %q, want %q", got, tt.want)
		}
	}
}

// TestViolationsThroughWrapping checks that the manager can wrap a validation error
// ("plugin x: %w") and still list the violations and match their rules.
func TestViolationsThroughWrapping(t *testing.T) {
	a := &validate.Violation{Item: "a", Rule: validate.RuleEmpty}
	b := &validate.Violation{Item: "b", Rule: validate.RuleDuplicate}
	c := &validate.Violation{Item: "c", Rule: validate.RuleNUL}
	err := fmt.Errorf("plugin x: %w", errors.Join(a, fmt.Errorf("inner: %w", errors.Join(b, errors.New("other"))), c))
	if got, want := validate.Violations(err), []*validate.Violation{a, b, c}; !slices.Equal(got, want) {
		t.Errorf("Violations() = %v, want %v", got, want)
	}
	for _, r := range []validate.Rule{validate.RuleEmpty, validate.RuleDuplicate, validate.RuleNUL} {
		if !errors.Is(err, r) {
			t.Errorf("errors.Is(err, %q) = false, want true", r)
		}
	}
	if errors.Is(err, validate.RuleTooMany) {
		t.Errorf("errors.Is(err, %q) = true for a rule that was not broken", validate.RuleTooMany)
	}
	if got := validate.Violations(nil); got != nil {
		t.Errorf("Violations(nil) = %v, want nil", got)
	}
	if got := validate.Violations(errors.New("plain")); got != nil {
		t.Errorf("Violations(plain error) = %v, want nil", got)
	}
}

func TestKnownUnits(t *testing.T) {
	want := []string{"", "%", "B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "MHz", "GHz",
		"W", "mW", "C", "V", "mV", "MB/s", "GB/s", "ns", "us", "ms", "s", "count", "rpm"}
	slices.Sort(want)
	got := validate.KnownUnits()
	if !slices.Equal(got, want) {
		t.Errorf("KnownUnits() = %q, want %q", got, want)
	}
	for _, u := range want {
		if !validate.KnownUnit(u) {
			t.Errorf("KnownUnit(%q) = false, want true", u)
		}
	}
	for _, u := range []string{"mib", "K", "F", "Watts", " W"} {
		if validate.KnownUnit(u) {
			t.Errorf("KnownUnit(%q) = true, want false", u)
		}
	}
	got[1] = "changed"
	if validate.KnownUnits()[1] == "changed" {
		t.Error("changing the slice KnownUnits returned changed the package's list")
	}
}
