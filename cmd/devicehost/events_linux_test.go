package main

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// jsonEvents parses `events -json` output.
func jsonEvents(t *testing.T, out string) []map[string]any {
	t.Helper()
	var evs []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line == "" {
			continue
		}
		var e map[string]any
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			t.Fatalf("events -json line %q: %v", line, err)
		}
		evs = append(evs, e)
	}
	return evs
}

// Every change made through any listener is in the trail with its listener and peer;
// a follower sees new events as they come; after a SIGKILL and a restart, -after
// resumes where the consumer was, missing nothing and repeating nothing.
func TestEventsThroughTheCLIResumeAfterAKill(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := tempDir(t, "dhev")
	bridgeSock := filepath.Join(dir, "bridge.sock")
	s := newAgentSetup(t, noGCConfig+fmt.Sprintf(`
listener "bridge" {
  address = "unix://%s"
  allow   = ["read", "reserve:k8s/"]
}
`, bridgeSock))
	a := s.start(t)
	c := a.client(t, ctx)
	g, ids := healthyGPUs(t, ctx, c)
	addr := s.addr.String()

	res, err := c.Reserve(ctx, reserveRequest(g, "job-1", ids[0]))
	if err != nil {
		t.Fatal(err)
	}
	bridge := (&agentProcess{addr: endpoint.Address{Network: "unix", Path: bridgeSock}}).client(t, ctx)
	if _, err := bridge.Reserve(ctx, reserveRequest(g, "k8s/ns/pod/c", ids[1])); err != nil {
		t.Fatal(err)
	}
	if _, err := bridge.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_OwnerId{OwnerId: "k8s/ns/pod/c"}}); err != nil {
		t.Fatal(err)
	}
	mustRunCLI(t, "cordon", "-device", ids[2], "-reason", "ECC storm", "-address", addr)

	evs := jsonEvents(t, mustRunCLI(t, "events", "-json", "-address", addr))
	var got []string
	for _, e := range evs {
		got = append(got, fmt.Sprintf("%v %v %v", e["kind"], e["ownerId"], strings.HasPrefix(fmt.Sprint(e["by"]), `listener "`+map[bool]string{true: "bridge", false: "main"}[strings.HasPrefix(fmt.Sprint(e["ownerId"]), "k8s/")]+`" uid=`)))
	}
	want := []string{"reserve job-1 true", "reserve k8s/ns/pod/c true", "release k8s/ns/pod/c true", "cordon <nil> true"}
	if strings.Join(got, "; ") != strings.Join(want, "; ") {
		t.Fatalf("events: %q\nwant %q\n(%v)", got, want, evs)
	}
	if evs[0]["reservationIds"].([]any)[0] != res.GetReservationId() {
		t.Errorf("the reserve event names %v, want %s", evs[0]["reservationIds"], res.GetReservationId())
	}
	table := mustRunCLI(t, "events", "-owner", "k8s/", "-address", addr)
	if !strings.Contains(table, "SEQ") || strings.Count(table, "k8s/ns/pod/c") != 2 || strings.Contains(table, "job-1") {
		t.Errorf("events -owner k8s/:\n%s", table)
	}

	// A follower sees a new event as it comes, then stops at its -timeout.
	follow := make(chan cliResult, 1)
	go func() {
		follow <- runCLI(t, "events", "-follow", "-json", "-after", fmt.Sprint(evs[3]["seq"]), "-timeout", "5s", "-address", addr)
	}()
	if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_OwnerId{OwnerId: "job-1"}}); err != nil {
		t.Fatal(err)
	}
	r := <-follow
	if fe := jsonEvents(t, r.stdout); r.code != 0 || len(fe) != 1 || fe[0]["kind"] != "release" || fe[0]["ownerId"] != "job-1" {
		t.Errorf("events -follow: exit %d, %q, stderr %q; want job-1's release alone", r.code, r.stdout, r.stderr)
	}
	last := fmt.Sprint(jsonEvents(t, mustRunCLI(t, "events", "-json", "-address", addr))[4]["seq"])

	a.kill(t, ctx)
	a = s.start(t)
	c = a.client(t, ctx)
	healthyGPUs(t, ctx, c)
	if _, err := c.Reserve(ctx, reserveRequest(g, "job-2", ids[3])); err != nil {
		t.Fatal(err)
	}
	after := jsonEvents(t, mustRunCLI(t, "events", "-json", "-after", last, "-address", addr))
	if len(after) != 1 || after[0]["kind"] != "reserve" || after[0]["ownerId"] != "job-2" {
		t.Errorf("events after %s once restarted: %v; want job-2's reserve alone", last, after)
	}
	if all := jsonEvents(t, mustRunCLI(t, "events", "-json", "-address", addr)); len(all) != 6 {
		t.Errorf("%d events after the restart, want the 6 made", len(all))
	}
}
