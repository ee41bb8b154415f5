package validate

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/textline"
)

// fields gathers *device.FieldError values for a request, up to MaxViolations; past
// it, it counts the rest and remembers the field where the cut fell.
type fields struct {
	errs      []error
	dropped   int
	firstDrop string
}

func (f *fields) add(field string, rule Rule, detail string) {
	if len(f.errs) >= MaxViolations {
		if f.dropped == 0 {
			f.firstDrop = field
		}
		f.dropped++
		return
	}
	f.errs = append(f.errs, fieldError(field, rule, detail))
}

// err returns nil or the join of everything gathered, ending with one RuleTruncated
// error when some were left out.
func (f *fields) err() error {
	if f.dropped > 0 {
		f.errs = append(f.errs, fieldError(f.firstDrop, RuleTruncated, fmt.Sprintf("%d more", f.dropped)))
		f.dropped = 0
	}
	return errors.Join(f.errs...)
}

func fieldError(field string, rule Rule, detail string) *device.FieldError {
	r := string(rule)
	if detail != "" {
		r += " (" + detail + ")"
	}
	return &device.FieldError{Field: field, Rule: r}
}

// checkID checks an identifier field that must be set: non-empty, at most MaxNameLen
// bytes, valid UTF-8, printable.
func (f *fields) checkID(field, s string) {
	if s == "" {
		f.add(field, RuleEmpty, "")
		return
	}
	f.checkOptionalID(field, s)
}

// idOK reports whether checkID would find nothing wrong with s.
func idOK(s string) bool {
	return s != "" && len(s) <= MaxNameLen && utf8.ValidString(s) && textline.Printable(s)
}

// checkOptionalID checks an identifier field that may be empty.
func (f *fields) checkOptionalID(field, s string) {
	if len(s) > MaxNameLen {
		f.add(field, RuleTooLong, tooLong(len(s), MaxNameLen))
	}
	if !utf8.ValidString(s) {
		f.add(field, RuleInvalidUTF8, "")
	} else if !textline.Printable(s) {
		f.add(field, RuleNotPrintable, "")
	}
}

// checkOwner checks an owner ID: an identifier (checkOptionalID) that is not blank and
// has no leading or trailing space, so that an owner never shows as blank or as another
// owner in a listing. Other white space is already not printable.
func (f *fields) checkOwner(field, s string) {
	f.checkOptionalID(field, s)
	switch {
	case s == "" || !utf8.ValidString(s) || !textline.Printable(s):
	case strings.Trim(s, " ") == "":
		f.add(field, RuleSpaces, "only spaces")
	case s[0] == ' ' || s[len(s)-1] == ' ':
		f.add(field, RuleSpaces, "")
	}
}

// reserveRequest is ReserveRequest's body; see its doc comment for the rules.
func reserveRequest(req device.ReserveRequest) error {
	var f fields
	if req.OwnerID == "" {
		f.add("owner_id", RuleEmpty, "")
	} else {
		f.checkOwner("owner_id", req.OwnerID)
	}
	f.checkID("vendor", req.Group.Vendor)
	f.checkID("type", req.Group.Type)
	f.checkID("name", req.Group.Name)
	ids := req.DeviceIDs
	switch {
	case len(ids) == 0:
		f.add("device_ids", RuleEmpty, "")
	case len(ids) > MaxDevicesPerGroup:
		f.add("device_ids", RuleTooMany, tooMany(len(ids), MaxDevicesPerGroup))
		ids = ids[:MaxDevicesPerGroup]
	}
	seen := make(map[string]int, len(ids))
	for i, id := range ids {
		if _, dup := seen[id]; !dup && idOK(id) { // the fast path: no field name to make
			seen[id] = i
			continue
		}
		field := fmt.Sprintf("device_ids[%d]", i)
		f.checkID(field, id)
		if id == "" {
			continue
		}
		if first, dup := seen[id]; dup {
			f.add(field, RuleDuplicate, fmt.Sprintf("of device_ids[%d]", first))
		} else {
			seen[id] = i
		}
	}
	f.checkPrefixes("take_over_owner_prefixes", req.TakeOverOwnerPrefixes)
	if req.AdminAccess && len(req.TakeOverOwnerPrefixes) > 0 {
		f.add("take_over_owner_prefixes", RuleAdminTakeOver, "")
	}
	f.checkOwnerLabels("owner_labels", req.OwnerLabels)
	f.checkPluginOptions("plugin_options", req.PluginOptions)
	if req.AdminAccess && len(req.PluginOptions) > 0 {
		f.add("plugin_options", RuleAdminTakeOver, "an admin access asks nothing of the plugin")
	}
	return f.err()
}

// checkPluginOptions checks a Reserve's plugin options: at most device.MaxPluginOptions
// (RuleTooMany, nothing else checked), each key device.PluginOptionKeyPattern
// (RuleOptionKey), each value at most device.MaxPluginOptionLen bytes, valid UTF-8 and
// printable. A field is "plugin_options[<key>]", the key escaped and cut to 40 bytes.
func (f *fields) checkPluginOptions(field string, opts map[string]string) {
	if len(opts) > device.MaxPluginOptions { // not sorted nor searched: a huge map costs nothing more
		f.add(field, RuleTooMany, fmt.Sprintf("%d, limit %d", len(opts), device.MaxPluginOptions))
		return
	}
	for _, k := range slices.Sorted(maps.Keys(opts)) {
		v := opts[k]
		if optionKeyOK(k) && len(v) <= device.MaxPluginOptionLen && utf8.ValidString(v) && textline.Printable(v) {
			continue // the fast path: no field name to make
		}
		name := fmt.Sprintf("%s[%s]", field, textline.Escape(k, 40))
		if !optionKeyOK(k) {
			f.add(name, RuleOptionKey, "want "+device.PluginOptionKeyPattern)
			continue
		}
		f.checkTextValue(name, v, device.MaxPluginOptionLen)
	}
}

// checkTextValue checks a map's value v (of field name): at most limit bytes
// (RuleTooLong), valid UTF-8, printable; the first rule it breaks is added.
func (f *fields) checkTextValue(name, v string, limit int) {
	switch {
	case len(v) > limit:
		f.add(name, RuleTooLong, tooLong(len(v), limit))
	case !utf8.ValidString(v):
		f.add(name, RuleInvalidUTF8, "")
	case !textline.Printable(v):
		f.add(name, RuleNotPrintable, "")
	}
}

// optionKeyOK reports whether k matches device.PluginOptionKeyPattern,
// ^[a-z][a-z0-9_]{0,62}$, without a regexp on the Reserve path.
func optionKeyOK(k string) bool {
	if k == "" || len(k) > 63 || k[0] < 'a' || k[0] > 'z' {
		return false
	}
	for i := 1; i < len(k); i++ {
		if c := k[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// checkOwnerLabels checks a Reserve's owner labels: at most as many as
// device.OwnerLabelKeys (RuleTooMany, nothing else checked), keys among them, each value non-empty, at most
// device.MaxOwnerLabelLen bytes, valid UTF-8 and printable. A field is
// "owner_labels[<key>]", the key escaped and cut to 40 bytes, whatever it holds.
func (f *fields) checkOwnerLabels(field string, labels map[string]string) {
	if len(labels) > len(device.OwnerLabelKeys) { // not sorted nor searched: a huge map costs nothing more
		f.add(field, RuleTooMany, fmt.Sprintf("%d, limit %d: %s", len(labels), len(device.OwnerLabelKeys), strings.Join(device.OwnerLabelKeys, ", ")))
		return
	}
	if ownerLabelsOK(labels) { // the fast path: no field names to make
		return
	}
	f.checkEachOwnerLabel(field, labels)
}

// ownerLabelsOK reports whether checkEachOwnerLabel would find nothing wrong.
func ownerLabelsOK(labels map[string]string) bool {
	for k, v := range labels {
		if !slices.Contains(device.OwnerLabelKeys, k) || v == "" || len(v) > device.MaxOwnerLabelLen ||
			!utf8.ValidString(v) || !textline.Printable(v) {
			return false
		}
	}
	return true
}

// checkEachOwnerLabel is checkOwnerLabels' check of each label, in key order.
func (f *fields) checkEachOwnerLabel(field string, labels map[string]string) {
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		name := fmt.Sprintf("%s[%s]", field, textline.Escape(k, 40))
		if !slices.Contains(device.OwnerLabelKeys, k) {
			f.add(name, RuleOwnerLabel, "want one of "+strings.Join(device.OwnerLabelKeys, ", "))
			continue
		}
		if v := labels[k]; v == "" {
			f.add(name, RuleEmpty, "")
		} else {
			f.checkTextValue(name, v, device.MaxOwnerLabelLen)
		}
	}
}

// checkPrefixes checks take-over owner prefixes: at most MaxTakeOverPrefixes, none
// repeated, each an owner ID's start that names whole segments: non-empty, ending with
// "/", not starting with "/" and without an empty segment ("//"), so that no prefix can
// match every owner or cut an owner's segment in two. An owner's other rules apply too
// (length, UTF-8, printable, no leading space).
func (f *fields) checkPrefixes(field string, prefixes []string) {
	if len(prefixes) > MaxTakeOverPrefixes {
		f.add(field, RuleTooMany, tooMany(len(prefixes), MaxTakeOverPrefixes))
		prefixes = prefixes[:MaxTakeOverPrefixes]
	}
	seen := make(map[string]int, len(prefixes))
	for i, p := range prefixes {
		name := fmt.Sprintf("%s[%d]", field, i)
		if p == "" {
			f.add(name, RuleEmpty, "")
			continue
		}
		f.checkOwner(name, p)
		switch {
		case !strings.HasSuffix(p, "/"):
			f.add(name, RuleOwnerPrefix, `must end with "/"`)
		case p[0] == '/':
			f.add(name, RuleOwnerPrefix, `must not start with "/"`)
		case strings.Contains(p, "//"):
			f.add(name, RuleOwnerPrefix, `empty segment ("//")`)
		}
		if first, dup := seen[p]; dup {
			f.add(name, RuleDuplicate, fmt.Sprintf("of %s[%d]", field, first))
		} else {
			seen[p] = i
		}
	}
}

// releaseRequest is ReleaseRequest's body; see its doc comment for the rules.
func releaseRequest(req device.ReleaseRequest) error {
	var f fields
	switch {
	case req.ReservationID == "" && req.OwnerID == "":
		f.add("reservation_id", RuleExactlyOne, "neither is set")
	case req.ReservationID != "" && req.OwnerID != "":
		f.add("reservation_id", RuleExactlyOne, "both are set")
	}
	f.checkOptionalID("reservation_id", req.ReservationID)
	f.checkOwner("owner_id", req.OwnerID)
	return f.err()
}

// reservationFilter is ReservationFilter's body; see its doc comment for the rules.
func reservationFilter(flt device.ReservationFilter) error {
	var f fields
	f.checkOptionalID("owner_id", flt.OwnerID)
	f.checkOptionalID("device_id", flt.DeviceID)
	switch flt.State {
	case device.ReservationAny, device.ReservationActive, device.ReservationReleased:
	default:
		f.add("state", RuleState, fmt.Sprintf("value %d", int(flt.State)))
	}
	return f.err()
}

// reownRequest is ReownRequest's body; see its doc comment for the rules.
func reownRequest(req device.ReownRequest) error {
	var f fields
	f.checkID("reservation_id", req.ReservationID)
	for _, o := range []struct{ field, id string }{{"owner_id", req.OwnerID}, {"new_owner_id", req.NewOwnerID}} {
		if o.id == "" {
			f.add(o.field, RuleEmpty, "")
		} else {
			f.checkOwner(o.field, o.id)
		}
	}
	return f.err()
}

// streamFilter is StreamFilter's body; see its doc comment for the rules.
func streamFilter(groups, plugins int) error {
	var errs []error
	if groups > MaxStreamFilters {
		errs = append(errs, &device.FieldError{Field: "groups", Rule: fmt.Sprintf("at most %d filters; got %d", MaxStreamFilters, groups)})
	}
	if plugins > MaxStreamFilters {
		errs = append(errs, &device.FieldError{Field: "plugins", Rule: fmt.Sprintf("at most %d plugin names; got %d", MaxStreamFilters, plugins)})
	}
	return errors.Join(errs...)
}

// statsInterval is StatsInterval's body; see its doc comment for the rules.
func statsInterval(d time.Duration) error {
	switch {
	case d < 0:
		return errors.Join(&device.FieldError{Field: "interval", Rule: "must not be negative"})
	case d > MaxStatsInterval:
		return errors.Join(&device.FieldError{Field: "interval", Rule: fmt.Sprintf("at most %v; got %v", MaxStatsInterval, d)})
	}
	return nil
}

// cordonRequest is CordonRequest's body; see its doc comment for the rules.
func cordonRequest(req device.CordonRequest) error {
	var f fields
	f.checkID("device_id", req.DeviceID)
	// The reason is shown wherever the device is refused: an owner's rules (printable,
	// not blank nor padded) at MaxNameLen bytes.
	if req.Reason == "" {
		f.add("reason", RuleEmpty, "say why the device is out of service")
	} else {
		f.checkOwner("reason", req.Reason)
	}
	return f.err()
}

// eventFilter is EventFilter's body; see its doc comment for the rules.
func eventFilter(f device.EventFilter) error {
	var fs fields
	fs.checkOptionalID("owner_id", f.Owner)
	fs.checkOptionalID("device_id", f.Device)
	return fs.err()
}

// uncordonRequest is UncordonRequest's body.
func uncordonRequest(deviceID string) error {
	var f fields
	f.checkID("device_id", deviceID)
	return f.err()
}
