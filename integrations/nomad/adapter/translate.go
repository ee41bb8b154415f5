package adapter

import (
	"math"
	"sort"
	"strconv"
	"time"

	"github.com/hashicorp/nomad/plugins/device"
	nproto "github.com/hashicorp/nomad/plugins/device/proto"
	"github.com/hashicorp/nomad/plugins/shared/structs"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/integrations/nomad/units"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

// fingerprintFromNomad translates a Nomad fingerprint: groups keep vendor, type and
// name, attributes become typed values in devicehost's units, each device keeps its ID,
// health, reason and PCI bus ID (Nomad has no NUMA node: -1). What the host would
// refuse is left to its validation, which names the rule; nil entries are skipped.
func fingerprintFromNomad(groups []*device.DeviceGroup) *pb.FingerprintResponse {
	out := &pb.FingerprintResponse{}
	for _, g := range groups {
		if g == nil {
			continue
		}
		pg := &pb.DeviceGroup{Vendor: g.Vendor, Type: g.Type, Name: g.Name}
		if len(g.Attributes) > 0 {
			pg.Attributes = make(map[string]*pb.Value, len(g.Attributes))
			for name, attr := range g.Attributes {
				if v := attributeFromNomad(attr); v != nil {
					pg.Attributes[name] = v
				}
			}
		}
		for _, d := range g.Devices {
			if d == nil {
				continue
			}
			pd := &pb.Device{Id: d.ID, Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{NumaNode: -1}}
			if !d.Healthy {
				pd.Health = pb.Health_HEALTH_UNHEALTHY
				pd.HealthReason = d.HealthDesc
			}
			if d.HwLocality != nil {
				pd.Locality.PciBusId = d.HwLocality.PciBusID
			}
			pg.Devices = append(pg.Devices, pd)
		}
		out.Groups = append(out.Groups, pg)
	}
	return out
}

// attributeFromNomad translates a Nomad attribute. A number whose unit Nomad's index
// knows is carried in devicehost's unit for that quantity (a PiB count as TiB, kW as
// W...); a number with a unit Nomad does not know (which Nomad itself would refuse) is
// kept as text, "12 furlong". Nil for an attribute with no value.
func attributeFromNomad(a *structs.Attribute) *pb.Value {
	if a == nil {
		return nil
	}
	switch {
	case a.Int != nil:
		return number(float64(*a.Int), a.Int, a.Unit, units.FromNomadAttribute)
	case a.Float != nil:
		return number(*a.Float, nil, a.Unit, units.FromNomadAttribute)
	case a.String != nil:
		return &pb.Value{Kind: &pb.Value_StringValue{StringValue: *a.String}}
	case a.Bool != nil:
		return &pb.Value{Kind: &pb.Value_BoolValue{BoolValue: *a.Bool}}
	}
	return nil
}

// number builds a value from a number f (and, for an integer, its exact value i) with
// unit u, converted by lookup. An integer stays an integer when the conversion keeps it
// whole and in range. Not-a-number and infinities are nil: the host would refuse them.
func number(f float64, i *int64, u string, lookup func(string) (units.Conversion, bool)) *pb.Value {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return nil
	}
	if u == "" {
		if i != nil {
			return &pb.Value{Kind: &pb.Value_IntValue{IntValue: *i}}
		}
		return &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: f}}
	}
	c, ok := lookup(u)
	if !ok {
		text := strconv.FormatFloat(f, 'g', -1, 64)
		if i != nil {
			text = strconv.FormatInt(*i, 10)
		}
		return &pb.Value{Kind: &pb.Value_StringValue{StringValue: text + " " + u}}
	}
	if i != nil && c.Factor == 1 {
		return &pb.Value{Kind: &pb.Value_IntValue{IntValue: *i}, Unit: c.To}
	}
	g := f * c.Factor
	if i != nil && g == math.Trunc(g) && math.Abs(g) < 1<<62 {
		return &pb.Value{Kind: &pb.Value_IntValue{IntValue: int64(g)}, Unit: c.To}
	}
	if math.IsInf(g, 0) {
		return nil
	}
	return &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: g}, Unit: c.To}
}

// maxStatDepth bounds how deep nested Nomad stat objects are followed.
const maxStatDepth = 8

// summaryName is the value name a Nomad device's summary statistic gets, unless the
// device has a statistic of that name already.
const summaryName = "summary"

// statsFromNomad translates a Nomad stats message: every device of every group (that
// known reports, i.e. that was fingerprinted) with its values flattened ("nested.name"),
// a fraction as two values ("name" and "name_total"), the summary as "summary", units
// as attributeFromNomad does plus the free-text ones Nomad plugins use for stats
// ("bytes", "°C"...). At most validate.MaxStatsValues values per device, taken in name
// order. A device without a timestamp gets now.
func statsFromNomad(groups []*device.DeviceGroupStats, known func(string) bool, now time.Time) *pb.StatsResponse {
	out := &pb.StatsResponse{}
	for _, g := range groups {
		if g == nil {
			continue
		}
		ids := make([]string, 0, len(g.InstanceStats))
		for id := range g.InstanceStats {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		for _, id := range ids {
			s := g.InstanceStats[id]
			if s == nil || !known(id) {
				continue
			}
			values := map[string]*pb.Value{}
			flatten(values, "", s.Stats, 0)
			if _, taken := values[summaryName]; !taken {
				addStat(values, summaryName, s.Summary)
			}
			limitValues(values, validate.MaxStatsValues)
			ts := s.Timestamp
			if ts.IsZero() {
				ts = now
			}
			out.Devices = append(out.Devices, &pb.DeviceStats{DeviceId: id, Values: values, Timestamp: timestamppb.New(ts)})
		}
	}
	return out
}

// flatten adds obj's values to out, named prefix + name, its nested objects' values
// named prefix + object + "." + name.
func flatten(out map[string]*pb.Value, prefix string, obj *structs.StatObject, depth int) {
	if obj == nil || depth > maxStatDepth {
		return
	}
	for name, v := range obj.Attributes {
		addStat(out, prefix+name, v)
	}
	for name, nested := range obj.Nested {
		flatten(out, prefix+name+".", nested, depth+1)
	}
}

// addStat adds one Nomad stat value as name (and, for a fraction, name_total).
func addStat(out map[string]*pb.Value, name string, v *structs.StatValue) {
	if v == nil || name == "" {
		return
	}
	lookup := units.FromNomadStat
	switch {
	case v.IntNumeratorVal != nil:
		put(out, name, number(float64(*v.IntNumeratorVal), v.IntNumeratorVal, v.Unit, lookup))
		if v.IntDenominatorVal != nil {
			put(out, name+"_total", number(float64(*v.IntDenominatorVal), v.IntDenominatorVal, v.Unit, lookup))
		}
	case v.FloatNumeratorVal != nil:
		put(out, name, number(*v.FloatNumeratorVal, nil, v.Unit, lookup))
		if v.FloatDenominatorVal != nil {
			put(out, name+"_total", number(*v.FloatDenominatorVal, nil, v.Unit, lookup))
		}
	case v.StringVal != nil:
		put(out, name, &pb.Value{Kind: &pb.Value_StringValue{StringValue: *v.StringVal}})
	case v.BoolVal != nil:
		put(out, name, &pb.Value{Kind: &pb.Value_BoolValue{BoolValue: *v.BoolVal}})
	}
}

func put(out map[string]*pb.Value, name string, v *pb.Value) {
	if v != nil {
		out[name] = v
	}
}

// limitValues keeps the first n values of m in name order.
func limitValues(m map[string]*pb.Value, n int) {
	if len(m) <= n {
		return
	}
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names[n:] {
		delete(m, k)
	}
}

// reservationFromNomad translates a Nomad container reservation: envs as they are,
// mounts and device nodes with Nomad's task paths as container paths.
func reservationFromNomad(r *nproto.ContainerReservation) *pb.ContainerReservation {
	out := &pb.ContainerReservation{Envs: r.GetEnvs()}
	for _, m := range r.GetMounts() {
		if m == nil {
			continue
		}
		out.Mounts = append(out.Mounts, &pb.Mount{HostPath: m.GetHostPath(), ContainerPath: m.GetTaskPath(), ReadOnly: m.GetReadOnly()})
	}
	for _, d := range r.GetDevices() {
		if d == nil {
			continue
		}
		out.Devices = append(out.Devices, &pb.DeviceSpec{HostPath: d.GetHostPath(), ContainerPath: d.GetTaskPath(), Permissions: d.GetPermissions()})
	}
	return out
}
