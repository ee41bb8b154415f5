package server_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/tools/rawgrpc"
)

// Requests that are not valid protobuf for their message. Field 1 of every request
// below is a string (ReserveRequest.owner_id, FingerprintRequest.groups is a message:
// its field 1, vendor, is a string).
var undecodable = []struct {
	name string
	data []byte
}{
	{"invalid UTF-8 in a string field", []byte{0x0a, 0x02, 0xff, 0xfe}},
	{"garbage bytes", []byte{0xff, 0xff, 0xff, 0xff}},
	{"truncated field", []byte{0x0a, 0x10, 'a'}},
}

func TestUndecodableRequestIsInvalidArgumentAndLogged(t *testing.T) {
	h := startHost(t, &devicetest.Fake{})
	ctx := testContext(t)
	for i, tt := range undecodable {
		t.Run("unary "+tt.name, func(t *testing.T) {
			var out []byte
			err := h.conn.Invoke(ctx, "/devicehost.v1.DeviceHost/Reserve", &tt.data, &out, grpc.ForceCodecV2(rawgrpc.Codec{}))
			st := status.Convert(err)
			if st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "devicehost.v1.ReserveRequest") {
				t.Errorf("Reserve with %s: %v %q, want %v naming devicehost.v1.ReserveRequest", tt.name, st.Code(), st.Message(), codes.InvalidArgument)
			}
			lines := h.logs.waitCallLines(t, "/devicehost.v1.DeviceHost/Reserve", i+1)
			if l := lines[len(lines)-1]; l["code"] != "InvalidArgument" || l["@level"] != "info" {
				t.Errorf("log line %v, want code InvalidArgument at info", l)
			}
		})
	}
	// Streams decode their request in the handler: the same answer.
	stream := &grpc.StreamDesc{ServerStreams: true}
	for i, tt := range undecodable {
		for _, method := range []string{"/devicehost.v1.DeviceHost/Fingerprint", "/devicehost.v1.DeviceHost/Stats"} {
			t.Run(method+" "+tt.name, func(t *testing.T) {
				cs, err := h.conn.NewStream(ctx, stream, method, grpc.ForceCodecV2(rawgrpc.Codec{}))
				if err != nil {
					t.Fatal(err)
				}
				if err := cs.SendMsg(&tt.data); err != nil {
					t.Fatal(err)
				}
				if err := cs.CloseSend(); err != nil {
					t.Fatal(err)
				}
				var out []byte
				err = cs.RecvMsg(&out)
				if got := status.Code(err); got != codes.InvalidArgument {
					t.Errorf("%s with %s: %v, want %v", method, tt.name, err, codes.InvalidArgument)
				}
				lines := h.logs.waitCallLines(t, method, i+1)
				if l := lines[len(lines)-1]; l["code"] != "InvalidArgument" {
					t.Errorf("log line %v, want code InvalidArgument", l)
				}
			})
		}
	}
	// A valid request on the same connection still works.
	if _, err := h.client.ListPlugins(ctx, &pb.ListPluginsRequest{}); err != nil {
		t.Errorf("ListPlugins after undecodable requests: %v", err)
	}
}

func TestOversizedRequestIsLogged(t *testing.T) {
	h := startHost(t, &devicetest.Fake{})
	big := strings.Repeat("x", server.DefaultMaxRecvMsgSize)
	_, err := h.client.Reserve(testContext(t), &pb.ReserveRequest{OwnerId: big})
	if got, want := status.Code(err), codes.ResourceExhausted; got != want {
		t.Fatalf("oversized request: code %v (%v), want %v", got, err, want)
	}
	l := h.logs.waitCallLines(t, "/devicehost.v1.DeviceHost/Reserve", 1)[0]
	if l["code"] != "ResourceExhausted" || !strings.Contains(fmt.Sprint(l["error"]), "larger than max") {
		t.Errorf("log line %v, want code ResourceExhausted and the size in the error", l)
	}
}

func TestUnknownMethodIsLogged(t *testing.T) {
	h := startHost(t, &devicetest.Fake{})
	var in, out []byte
	err := h.conn.Invoke(testContext(t), "/devicehost.v1.DeviceHost/Nope", &in, &out, grpc.ForceCodecV2(rawgrpc.Codec{}))
	if got, want := status.Code(err), codes.Unimplemented; got != want {
		t.Fatalf("unknown method: %v, want %v", err, want)
	}
	if l := h.logs.waitCallLines(t, "/devicehost.v1.DeviceHost/Nope", 1)[0]; l["code"] != "Unimplemented" {
		t.Errorf("log line %v, want code Unimplemented", l)
	}
}

func TestStatsIntervalIsCapped(t *testing.T) {
	intervals := make(chan time.Duration, 8) // room for every subtest: a server that does not refuse never blocks here
	h := startHost(t, &devicetest.Fake{WatchStatsFunc: func(_ context.Context, interval time.Duration) <-chan device.StatsSnapshot {
		intervals <- interval
		ch := make(chan device.StatsSnapshot, 1)
		ch <- device.StatsSnapshot{Time: t0}
		return ch
	}})
	ctx := testContext(t)
	for _, tt := range []struct {
		name     string
		interval *durationpb.Duration
	}{
		{"24h and a nanosecond", durationpb.New(24*time.Hour + 1)},
		{"9223372036s (time.Duration overflows)", &durationpb.Duration{Seconds: 9223372036}},
		{"10,000 years", &durationpb.Duration{Seconds: 315576000000}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			stream, err := h.client.Stats(ctx, &pb.StatsRequest{Interval: tt.interval})
			if err != nil {
				t.Fatal(err)
			}
			_, err = stream.Recv()
			assertInvalidField(t, err, "interval")
			if msg := status.Convert(err).Message(); !strings.Contains(msg, "at most 24h0m0s") {
				t.Errorf("message %q does not give the cap", msg)
			}
		})
	}
	t.Run("24h is served", func(t *testing.T) {
		stream, err := h.client.Stats(ctx, &pb.StatsRequest{Interval: durationpb.New(24 * time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != nil {
			t.Fatalf("Stats at 24h: %v", err)
		}
		if got := <-intervals; got != 24*time.Hour {
			t.Errorf("manager asked for %v, want 24h", got)
		}
	})
}
