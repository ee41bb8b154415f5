package shim

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/hashicorp/nomad/plugins/device"
	"github.com/hashicorp/nomad/plugins/shared/structs"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/nomad/units"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// groupsToNomad translates a snapshot to Nomad device groups, sorted by vendor, type
// and name, devices by ID: vendor, type, name, attributes as Nomad attributes, and per
// device its health (healthy only when the agent says healthy and nothing blocks it),
// reason and PCI bus ID. A device that shares capacity with held ones (a MIG partition of
// a GPU held whole, the whole GPU while a partition of it is held) is unhealthy, with the
// blocking reservation in the reason, so Nomad never places a task on one the agent would
// refuse.
//
// A group of MPS shares (type or name ending in ".mps") becomes one Nomad group per
// device the shares divide, named "<name> <device>" (the counter set they consume):
// Nomad's scheduler takes all the instances of one device request from one group, in
// no particular order within it, and a task's MPS shares must all be of one device
// (its pipe directory names that device's daemon).
func groupsToNomad(snap *pb.FingerprintResponse) []*device.DeviceGroup {
	out := make([]*device.DeviceGroup, 0, len(snap.GetGroups()))
	for _, g := range splitShareGroups(snap) {
		ng := &device.DeviceGroup{Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName()}
		if len(g.GetAttributes()) > 0 {
			ng.Attributes = make(map[string]*structs.Attribute, len(g.GetAttributes()))
			for name, v := range g.GetAttributes() {
				if a := attributeToNomad(v); a != nil {
					ng.Attributes[name] = a
				}
			}
		}
		for _, d := range g.GetDevices() {
			nd := &device.Device{ID: d.GetId()}
			switch bs := d.GetBlockedBy(); {
			case d.GetCordon() != nil:
				// Offered to no new allocation, whatever its health.
				nd.HealthDesc = fmt.Sprintf("cordoned by %s: %s", d.GetCordon().GetBy(), d.GetCordon().GetReason())
			case d.GetHealth() == pb.Health_HEALTH_HEALTHY && len(bs) > 0:
				nd.HealthDesc = fmt.Sprintf("cannot be reserved now: the shared capacity it needs is in use by reservation %s of owner %q", bs[0].GetReservationId(), bs[0].GetOwnerId())
				if len(bs) > 1 {
					nd.HealthDesc += fmt.Sprintf(" and %d more", len(bs)-1)
				}
			case d.GetHealth() == pb.Health_HEALTH_HEALTHY:
				nd.Healthy = true
			case d.GetHealth() == pb.Health_HEALTH_UNHEALTHY:
				nd.HealthDesc = cmp.Or(d.GetHealthReason(), "unhealthy")
			default:
				nd.HealthDesc = cmp.Or(d.GetHealthReason(), "health unknown")
			}
			if bus := d.GetLocality().GetPciBusId(); bus != "" {
				nd.HwLocality = &device.DeviceLocality{PciBusID: bus}
			}
			ng.Devices = append(ng.Devices, nd)
		}
		slices.SortFunc(ng.Devices, func(a, b *device.Device) int { return strings.Compare(a.ID, b.ID) })
		out = append(out, ng)
	}
	slices.SortFunc(out, func(a, b *device.DeviceGroup) int {
		return cmp.Or(strings.Compare(a.Vendor, b.Vendor), strings.Compare(a.Type, b.Type), strings.Compare(a.Name, b.Name))
	})
	return out
}

// splitShareGroups returns snap's groups with each MPS share group split by the device
// its shares divide (see groupsToNomad); other groups are as they are. Shares of part
// of a device (an on-demand MIG placement's, see client.ShareParent) are left out:
// Nomad could give one task shares of two placements, which no daemon serves together.
func splitShareGroups(snap *pb.FingerprintResponse) []*pb.DeviceGroup {
	groups := snap.GetGroups()
	out := make([]*pb.DeviceGroup, 0, len(groups))
	var sets client.CounterSets
	for _, g := range groups {
		if !client.IsShareGroup(g) {
			out = append(out, g)
			continue
		}
		if sets == nil {
			sets = client.IndexCounterSets(snap)
		}
		byParent := make(map[string]*pb.DeviceGroup)
		var order []string
		for _, d := range g.GetDevices() {
			parent, ok := sets.ShareParent(g.GetPlugin(), d)
			if !ok {
				continue
			}
			sg := byParent[parent]
			if sg == nil {
				sg = &pb.DeviceGroup{Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName() + " " + parent, Attributes: g.GetAttributes()}
				byParent[parent] = sg
				order = append(order, parent)
			}
			sg.Devices = append(sg.Devices, d)
		}
		for _, p := range order {
			out = append(out, byParent[p])
		}
	}
	return out
}

// allUnhealthy returns a copy of groups with every device unhealthy for reason.
func allUnhealthy(groups []*device.DeviceGroup, reason string) []*device.DeviceGroup {
	out := make([]*device.DeviceGroup, 0, len(groups))
	for _, g := range groups {
		ng := *g
		ng.Devices = make([]*device.Device, 0, len(g.Devices))
		for _, d := range g.Devices {
			nd := *d
			nd.Healthy, nd.HealthDesc = false, reason
			ng.Devices = append(ng.Devices, &nd)
		}
		out = append(out, &ng)
	}
	return out
}

// attributeToNomad translates a typed value to a Nomad attribute. Numbers keep their
// unit where Nomad's scheduler has one for the quantity (bytes are given in KiB, the
// smallest byte unit Nomad knows); other numbers ("%", "C", counts, durations) go
// without a unit, which Nomad would refuse. Nil for a value without a kind.
func attributeToNomad(v *pb.Value) *structs.Attribute {
	switch k := v.GetKind().(type) {
	case *pb.Value_IntValue:
		c, ok := units.ToNomadAttribute(v.GetUnit())
		switch {
		case !ok:
			return structs.NewIntAttribute(k.IntValue, "")
		case c.Factor == 1:
			return structs.NewIntAttribute(k.IntValue, c.To)
		}
		f := float64(k.IntValue) * c.Factor
		if f == math.Trunc(f) {
			return structs.NewIntAttribute(int64(f), c.To)
		}
		return structs.NewFloatAttribute(f, c.To)
	case *pb.Value_FloatValue:
		c, ok := units.ToNomadAttribute(v.GetUnit())
		if !ok {
			return structs.NewFloatAttribute(k.FloatValue, "")
		}
		return structs.NewFloatAttribute(k.FloatValue*c.Factor, c.To)
	case *pb.Value_StringValue:
		return structs.NewStringAttribute(k.StringValue)
	case *pb.Value_BoolValue:
		return structs.NewBoolAttribute(k.BoolValue)
	}
	return nil
}

// summaryPreference lists the statistics that best sum a device up, best first; a
// device with none of them is summed up by its first percentage, else its first
// number, in name order.
var summaryPreference = []string{"gpu_utilization", "utilization", "memory_utilization", "temperature", "power"}

// statsToNomad translates the agent's stats to Nomad's: one group per device group,
// each device's values as Nomad stat values (unit as the agent gives it, the metric's
// name as its description), and a summary value.
func statsToNomad(snap *pb.StatsResponse) []*device.DeviceGroupStats {
	out := make([]*device.DeviceGroupStats, 0, len(snap.GetGroups()))
	for _, g := range snap.GetGroups() {
		ng := &device.DeviceGroupStats{
			Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName(),
			InstanceStats: make(map[string]*device.DeviceStats, len(g.GetDevices())),
		}
		for _, d := range g.GetDevices() {
			s := &device.DeviceStats{Stats: &structs.StatObject{Attributes: make(map[string]*structs.StatValue, len(d.GetValues()))}}
			if ts := d.GetTimestamp(); ts != nil {
				s.Timestamp = ts.AsTime()
			} else {
				s.Timestamp = snap.GetTimestamp().AsTime()
			}
			for name, v := range d.GetValues() {
				if sv := statToNomad(name, v); sv != nil {
					s.Stats.Attributes[name] = sv
				}
			}
			s.Summary = summary(d.GetValues(), s.Stats.Attributes)
			ng.InstanceStats[d.GetDeviceId()] = s
		}
		out = append(out, ng)
	}
	return out
}

// statToNomad translates one value; nil for a value without a kind.
func statToNomad(name string, v *pb.Value) *structs.StatValue {
	sv := &structs.StatValue{Unit: v.GetUnit(), Desc: name}
	switch k := v.GetKind().(type) {
	case *pb.Value_IntValue:
		sv.IntNumeratorVal = &k.IntValue
	case *pb.Value_FloatValue:
		sv.FloatNumeratorVal = &k.FloatValue
	case *pb.Value_StringValue:
		sv.StringVal, sv.Unit = &k.StringValue, ""
	case *pb.Value_BoolValue:
		sv.BoolVal, sv.Unit = &k.BoolValue, ""
	default:
		return nil
	}
	return sv
}

// summary picks a device's summary statistic (see summaryPreference); nil when it has
// no number.
func summary(values map[string]*pb.Value, stats map[string]*structs.StatValue) *structs.StatValue {
	for _, name := range summaryPreference {
		if s := stats[name]; s != nil && isNumber(values[name]) {
			return s
		}
	}
	names := make([]string, 0, len(values))
	for name, v := range values {
		if isNumber(v) && stats[name] != nil {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	for _, name := range names {
		if values[name].GetUnit() == "%" {
			return stats[name]
		}
	}
	if len(names) > 0 {
		return stats[names[0]]
	}
	return nil
}

func isNumber(v *pb.Value) bool {
	switch v.GetKind().(type) {
	case *pb.Value_IntValue, *pb.Value_FloatValue:
		return true
	}
	return false
}

// reservationToNomad translates the agent's container reservation: envs as they are,
// mounts and device nodes with the container path as Nomad's task path.
func reservationToNomad(r *pb.ContainerReservation) *device.ContainerReservation {
	out := &device.ContainerReservation{Envs: r.GetEnvs()}
	for _, m := range r.GetMounts() {
		out.Mounts = append(out.Mounts, &device.Mount{TaskPath: m.GetContainerPath(), HostPath: m.GetHostPath(), ReadOnly: m.GetReadOnly()})
	}
	for _, d := range r.GetDevices() {
		out.Devices = append(out.Devices, &device.DeviceSpec{TaskPath: d.GetContainerPath(), HostPath: d.GetHostPath(), CgroupPerms: d.GetPermissions()})
	}
	return out
}
