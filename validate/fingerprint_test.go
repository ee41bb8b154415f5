package validate_test

import (
	"fmt"
	"math"
	"strings"
	"testing"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

const (
	g0 = `group[0] "nvidia/gpu/H100"`
	g1 = `group[1] "nvidia/gpu/A100"`
)

// goodFingerprint returns a fresh fingerprint that breaks no rule: two groups, three
// devices, every kind of attribute value, and both PCI bus ID forms.
func goodFingerprint() *pb.FingerprintResponse {
	return &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{
		{
			Vendor: "nvidia", Type: "gpu", Name: "H100",
			Attributes: map[string]*pb.Value{
				"memory":             {Kind: &pb.Value_IntValue{IntValue: 81559}, Unit: "MiB"},
				"compute_capability": {Kind: &pb.Value_StringValue{StringValue: "9.0"}},
				"power_limit":        {Kind: &pb.Value_FloatValue{FloatValue: 700}, Unit: "W"},
				"mig_enabled":        {Kind: &pb.Value_BoolValue{BoolValue: false}},
			},
			Devices: []*pb.Device{
				{Id: "GPU-0", Health: pb.Health_HEALTH_HEALTHY,
					Locality: &pb.Locality{PciBusId: "0000:17:00.0", NumaNode: 0}},
				{Id: "GPU-1", Health: pb.Health_HEALTH_UNHEALTHY, HealthReason: "XID 79",
					Locality: &pb.Locality{PciBusId: "00000000:2A:1f.7", NumaNode: 1}},
			},
		},
		{
			Vendor: "nvidia", Type: "gpu", Name: "A100",
			Devices: []*pb.Device{{Id: "GPU-2", Locality: &pb.Locality{NumaNode: -1}}},
		},
	}}
}

// cdiNames sets GPU-0's CDI names.
func cdiNames(names ...string) func(*pb.FingerprintResponse) {
	return func(r *pb.FingerprintResponse) { r.Groups[0].Devices[0].CdiDevices = names }
}

func TestFingerprint(t *testing.T) {
	attr := func(r *pb.FingerprintResponse, name string, v *pb.Value) {
		r.Groups[0].Attributes[name] = v
	}
	pci := func(id string) func(*pb.FingerprintResponse) {
		return func(r *pb.FingerprintResponse) { r.Groups[0].Devices[0].Locality.PciBusId = id }
	}
	dev0 := g0 + `: device[0] "GPU-0"`
	tests := []struct {
		name   string
		mutate func(*pb.FingerprintResponse)
		want   []found
	}{
		{name: "good", mutate: func(*pb.FingerprintResponse) {}},
		{name: "no groups", mutate: func(r *pb.FingerprintResponse) { r.Groups = nil }},
		{
			// Not a rule: see Fingerprint's doc comment.
			name:   "unhealthy without reason",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[1].HealthReason = "" },
		},
		{name: "nil locality", mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[0].Locality = nil }},
		{name: "CDI names of the device", mutate: cdiNames("nvidia.com/gpu=GPU-0", "example.com/debug=GPU-0")},
		{
			name: "too many CDI names",
			mutate: func(r *pb.FingerprintResponse) {
				var names []string
				for i := range validate.MaxDeviceCDINames + 1 {
					names = append(names, fmt.Sprintf("example.com/k%d=GPU-0", i))
				}
				cdiNames(names...)(r)
			},
			want: []found{{dev0 + ": cdi_devices", validate.RuleTooMany}},
		},
		{
			name:   "CDI name of another device",
			mutate: cdiNames("nvidia.com/gpu=GPU-1"),
			want:   []found{{dev0 + `: cdi_device[0] "nvidia.com/gpu=GPU-1"`, validate.RuleNotRequested}},
		},
		{
			name:   "CDI name without a kind",
			mutate: cdiNames("GPU-0"),
			want:   []found{{dev0 + `: cdi_device[0] "GPU-0"`, validate.RuleCDIName}},
		},
		{
			name:   "CDI name twice",
			mutate: cdiNames("nvidia.com/gpu=GPU-0", "nvidia.com/gpu=GPU-0"),
			want:   []found{{dev0 + `: cdi_device[1] "nvidia.com/gpu=GPU-0"`, validate.RuleDuplicate}},
		},
		{
			name:   "empty CDI name",
			mutate: cdiNames(""),
			want:   []found{{dev0 + `: cdi_device[0] ""`, validate.RuleEmpty}},
		},
		{name: "uppercase PCI hex", mutate: pci("0000:AB:1F.0")},
		{name: "empty PCI bus ID", mutate: pci("")},
		{
			name:   "nil group",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[1] = nil },
			want:   []found{{"group[1]", validate.RuleMissing}},
		},
		{
			name:   "empty vendor",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Vendor = "" },
			want:   []found{{`group[0] "/gpu/H100": vendor`, validate.RuleEmpty}},
		},
		{
			name:   "empty type",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Type = "" },
			want:   []found{{`group[0] "nvidia//H100": type`, validate.RuleEmpty}},
		},
		{
			name:   "empty name",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[1].Name = "" },
			want:   []found{{`group[1] "nvidia/gpu/": name`, validate.RuleEmpty}},
		},
		{
			name:   "name too long",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[1].Name = strings.Repeat("x", validate.MaxNameLen+1) },
			want: []found{{
				`group[1] "nvidia/gpu/` + strings.Repeat("x", 53) + `"...: name`, validate.RuleTooLong,
			}},
		},
		{
			name:   "name at the length limit",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[1].Name = strings.Repeat("x", validate.MaxNameLen) },
		},
		{
			name:   "vendor not UTF-8",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[1].Vendor = "nv\xff" },
			want:   []found{{`group[1] "nv\xff/gpu/A100": vendor`, validate.RuleInvalidUTF8}},
		},
		{
			name:   "name not printable",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[1].Name = "A100\n" },
			want:   []found{{`group[1] "nvidia/gpu/A100\n": name`, validate.RuleNotPrintable}},
		},
		{
			name:   "duplicate group",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[1].Name = "H100" },
			want:   []found{{`group[1] "nvidia/gpu/H100"`, validate.RuleDuplicate}},
		},
		{
			name:   "nil device",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[1] = nil },
			want:   []found{{g0 + ": device[1]", validate.RuleMissing}},
		},
		{
			name:   "empty device ID",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[1].Id = "" },
			want:   []found{{g0 + `: device[1] "": id`, validate.RuleEmpty}},
		},
		{
			// Device IDs become keys of the ledger's owner records; this rule, not the
			// ledger, bounds them.
			name: "device ID too long",
			mutate: func(r *pb.FingerprintResponse) {
				r.Groups[0].Devices[1].Id = strings.Repeat("x", validate.MaxNameLen+1)
			},
			want: []found{{g0 + `: device[1] "` + strings.Repeat("x", 64) + `"...: id`, validate.RuleTooLong}},
		},
		{
			name:   "device ID not UTF-8",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[1].Id = "GPU-\xff" },
			want:   []found{{g0 + `: device[1] "GPU-\xff": id`, validate.RuleInvalidUTF8}},
		},
		{
			name:   "device ID not printable",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[1].Id = "GPU\x00" },
			want:   []found{{g0 + `: device[1] "GPU\x00": id`, validate.RuleNotPrintable}},
		},
		{
			name:   "duplicate ID in one group",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[1].Id = "GPU-0" },
			want:   []found{{g0 + `: device[1] "GPU-0"`, validate.RuleDuplicate}},
		},
		{
			name:   "duplicate ID across groups",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[1].Devices[0].Id = "GPU-1" },
			want:   []found{{g1 + `: device[0] "GPU-1"`, validate.RuleDuplicate}},
		},
		{
			name:   "health out of range",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[0].Health = 7 },
			want:   []found{{dev0 + ": health", validate.RuleHealth}},
		},
		{
			name: "health reason too long",
			mutate: func(r *pb.FingerprintResponse) {
				r.Groups[0].Devices[1].HealthReason = strings.Repeat("x", validate.MaxStringValueLen+1)
			},
			want: []found{{g0 + `: device[1] "GPU-1": health_reason`, validate.RuleTooLong}},
		},
		{
			name:   "health reason not UTF-8",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[1].HealthReason = "\xc0" },
			want:   []found{{g0 + `: device[1] "GPU-1": health_reason`, validate.RuleInvalidUTF8}},
		},
		{
			name:   "NUMA node below -1",
			mutate: func(r *pb.FingerprintResponse) { r.Groups[0].Devices[0].Locality.NumaNode = -2 },
			want:   []found{{dev0 + ": numa_node", validate.RuleNUMANode}},
		},
		{name: "PCI without domain", mutate: pci("17:00.0"), want: []found{{dev0 + ": pci_bus_id", validate.RulePCIBusID}}},
		{name: "PCI without function", mutate: pci("0000:17:00"), want: []found{{dev0 + ": pci_bus_id", validate.RulePCIBusID}}},
		{name: "PCI device over 1f", mutate: pci("0000:17:20.0"), want: []found{{dev0 + ": pci_bus_id", validate.RulePCIBusID}}},
		{name: "PCI function over 7", mutate: pci("0000:17:00.8"), want: []found{{dev0 + ": pci_bus_id", validate.RulePCIBusID}}},
		{name: "PCI not hex", mutate: pci("000g:17:00.0"), want: []found{{dev0 + ": pci_bus_id", validate.RulePCIBusID}}},
		{name: "PCI wrong separator", mutate: pci("0000-17:00.0"), want: []found{{dev0 + ": pci_bus_id", validate.RulePCIBusID}}},
		{name: "PCI 6-digit domain", mutate: pci("000000:17:00.0"), want: []found{{dev0 + ": pci_bus_id", validate.RulePCIBusID}}},
		{
			name:   "empty attribute name",
			mutate: func(r *pb.FingerprintResponse) { attr(r, "", &pb.Value{Kind: &pb.Value_BoolValue{}}) },
			want:   []found{{g0 + `: attribute ""`, validate.RuleEmpty}},
		},
		{
			name:   "nil attribute value",
			mutate: func(r *pb.FingerprintResponse) { attr(r, "x", nil) },
			want:   []found{{g0 + `: attribute "x"`, validate.RuleValueUnset}},
		},
		{
			name:   "attribute kind not set",
			mutate: func(r *pb.FingerprintResponse) { attr(r, "x", &pb.Value{Unit: "W"}) },
			want:   []found{{g0 + `: attribute "x"`, validate.RuleValueUnset}},
		},
		{
			name:   "attribute kind typed nil",
			mutate: func(r *pb.FingerprintResponse) { attr(r, "x", &pb.Value{Kind: (*pb.Value_FloatValue)(nil)}) },
			want:   []found{{g0 + `: attribute "x"`, validate.RuleValueUnset}},
		},
		{
			name: "attribute NaN",
			mutate: func(r *pb.FingerprintResponse) {
				attr(r, "x", &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: math.NaN()}})
			},
			want: []found{{g0 + `: attribute "x"`, validate.RuleNotFinite}},
		},
		{
			name: "attribute +Inf",
			mutate: func(r *pb.FingerprintResponse) {
				attr(r, "x", &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: math.Inf(1)}})
			},
			want: []found{{g0 + `: attribute "x"`, validate.RuleNotFinite}},
		},
		{
			name: "attribute -Inf",
			mutate: func(r *pb.FingerprintResponse) {
				attr(r, "x", &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: math.Inf(-1)}})
			},
			want: []found{{g0 + `: attribute "x"`, validate.RuleNotFinite}},
		},
		{
			name:   "attribute unit unknown",
			mutate: func(r *pb.FingerprintResponse) { attr(r, "x", &pb.Value{Kind: &pb.Value_IntValue{}, Unit: "furlong"}) },
			want:   []found{{g0 + `: attribute "x"`, validate.RuleUnknownUnit}},
		},
		{
			name:   "attribute unit case matters",
			mutate: func(r *pb.FingerprintResponse) { attr(r, "x", &pb.Value{Kind: &pb.Value_IntValue{}, Unit: "mib"}) },
			want:   []found{{g0 + `: attribute "x"`, validate.RuleUnknownUnit}},
		},
		{
			name: "attribute string too long",
			mutate: func(r *pb.FingerprintResponse) {
				attr(r, "x", &pb.Value{Kind: &pb.Value_StringValue{StringValue: strings.Repeat("x", validate.MaxStringValueLen+1)}})
			},
			want: []found{{g0 + `: attribute "x"`, validate.RuleTooLong}},
		},
		{
			name: "attribute string not UTF-8",
			mutate: func(r *pb.FingerprintResponse) {
				attr(r, "x", &pb.Value{Kind: &pb.Value_StringValue{StringValue: "\xff"}})
			},
			want: []found{{g0 + `: attribute "x"`, validate.RuleInvalidUTF8}},
		},
		{
			name: "too many groups",
			mutate: func(r *pb.FingerprintResponse) {
				r.Groups = nil
				for i := range validate.MaxGroups + 1 {
					r.Groups = append(r.Groups, &pb.DeviceGroup{Vendor: "v", Type: "t", Name: fmt.Sprint(i)})
				}
			},
			want: []found{{"groups", validate.RuleTooMany}},
		},
		{
			name: "too many devices in a group",
			mutate: func(r *pb.FingerprintResponse) {
				r.Groups[1].Devices = devices("X-", validate.MaxDevicesPerGroup+1)
			},
			want: []found{{g1 + ": devices", validate.RuleTooMany}},
		},
		{
			name: "too many devices in all",
			mutate: func(r *pb.FingerprintResponse) {
				r.Groups = nil
				for i := range validate.MaxDevices/validate.MaxDevicesPerGroup + 1 {
					r.Groups = append(r.Groups, &pb.DeviceGroup{
						Vendor: "v", Type: "t", Name: fmt.Sprint(i),
						Devices: devices(fmt.Sprintf("G%d-", i), validate.MaxDevicesPerGroup),
					})
				}
			},
			want: []found{{"devices", validate.RuleTooMany}},
		},
		{
			name: "too many attributes",
			mutate: func(r *pb.FingerprintResponse) {
				for i := range validate.MaxAttributes {
					attr(r, fmt.Sprintf("a%03d", i), &pb.Value{Kind: &pb.Value_BoolValue{}})
				}
			},
			want: []found{{g0 + ": attributes", validate.RuleTooMany}},
		},
		{
			name: "every violation is reported",
			mutate: func(r *pb.FingerprintResponse) {
				r.Groups[0].Vendor = ""
				r.Groups[0].Devices[0].Locality.NumaNode = -5
				attr(r, "temp", &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: math.NaN()}, Unit: "K"})
				r.Groups[1].Devices[0].Id = "GPU-0"
			},
			want: []found{
				{`group[0] "/gpu/H100": vendor`, validate.RuleEmpty},
				{`group[0] "/gpu/H100": attribute "temp"`, validate.RuleNotFinite},
				{`group[0] "/gpu/H100": attribute "temp"`, validate.RuleUnknownUnit},
				{`group[0] "/gpu/H100": device[0] "GPU-0": numa_node`, validate.RuleNUMANode},
				{g1 + `: device[0] "GPU-0"`, validate.RuleDuplicate},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := goodFingerprint()
			tt.mutate(resp)
			checkViolations(t, validate.Fingerprint(resp), tt.want)
		})
	}
}

// devices returns n healthy devices with IDs prefix0, prefix1...
func devices(prefix string, n int) []*pb.Device {
	out := make([]*pb.Device, n)
	for i := range out {
		out[i] = &pb.Device{Id: fmt.Sprint(prefix, i), Health: pb.Health_HEALTH_HEALTHY}
	}
	return out
}

func TestFingerprintNil(t *testing.T) {
	checkViolations(t, validate.Fingerprint(nil), []found{{"fingerprint", validate.RuleMissing}})
}

// TestFingerprintMessage pins the text a person reads in the log for the commonest
// rejection, including where the first copy of a duplicate ID was.
func TestFingerprintMessage(t *testing.T) {
	resp := goodFingerprint()
	resp.Groups[0].Devices[1].Id = "GPU-0"
	err := validate.Fingerprint(resp)
	want := `group[0] "nvidia/gpu/H100": device[1] "GPU-0": duplicate (first seen at group[0] device[0])`
	if err == nil || err.Error() != want {
		t.Errorf("Fingerprint() = %v, want %s", err, want)
	}
}

// TestFingerprintDeterministic checks that violations in a map (attributes) come out in
// the same order every time, so equal inputs give equal log lines.
func TestFingerprintDeterministic(t *testing.T) {
	resp := goodFingerprint()
	for i := range 20 {
		resp.Groups[0].Attributes[fmt.Sprintf("bad%02d", i)] = &pb.Value{Unit: "?"}
	}
	first := validate.Fingerprint(resp).Error()
	for range 10 {
		if got := validate.Fingerprint(resp).Error(); got != first {
			t.Fatalf("Fingerprint() changed between calls:\n got  %s\n want %s", got, first)
		}
	}
}

// TestFingerprintViolationCap checks that a response with more than MaxViolations
// violations reports the first MaxViolations and one RuleTruncated counting the rest.
func TestFingerprintViolationCap(t *testing.T) {
	const n = validate.MaxViolations + 30
	resp := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{{
		Vendor: "v", Type: "t", Name: "n",
		Devices: make([]*pb.Device, n), // every device nil
	}}}
	vs := validate.Violations(validate.Fingerprint(resp))
	if got, want := len(vs), validate.MaxViolations+1; got != want {
		t.Fatalf("got %d violations, want %d", got, want)
	}
	last := vs[len(vs)-1]
	if last.Rule != validate.RuleTruncated || last.Detail != "30 more" {
		t.Errorf("last violation = %v, want rule %q with detail %q", last, validate.RuleTruncated, "30 more")
	}
	for i, v := range vs[:len(vs)-1] {
		if want := fmt.Sprintf(`group[0] "v/t/n": device[%d]`, i); v.Item != want || v.Rule != validate.RuleMissing {
			t.Errorf("violation %d = %v, want %s: %s", i, v, want, validate.RuleMissing)
		}
	}
}
