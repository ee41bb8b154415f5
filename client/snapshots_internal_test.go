package client

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// testSnapshot is a snapshot of groups of n devices each, with the maps, nested
// messages and repeated fields a GPU machine's has; holder names device held's holder.
func testSnapshot(groups, n int, held string) *pb.FingerprintResponse {
	s := &pb.FingerprintResponse{Timestamp: timestamppb.Now()}
	for gi := range groups {
		g := &pb.DeviceGroup{Vendor: "nvidia", Type: "mig", Name: fmt.Sprintf("%dg.10gb", gi+1), Plugin: "nvidia",
			Attributes: map[string]*pb.Value{
				"memory": {Kind: &pb.Value_IntValue{IntValue: 10240}, Unit: "MiB"},
				"driver": {Kind: &pb.Value_StringValue{StringValue: "550.1"}},
				"cc":     {Kind: &pb.Value_FloatValue{FloatValue: 9.0}},
			}}
		for i := range n {
			id := fmt.Sprintf("MIG-%d-%d", gi, i)
			d := &pb.Device{Id: id, Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{PciBusId: "0000:1b:00.0", NumaNode: int32(i % 2)},
				Consumes: []*pb.CounterConsumption{{CounterSet: fmt.Sprintf("GPU-%d", i%8), Counters: map[string]int64{"memory-slices": 1, "compute-slices": 1, "decoders": 0}}}}
			if id == held {
				d.Holder = &pb.Holder{ReservationId: "res-" + id, OwnerId: "k8s-claim/ns/c/uid"}
			}
			g.Devices = append(g.Devices, d)
		}
		s.Groups = append(s.Groups, g)
	}
	for i := range 8 {
		s.CounterSets = append(s.CounterSets, &pb.CounterSet{Plugin: "nvidia", Name: fmt.Sprintf("GPU-%d", i),
			Capacity: map[string]int64{"memory-slices": 8, "compute-slices": 7}})
	}
	return s
}

// deterministic makes a message's bytes the same each time, as the agent's encoder
// keeps an unchanged device's.
var deterministic = proto.MarshalOptions{Deterministic: true}

func mustMarshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := deterministic.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// decodeBoth decodes b with d and with proto.Unmarshal, and fails unless they agree:
// both refuse it, or both give equal messages.
func decodeBoth(t *testing.T, d *snapshotDecoder, b []byte, what string) *pb.FingerprintResponse {
	t.Helper()
	got, want := &pb.FingerprintResponse{}, &pb.FingerprintResponse{}
	errGot, errWant := d.decode(b, got), proto.Unmarshal(b, want)
	if (errGot != nil) != (errWant != nil) {
		t.Fatalf("%s: decoder error %v, proto.Unmarshal error %v: want both or neither", what, errGot, errWant)
	}
	if errGot != nil {
		return nil
	}
	if !proto.Equal(got, want) {
		t.Fatalf("%s: decoded\n%v\nproto.Unmarshal gives\n%v", what, got, want)
	}
	return got
}

func TestSnapshotDecoderDecodesAsProto(t *testing.T) {
	base := mustMarshal(t, testSnapshot(3, 5, "MIG-1-2"))
	// Unknown fields (a newer agent's) at the top, in a group and in a device; a group
	// whose own fields come after its devices; a scalar field twice (the last wins); a
	// group field split in two (they merge).
	var unknown []byte
	unknown = protowire.AppendTag(unknown, 99, protowire.BytesType)
	unknown = protowire.AppendString(unknown, "from a newer agent")
	unknown = protowire.AppendTag(unknown, 98, protowire.VarintType)
	unknown = protowire.AppendVarint(unknown, 7)
	dev := mustMarshal(t, &pb.Device{Id: "GPU-x", Health: pb.Health_HEALTH_UNHEALTHY})
	dev = append(dev, unknown...)
	var group []byte
	group = protowire.AppendTag(group, groupDevicesField, protowire.BytesType)
	group = protowire.AppendBytes(group, dev)
	group = append(group, mustMarshal(t, &pb.DeviceGroup{Vendor: "v", Type: "t"})...)
	group = append(group, unknown...)
	group = protowire.AppendTag(group, groupDevicesField, protowire.BytesType)
	group = protowire.AppendBytes(group, dev) // the same device twice
	group = append(group, mustMarshal(t, &pb.DeviceGroup{Type: "t2", Name: "n"})...)
	odd := append([]byte{}, unknown...)
	odd = protowire.AppendTag(odd, fingerprintGroupsField, protowire.BytesType)
	odd = protowire.AppendBytes(odd, group)
	odd = append(odd, base...)
	odd = append(odd, mustMarshal(t, &pb.FingerprintResponse{Timestamp: timestamppb.New(timestamppb.Now().AsTime().Add(1))})...)

	for name, b := range map[string][]byte{"a snapshot": base, "unusual layouts": odd, "empty": nil} {
		d := newSnapshotDecoder()
		decodeBoth(t, d, b, name)
		decodeBoth(t, d, b, name+", again")
	}
}

func TestSnapshotDecoderRefusesWhatProtoRefuses(t *testing.T) {
	full := mustMarshal(t, testSnapshot(2, 3, "MIG-0-1"))
	d := newSnapshotDecoder()
	decodeBoth(t, d, full, "whole")
	// Every cut of the message, and every byte of it flipped to 0xff: either both
	// decoders refuse it, or both give the same message; the decoder goes on decoding
	// the stream's whole snapshots after a refusal.
	for n := range len(full) {
		decodeBoth(t, d, full[:n], fmt.Sprintf("first %d bytes", n))
	}
	for i := range full {
		b := append([]byte{}, full...)
		b[i] = 0xff
		decodeBoth(t, d, b, fmt.Sprintf("byte %d flipped", i))
		decodeBoth(t, d, full, "whole, after a broken one")
	}
}

func TestSnapshotDecoderSharesTheDevicesThatDidNotChange(t *testing.T) {
	d := newSnapshotDecoder()
	held := func(id string) *pb.FingerprintResponse {
		return decodeBoth(t, d, mustMarshal(t, testSnapshot(3, 10, id)), "held "+id)
	}
	devices := func(s *pb.FingerprintResponse) map[string]*pb.Device {
		m := make(map[string]*pb.Device)
		for _, g := range s.GetGroups() {
			for _, dv := range g.GetDevices() {
				m[dv.GetId()] = dv
			}
		}
		return m
	}
	rnd := rand.New(rand.NewPCG(1, 2))
	last := held("")
	for range 20 {
		id := fmt.Sprintf("MIG-%d-%d", rnd.IntN(3), rnd.IntN(10))
		now := held(id)
		before, after := devices(last), devices(now)
		if len(after) != 30 {
			t.Fatalf("%d devices, want 30", len(after))
		}
		for id2, dv := range after {
			was := before[id2]
			changed := !proto.Equal(was, dv)
			if changed == (was == dv) {
				t.Errorf("holder %s: device %s changed=%v, same message as before=%v: want a new message exactly where it changed", id, id2, changed, was == dv)
			}
		}
		if now.GetCounterSets()[0] != last.GetCounterSets()[0] {
			t.Error("a counter set that did not change is a new message")
		}
		if now.GetGroups()[0] == last.GetGroups()[0] {
			t.Error("a group is the last snapshot's message: its devices list would be shared")
		}
		last = now
	}
}
