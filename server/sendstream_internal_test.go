package server

import (
	"testing"

	"google.golang.org/grpc"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// innerStream stands for grpc-go's own stream.
type innerStream struct{ grpc.ServerStream }

// countingStream is a ServerOption interceptor's wrapper that sends differently: it
// counts what it sends, so a feed must send through it.
type countingStream struct {
	grpc.ServerStream
	sent int
}

func (s *countingStream) SendMsg(m any) error { s.sent++; return s.ServerStream.SendMsg(m) }

// TestSendStreamSkipsOnlyWrappersThatSendAsTheirStream: a feed sends on grpc-go's
// stream past the typed stream and the access check's wrapper (fanout.Unstrict is
// tested in its package), and through any wrapper of its own SendMsg.
func TestSendStreamSkipsOnlyWrappersThatSendAsTheirStream(t *testing.T) {
	inner := &innerStream{}
	fp := &grpc.GenericServerStream[pb.FingerprintRequest, pb.FingerprintResponse]{ServerStream: &callerStream{ServerStream: inner}}
	if got := sendStream(fp); got != inner {
		t.Errorf("Fingerprint: sends on %T, want grpc-go's stream", got)
	}
	st := &grpc.GenericServerStream[pb.StatsRequest, pb.StatsResponse]{ServerStream: &callerStream{ServerStream: inner}}
	if got := sendStream(st); got != inner {
		t.Errorf("Stats: sends on %T, want grpc-go's stream", got)
	}
	counting := &countingStream{ServerStream: inner}
	wrapped := &grpc.GenericServerStream[pb.FingerprintRequest, pb.FingerprintResponse]{ServerStream: &callerStream{ServerStream: counting}}
	if got := sendStream(wrapped); got != counting {
		t.Errorf("behind an interceptor's wrapper: sends on %T, want the wrapper", got)
	}
}
