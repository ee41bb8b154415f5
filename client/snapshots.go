package client

import (
	"fmt"

	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// The fields snapshotDecoder takes apart itself.
var (
	fingerprintGroupsField      = (&pb.FingerprintResponse{}).ProtoReflect().Descriptor().Fields().ByName("groups").Number()
	fingerprintCounterSetsField = (&pb.FingerprintResponse{}).ProtoReflect().Descriptor().Fields().ByName("counter_sets").Number()
	groupDevicesField           = (&pb.DeviceGroup{}).ProtoReflect().Descriptor().Fields().ByName("devices").Number()
)

// snapshotDecoder decodes the snapshots of one Fingerprint stream, each device (and
// counter set) whose encoding is byte for byte the one it had in the stream's previous
// snapshot given as the message decoded then, not decoded again. The agent keeps an
// unchanged device's encoding from one snapshot to the next (server/snapenc.go), so a
// Reserve, which changes a few of the hundreds of devices of a GPU machine with
// on-demand MIG, costs a watcher a few devices' decoding rather than a 51 KB message's,
// and tells it which devices are the same messages as before: the DRA driver rebuilds
// only the devices that are not. The result is what proto.Unmarshal gives
// (TestSnapshotDecoderDecodesAsProto). Memory: the last snapshot's encodings, about its
// size. For one stream's goroutine.
type snapshotDecoder struct {
	devices map[string]known[*pb.Device]     // the last snapshot's, by encoding
	sets    map[string]known[*pb.CounterSet] // likewise
	// The maps the next snapshot fills (the ones before last, cleared): a decode
	// allocates neither the maps nor a key for a message it had.
	nextDevices map[string]known[*pb.Device]
	nextSets    map[string]known[*pb.CounterSet]
	scratch     []byte // a group's own fields, gathered
}

// known is a message decoded from the encoding key.
type known[P any] struct {
	key string
	m   P
}

func newSnapshotDecoder() *snapshotDecoder {
	return &snapshotDecoder{nextDevices: make(map[string]known[*pb.Device]), nextSets: make(map[string]known[*pb.CounterSet])}
}

// decode decodes b into m (a fresh message), as proto.Unmarshal would.
func (d *snapshotDecoder) decode(b []byte, m *pb.FingerprintResponse) error {
	devices, sets := d.nextDevices, d.nextSets
	clear(devices)
	clear(sets)
	var groups []*pb.DeviceGroup
	var setList []*pb.CounterSet
	rest := make([]byte, 0, 32) // the other fields: the timestamp, ones this build does not know
	for len(b) > 0 {
		num, field, v, err := nextField(b)
		if err != nil {
			return fmt.Errorf("snapshot: %w", err)
		}
		b = b[len(field):]
		if v == nil {
			rest = append(rest, field...) // (a wrong wire type is proto.Unmarshal's to refuse)
			continue
		}
		switch num {
		case fingerprintGroupsField:
			g, err := d.group(v, devices)
			if err != nil {
				return err
			}
			groups = append(groups, g)
		case fingerprintCounterSetsField:
			cs, err := reuse(d.sets, sets, v)
			if err != nil {
				return fmt.Errorf("snapshot: counter set: %w", err)
			}
			setList = append(setList, cs)
		default:
			rest = append(rest, field...)
		}
	}
	if err := proto.Unmarshal(rest, m); err != nil {
		return err
	}
	m.Groups = append(m.Groups, groups...)
	m.CounterSets = append(m.CounterSets, setList...)
	d.devices, d.nextDevices = devices, d.devices
	d.sets, d.nextSets = sets, d.sets
	if d.nextDevices == nil { // the first snapshot's
		d.nextDevices, d.nextSets = make(map[string]known[*pb.Device]), make(map[string]known[*pb.CounterSet])
	}
	return nil
}

// group decodes one group: its own fields afresh, its devices from the last snapshot's
// where their encodings are the same.
func (d *snapshotDecoder) group(b []byte, devices map[string]known[*pb.Device]) (*pb.DeviceGroup, error) {
	d.scratch = d.scratch[:0]
	var devs []*pb.Device
	for len(b) > 0 {
		num, field, v, err := nextField(b)
		if err != nil {
			return nil, fmt.Errorf("snapshot: device group: %w", err)
		}
		b = b[len(field):]
		if num != groupDevicesField || v == nil {
			d.scratch = append(d.scratch, field...)
			continue
		}
		dev, err := reuse(d.devices, devices, v)
		if err != nil {
			return nil, fmt.Errorf("snapshot: device: %w", err)
		}
		devs = append(devs, dev)
	}
	g := &pb.DeviceGroup{}
	if err := proto.Unmarshal(d.scratch, g); err != nil {
		return nil, err
	}
	g.Devices = append(g.Devices, devs...)
	return g, nil
}

// nextField splits off b's first field: its number, the field whole (its tag
// included) and, where it is length-delimited, what it holds (else nil).
func nextField(b []byte) (num protowire.Number, field, contents []byte, err error) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return 0, nil, nil, protowire.ParseError(n)
	}
	vn := protowire.ConsumeFieldValue(num, typ, b[n:])
	if vn < 0 {
		return 0, nil, nil, protowire.ParseError(vn)
	}
	field = b[:n+vn]
	if typ == protowire.BytesType {
		contents, _ = protowire.ConsumeBytes(field[n:])
		if contents == nil {
			contents = []byte{} // empty, but length-delimited
		}
	}
	return num, field, contents, nil
}

// reuse returns the message that encodes as b: last's, or next's (the same encoding
// twice in one snapshot), or b decoded; it records it in next.
func reuse[T any, P interface {
	*T
	proto.Message
}](last, next map[string]known[P], b []byte) (P, error) {
	if k, ok := next[string(b)]; ok {
		return k.m, nil
	}
	k, ok := last[string(b)]
	if !ok {
		m := P(new(T))
		if err := proto.Unmarshal(b, m); err != nil {
			return nil, err
		}
		k = known[P]{key: string(b), m: m}
	}
	next[k.key] = k
	return k.m, nil
}

// snapshotCodec is the codec of one Fingerprint stream: its snapshots go through the
// stream's snapshotDecoder, everything else (the request) through gRPC's proto codec.
type snapshotCodec struct {
	encoding.CodecV2
	dec *snapshotDecoder
}

func newSnapshotCodec() snapshotCodec {
	return snapshotCodec{CodecV2: encoding.GetCodecV2(grpcproto.Name), dec: newSnapshotDecoder()}
}

// Unmarshal implements encoding.CodecV2.
func (c snapshotCodec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(*pb.FingerprintResponse)
	if !ok {
		return c.CodecV2.Unmarshal(data, v)
	}
	return endpoint.Gathered(data, func(b []byte) error { return c.dec.decode(b, m) })
}
