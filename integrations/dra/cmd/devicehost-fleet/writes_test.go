package main

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

func TestClassify(t *testing.T) {
	for _, c := range []struct {
		method, contentType, url string
		verb, resource           string
	}{
		{"GET", "", "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3Dn", "list", "resourceslices"},
		{"GET", "", "/apis/resource.k8s.io/v1/resourceslices?watch=true&resourceVersion=5", "watch", "resourceslices"},
		{"GET", "", "/apis/resource.k8s.io/v1/resourceslices?watch=1", "watch", "resourceslices"},
		{"GET", "", "/api/v1/nodes/fleet-0001", "get", "nodes"},
		{"POST", "application/vnd.kubernetes.protobuf", "/apis/resource.k8s.io/v1/resourceslices", "create", "resourceslices"},
		{"PUT", "application/vnd.kubernetes.protobuf", "/apis/resource.k8s.io/v1/resourceslices/00000-devicehost.io-n-abc", "update", "resourceslices"},
		{"DELETE", "", "/apis/resource.k8s.io/v1/resourceslices/00001-x", "delete", "resourceslices"},
		{"DELETE", "", "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=x", "deletecollection", "resourceslices"},
		{"PATCH", "application/apply-patch+yaml", "/apis/resource.k8s.io/v1/namespaces/fleet/resourceclaims/claim-1/status", "apply", "resourceclaims/status"},
		{"PATCH", "application/merge-patch+json", "/apis/resource.k8s.io/v1/namespaces/fleet/resourceclaims/claim-1", "patch", "resourceclaims"},
		{"GET", "", "/api/v1/namespaces/fleet", "get", "namespaces"},
		{"POST", "", "/api/v1/namespaces/fleet/events", "create", "events"},
		{"GET", "", "/version", "get", "/version"},
	} {
		u, err := url.Parse(c.url)
		if err != nil {
			t.Fatal(err)
		}
		verb, resource := classify(c.method, c.contentType, u)
		if verb != c.verb || resource != c.resource {
			t.Errorf("classify(%s %s %s) = %s %s; want %s %s", c.method, c.contentType, c.url, verb, resource, c.verb, c.resource)
		}
	}
}

// okTransport answers every request 200, empty.
type okTransport struct{}

func (okTransport) RoundTrip(*http.Request) (*http.Response, error) {
	return &http.Response{StatusCode: http.StatusOK, Body: io.NopCloser(strings.NewReader(""))}, nil
}

// The counter counts each request of each transport it wrapped (a clientset's and a
// metadata client's) under the node of its context, writes apart from reads, the most
// writes of one node within a second, and starts again at each take; requests of no
// node are left out of the nodes' figures.
func TestCounter(t *testing.T) {
	start := time.Unix(1000, 0)
	now := start
	c := newCounter(func() time.Time { return now })
	typed, meta := c.wrap(okTransport{}), c.wrap(okTransport{})
	do := func(rt http.RoundTripper, node int, at time.Duration, method, path string) {
		t.Helper()
		now = start.Add(at)
		ctx := context.Background()
		if node >= 0 {
			ctx = withNode(ctx, node)
		}
		req, err := http.NewRequestWithContext(ctx, method, "https://127.0.0.1"+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		res, err := rt.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
	}
	const slices = "/apis/resource.k8s.io/v1/resourceslices"
	do(meta, 0, 0, "GET", slices+"?watch=true")
	if got := c.watching(2); got != 1 {
		t.Errorf("watching = %d after node 0's watch; want 1", got)
	}
	do(typed, 0, 100*time.Millisecond, "PUT", slices+"/a")
	do(typed, 0, 900*time.Millisecond, "PUT", slices+"/a")
	do(typed, 0, 1100*time.Millisecond, "PUT", slices+"/a")
	do(typed, 1, 2*time.Second, "POST", slices)
	do(typed, -1, 2*time.Second, "POST", slices) // not a node's
	now = start.Add(30 * time.Second)
	p := c.take("rest", 3)
	want := phase{name: "rest", seconds: 30, nodes: 3, writes: 4, min: 0, max: 3, peak: 2, reads: 1}
	if p.name != want.name || p.seconds != want.seconds || p.nodes != want.nodes || p.writes != want.writes || p.min != want.min || p.max != want.max || p.peak != want.peak || p.reads != want.reads {
		t.Errorf("take = %+v; want %+v", p, want)
	}
	if p.kinds["update resourceslices"] != 3 || p.kinds["create resourceslices"] != 1 || p.kinds["watch resourceslices"] != 1 || len(p.kinds) != 3 {
		t.Errorf("kinds = %v; want 3 updates, 1 create, 1 watch", p.kinds)
	}
	if got, want := p.String(), "WRITES rest 30 3 4 2.7 0.0 6.0 2 1 create:resourceslices=1,update:resourceslices=3,watch:resourceslices=1"; got != want {
		t.Errorf("String = %q; want %q", got, want)
	}
	now = start.Add(90 * time.Second)
	p = c.take("churn", 3)
	if p.seconds != 60 || p.writes != 0 || p.reads != 0 || p.peak != 0 || c.watching(3) != 0 {
		t.Errorf("take after a take with nothing between = %+v, watching %d; want 60 s, nothing", p, c.watching(3))
	}
}

// mig-first is the mig layout with each GPU's first placement of each profile alone: 8
// GPUs and 7 placements each, every one at its profile's lowest start, each GPU's
// placements consuming its own counter set.
func TestMIGFirstLayout(t *testing.T) {
	full, first := loadFingerprint(t, "mig"), loadFingerprint(t, "mig-first")
	count := func(s *pb.FingerprintResponse) (n int) {
		for _, g := range s.GetGroups() {
			n += len(g.GetDevices())
		}
		return n
	}
	if got, want := count(full), 8+8*28; got != want {
		t.Fatalf("the mig layout: %d devices, want %d", got, want)
	}
	if got, want := count(first), 8+8*7; got != want {
		t.Errorf("mig-first: %d devices, want %d", got, want)
	}
	for _, g := range first.GetGroups() {
		if g.GetType() != "mig" {
			if len(g.GetDevices()) != 8 {
				t.Errorf("mig-first group %s: %d devices, want the 8 GPUs", g.GetName(), len(g.GetDevices()))
			}
			continue
		}
		sets := make(map[string]bool)
		for _, d := range g.GetDevices() {
			sets[d.GetConsumes()[0].GetCounterSet()] = true
			if !strings.HasSuffix(d.GetId(), "-0") {
				t.Errorf("mig-first %s: %s is not at start 0", g.GetName(), d.GetId())
			}
		}
		if len(sets) != 8 {
			t.Errorf("mig-first %s: placements on %d GPUs, want one on each of 8", g.GetName(), len(sets))
		}
	}
	if len(first.GetCounterSets()) != len(full.GetCounterSets()) {
		t.Errorf("mig-first: %d counter sets, want the mig layout's %d", len(first.GetCounterSets()), len(full.GetCounterSets()))
	}
}

func loadFingerprint(t *testing.T, layout string) *pb.FingerprintResponse {
	t.Helper()
	raw, err := fingerprint(layout)
	if err != nil {
		t.Fatal(err)
	}
	snap := &pb.FingerprintResponse{}
	if err := protojson.Unmarshal(raw, snap); err != nil {
		t.Fatal(err)
	}
	return snap
}

// The churner holds the GPUs in turn and then releases them in the same turn, each
// snapshot sharing every message but the held GPUs' with the recording (as the agent's
// stream does), which stays as it was.
func TestChurner(t *testing.T) {
	for _, layout := range []string{"plain", "static", "mig", "mig-trimmed", "sharing"} {
		t.Run(layout, func(t *testing.T) {
			base := loadFingerprint(t, layout)
			orig := proto.Clone(base)
			c := newChurner(base, "gpu", func(k int) string { return "owner-" + string(rune('a'+k)) })
			if c == nil {
				t.Fatal("no GPUs to churn")
			}
			g := c.group
			gpus := base.GetGroups()[g].GetDevices()
			n := len(gpus)
			if n != 8 {
				t.Fatalf("%d GPUs; want 8", n)
			}
			for k := range 2 * n {
				s := c.step()
				var holders []string
				for j, d := range s.GetGroups()[g].GetDevices() {
					if d.GetHolder() == nil {
						if d != gpus[j] {
							t.Errorf("step %d: free GPU %d is not the recording's message", k, j)
						}
						continue
					}
					holders = append(holders, d.GetHolder().GetOwnerId())
					if d.GetId() != gpus[j].GetId() {
						t.Errorf("step %d: GPU %d held as %s; want %s", k, j, d.GetId(), gpus[j].GetId())
					}
				}
				// Steps 0..n-1 hold GPU k; steps n..2n-1 release GPU k-n.
				held := k + 1
				if k >= n {
					held = 2*n - k - 1
				}
				if len(holders) != held {
					t.Errorf("step %d: %d GPUs held (%v); want %d", k, len(holders), holders, held)
				}
				for i, gr := range s.GetGroups() {
					if i != g && gr != base.GetGroups()[i] {
						t.Errorf("step %d: group %d is not the recording's message", k, i)
					}
				}
			}
			if !proto.Equal(base, orig) {
				t.Error("the churn changed the recording")
			}
		})
	}
	if newChurner(loadFingerprint(t, "static"), "no-such-type", nil) != nil {
		t.Error("a churner of a type the fingerprint has no devices of")
	}
}
