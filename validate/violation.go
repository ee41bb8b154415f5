package validate

import (
	"errors"
	"fmt"
	"strconv"
)

// Rule names one validation rule. It is an error, so callers can test a result with
// errors.Is(err, validate.RuleDuplicate); its text is the stable rule name to put in
// logs ("plugin X: rule Y").
type Rule string

// Error returns the rule's text.
func (r Rule) Error() string { return string(r) }

// The rules. Plugin-output checks (Fingerprint, Stats, Reservation) report them in a
// *Violation; request checks (ReserveRequest, ReleaseRequest, ReservationFilter) report
// them as the Rule of a *device.FieldError.
const (
	RuleMissing       Rule = "missing"            // a nil message or list element
	RuleEmpty         Rule = "must not be empty"  // an empty string or list
	RuleTooLong       Rule = "too long"           // a string over its length limit
	RuleTooMany       Rule = "too many"           // a list or map over its count limit
	RuleTooLarge      Rule = "too large"          // a message over its encoded byte limit
	RuleInvalidUTF8   Rule = "not valid UTF-8"    // a string that is not UTF-8
	RuleNotPrintable  Rule = "not printable"      // an identifier with control or non-printing characters
	RuleSpaces        Rule = "padded with spaces" // an owner ID that is blank or starts or ends with a space
	RuleDuplicate     Rule = "duplicate"          // an ID, group or device entry seen before
	RuleValueUnset    Rule = "value not set"      // a Value with no kind set
	RuleNotFinite     Rule = "not finite"         // a float that is NaN or ±Inf
	RuleUnknownUnit   Rule = "unknown unit"       // a unit not in KnownUnits
	RuleHealth        Rule = "unknown health"     // a health value outside the enum
	RuleNUMANode      Rule = "invalid NUMA node"  // a NUMA node below -1
	RulePCIBusID      Rule = "invalid PCI bus ID" // not empty and not dddd:bb:dd.f
	RuleUnknownDevice Rule = "unknown device"     // a stats entry for a device not fingerprinted
	RuleTimestamp     Rule = "invalid timestamp"  // a stats timestamp out of range
	RuleEnvName       Rule = "invalid env name"   // not [A-Za-z_][A-Za-z0-9_]*
	RuleEnvDenied     Rule = "env name denied"    // on the deny list (see EnvDenied)
	RuleNUL           Rule = "contains NUL"       // a NUL byte in an env value or path
	RuleNotAbsolute   Rule = "path not absolute"
	RuleDotDot        Rule = "path contains .."
	RuleNotClean      Rule = "path not clean" // path.Clean(p) != p
	RulePermissions   Rule = "invalid permissions"
	RuleCDIName       Rule = "invalid CDI device name"
	RuleNotRequested  Rule = "device not requested" // a CDI device for a device the caller did not ask for
	RuleExactlyOne    Rule = "exactly one of reservation_id and owner_id must be set"
	RuleState         Rule = "unknown reservation state"
	RuleOwnerPrefix   Rule = "invalid owner prefix"  // a take-over prefix that is not "segment/.../"
	RuleAdminTakeOver Rule = "not with admin_access" // an admin access takes nothing over, and takes no plugin options
	RuleOptionKey     Rule = "invalid option key"    // a plugin option key that is not device.PluginOptionKeyPattern
	RuleOwnerLabel    Rule = "unknown owner label"   // an owner label key not in device.OwnerLabelKeys
	// Shared capacity (counter sets).
	RuleUnknownCounterSet Rule = "unknown counter set"         // a device consumes from a set the fingerprint does not declare
	RuleUnknownCounter    Rule = "unknown counter"             // a device consumes a counter its set does not have
	RuleCounterRange      Rule = "counter out of range"        // a capacity or use below 0 or over MaxCounterValue
	RuleOverCapacity      Rule = "consumption over capacity"   // one device alone uses more than the set has
	RuleGroupName         Rule = "invalid compatibility group" // not a DNS label (lowercase letters, digits, "-"; at most 63)
	// RuleTruncated is reported once, last, when more than MaxViolations violations were
	// found; its Detail says how many were left out.
	RuleTruncated Rule = "more violations not shown"
)

// MaxViolations bounds how many violations one call reports, so that a hostile answer
// cannot turn into a huge log line. Past it, one RuleTruncated violation says how many
// more there were.
const MaxViolations = 100

// Violation is one broken rule in plugin output. It unwraps to its Rule.
type Violation struct {
	// Item names what broke the rule, from the top of the message down, e.g.
	// `group[0] "nvidia/gpu/H100": device[2] "GPU-1"`. Strings in it are quoted and
	// cut to a readable length.
	Item string
	Rule Rule
	// Detail is optional context, e.g. "first seen at group[0] device[0]".
	Detail string
}

// Error renders "item: rule (detail)".
func (v *Violation) Error() string {
	s := string(v.Rule)
	if v.Item != "" {
		s = v.Item + ": " + s
	}
	if v.Detail != "" {
		s += " (" + v.Detail + ")"
	}
	return s
}

// Unwrap returns the Rule, so errors.Is(err, RuleX) matches.
func (v *Violation) Unwrap() error { return v.Rule }

// Violations returns every *Violation in err, which may be a single violation or any
// tree of joined and wrapped errors, in order. It returns nil for nil.
func Violations(err error) []*Violation {
	var out []*Violation
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		if v, ok := e.(*Violation); ok {
			out = append(out, v)
			return
		}
		switch u := e.(type) {
		case interface{ Unwrap() []error }:
			for _, c := range u.Unwrap() {
				walk(c)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}

// collector gathers violations up to MaxViolations and counts the rest.
type collector struct {
	errs    []error
	dropped int
}

func (c *collector) add(item string, rule Rule, detail string) {
	if len(c.errs) >= MaxViolations {
		c.dropped++
		return
	}
	c.errs = append(c.errs, &Violation{Item: item, Rule: rule, Detail: detail})
}

// err returns nil or the join of everything collected.
func (c *collector) err() error {
	if c.dropped > 0 {
		c.errs = append(c.errs, &Violation{Rule: RuleTruncated, Detail: fmt.Sprintf("%d more", c.dropped)})
		c.dropped = 0
	}
	return errors.Join(c.errs...)
}

// maxQuoted is how many bytes of a string an item or detail quotes.
const maxQuoted = 64

// q quotes s for an item or detail, cut to maxQuoted bytes. %q keeps control characters
// and invalid UTF-8 from reaching a log line raw.
func q(s string) string {
	if len(s) <= maxQuoted {
		return strconv.Quote(s)
	}
	return strconv.Quote(s[:maxQuoted]) + "..."
}

// at joins an item path: at("group[0]", "vendor") is "group[0]: vendor".
func at(parent, child string) string {
	if parent == "" {
		return child
	}
	return parent + ": " + child
}

func tooLong(n, limit int) string { return fmt.Sprintf("%d bytes, limit %d", n, limit) }

func tooLarge(n, limit int) string { return fmt.Sprintf("%d bytes encoded, limit %d", n, limit) }

func tooMany(n, limit int) string {
	return fmt.Sprintf("%d, limit %d; only the first %d checked", n, limit, limit)
}
