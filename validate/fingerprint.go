package validate

import (
	"fmt"
	"maps"
	"math"
	"slices"

	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// fingerprint is Fingerprint's body; see its doc comment for the rules.
func fingerprint(resp *pb.FingerprintResponse) error {
	var c collector
	if resp == nil {
		c.add("fingerprint", RuleMissing, "")
		return c.err()
	}
	if n := proto.Size(resp); n > MaxFingerprintBytes {
		c.add("fingerprint", RuleTooLarge, tooLarge(n, MaxFingerprintBytes))
	}
	groups := resp.GetGroups()
	if len(groups) > MaxGroups {
		c.add("groups", RuleTooMany, tooMany(len(groups), MaxGroups))
		groups = groups[:MaxGroups]
	}
	sets := c.checkCounterSets(resp.GetCounterSets())
	type groupKey struct{ vendor, typ, name string }
	seenGroup := make(map[groupKey]int, len(groups))
	seenID := make(map[string]string) // device ID -> where first seen
	total := 0                        // devices checked so far, all groups
	for gi, g := range groups {
		if g == nil {
			c.add(fmt.Sprintf("group[%d]", gi), RuleMissing, "")
			continue
		}
		gItem := fmt.Sprintf("group[%d] %s", gi, q(g.GetVendor()+"/"+g.GetType()+"/"+g.GetName()))
		c.checkName(at(gItem, "vendor"), g.GetVendor())
		c.checkName(at(gItem, "type"), g.GetType())
		c.checkName(at(gItem, "name"), g.GetName())
		k := groupKey{g.GetVendor(), g.GetType(), g.GetName()}
		if first, dup := seenGroup[k]; dup {
			c.add(gItem, RuleDuplicate, fmt.Sprintf("first seen at group[%d]", first))
		} else {
			seenGroup[k] = gi
		}
		c.checkValues(gItem, "attribute", g.GetAttributes(), MaxAttributes)

		devices := g.GetDevices()
		if len(devices) > MaxDevicesPerGroup {
			c.add(at(gItem, "devices"), RuleTooMany, tooMany(len(devices), MaxDevicesPerGroup))
			devices = devices[:MaxDevicesPerGroup]
		}
		for di, d := range devices {
			if total == MaxDevices {
				break // reported once, after the loop
			}
			total++
			where := fmt.Sprintf("group[%d] device[%d]", gi, di)
			if d == nil {
				c.add(at(gItem, fmt.Sprintf("device[%d]", di)), RuleMissing, "")
				continue
			}
			dItem := at(gItem, fmt.Sprintf("device[%d] %s", di, q(d.GetId())))
			c.checkName(at(dItem, "id"), d.GetId())
			if d.GetId() != "" {
				if first, dup := seenID[d.GetId()]; dup {
					c.add(dItem, RuleDuplicate, "first seen at "+first)
				} else {
					seenID[d.GetId()] = where
				}
			}
			if _, ok := pb.Health_name[int32(d.GetHealth())]; !ok {
				c.add(at(dItem, "health"), RuleHealth, fmt.Sprintf("value %d", d.GetHealth()))
			}
			c.checkText(at(dItem, "health_reason"), d.GetHealthReason(), MaxStringValueLen)
			if loc := d.GetLocality(); loc != nil {
				if loc.GetNumaNode() < -1 {
					c.add(at(dItem, "numa_node"), RuleNUMANode, fmt.Sprintf("%d, want -1 or more", loc.GetNumaNode()))
				}
				if id := loc.GetPciBusId(); id != "" && !validPCIBusID(id) {
					c.add(at(dItem, "pci_bus_id"), RulePCIBusID, q(id)+", want dddd:bb:dd.f")
				}
			}
			c.checkConsumption(dItem, d.GetConsumes(), sets)
			c.checkDeviceCDI(dItem, d.GetId(), d.GetCdiDevices())
		}
	}
	if n := countDevices(resp.GetGroups()); n > MaxDevices {
		c.add("devices", RuleTooMany, tooMany(n, MaxDevices))
	}
	return c.err()
}

// checkCounterSets checks the fingerprint's counter sets: at most MaxCounterSets, each
// named like a device ID and unique, with 1 to MaxCountersPerSet counters named like
// attributes, each capacity 0 to MaxCounterValue. It returns the capacities of the
// sets checked, by name, for the devices' consumption.
func (c *collector) checkCounterSets(sets []*pb.CounterSet) map[string]map[string]int64 {
	if len(sets) > MaxCounterSets {
		c.add("counter_sets", RuleTooMany, tooMany(len(sets), MaxCounterSets))
		sets = sets[:MaxCounterSets]
	}
	out := make(map[string]map[string]int64, len(sets))
	first := make(map[string]int, len(sets))
	for si, s := range sets {
		if s == nil {
			c.add(fmt.Sprintf("counter_set[%d]", si), RuleMissing, "")
			continue
		}
		item := fmt.Sprintf("counter_set[%d] %s", si, q(s.GetName()))
		c.checkName(at(item, "name"), s.GetName())
		if i, dup := first[s.GetName()]; dup {
			c.add(item, RuleDuplicate, fmt.Sprintf("first seen at counter_set[%d]", i))
			continue
		}
		first[s.GetName()] = si
		names := slices.Sorted(maps.Keys(s.GetCounters()))
		switch {
		case len(names) == 0:
			c.add(at(item, "counters"), RuleEmpty, "")
		case len(names) > MaxCountersPerSet:
			c.add(at(item, "counters"), RuleTooMany, tooMany(len(names), MaxCountersPerSet))
			names = names[:MaxCountersPerSet]
		}
		caps := make(map[string]int64, len(names))
		for _, n := range names {
			cItem := at(item, "counter "+q(n))
			c.checkName(cItem, n)
			v := s.GetCounters()[n]
			c.checkCounterValue(cItem, "capacity", v)
			caps[n] = v
		}
		out[s.GetName()] = caps
	}
	return out
}

// checkConsumption checks what one device consumes: at most MaxConsumptions sets, each
// declared in the fingerprint (RuleUnknownCounterSet) and named once, each counter one
// of its set's (RuleUnknownCounter) with a use of 0 to its capacity (RuleOverCapacity:
// a device that alone does not fit could never be reserved).
func (c *collector) checkConsumption(dItem string, cons []*pb.CounterConsumption, sets map[string]map[string]int64) {
	if len(cons) > MaxConsumptions {
		c.add(at(dItem, "consumes"), RuleTooMany, tooMany(len(cons), MaxConsumptions))
		cons = cons[:MaxConsumptions]
	}
	seen := make(map[string]bool, len(cons))
	for ci, cc := range cons {
		if cc == nil {
			c.add(at(dItem, fmt.Sprintf("consumes[%d]", ci)), RuleMissing, "")
			continue
		}
		item := at(dItem, fmt.Sprintf("consumes[%d] %s", ci, q(cc.GetCounterSet())))
		caps, ok := sets[cc.GetCounterSet()]
		switch {
		case seen[cc.GetCounterSet()]:
			c.add(item, RuleDuplicate, "the device names this counter set twice")
			continue
		case !ok:
			c.add(item, RuleUnknownCounterSet, "not among the fingerprint's counter_sets")
			continue
		}
		seen[cc.GetCounterSet()] = true
		c.checkGroups(item, cc.GetCompatibilityGroups())
		names := slices.Sorted(maps.Keys(cc.GetCounters()))
		if len(names) > MaxCountersPerSet {
			c.add(at(item, "counters"), RuleTooMany, tooMany(len(names), MaxCountersPerSet))
			names = names[:MaxCountersPerSet]
		}
		for _, n := range names {
			cItem := at(item, "counter "+q(n))
			capacity, known := caps[n]
			v := cc.GetCounters()[n]
			switch {
			case !known:
				c.add(cItem, RuleUnknownCounter, "the set has no such counter")
			case v < 0 || v > MaxCounterValue:
				c.checkCounterValue(cItem, "use", v)
			case v > capacity:
				c.add(cItem, RuleOverCapacity, fmt.Sprintf("uses %d of a capacity of %d", v, capacity))
			}
		}
	}
}

// checkGroups checks a use's compatibility groups: at most
// device.MaxCompatibilityGroups, each a DNS label (as Kubernetes' k8s-short-name) and
// named once.
func (c *collector) checkGroups(item string, groups []string) {
	if len(groups) > device.MaxCompatibilityGroups {
		c.add(at(item, "compatibility_groups"), RuleTooMany, tooMany(len(groups), device.MaxCompatibilityGroups))
		groups = groups[:device.MaxCompatibilityGroups]
	}
	for gi, g := range groups {
		gItem := at(item, fmt.Sprintf("compatibility_group[%d] %s", gi, q(g)))
		switch {
		case !dnsLabel(g):
			c.add(gItem, RuleGroupName, "")
		case slices.Index(groups, g) < gi:
			c.add(gItem, RuleDuplicate, "")
		}
	}
}

// dnsLabel reports whether s is an RFC 1123 label: 1 to 63 lowercase letters, digits
// and "-", starting and ending with a letter or digit.
func dnsLabel(s string) bool {
	if s == "" || len(s) > 63 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// checkCounterValue checks a capacity or a use: 0 to MaxCounterValue.
func (c *collector) checkCounterValue(item, what string, v int64) {
	if v < 0 || v > MaxCounterValue {
		c.add(item, RuleCounterRange, fmt.Sprintf("%s %d, want 0 to %d", what, v, int64(MaxCounterValue)))
	}
}

func countDevices(groups []*pb.DeviceGroup) int {
	n := 0
	for _, g := range groups {
		n += len(g.GetDevices())
	}
	return n
}

// checkValues checks a map of typed values (group attributes, stats values): at most
// limit entries, each with a valid name and a valid value. kind names an entry in items
// ("attribute", "value"). Names are visited sorted, so the result is deterministic.
func (c *collector) checkValues(parent, kind string, values map[string]*pb.Value, limit int) {
	names := make([]string, 0, len(values))
	for n := range values {
		names = append(names, n)
	}
	slices.Sort(names)
	if len(names) > limit {
		c.add(at(parent, kind+"s"), RuleTooMany, tooMany(len(names), limit))
		names = names[:limit]
	}
	for _, n := range names {
		item := at(parent, kind+" "+q(n))
		c.checkName(item, n)
		c.checkValue(item, values[n])
	}
}

// checkValue checks one typed value: its kind is set, a float is finite, a string is
// bounded UTF-8, and its unit is known.
func (c *collector) checkValue(item string, v *pb.Value) {
	if v == nil {
		c.add(item, RuleValueUnset, "")
		return
	}
	switch k := v.GetKind().(type) {
	case *pb.Value_IntValue:
		if k == nil {
			c.add(item, RuleValueUnset, "")
		}
	case *pb.Value_BoolValue:
		if k == nil {
			c.add(item, RuleValueUnset, "")
		}
	case *pb.Value_FloatValue:
		if k == nil {
			c.add(item, RuleValueUnset, "")
		} else if math.IsNaN(k.FloatValue) || math.IsInf(k.FloatValue, 0) {
			c.add(item, RuleNotFinite, fmt.Sprint(k.FloatValue))
		}
	case *pb.Value_StringValue:
		if k == nil {
			c.add(item, RuleValueUnset, "")
		} else {
			c.checkText(item, k.StringValue, MaxStringValueLen)
		}
	default: // no kind set
		c.add(item, RuleValueUnset, "")
	}
	if !KnownUnit(v.GetUnit()) {
		c.add(item, RuleUnknownUnit, "unit "+q(v.GetUnit()))
	}
}

// validPCIBusID reports whether id has the form dddd:bb:dd.f in hex (domain, bus,
// device, function), or the 8-digit-domain form NVML returns (00000000:17:00.0). Either
// case of hex digit is accepted; the device is at most 0x1f and the function at most 7.
func validPCIBusID(id string) bool {
	var domainLen int
	switch len(id) {
	case len("0000:00:00.0"):
		domainLen = 4
	case len("00000000:00:00.0"):
		domainLen = 8
	default:
		return false
	}
	domain, rest := id[:domainLen], id[domainLen:]
	if !allHex(domain) || len(rest) != 8 || rest[0] != ':' || rest[3] != ':' || rest[6] != '.' {
		return false
	}
	bus, dev, fn := rest[1:3], rest[4:6], rest[7]
	if !allHex(bus) || !allHex(dev) || fn < '0' || fn > '7' {
		return false
	}
	return dev[0] == '0' || dev[0] == '1' // device number is 5 bits: 00-1f
}

func allHex(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// checkDeviceCDI checks the CDI names a plugin reports for device id: at most
// MaxDeviceCDINames, each a valid CDI name of at most MaxNameLen bytes whose device part
// is id (the names expose this device, not another), none twice.
func (c *collector) checkDeviceCDI(item, id string, names []string) {
	if len(names) > MaxDeviceCDINames {
		c.add(at(item, "cdi_devices"), RuleTooMany, tooMany(len(names), MaxDeviceCDINames))
		names = names[:MaxDeviceCDINames]
	}
	seen := make(map[string]bool, len(names))
	for i, name := range names {
		where := at(item, fmt.Sprintf("cdi_device[%d] %s", i, q(name)))
		switch dev, why := parseCDIName(name); {
		case name == "":
			c.add(where, RuleEmpty, "")
		case len(name) > MaxNameLen:
			c.add(where, RuleTooLong, tooLong(len(name), MaxNameLen))
		case why != "":
			c.add(where, RuleCDIName, why)
		case dev != id:
			c.add(where, RuleNotRequested, "names device "+q(dev)+", not this one")
		case seen[name]:
			c.add(where, RuleDuplicate, "")
		default:
			seen[name] = true
		}
	}
}
