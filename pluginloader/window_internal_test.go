package pluginloader

import (
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/devicehost/devicehost/tools/h2test"
)

// TestDialOptionsMakeNoFlowControlPings checks that the host's connection to a plugin
// sends it no PING frames while answers arrive (gRPC's window estimate would, after
// most calls, for the plugin to read and answer). Without dialOptions' windows the same
// client must send some, or the count is not seeing them.
func TestDialOptionsMakeNoFlowControlPings(t *testing.T) {
	const calls = 20
	for _, tt := range []struct {
		name      string
		opts      []grpc.DialOption
		wantPings bool
	}{
		{"recvLimit alone", recvLimit("p", 1<<20), true},
		{"dialOptions", dialOptions("p", 1<<20), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			l, target := h2test.Serve(t, grpc.NewServer(), nil)
			conn, err := grpc.NewClient(target, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, tt.opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			pings, _ := h2test.Checks(t, l, conn, calls)
			if tt.wantPings && pings == 0 {
				t.Fatalf("no PING in %d calls: the count does not see them", calls)
			}
			if !tt.wantPings && pings != 0 {
				t.Errorf("%d PINGs in %d calls, want none", pings, calls)
			}
		})
	}
}
