package deviceplugin_test

import (
	"testing"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/tools/h2test"
)

// TestServeMakesNoFlowControlPings checks that the server Serve runs sends its host no
// PING frames while requests arrive, nor does a client with WindowDialOptions (the
// host's) send any while answers arrive: gRPC's window estimate would make each side
// read and answer one after most calls. go-plugin's default server, and a client with
// gRPC's defaults, must show pings, or the count is not seeing them.
func TestServeMakesNoFlowControlPings(t *testing.T) {
	const calls = 20
	dial := func(target string, opts ...grpc.DialOption) *grpc.ClientConn {
		t.Helper()
		conn, err := grpc.NewClient(target, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}

	l, target := h2test.Serve(t, plugin.DefaultGRPCServer(nil), nil)
	received, sent := h2test.Checks(t, l, dial(target), calls)
	if received == 0 || sent == 0 {
		t.Fatalf("gRPC's defaults: %d PINGs from the client, %d from the server in %d calls; want some each way, or the count does not see them", received, sent, calls)
	}

	l, target = h2test.Serve(t, deviceplugin.ServeConfig(nil).GRPCServer(nil), nil)
	received, sent = h2test.Checks(t, l, dial(target, deviceplugin.WindowDialOptions()...), calls)
	if received != 0 || sent != 0 {
		t.Errorf("host and plugin windows: %d PINGs from the client, %d from the server in %d calls, want none", received, sent, calls)
	}
}
