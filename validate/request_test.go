package validate_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/validate"
)

// fieldErrors returns the *device.FieldError values joined in err, in order, and fails
// t if err holds anything else or does not match device.ErrInvalidRequest.
func fieldErrors(t *testing.T, err error) []device.FieldError {
	t.Helper()
	if err == nil {
		return nil
	}
	if !errors.Is(err, device.ErrInvalidRequest) {
		t.Errorf("errors.Is(%v, ErrInvalidRequest) = false, want true", err)
	}
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("error %T is not a join", err)
	}
	var out []device.FieldError
	for _, e := range joined.Unwrap() {
		fe, ok := e.(*device.FieldError)
		if !ok {
			t.Fatalf("joined error %T (%v), want *device.FieldError", e, e)
		}
		out = append(out, *fe)
	}
	return out
}

// fe builds a wanted FieldError from a rule and an optional detail, as the package
// renders them.
func fe(field string, rule validate.Rule, detail ...string) device.FieldError {
	r := string(rule)
	if len(detail) > 0 {
		r += " (" + detail[0] + ")"
	}
	return device.FieldError{Field: field, Rule: r}
}

func checkFieldErrors(t *testing.T, err error, want []device.FieldError) {
	t.Helper()
	if got := fieldErrors(t, err); !slices.Equal(got, want) {
		t.Errorf("field errors:\n got  %+v\n want %+v", got, want)
	}
}

func TestReserveRequest(t *testing.T) {
	good := func() device.ReserveRequest {
		return device.ReserveRequest{
			OwnerID:   "alloc-1f2e",
			Group:     device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3"},
			DeviceIDs: []string{"GPU-0", "GPU-1"},
		}
	}
	long := strings.Repeat("o", validate.MaxNameLen+1)
	tests := []struct {
		name   string
		mutate func(*device.ReserveRequest)
		want   []device.FieldError
	}{
		{name: "good", mutate: func(*device.ReserveRequest) {}},
		{name: "owner_id empty", mutate: func(r *device.ReserveRequest) { r.OwnerID = "" }, want: []device.FieldError{fe("owner_id", validate.RuleEmpty)}},
		{
			name:   "owner_id too long",
			mutate: func(r *device.ReserveRequest) { r.OwnerID = long },
			want:   []device.FieldError{fe("owner_id", validate.RuleTooLong, fmt.Sprintf("%d bytes, limit %d", len(long), validate.MaxNameLen))},
		},
		{name: "owner_id not UTF-8", mutate: func(r *device.ReserveRequest) { r.OwnerID = "a\xff" }, want: []device.FieldError{fe("owner_id", validate.RuleInvalidUTF8)}},
		{name: "owner_id with newline", mutate: func(r *device.ReserveRequest) { r.OwnerID = "a\nb" }, want: []device.FieldError{fe("owner_id", validate.RuleNotPrintable)}},
		{name: "owner_id with tab", mutate: func(r *device.ReserveRequest) { r.OwnerID = "a\tb" }, want: []device.FieldError{fe("owner_id", validate.RuleNotPrintable)}},
		{name: "owner_id not ASCII is fine", mutate: func(r *device.ReserveRequest) { r.OwnerID = "job-é" }},
		{name: "owner_id inner spaces are fine", mutate: func(r *device.ReserveRequest) { r.OwnerID = "k8s/ns/my pod" }},
		{name: "owner_id only spaces", mutate: func(r *device.ReserveRequest) { r.OwnerID = "   " }, want: []device.FieldError{fe("owner_id", validate.RuleSpaces, "only spaces")}},
		{name: "owner_id leading space", mutate: func(r *device.ReserveRequest) { r.OwnerID = " job-lead" }, want: []device.FieldError{fe("owner_id", validate.RuleSpaces)}},
		{name: "owner_id trailing space", mutate: func(r *device.ReserveRequest) { r.OwnerID = "job-lead " }, want: []device.FieldError{fe("owner_id", validate.RuleSpaces)}},
		{name: "owner_id no-break space", mutate: func(r *device.ReserveRequest) { r.OwnerID = "\u00a0job" }, want: []device.FieldError{fe("owner_id", validate.RuleNotPrintable)}},
		{name: "vendor empty", mutate: func(r *device.ReserveRequest) { r.Group.Vendor = "" }, want: []device.FieldError{fe("vendor", validate.RuleEmpty)}},
		{name: "type empty", mutate: func(r *device.ReserveRequest) { r.Group.Type = "" }, want: []device.FieldError{fe("type", validate.RuleEmpty)}},
		{name: "name empty", mutate: func(r *device.ReserveRequest) { r.Group.Name = "" }, want: []device.FieldError{fe("name", validate.RuleEmpty)}},
		{name: "device_ids nil", mutate: func(r *device.ReserveRequest) { r.DeviceIDs = nil }, want: []device.FieldError{fe("device_ids", validate.RuleEmpty)}},
		{
			name:   "device ID empty",
			mutate: func(r *device.ReserveRequest) { r.DeviceIDs = []string{"GPU-0", ""} },
			want:   []device.FieldError{fe("device_ids[1]", validate.RuleEmpty)},
		},
		{
			name:   "device ID duplicate",
			mutate: func(r *device.ReserveRequest) { r.DeviceIDs = []string{"GPU-0", "GPU-1", "GPU-2", "GPU-0"} },
			want:   []device.FieldError{fe("device_ids[3]", validate.RuleDuplicate, "of device_ids[0]")},
		},
		{
			name: "too many device IDs",
			mutate: func(r *device.ReserveRequest) {
				r.DeviceIDs = nil
				for i := range validate.MaxDevicesPerGroup + 1 {
					r.DeviceIDs = append(r.DeviceIDs, fmt.Sprint("GPU-", i))
				}
			},
			want: []device.FieldError{fe("device_ids", validate.RuleTooMany,
				fmt.Sprintf("%d, limit %d; only the first %[2]d checked", validate.MaxDevicesPerGroup+1, validate.MaxDevicesPerGroup))},
		},
		{
			name: "take-over prefixes that are fine",
			mutate: func(r *device.ReserveRequest) {
				r.TakeOverOwnerPrefixes = []string{"nomad/", "kubelet/nvidia.com/gpu/", "k8s/ns/pod/"}
			},
		},
		{
			name: "take-over prefix malformed",
			mutate: func(r *device.ReserveRequest) {
				r.TakeOverOwnerPrefixes = []string{"", "nomad", "/", "/nomad/", "k8s//x/", " nomad/", "no\nmad/", "nomad/", long + "/"}
			},
			want: []device.FieldError{
				fe("take_over_owner_prefixes[0]", validate.RuleEmpty),
				fe("take_over_owner_prefixes[1]", validate.RuleOwnerPrefix, `must end with "/"`),
				fe("take_over_owner_prefixes[2]", validate.RuleOwnerPrefix, `must not start with "/"`),
				fe("take_over_owner_prefixes[3]", validate.RuleOwnerPrefix, `must not start with "/"`),
				fe("take_over_owner_prefixes[4]", validate.RuleOwnerPrefix, `empty segment ("//")`),
				fe("take_over_owner_prefixes[5]", validate.RuleSpaces),
				fe("take_over_owner_prefixes[6]", validate.RuleNotPrintable),
				fe("take_over_owner_prefixes[8]", validate.RuleTooLong, fmt.Sprintf("%d bytes, limit %d", len(long)+1, validate.MaxNameLen)),
			},
		},
		{name: "admin access", mutate: func(r *device.ReserveRequest) { r.AdminAccess = true }},
		{
			name:   "owner labels of the pods",
			mutate: func(r *device.ReserveRequest) { r.OwnerLabels = map[string]string{"pod": "a,b", "namespace": "ml"} },
		},
		{
			name: "owner labels malformed",
			mutate: func(r *device.ReserveRequest) {
				r.OwnerLabels = map[string]string{"pod": strings.Repeat("p", device.MaxOwnerLabelLen+1), "namespace": ""}
			},
			want: []device.FieldError{
				fe(`owner_labels[namespace]`, validate.RuleEmpty),
				fe(`owner_labels[pod]`, validate.RuleTooLong, fmt.Sprintf("%d bytes, limit %d", device.MaxOwnerLabelLen+1, device.MaxOwnerLabelLen)),
			},
		},
		{
			name:   "owner label not printable",
			mutate: func(r *device.ReserveRequest) { r.OwnerLabels = map[string]string{"pod": "a\x1b[2Jb"} },
			want:   []device.FieldError{fe(`owner_labels[pod]`, validate.RuleNotPrintable)},
		},
		{
			name:   "owner label of an unknown key, escaped",
			mutate: func(r *device.ReserveRequest) { r.OwnerLabels = map[string]string{"gpu\n" + long: "0"} },
			want:   []device.FieldError{fe(`owner_labels[gpu\n`+strings.Repeat("o", 32)+`...]`, validate.RuleOwnerLabel, "want one of pod, namespace")},
		},
		{
			name: "too many owner labels",
			mutate: func(r *device.ReserveRequest) {
				r.OwnerLabels = map[string]string{"pod": "a", "namespace": "b", "container": "c"}
			},
			want: []device.FieldError{fe("owner_labels", validate.RuleTooMany, "3, limit 2: pod, namespace")},
		},
		{
			name: "plugin options at their bounds",
			mutate: func(r *device.ReserveRequest) {
				r.PluginOptions = map[string]string{"mps_isolation": "per-holder", "z" + strings.Repeat("9", 62): strings.Repeat("v", device.MaxPluginOptionLen), "e": ""}
				for i := range device.MaxPluginOptions - 3 {
					r.PluginOptions[fmt.Sprintf("o%d", i)] = "a b,c=d é"
				}
			},
		},
		{
			name: "too many plugin options",
			mutate: func(r *device.ReserveRequest) {
				r.PluginOptions = map[string]string{}
				for i := range device.MaxPluginOptions + 1 {
					r.PluginOptions[fmt.Sprintf("o%d", i)] = "v"
				}
			},
			want: []device.FieldError{fe("plugin_options", validate.RuleTooMany, "9, limit 8")},
		},
		{
			name: "plugin option keys off the pattern, escaped",
			mutate: func(r *device.ReserveRequest) {
				r.PluginOptions = map[string]string{"Mps": "a", "9a": "b", "": "c", "a-b": "d", "a\x1b": "e", "k\n" + long: "f", "a" + strings.Repeat("b", 63): "g"}
			},
			want: []device.FieldError{
				fe(`plugin_options[]`, validate.RuleOptionKey, "want "+device.PluginOptionKeyPattern),
				fe(`plugin_options[9a]`, validate.RuleOptionKey, "want "+device.PluginOptionKeyPattern),
				fe(`plugin_options[Mps]`, validate.RuleOptionKey, "want "+device.PluginOptionKeyPattern),
				fe(`plugin_options[a\x1b]`, validate.RuleOptionKey, "want "+device.PluginOptionKeyPattern),
				fe(`plugin_options[a-b]`, validate.RuleOptionKey, "want "+device.PluginOptionKeyPattern),
				fe(`plugin_options[a`+strings.Repeat("b", 36)+`...]`, validate.RuleOptionKey, "want "+device.PluginOptionKeyPattern),
				fe(`plugin_options[k\n`+strings.Repeat("o", 34)+`...]`, validate.RuleOptionKey, "want "+device.PluginOptionKeyPattern),
			},
		},
		{
			name: "plugin option values too long, not UTF-8, not printable",
			mutate: func(r *device.ReserveRequest) {
				r.PluginOptions = map[string]string{"a": strings.Repeat("v", device.MaxPluginOptionLen+1), "b": "x\xffy", "c": "shared\n", "d": "a\x1b[2Jb"}
			},
			want: []device.FieldError{
				fe(`plugin_options[a]`, validate.RuleTooLong, "257 bytes, limit 256"),
				fe(`plugin_options[b]`, validate.RuleInvalidUTF8),
				fe(`plugin_options[c]`, validate.RuleNotPrintable),
				fe(`plugin_options[d]`, validate.RuleNotPrintable),
			},
		},
		{
			name: "plugin options with admin access",
			mutate: func(r *device.ReserveRequest) {
				r.AdminAccess, r.PluginOptions = true, map[string]string{"mps_isolation": "shared"}
			},
			want: []device.FieldError{fe("plugin_options", validate.RuleAdminTakeOver, "an admin access asks nothing of the plugin")},
		},
		{
			name:   "admin access taking over",
			mutate: func(r *device.ReserveRequest) { r.AdminAccess, r.TakeOverOwnerPrefixes = true, []string{"nomad/"} },
			want:   []device.FieldError{fe("take_over_owner_prefixes", validate.RuleAdminTakeOver)},
		},
		{
			name:   "take-over prefix duplicate",
			mutate: func(r *device.ReserveRequest) { r.TakeOverOwnerPrefixes = []string{"nomad/", "k8s/", "nomad/"} },
			want:   []device.FieldError{fe("take_over_owner_prefixes[2]", validate.RuleDuplicate, "of take_over_owner_prefixes[0]")},
		},
		{
			name: "too many take-over prefixes",
			mutate: func(r *device.ReserveRequest) {
				for i := range validate.MaxTakeOverPrefixes + 1 {
					r.TakeOverOwnerPrefixes = append(r.TakeOverOwnerPrefixes, fmt.Sprintf("p%d/", i))
				}
			},
			want: []device.FieldError{fe("take_over_owner_prefixes", validate.RuleTooMany,
				fmt.Sprintf("%d, limit %d; only the first %[2]d checked", validate.MaxTakeOverPrefixes+1, validate.MaxTakeOverPrefixes))},
		},
		{
			name: "every violation is reported",
			mutate: func(r *device.ReserveRequest) {
				r.OwnerID = ""
				r.Group = device.GroupKey{}
				r.DeviceIDs = []string{"a", "", "a\x00", "a"}
			},
			want: []device.FieldError{
				fe("owner_id", validate.RuleEmpty),
				fe("vendor", validate.RuleEmpty),
				fe("type", validate.RuleEmpty),
				fe("name", validate.RuleEmpty),
				fe("device_ids[1]", validate.RuleEmpty),
				fe("device_ids[2]", validate.RuleNotPrintable),
				fe("device_ids[3]", validate.RuleDuplicate, "of device_ids[0]"),
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := good()
			tt.mutate(&req)
			checkFieldErrors(t, validate.ReserveRequest(req), tt.want)
		})
	}
}

// TestReserveRequestViolationCap checks that a request with more than MaxViolations
// violations reports the first MaxViolations and one RuleTruncated naming the field
// where the cut fell and counting the rest, as plugin-output checks do.
func TestReserveRequestViolationCap(t *testing.T) {
	const extra = 30
	req := device.ReserveRequest{OwnerID: "o", Group: device.GroupKey{Vendor: "v", Type: "t", Name: "n"}}
	req.DeviceIDs = make([]string, validate.MaxViolations+extra) // every one empty
	got := fieldErrors(t, validate.ReserveRequest(req))
	if len(got) != validate.MaxViolations+1 {
		t.Fatalf("got %d field errors, want %d", len(got), validate.MaxViolations+1)
	}
	want := fe(fmt.Sprintf("device_ids[%d]", validate.MaxViolations), validate.RuleTruncated, fmt.Sprintf("%d more", extra))
	if last := got[len(got)-1]; last != want {
		t.Errorf("last field error = %+v, want %+v", last, want)
	}
}

func TestReserveRequestMessage(t *testing.T) {
	err := validate.ReserveRequest(device.ReserveRequest{
		OwnerID: "o", Group: device.GroupKey{Vendor: "v", Type: "t", Name: "n"}, DeviceIDs: []string{"a", "a"},
	})
	want := "invalid request: device_ids[1]: duplicate (of device_ids[0])"
	if err == nil || err.Error() != want {
		t.Errorf("ReserveRequest() = %v, want %s", err, want)
	}
}

func TestReleaseRequest(t *testing.T) {
	tests := []struct {
		name string
		req  device.ReleaseRequest
		want []device.FieldError
	}{
		{name: "by reservation", req: device.ReleaseRequest{ReservationID: "r-1"}},
		{name: "by owner", req: device.ReleaseRequest{OwnerID: "alloc-1"}},
		{name: "neither", want: []device.FieldError{fe("reservation_id", validate.RuleExactlyOne, "neither is set")}},
		{
			name: "both",
			req:  device.ReleaseRequest{ReservationID: "r-1", OwnerID: "alloc-1"},
			want: []device.FieldError{fe("reservation_id", validate.RuleExactlyOne, "both are set")},
		},
		{
			name: "owner only spaces",
			req:  device.ReleaseRequest{OwnerID: "   "},
			want: []device.FieldError{fe("owner_id", validate.RuleSpaces, "only spaces")},
		},
		{
			name: "owner space-padded",
			req:  device.ReleaseRequest{OwnerID: " job-lead"},
			want: []device.FieldError{fe("owner_id", validate.RuleSpaces)},
		},
		{
			name: "owner not printable",
			req:  device.ReleaseRequest{OwnerID: "a\x1b[31m"},
			want: []device.FieldError{fe("owner_id", validate.RuleNotPrintable)},
		},
		{
			name: "reservation ID too long",
			req:  device.ReleaseRequest{ReservationID: strings.Repeat("r", validate.MaxNameLen+1)},
			want: []device.FieldError{fe("reservation_id", validate.RuleTooLong, fmt.Sprintf("%d bytes, limit %d", validate.MaxNameLen+1, validate.MaxNameLen))},
		},
		{
			name: "every violation is reported",
			req:  device.ReleaseRequest{ReservationID: "\xff", OwnerID: "a\n"},
			want: []device.FieldError{
				fe("reservation_id", validate.RuleExactlyOne, "both are set"),
				fe("reservation_id", validate.RuleInvalidUTF8),
				fe("owner_id", validate.RuleNotPrintable),
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkFieldErrors(t, validate.ReleaseRequest(tt.req), tt.want)
		})
	}
}

func TestReownRequest(t *testing.T) {
	ok := device.ReownRequest{ReservationID: "r-1", OwnerID: "kubelet/nvidia.com/gpu/0123456789abcdef", NewOwnerID: "k8s/ml/trainer-0/main"}
	with := func(f func(*device.ReownRequest)) device.ReownRequest {
		r := ok
		f(&r)
		return r
	}
	tests := []struct {
		name string
		req  device.ReownRequest
		want []device.FieldError
	}{
		{name: "valid", req: ok},
		{name: "nothing set", want: []device.FieldError{
			fe("reservation_id", validate.RuleEmpty), fe("owner_id", validate.RuleEmpty), fe("new_owner_id", validate.RuleEmpty),
		}},
		{name: "new owner space-padded", req: with(func(r *device.ReownRequest) { r.NewOwnerID = "k8s/a/b/c " }),
			want: []device.FieldError{fe("new_owner_id", validate.RuleSpaces)}},
		{name: "new owner not printable", req: with(func(r *device.ReownRequest) { r.NewOwnerID = "k8s/a\nb" }),
			want: []device.FieldError{fe("new_owner_id", validate.RuleNotPrintable)}},
		{name: "new owner too long", req: with(func(r *device.ReownRequest) { r.NewOwnerID = strings.Repeat("o", validate.MaxNameLen+1) }),
			want: []device.FieldError{fe("new_owner_id", validate.RuleTooLong, fmt.Sprintf("%d bytes, limit %d", validate.MaxNameLen+1, validate.MaxNameLen))}},
		{name: "owner only spaces", req: with(func(r *device.ReownRequest) { r.OwnerID = "  " }),
			want: []device.FieldError{fe("owner_id", validate.RuleSpaces, "only spaces")}},
		{name: "reservation ID invalid UTF-8", req: with(func(r *device.ReownRequest) { r.ReservationID = "\xff" }),
			want: []device.FieldError{fe("reservation_id", validate.RuleInvalidUTF8)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkFieldErrors(t, validate.ReownRequest(tt.req), tt.want)
		})
	}
}

func TestCordonRequest(t *testing.T) {
	tests := []struct {
		name string
		req  device.CordonRequest
		want []device.FieldError
	}{
		{name: "valid", req: device.CordonRequest{DeviceID: "GPU-0", Reason: "ECC storm"}},
		{name: "nothing set", want: []device.FieldError{
			fe("device_id", validate.RuleEmpty), fe("reason", validate.RuleEmpty, "say why the device is out of service"),
		}},
		{name: "reason that would fake a line", req: device.CordonRequest{DeviceID: "GPU-0", Reason: "ok\nGPU-1 healthy"},
			want: []device.FieldError{fe("reason", validate.RuleNotPrintable)}},
		{name: "reason too long", req: device.CordonRequest{DeviceID: "GPU-0", Reason: strings.Repeat("r", validate.MaxNameLen+1)},
			want: []device.FieldError{fe("reason", validate.RuleTooLong, fmt.Sprintf("%d bytes, limit %d", validate.MaxNameLen+1, validate.MaxNameLen))}},
		{name: "blank reason", req: device.CordonRequest{DeviceID: "GPU-0", Reason: "   "},
			want: []device.FieldError{fe("reason", validate.RuleSpaces, "only spaces")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkFieldErrors(t, validate.CordonRequest(tt.req), tt.want)
		})
	}
}

func TestUncordonRequest(t *testing.T) {
	checkFieldErrors(t, validate.UncordonRequest("GPU-0"), nil)
	checkFieldErrors(t, validate.UncordonRequest(""), []device.FieldError{fe("device_id", validate.RuleEmpty)})
	checkFieldErrors(t, validate.UncordonRequest("GPU-0\nGPU-1"), []device.FieldError{fe("device_id", validate.RuleNotPrintable)})
}

func TestReservationFilter(t *testing.T) {
	tests := []struct {
		name string
		f    device.ReservationFilter
		want []device.FieldError
	}{
		{name: "match all"},
		{name: "all fields", f: device.ReservationFilter{OwnerID: "o", DeviceID: "GPU-0", State: device.ReservationReleased}},
		{name: "owner not UTF-8", f: device.ReservationFilter{OwnerID: "\xff"}, want: []device.FieldError{fe("owner_id", validate.RuleInvalidUTF8)}},
		{
			name: "device ID too long",
			f:    device.ReservationFilter{DeviceID: strings.Repeat("d", validate.MaxNameLen+1)},
			want: []device.FieldError{fe("device_id", validate.RuleTooLong, fmt.Sprintf("%d bytes, limit %d", validate.MaxNameLen+1, validate.MaxNameLen))},
		},
		{name: "state out of range", f: device.ReservationFilter{State: 9}, want: []device.FieldError{fe("state", validate.RuleState, "value 9")}},
		{name: "state negative", f: device.ReservationFilter{State: -1}, want: []device.FieldError{fe("state", validate.RuleState, "value -1")}},
		{
			name: "every violation is reported",
			f:    device.ReservationFilter{OwnerID: "\x00", DeviceID: "\xff", State: 3},
			want: []device.FieldError{
				fe("owner_id", validate.RuleNotPrintable),
				fe("device_id", validate.RuleInvalidUTF8),
				fe("state", validate.RuleState, "value 3"),
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkFieldErrors(t, validate.ReservationFilter(tt.f), tt.want)
		})
	}
}
