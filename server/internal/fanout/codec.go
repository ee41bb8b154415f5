package fanout

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// How requests are decoded and stream messages encoded.
//
// Decoding. grpc-go decodes a request inside the generated handler (unary: the `dec`
// callback, before any interceptor runs; streams: RecvMsg), and when its codec fails it
// writes INTERNAL to the client at once, before the handler can say anything else. A
// request that is not valid protobuf, or holds invalid UTF-8 in a string field, is the
// caller's mistake, so it must be INVALID_ARGUMENT. So every service is registered
// through StrictServices, whose handlers decode into a *pendingDecode: the server's
// codec (Codec) decodes the real message into it and keeps the error instead of
// failing, and the handler returns that error as INVALID_ARGUMENT. The call then ends
// like any other, and the server's stats handler logs it once.
//
// Encoding. Fingerprint and Stats send one message to many streams. The fan-out
// (fanout.go) marshals it once into a *Frame; Codec passes a frame's bytes through
// untouched, and every stream sends the same immutable bytes. Anything else is handed
// to grpc-go's own proto codec.

// Frame is a message marshalled once, shared read-only by every stream that sends it.
type Frame struct {
	data []byte // the encoded message; never written after the frame is made
	// wire is data as grpc-go takes it from the codec, made once rather than on every
	// send. A SliceBuffer is never pooled: grpc-go's Ref and Free leave it alone.
	wire mem.BufferSlice
	err  error // marshalling failed: the status to end the streams with
	// seq orders the values frames of one feed were made from (a snapshot's Seq); 0
	// when they are not ordered. A stream that started from a frame newer than its
	// feed's skips the feed's frames up to that one's seq (see Sub.Start).
	seq uint64
}

// NewFrame makes the frame of encoded message data, which the caller must not modify
// after.
func NewFrame(data []byte) *Frame {
	return &Frame{data: data, wire: mem.BufferSlice{mem.SliceBuffer(data)}}
}

// At is a copy of f made from the value numbered seq (see Frame.seq).
func (f *Frame) At(seq uint64) *Frame {
	c := *f
	c.seq = seq
	return &c
}

// Seq is the number of the value f was made from; 0 when unordered.
func (f *Frame) Seq() uint64 { return f.seq }

// Data is the encoded message; nil when encoding failed. Not to be modified.
func (f *Frame) Data() []byte { return f.data }

// Err is the status the streams end with when the message could not be encoded.
func (f *Frame) Err() error { return f.err }

// Encode marshals m into a frame. When that fails, the frame holds the INTERNAL status
// that a stream sending it ends with.
func Encode(m proto.Message) *Frame {
	data, err := proto.Marshal(m)
	if err != nil {
		return &Frame{err: status.Errorf(codes.Internal, "encode %s: %v", m.ProtoReflect().Descriptor().Name(), err)}
	}
	return NewFrame(data)
}

// pendingDecode is what strict handlers ask the codec to decode into: msg is the request
// message, and err is set (an INVALID_ARGUMENT status) when the bytes were not a valid
// msg.
type pendingDecode struct {
	msg proto.Message
	err error
}

// Codec is the server's codec (grpc.ForceServerCodecV2): frames and pendingDecodes as
// described above, anything else through grpc-go's proto codec. Stateless; safe for
// concurrent use.
type Codec struct {
	proto encoding.CodecV2
}

// NewCodec returns the server's codec.
func NewCodec() Codec {
	return Codec{proto: encoding.GetCodecV2(grpcproto.Name)}
}

// Name implements encoding.CodecV2.
func (Codec) Name() string { return grpcproto.Name }

// Marshal implements encoding.CodecV2. A frame's bytes are sent as they are.
func (c Codec) Marshal(v any) (mem.BufferSlice, error) {
	if f, ok := v.(*Frame); ok {
		return f.wire, nil
	}
	return c.proto.Marshal(v)
}

// Unmarshal implements encoding.CodecV2. Decoding into a *pendingDecode never fails: the
// error is kept in it for the handler to return.
func (c Codec) Unmarshal(data mem.BufferSlice, v any) error {
	p, ok := v.(*pendingDecode)
	if !ok {
		return c.proto.Unmarshal(data, v)
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	if err := proto.Unmarshal(buf.ReadOnlyData(), p.msg); err != nil {
		p.err = status.Errorf(codes.InvalidArgument, "the request is not a valid %s: %v",
			p.msg.ProtoReflect().Descriptor().FullName(), err)
	}
	return nil
}

// StrictServices is a grpc.ServiceRegistrar (and reflection.GRPCServer) that registers
// every service on Server with handlers that answer an undecodable request
// INVALID_ARGUMENT. It relies on Server using Codec.
type StrictServices struct {
	Server *grpc.Server
}

// RegisterService implements grpc.ServiceRegistrar.
func (r StrictServices) RegisterService(desc *grpc.ServiceDesc, impl any) {
	r.Server.RegisterService(strictDesc(desc), impl)
}

// GetServiceInfo lets reflection list the services.
func (r StrictServices) GetServiceInfo() map[string]grpc.ServiceInfo {
	return r.Server.GetServiceInfo()
}

// strictDesc returns a copy of desc whose handlers decode requests strictly.
func strictDesc(desc *grpc.ServiceDesc) *grpc.ServiceDesc {
	out := *desc
	out.Methods = make([]grpc.MethodDesc, len(desc.Methods))
	for i, m := range desc.Methods {
		h := m.Handler
		out.Methods[i] = grpc.MethodDesc{
			MethodName: m.MethodName,
			Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
				return h(srv, ctx, strictDecoder(dec), interceptor)
			},
		}
	}
	out.Streams = make([]grpc.StreamDesc, len(desc.Streams))
	for i, sd := range desc.Streams {
		h := sd.Handler
		sd.Handler = func(srv any, ss grpc.ServerStream) error { return h(srv, strictStream{ss}) }
		out.Streams[i] = sd
	}
	return &out
}

// strictDecoder wraps a unary handler's dec.
func strictDecoder(dec func(any) error) func(any) error {
	return func(v any) error {
		m, ok := v.(proto.Message)
		if !ok {
			return dec(v)
		}
		p := &pendingDecode{msg: m}
		if err := dec(p); err != nil {
			return err
		}
		return p.err
	}
}

// strictStream is a ServerStream whose RecvMsg decodes strictly.
type strictStream struct {
	grpc.ServerStream
}

// Unstrict returns the stream a StrictServices handler's stream wraps, and whether ss is
// one: its SendMsg is the wrapped stream's own.
func Unstrict(ss grpc.ServerStream) (grpc.ServerStream, bool) {
	s, ok := ss.(strictStream)
	return s.ServerStream, ok
}

// RecvMsg implements grpc.ServerStream.
func (s strictStream) RecvMsg(v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return s.ServerStream.RecvMsg(v)
	}
	p := &pendingDecode{msg: m}
	if err := s.ServerStream.RecvMsg(p); err != nil {
		return err
	}
	return p.err
}
