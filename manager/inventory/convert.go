package inventory

import (
	"cmp"
	"maps"
	"slices"
	"time"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// reportedDevice is one device of a validated fingerprint: its static part and the health
// the plugin reported for it.
type reportedDevice struct {
	group  device.GroupKey
	info   device.DeviceInfo
	health device.Health
	reason string
}

// fingerprint is a validated plugin fingerprint converted to domain types. Groups are
// sorted by GroupKey and their devices by ID; nothing in it is written after conversion.
type fingerprint struct {
	groups      []device.Group            // Plugin is set; Devices hold every reported device
	devices     map[string]reportedDevice // by device ID
	counterSets []device.CounterSet       // sorted by name

	cost           int // charged against MaxSnapshotBytes: fingerprintCost
	statsGroupCost int // added to the plugin's stats' charge: statsGroupCost
}

// fromFingerprint converts a fingerprint that validate.Fingerprint accepted.
func fromFingerprint(plugin string, resp *pb.FingerprintResponse) fingerprint {
	fp := fingerprint{
		devices:        make(map[string]reportedDevice),
		cost:           fingerprintCost(plugin, resp),
		statsGroupCost: statsGroupCost(plugin, resp),
	}
	for _, g := range resp.GetGroups() {
		key := device.GroupKey{Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName()}
		grp := device.Group{
			GroupKey:   key,
			Plugin:     plugin,
			Attributes: fromValues(g.GetAttributes()),
			Devices:    make([]device.DeviceInfo, 0, len(g.GetDevices())),
		}
		for _, d := range g.GetDevices() {
			info := device.DeviceInfo{
				ID: d.GetId(),
				Locality: device.Locality{
					PCIBusID: d.GetLocality().GetPciBusId(),
					NUMANode: -1,
				},
				NothingToRelease: d.GetNothingToRelease(),
			}
			if d.GetLocality() != nil {
				info.Locality.NUMANode = int(d.GetLocality().GetNumaNode())
			}
			if len(d.GetCdiDevices()) > 0 {
				info.CDIDevices = slices.Clone(d.GetCdiDevices())
			}
			for _, c := range d.GetConsumes() {
				info.Consumes = append(info.Consumes, device.Consumption{
					Set:      device.CounterSetKey{Plugin: plugin, Name: c.GetCounterSet()},
					Counters: maps.Clone(c.GetCounters()),
					Groups:   sortedGroups(c.GetCompatibilityGroups()),
				})
			}
			slices.SortFunc(info.Consumes, func(a, b device.Consumption) int { return cmp.Compare(a.Set.Name, b.Set.Name) })
			grp.Devices = append(grp.Devices, info)
			fp.devices[info.ID] = reportedDevice{
				group:  key,
				info:   info,
				health: fromHealth(d.GetHealth()),
				reason: d.GetHealthReason(),
			}
		}
		slices.SortFunc(grp.Devices, func(a, b device.DeviceInfo) int { return cmp.Compare(a.ID, b.ID) })
		fp.groups = append(fp.groups, grp)
	}
	slices.SortFunc(fp.groups, func(a, b device.Group) int { return compareKeys(a.GroupKey, b.GroupKey) })
	for _, cs := range resp.GetCounterSets() {
		fp.counterSets = append(fp.counterSets, device.CounterSet{
			Key:      device.CounterSetKey{Plugin: plugin, Name: cs.GetName()},
			Capacity: maps.Clone(cs.GetCounters()),
		})
	}
	slices.SortFunc(fp.counterSets, func(a, b device.CounterSet) int { return cmp.Compare(a.Key.Name, b.Key.Name) })
	return fp
}

func compareKeys(a, b device.GroupKey) int {
	return cmp.Or(cmp.Compare(a.Vendor, b.Vendor), cmp.Compare(a.Type, b.Type), cmp.Compare(a.Name, b.Name))
}

func fromHealth(h pb.Health) device.Health {
	switch h {
	case pb.Health_HEALTH_HEALTHY:
		return device.HealthHealthy
	case pb.Health_HEALTH_UNHEALTHY:
		return device.HealthUnhealthy
	default:
		return device.HealthUnknown
	}
}

func fromValues(in map[string]*pb.Value) map[string]device.Value {
	out := make(map[string]device.Value, len(in))
	for k, v := range in {
		out[k] = fromValue(v)
	}
	return out
}

func fromValue(v *pb.Value) device.Value {
	out := device.Value{Unit: v.GetUnit()}
	switch k := v.GetKind().(type) {
	case *pb.Value_IntValue:
		out.Kind, out.Int = device.KindInt, k.IntValue
	case *pb.Value_FloatValue:
		out.Kind, out.Float = device.KindFloat, k.FloatValue
	case *pb.Value_StringValue:
		out.Kind, out.Str = device.KindString, k.StringValue
	case *pb.Value_BoolValue:
		out.Kind, out.Bool = device.KindBool, k.BoolValue
	}
	return out
}

// fromStats converts a stats message that validate.Stats accepted, keyed by device ID.
// received stands in for a missing timestamp.
func fromStats(resp *pb.StatsResponse, received time.Time) map[string]device.DeviceStats {
	out := make(map[string]device.DeviceStats, len(resp.GetDevices()))
	for _, d := range resp.GetDevices() {
		t := received
		if d.GetTimestamp() != nil {
			t = d.GetTimestamp().AsTime()
		}
		st := device.DeviceStats{ID: d.GetDeviceId(), Values: fromValues(d.GetValues()), Time: t}
		for _, p := range d.GetProcesses() {
			st.Processes = append(st.Processes, device.ProcessMemory{PID: p.GetPid(), UsedBytes: p.GetUsedBytes(),
				SMUtil: p.GetSmUtilization(), HasSMUtil: p.SmUtilization != nil})
		}
		out[d.GetDeviceId()] = st
	}
	return out
}

// sortedGroups is a sorted copy of a use's compatibility groups (validated: unique),
// nil for none.
func sortedGroups(groups []string) []string {
	if len(groups) == 0 {
		return nil
	}
	return slices.Sorted(slices.Values(groups))
}
