package main

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// stop SIGTERMs the agent and waits until it has exited cleanly.
func (a *agentProcess) stop(t *testing.T, ctx context.Context) {
	t.Helper()
	if err := a.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := a.Wait(ctx); err != nil {
		t.Fatalf("agent exit after SIGTERM: %v", err)
	}
}

// copyFile copies the file at from to to (mode 0600), as `cp -p` does for the test.
func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestBackupAndRestoreAsDocumented follows docs/reservations.md's backup and restore
// steps with the real binary: a copy of devicehost.db taken after a clean stop, put
// back (and a log of an earlier version removed) after later changes, is exactly what
// the agent serves next: its reservation, none of the later ones, no later cordon, and
// the trail as it was.
func TestBackupAndRestoreAsDocumented(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s := newAgentSetup(t, noGCConfig)
	db := filepath.Join(s.stateDir, "devicehost.db")
	backup := filepath.Join(t.TempDir(), "devicehost.db")

	agent := s.start(t)
	c := agent.client(t, ctx)
	g, gpus := healthyGPUs(t, ctx, c)
	kept, err := c.Reserve(ctx, reserveRequest(g, "o1", gpus[0]))
	if err != nil {
		t.Fatal(err)
	}
	// Backup: 1. stop the agent; 2. copy the file; 3. start it again.
	agent.stop(t, ctx)
	copyFile(t, db, backup)
	agent = s.start(t)
	c = agent.client(t, ctx)
	healthyGPUs(t, ctx, c)
	if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_OwnerId{OwnerId: "o1"}}); err != nil {
		t.Fatal(err)
	}
	later, err := c.Reserve(ctx, reserveRequest(g, "o2", gpus[0]))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.CordonDevice(ctx, &pb.CordonDeviceRequest{DeviceId: gpus[1], Reason: "after the backup"}); err != nil {
		t.Fatal(err)
	}
	// Restore: 1. stop the agent; 2. copy the backup into place, remove any log; 3. start.
	agent.stop(t, ctx)
	copyFile(t, backup, db)
	if err := os.Remove(db + "-wal"); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	agent = s.start(t)
	c = agent.client(t, ctx)
	fp := currentFingerprint(t, ctx, c, "the GPUs", func(fp *pb.FingerprintResponse) bool { return len(fp.GetGroups()) > 0 })

	list, err := c.ListReservations(ctx, &pb.ListReservationsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	rs := list.GetReservations()
	if len(rs) != 1 || rs[0].GetReservationId() != kept.GetReservationId() || rs[0].GetState() != pb.ReservationState_RESERVATION_STATE_ACTIVE {
		t.Errorf("reservations after the restore = %v, want only %s, live (not %s, made after the backup)", rs, kept.GetReservationId(), later.GetReservationId())
	}
	for _, d := range fp.GetGroups()[0].GetDevices() {
		if d.GetCordon() != nil {
			t.Errorf("%s cordoned after the restore: the cordon came after the backup", d.GetId())
		}
	}
	stream, err := c.WatchEvents(ctx, &pb.WatchEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var ev []*pb.Event
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break // the trail is read (no follow)
		}
		if err != nil {
			t.Fatal(err)
		}
		ev = append(ev, resp.GetEvents()...)
	}
	if len(ev) != 1 || ev[0].GetSeq() != 1 || ev[0].GetOwnerId() != "o1" {
		t.Errorf("events after the restore = %v, want the backup's one: o1's reserve at seq 1", ev)
	}
	agent.stop(t, ctx)
}
