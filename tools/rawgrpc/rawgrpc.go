// Package rawgrpc lets a gRPC client send and receive a message as its encoded bytes,
// for tests and benchmarks of the host API: sending bytes no protobuf library would
// encode, or reading thousands of streams' messages without decoding them.
package rawgrpc

import (
	"errors"
	"time"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Codec sends a *[]byte as it is and receives into a *[]byte. Use it with
// grpc.ForceCodecV2.
type Codec struct{}

// Name is "proto", so the server decodes what it gets as protobuf.
func (Codec) Name() string { return "proto" }

// Marshal returns the bytes v (a *[]byte) points to.
func (Codec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}

// Unmarshal stores the message's bytes in v (a *[]byte).
func (Codec) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*[]byte) = data.Materialize()
	return nil
}

// FingerprintTime reads field 2 (timestamp) of an encoded
// devicehost.v1.FingerprintResponse, skipping the rest undecoded.
func FingerprintTime(b []byte) (time.Time, error) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return time.Time{}, protowire.ParseError(n)
		}
		b = b[n:]
		if num == 2 && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return time.Time{}, protowire.ParseError(n)
			}
			var ts timestamppb.Timestamp
			if err := proto.Unmarshal(v, &ts); err != nil {
				return time.Time{}, err
			}
			return ts.AsTime(), nil
		}
		if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
			return time.Time{}, protowire.ParseError(n)
		}
		b = b[n:]
	}
	return time.Time{}, errors.New("no timestamp")
}
