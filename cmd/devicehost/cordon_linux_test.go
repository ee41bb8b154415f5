package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// cordonOf is device id's cordon in fp; nil when it has none or is not there.
func cordonOf(fp *pb.FingerprintResponse, id string) *pb.Cordon {
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetId() == id {
				return d.GetCordon()
			}
		}
	}
	return nil
}

// A cordoned GPU keeps its holder, is refused to any other with the reason and who
// cordoned it, stays cordoned across a SIGKILL of the agent, and is offered again once
// uncordoned; drain waits for the holder to let go, and names it when it does not.
func TestCordonThroughTheCLIOutlivesAKill(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s := newAgentSetup(t, noGCConfig)
	a := s.start(t)
	c := a.client(t, ctx)
	g, ids := healthyGPUs(t, ctx, c)
	if _, err := c.Reserve(ctx, reserveRequest(g, "job-1", ids[0])); err != nil {
		t.Fatal(err)
	}
	addr := s.addr.String()
	if out := mustRunCLI(t, "cordon", "-device", ids[0], "-reason", "ECC storm", "-address", addr); !strings.Contains(out, "cordoned "+ids[0]) {
		t.Errorf("cordon said %q", out)
	}
	mustRunCLI(t, "cordon", "-device", ids[1], "-reason", "firmware update", "-address", addr)
	refused := func(when string) {
		t.Helper()
		_, err := c.Reserve(ctx, reserveRequest(g, "job-2", ids[1]))
		if status.Code(err) != codes.FailedPrecondition || client.Reason(err) != client.ReasonDeviceCordoned ||
			!strings.Contains(err.Error(), "firmware update") || !strings.Contains(err.Error(), `listener "main" uid=`) {
			t.Errorf("%s: Reserve of a cordoned GPU: %v; want DEVICE_CORDONED with the reason and who cordoned it", when, err)
		}
	}
	refused("cordoned")
	if r := runCLI(t, "cordon", "-device", "GPU-nope", "-reason", "x", "-address", addr); r.code == 0 || !strings.Contains(r.stderr, "unknown device") {
		t.Errorf("cordon of an unknown device: exit %d, %q", r.code, r.stderr)
	}

	a.kill(t, ctx)
	a = s.start(t)
	c = a.client(t, ctx)
	fp := currentFingerprint(t, ctx, c, "both cordons back", func(fp *pb.FingerprintResponse) bool {
		return cordonOf(fp, ids[0]) != nil && cordonOf(fp, ids[1]) != nil
	})
	if got := cordonOf(fp, ids[0]); got.GetReason() != "ECC storm" || got.GetDrain() {
		t.Errorf("cordon of %s after the kill: %v", ids[0], got)
	}
	refused("after a SIGKILL and a restart")
	if out := mustRunCLI(t, "devices", "-address", addr); !strings.Contains(out, "CORDONED") || !strings.Contains(out, "ECC storm") {
		t.Errorf("devices does not show the cordons:\n%s", out)
	}

	if out := mustRunCLI(t, "uncordon", "-device", ids[1], "-address", addr); !strings.Contains(out, "uncordoned "+ids[1]+" (was: firmware update") {
		t.Errorf("uncordon said %q", out)
	}
	if _, err := c.Reserve(ctx, reserveRequest(g, "job-2", ids[1])); err != nil {
		t.Errorf("Reserve after uncordon: %v", err)
	}

	// Drain: its holder does not let go within the timeout, and is named.
	r := runCLI(t, "drain", "-device", ids[0], "-timeout", "3s", "-address", addr)
	if r.code == 0 || !strings.Contains(r.stderr, "still held by job-1") {
		t.Errorf("drain of a held GPU with a short timeout: exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	// Then it does.
	done := make(chan cliResult, 1)
	go func() { done <- runCLI(t, "drain", "-device", ids[0], "-timeout", "1m", "-address", addr) }()
	currentFingerprint(t, ctx, c, "the drain recorded", func(fp *pb.FingerprintResponse) bool { return cordonOf(fp, ids[0]).GetDrain() })
	if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_OwnerId{OwnerId: "job-1"}}); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.code != 0 || !strings.Contains(r.stdout, ids[0]+" is free") {
		t.Errorf("drain: exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	if _, err := c.Reserve(ctx, reserveRequest(g, "job-3", ids[0])); client.Reason(err) != client.ReasonDeviceCordoned {
		t.Errorf("Reserve of a drained GPU: %v; want it cordoned still", err)
	}
}
