package server

import (
	"maps"
	"slices"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server/internal/fanout"
)

// The field numbers the encoder writes itself.
var (
	fingerprintGroupsField      = (&pb.FingerprintResponse{}).ProtoReflect().Descriptor().Fields().ByName("groups").Number()
	fingerprintCounterSetsField = (&pb.FingerprintResponse{}).ProtoReflect().Descriptor().Fields().ByName("counter_sets").Number()
	groupDevicesField           = (&pb.DeviceGroup{}).ProtoReflect().Descriptor().Fields().ByName("devices").Number()
)

// snapshotEncoder encodes the Fingerprint snapshots of one stream filter (one fan-out
// group: every stream with that filter gets the same bytes). It keeps each device's
// encoding while the device's inventory entry and the state the message carries of it
// are unchanged, and writes a snapshot's message around them: a change of one holder
// re-encodes the devices whose state it changed (the device, and on a partitionable GPU
// the placements it blocks), not all of them. On a simulated DGX H100 with on-demand MIG
// (232 devices, a 51 KB message) encoding the whole message on every change was a
// quarter of the agent's CPU in a Reserve+Release loop of one partition.
//
// The groups' own fields and the counter sets with their use are kept the same way.
// The bytes differ from proto.Marshal's of snapshotToProto only in the order of the
// top-level fields (the timestamp, the counter sets, then the groups), which decoders
// do not see. Safe for concurrent use.
type snapshotEncoder struct {
	filter streamFilter

	mu     sync.Mutex
	gen    uint64                                // encodes made
	devs   map[*device.DeviceInfo]*encodedDevice // by the inventory entry encoded
	groups map[*device.Group]*encodedPart        // each group's own fields, by the group
	sets   map[*device.CounterSet]*encodedPart   // each counter set with its use, by the set
}

// encodedPart is the encoding of a group's own fields (its devices apart), or of a
// counter set with its use (used: a copy of the use it was made from).
type encodedPart struct {
	data []byte
	used map[string]int64
	gen  uint64
}

// encodedDevice is a device's encoding, with the state it was made from.
type encodedDevice struct {
	state device.DeviceState // a copy of what deviceToProto reads
	data  []byte             // the pb.Device, encoded
	gen   uint64             // the last encode that used it
}

func newSnapshotEncoder(f streamFilter) *snapshotEncoder {
	return &snapshotEncoder{filter: f, devs: make(map[*device.DeviceInfo]*encodedDevice),
		groups: make(map[*device.Group]*encodedPart), sets: make(map[*device.CounterSet]*encodedPart)}
}

// encode is snapshotToProto and proto.Marshal, with the devices' encodings reused; the
// frame is numbered with snap.Seq.
func (e *snapshotEncoder) encode(snap device.Snapshot) *fanout.Frame {
	return e.marshal(snap).At(snap.Seq)
}

// marshal is encode's frame, unnumbered. Inventory entries are keyed by address: a
// snapshot's inventory is never modified (a new one is new slices), and an entry kept
// here keeps its array from being reused.
func (e *snapshotEncoder) marshal(snap device.Snapshot) *fanout.Frame {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.gen++
	inv, st := snap.Inventory, snap.State
	head := &pb.FingerprintResponse{Timestamp: timeToProto(snap.Time)}
	sets := make(map[device.CounterSetKey]bool) // the sets a listed device consumes
	// First each listed group's header and its devices' encodings, then one buffer of
	// the message's size: each device's bytes are copied once.
	type groupParts struct {
		head []byte
		size int // of the group's message
		devs [][]byte
	}
	var parts []groupParts
	total := 0
	for gi := range inv.Groups {
		g := &inv.Groups[gi]
		if !e.filter.matches(g.Plugin, g.GroupKey) {
			continue
		}
		gp := e.groups[g]
		if gp == nil {
			gh, err := proto.Marshal(groupToProto(g))
			if err != nil {
				return fanout.Encode(snapshotToProto(snap, e.filter)) // its error, in the frame
			}
			gp = &encodedPart{data: gh}
			e.groups[g] = gp
		}
		gp.gen = e.gen
		gh := gp.data
		p := groupParts{head: gh, size: len(gh), devs: make([][]byte, 0, len(g.Devices))}
		for i := range g.Devices {
			d := &g.Devices[i]
			ds := st.Devices[d.ID]
			c := e.devs[d]
			if c == nil || !sameEncodedState(c.state, ds) {
				data, err := proto.Marshal(deviceToProto(d, ds))
				if err != nil {
					return fanout.Encode(snapshotToProto(snap, e.filter))
				}
				c = &encodedDevice{state: copyEncodedState(ds), data: data}
				e.devs[d] = c
			}
			c.gen = e.gen
			p.devs = append(p.devs, c.data)
			p.size += protowire.SizeTag(groupDevicesField) + protowire.SizeBytes(len(c.data))
			for _, cs := range d.Consumes {
				sets[cs.Set] = true
			}
		}
		total += protowire.SizeTag(fingerprintGroupsField) + protowire.SizeBytes(p.size)
		parts = append(parts, p)
	}
	var setParts [][]byte
	for i := range inv.CounterSets {
		cs := &inv.CounterSets[i]
		if !sets[cs.Key] {
			continue
		}
		used := st.CounterUse[cs.Key]
		sp := e.sets[cs]
		if sp == nil || !maps.Equal(sp.used, used) {
			data, err := proto.Marshal(counterSetToProto(*cs, st))
			if err != nil {
				return fanout.Encode(snapshotToProto(snap, e.filter))
			}
			sp = &encodedPart{data: data, used: maps.Clone(used)}
			e.sets[cs] = sp
		}
		sp.gen = e.gen
		setParts = append(setParts, sp.data)
		total += protowire.SizeTag(fingerprintCounterSetsField) + protowire.SizeBytes(len(sp.data))
	}
	prune(e.devs, func(c *encodedDevice) bool { return c.gen != e.gen }) // no longer in the snapshot (or the filter)
	prune(e.groups, func(c *encodedPart) bool { return c.gen != e.gen })
	prune(e.sets, func(c *encodedPart) bool { return c.gen != e.gen })
	data, err := proto.MarshalOptions{}.MarshalAppend(make([]byte, 0, 16+total), head) // the timestamp
	if err != nil {
		return fanout.Encode(snapshotToProto(snap, e.filter))
	}
	for _, b := range setParts {
		data = protowire.AppendTag(data, fingerprintCounterSetsField, protowire.BytesType)
		data = protowire.AppendBytes(data, b)
	}
	for _, p := range parts {
		data = protowire.AppendTag(data, fingerprintGroupsField, protowire.BytesType)
		data = protowire.AppendVarint(data, uint64(p.size))
		data = append(data, p.head...)
		for _, b := range p.devs {
			data = protowire.AppendTag(data, groupDevicesField, protowire.BytesType)
			data = protowire.AppendBytes(data, b)
		}
	}
	return fanout.NewFrame(data)
}

// prune deletes the entries of m that drop says to.
func prune[K comparable, V any](m map[K]V, drop func(V) bool) {
	for k, v := range m {
		if drop(v) {
			delete(m, k)
		}
	}
}

// sameEncodedState reports whether a and b encode alike (what deviceToProto reads).
func sameEncodedState(a, b device.DeviceState) bool {
	sameHolder := func(x, y device.Holder) bool { return x.ReservationID == y.ReservationID && x.OwnerID == y.OwnerID }
	return a.Health == b.Health && a.Reason == b.Reason && a.Since.Equal(b.Since) &&
		(a.Holder == nil) == (b.Holder == nil) && (a.Holder == nil || sameHolder(*a.Holder, *b.Holder)) &&
		slices.EqualFunc(a.BlockedBy, b.BlockedBy, sameHolder) &&
		(a.Cordon == nil) == (b.Cordon == nil) &&
		(a.Cordon == nil || a.Cordon.Reason == b.Cordon.Reason && a.Cordon.By == b.Cordon.By && a.Cordon.Since.Equal(b.Cordon.Since) && a.Cordon.Drain == b.Cordon.Drain) &&
		slices.EqualFunc(a.AdminAccess, b.AdminAccess, sameHolder)
}

// copyEncodedState copies what deviceToProto reads of s, sharing nothing with it.
func copyEncodedState(s device.DeviceState) device.DeviceState {
	out := device.DeviceState{Health: s.Health, Reason: s.Reason, Since: s.Since}
	ids := func(h device.Holder) device.Holder {
		return device.Holder{ReservationID: h.ReservationID, OwnerID: h.OwnerID}
	}
	if s.Holder != nil {
		h := ids(*s.Holder)
		out.Holder = &h
	}
	if s.Cordon != nil {
		c := *s.Cordon
		out.Cordon = &c
	}
	for _, h := range s.BlockedBy {
		out.BlockedBy = append(out.BlockedBy, ids(h))
	}
	for _, h := range s.AdminAccess {
		out.AdminAccess = append(out.AdminAccess, ids(h))
	}
	return out
}
