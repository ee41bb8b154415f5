package server

import (
	"fmt"
	"maps"
	"slices"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Conversions between the host API's protobuf messages and the device contract's domain
// types. They are pure; snapshots from the manager are read, never modified.

func timeToProto(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func valueToProto(v device.Value) *pb.Value {
	out := &pb.Value{Unit: v.Unit}
	switch v.Kind {
	case device.KindInt:
		out.Kind = &pb.Value_IntValue{IntValue: v.Int}
	case device.KindFloat:
		out.Kind = &pb.Value_FloatValue{FloatValue: v.Float}
	case device.KindString:
		out.Kind = &pb.Value_StringValue{StringValue: v.Str}
	case device.KindBool:
		out.Kind = &pb.Value_BoolValue{BoolValue: v.Bool}
	}
	return out
}

func valuesToProto(in map[string]device.Value) map[string]*pb.Value {
	if len(in) == 0 {
		return nil
	}
	out := make(map[string]*pb.Value, len(in))
	for k, v := range in {
		out[k] = valueToProto(v)
	}
	return out
}

func healthToProto(h device.Health) pb.Health {
	switch h {
	case device.HealthHealthy:
		return pb.Health_HEALTH_HEALTHY
	case device.HealthUnhealthy:
		return pb.Health_HEALTH_UNHEALTHY
	default:
		return pb.Health_HEALTH_UNKNOWN
	}
}

// snapshotToProto joins the static inventory with the dynamic state, for the groups
// that pass f. A device the state does not mention is reported with unknown health.
// The counter sets listed are those a listed device consumes.
func snapshotToProto(snap device.Snapshot, f streamFilter) *pb.FingerprintResponse {
	inv, st := snap.Inventory, snap.State
	out := &pb.FingerprintResponse{
		Groups:    make([]*pb.DeviceGroup, 0, len(inv.Groups)),
		Timestamp: timeToProto(snap.Time),
	}
	sets := make(map[device.CounterSetKey]bool) // the sets a listed device consumes
	for _, g := range inv.Groups {
		if !f.matches(g.Plugin, g.GroupKey) {
			continue
		}
		pg := groupToProto(&g)
		pg.Devices = make([]*pb.Device, 0, len(g.Devices))
		for i := range g.Devices {
			d := &g.Devices[i]
			pg.Devices = append(pg.Devices, deviceToProto(d, st.Devices[d.ID]))
			for _, c := range d.Consumes {
				sets[c.Set] = true
			}
		}
		out.Groups = append(out.Groups, pg)
	}
	for _, cs := range inv.CounterSets { // sorted by plugin, then name
		if sets[cs.Key] {
			out.CounterSets = append(out.CounterSets, counterSetToProto(cs, st))
		}
	}
	return out
}

// counterSetToProto is counter set cs with its use in st.
func counterSetToProto(cs device.CounterSet, st device.State) *pb.CounterSet {
	return &pb.CounterSet{
		Plugin: cs.Key.Plugin, Name: cs.Key.Name,
		Capacity: maps.Clone(cs.Capacity), Used: maps.Clone(st.CounterUse[cs.Key]),
	}
}

// groupToProto is group g's own fields, without its devices.
func groupToProto(g *device.Group) *pb.DeviceGroup {
	return &pb.DeviceGroup{
		Vendor:     g.Vendor,
		Type:       g.Type,
		Name:       g.Name,
		Plugin:     g.Plugin,
		Attributes: valuesToProto(g.Attributes),
	}
}

// deviceToProto joins device d of the inventory with its state ds.
func deviceToProto(d *device.DeviceInfo, ds device.DeviceState) *pb.Device {
	pd := &pb.Device{
		Id:           d.ID,
		Health:       healthToProto(ds.Health),
		HealthReason: ds.Reason,
		HealthSince:  timeToProto(ds.Since),
		Locality: &pb.Locality{
			PciBusId: d.Locality.PCIBusID,
			NumaNode: int32(d.Locality.NUMANode),
		},
	}
	if ds.Holder != nil {
		pd.Holder = &pb.Holder{
			ReservationId: ds.Holder.ReservationID,
			OwnerId:       ds.Holder.OwnerID,
		}
	}
	for _, c := range d.Consumes {
		pd.Consumes = append(pd.Consumes, &pb.CounterConsumption{CounterSet: c.Set.Name, Counters: maps.Clone(c.Counters),
			CompatibilityGroups: slices.Clone(c.Groups)})
	}
	for _, h := range ds.BlockedBy {
		pd.BlockedBy = append(pd.BlockedBy, &pb.Holder{ReservationId: h.ReservationID, OwnerId: h.OwnerID})
	}
	if ds.Cordon != nil {
		pd.Cordon = cordonToProto(*ds.Cordon)
	}
	pd.CdiDevices = slices.Clone(d.CDIDevices)
	for _, h := range ds.AdminAccess {
		pd.AdminAccess = append(pd.AdminAccess, &pb.Holder{ReservationId: h.ReservationID, OwnerId: h.OwnerID})
	}
	return pd
}

// statsToProto converts the stats of the groups that pass f.
func statsToProto(s device.StatsSnapshot, f streamFilter) *pb.StatsResponse {
	out := &pb.StatsResponse{Timestamp: timeToProto(s.Time)}
	for _, g := range s.Groups {
		if !f.matches(g.Plugin, g.GroupKey) {
			continue
		}
		pg := &pb.GroupStats{
			Vendor:  g.Vendor,
			Type:    g.Type,
			Name:    g.Name,
			Plugin:  g.Plugin,
			Devices: make([]*pb.DeviceStats, 0, len(g.Devices)),
		}
		for _, d := range g.Devices {
			pg.Devices = append(pg.Devices, &pb.DeviceStats{
				DeviceId:  d.ID,
				Values:    valuesToProto(d.Values),
				Timestamp: timeToProto(d.Time),
			})
		}
		out.Groups = append(out.Groups, pg)
	}
	return out
}

func reserveRequestFromProto(in *pb.ReserveRequest) device.ReserveRequest {
	return device.ReserveRequest{
		OwnerID: in.GetOwnerId(),
		Group: device.GroupKey{
			Vendor: in.GetVendor(),
			Type:   in.GetType(),
			Name:   in.GetName(),
		},
		DeviceIDs:             append([]string(nil), in.GetDeviceIds()...),
		TakeOverOwnerPrefixes: append([]string(nil), in.GetTakeOverOwnerPrefixes()...),
		AdminAccess:           in.GetAdminAccess(),
		OwnerLabels:           maps.Clone(in.GetOwnerLabels()),
		PluginOptions:         maps.Clone(in.GetPluginOptions()),
	}
}

func containerToProto(c device.ContainerReservation) *pb.ContainerReservation {
	out := &pb.ContainerReservation{
		CdiDevices: append([]string(nil), c.CDIDevices...),
	}
	if len(c.Envs) > 0 {
		out.Envs = make(map[string]string, len(c.Envs))
		for k, v := range c.Envs {
			out.Envs[k] = v
		}
	}
	for _, m := range c.Mounts {
		out.Mounts = append(out.Mounts, &pb.Mount{
			HostPath:      m.HostPath,
			ContainerPath: m.ContainerPath,
			ReadOnly:      m.ReadOnly,
		})
	}
	for _, d := range c.Devices {
		out.Devices = append(out.Devices, &pb.DeviceSpec{
			HostPath:      d.HostPath,
			ContainerPath: d.ContainerPath,
			Permissions:   d.Permissions,
		})
	}
	return out
}

func releaseRequestFromProto(in *pb.ReleaseRequest) device.ReleaseRequest {
	return device.ReleaseRequest{
		ReservationID: in.GetReservationId(),
		OwnerID:       in.GetOwnerId(),
	}
}

func reservationStateToProto(s device.ReservationState) pb.ReservationState {
	switch s {
	case device.ReservationActive:
		return pb.ReservationState_RESERVATION_STATE_ACTIVE
	case device.ReservationReleased:
		return pb.ReservationState_RESERVATION_STATE_RELEASED
	default:
		return pb.ReservationState_RESERVATION_STATE_UNSPECIFIED
	}
}

// reservationFilterFromProto converts a ListReservations request. An unknown state is a
// *device.FieldError.
func reservationFilterFromProto(in *pb.ListReservationsRequest) (device.ReservationFilter, error) {
	f := device.ReservationFilter{OwnerID: in.GetOwnerId(), DeviceID: in.GetDeviceId(), IncludeAdminAccess: in.GetIncludeAdminAccess()}
	switch in.GetState() {
	case pb.ReservationState_RESERVATION_STATE_UNSPECIFIED:
		f.State = device.ReservationAny
	case pb.ReservationState_RESERVATION_STATE_ACTIVE:
		f.State = device.ReservationActive
	case pb.ReservationState_RESERVATION_STATE_RELEASED:
		f.State = device.ReservationReleased
	default:
		return f, &device.FieldError{
			Field: "state",
			Rule:  fmt.Sprintf("unknown reservation state %d", int32(in.GetState())),
		}
	}
	return f, nil
}

func reservationToProto(r device.Reservation) *pb.Reservation {
	return &pb.Reservation{
		ReservationId:  r.ID,
		OwnerId:        r.OwnerID,
		Vendor:         r.Group.Vendor,
		Type:           r.Group.Type,
		Name:           r.Group.Name,
		Plugin:         r.Plugin,
		DeviceIds:      append([]string(nil), r.DeviceIDs...),
		State:          reservationStateToProto(r.State),
		Reservation:    containerToProto(r.Container),
		CreatedAt:      timeToProto(r.CreatedAt),
		ReleasedAt:     timeToProto(r.ReleasedAt),
		CleanupPending: r.CleanupPending,
		AdminAccess:    r.AdminAccess,
		OwnerLabels:    r.OwnerLabels.Map(),
		PluginOptions:  maps.Clone(r.PluginOptions),
	}
}

func pluginStatusToProto(s device.PluginStatus) pb.PluginStatus {
	switch s {
	case device.PluginStarting:
		return pb.PluginStatus_PLUGIN_STATUS_STARTING
	case device.PluginRunning:
		return pb.PluginStatus_PLUGIN_STATUS_RUNNING
	case device.PluginRestarting:
		return pb.PluginStatus_PLUGIN_STATUS_RESTARTING
	case device.PluginFailed:
		return pb.PluginStatus_PLUGIN_STATUS_FAILED
	default:
		return pb.PluginStatus_PLUGIN_STATUS_UNSPECIFIED
	}
}

func pluginToProto(p device.PluginState) *pb.Plugin {
	return &pb.Plugin{
		Name:        p.Name,
		Version:     p.Version,
		Status:      pluginStatusToProto(p.Status),
		Restarts:    uint32(max(p.Restarts, 0)),
		LastError:   p.LastError,
		LastErrorAt: timeToProto(p.LastErrorAt),
		NextRetry:   timeToProto(p.NextRetry),
		Path:        p.Path,
		DeviceCount: uint32(max(p.DeviceCount, 0)),
	}
}

func cordonToProto(c device.Cordon) *pb.Cordon {
	return &pb.Cordon{Reason: c.Reason, By: c.By, Since: timeToProto(c.Since), Drain: c.Drain}
}
