package server

import (
	"testing"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
)

func TestCallLevel(t *testing.T) {
	tests := []struct {
		method       string
		code         codes.Code
		serverStream bool
		want         hclog.Level
	}{
		// A client ending its own stream.
		{"/devicehost.v1.DeviceHost/Fingerprint", codes.Canceled, true, hclog.Debug},
		{"/devicehost.v1.DeviceHost/Stats", codes.DeadlineExceeded, true, hclog.Debug},
		{"/grpc.health.v1.Health/Watch", codes.Canceled, true, hclog.Debug},
		// A stream the server ended keeps its level.
		{"/devicehost.v1.DeviceHost/Fingerprint", codes.Unavailable, true, hclog.Warn},
		{"/devicehost.v1.DeviceHost/Stats", codes.InvalidArgument, true, hclog.Info},
		{"/devicehost.v1.DeviceHost/Stats", codes.Internal, true, hclog.Error},
		// Unary calls: a deadline the server missed is worth a warning, a call the client
		// abandoned (a Reserve that may have been made) stays visible.
		{"/devicehost.v1.DeviceHost/Reserve", codes.DeadlineExceeded, false, hclog.Warn},
		{"/devicehost.v1.DeviceHost/Reserve", codes.Canceled, false, hclog.Info},
		{"/devicehost.v1.DeviceHost/Reserve", codes.OK, false, hclog.Info},
		{"/grpc.health.v1.Health/Check", codes.OK, false, hclog.Debug},
		{"/grpc.health.v1.Health/Check", codes.Internal, false, hclog.Error},
	}
	for _, tt := range tests {
		if got := callLevel(tt.method, tt.code, tt.serverStream); got != tt.want {
			t.Errorf("callLevel(%s, %v, serverStream %v) = %v, want %v", tt.method, tt.code, tt.serverStream, got, tt.want)
		}
	}
}
