package endpoint

import (
	"bytes"
	"runtime"
	"testing"

	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// frames is m's encoding as it arrives: 16 KB HTTP/2 frames, the last one shorter.
func frames(t testing.TB, m proto.Message) mem.BufferSlice {
	data, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var out mem.BufferSlice
	for len(data) > 0 {
		n := min(len(data), 16<<10)
		out = append(out, mem.SliceBuffer(data[:n]))
		data = data[n:]
	}
	return out
}

// The clients' codec decodes what grpc-go's does, in one piece or in many.
func TestClientCodecDecodesAsGRPCs(t *testing.T) {
	for _, size := range []int{0, 100, 51433, 3 << 20} {
		want := wrapperspb.Bytes(bytes.Repeat([]byte{0xa5}, size))
		var got wrapperspb.BytesValue
		if err := newClientCodec().Unmarshal(frames(t, want), &got); err != nil {
			t.Fatalf("%d bytes: %v", size, err)
		}
		if !proto.Equal(&got, want) {
			t.Errorf("%d bytes: decoded %d bytes, not what was sent", size, len(got.GetValue()))
		}
	}
	if err := newClientCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer([]byte{0xff})}, &wrapperspb.BytesValue{}); err == nil {
		t.Error("a broken message decoded without an error")
	}
}

// BenchmarkReceive decodes a 51 KB message (a Fingerprint of 8 GPUs with on-demand MIG
// is that size) from the 16 KB HTTP/2 frames it arrives in, with grpc-go's proto codec
// and with the clients' (clientCodec); "/gc" collects garbage every third message, as
// a watcher of such snapshots does (not timed; it empties the pools).
func BenchmarkReceive(b *testing.B) {
	msg := frames(b, wrapperspb.Bytes(bytes.Repeat([]byte{0xa5}, 51433)))
	for _, codec := range []struct {
		name string
		c    encoding.CodecV2
	}{{"grpc", encoding.GetCodecV2(grpcproto.Name)}, {"client", newClientCodec()}} {
		for _, gc := range []bool{false, true} {
			name := codec.name
			if gc {
				name += "/gc"
			}
			b.Run(name, func(b *testing.B) {
				n := 0
				for b.Loop() {
					var m wrapperspb.BytesValue
					if err := codec.c.Unmarshal(msg, &m); err != nil {
						b.Fatal(err)
					}
					if n++; gc && n%3 == 0 {
						b.StopTimer()
						runtime.GC()
						b.StartTimer()
					}
				}
			})
		}
	}
}
