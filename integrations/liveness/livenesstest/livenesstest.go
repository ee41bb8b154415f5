// Package livenesstest follows a component's health socket (liveness.Listen) in tests,
// as a liveness probe asks it.
package livenesstest

import (
	"context"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// Watch follows grpc.health.v1 Watch on a health socket.
type Watch struct{ w healthpb.Health_WatchClient }

// NewWatch dials the health socket at sock and watches the overall health; the watch
// ends with ctx, and the connection with the test. It waits for the socket to answer.
func NewWatch(t testing.TB, ctx context.Context, sock string) *Watch {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	w, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	return &Watch{w: w}
}

// Wait reads the watch until it reports want; what names the wait in a failure.
func (w *Watch) Wait(t testing.TB, what string, want healthpb.HealthCheckResponse_ServingStatus) {
	t.Helper()
	for {
		r, err := w.w.Recv()
		if err != nil {
			t.Fatalf("%s: waiting for %v: %v", what, want, err)
		}
		if r.GetStatus() == want {
			return
		}
	}
}
