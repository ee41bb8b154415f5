package main

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"

	"github.com/devicehost/devicehost/integrations/dra"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// The driver's writes to the API server (issue 61): every node's pool run by the
// driver's own publish loop (dra.RunPool), its requests counted by a transport of the
// fleet's client, over phases of one length each:
//
//	rest          the pools as published, nothing changing
//	churn-claims  a reservation made or released on each node every -churn-interval,
//	              owned by a DRA claim (what NodePrepareResources and
//	              NodeUnprepareResources make): the snapshots differ in a GPU's holder
//	churn-other   the same, owned outside DRA (the device-plugin bridge, Nomad, the
//	              CLI), which the driver publishes as a taint
//
// The kubelet's calls and the claims' status (one apply at prepare, one at unprepare)
// are not in it: kwok has no kubelet.

// nodeKey is the context key of the index of the node whose driver makes a request.
type nodeKey struct{}

func withNode(ctx context.Context, i int) context.Context {
	return context.WithValue(ctx, nodeKey{}, i)
}

// nodeOf is the node that ctx is a request of; -1 for none.
func nodeOf(ctx context.Context) int {
	if i, ok := ctx.Value(nodeKey{}).(int); ok {
		return i
	}
	return -1
}

// classify names an API request's verb and resource as the API server's audit log
// does: get, list, watch, create, update, patch, apply, delete, deletecollection; the
// resource with its subresource ("resourceclaims/status").
func classify(method, contentType string, u *url.URL) (verb, resource string) {
	segs := strings.Split(strings.Trim(u.Path, "/"), "/")
	// /api/v1/... or /apis/<group>/<version>/...
	switch {
	case len(segs) >= 2 && segs[0] == "api":
		segs = segs[2:]
	case len(segs) >= 3 && segs[0] == "apis":
		segs = segs[3:]
	default:
		return strings.ToLower(method), u.Path
	}
	if len(segs) >= 3 && segs[0] == "namespaces" {
		segs = segs[2:] // a namespaced resource
	}
	if len(segs) == 0 {
		return strings.ToLower(method), u.Path
	}
	resource = segs[0]
	named := len(segs) > 1
	if len(segs) > 2 {
		resource += "/" + segs[2]
	}
	switch method {
	case http.MethodGet:
		switch {
		case u.Query().Get("watch") == "true" || u.Query().Get("watch") == "1":
			verb = "watch"
		case named:
			verb = "get"
		default:
			verb = "list"
		}
	case http.MethodPost:
		verb = "create"
	case http.MethodPut:
		verb = "update"
	case http.MethodPatch:
		verb = "patch"
		if strings.HasPrefix(contentType, "application/apply-patch") {
			verb = "apply"
		}
	case http.MethodDelete:
		verb = "delete"
		if !named {
			verb = "deletecollection"
		}
	default:
		verb = strings.ToLower(method)
	}
	return verb, resource
}

// isWrite reports whether verb changes what the API server stores.
func isWrite(verb string) bool { return verb != "get" && verb != "list" && verb != "watch" }

// counter counts the requests through its transports (wrap), by the node of their
// context (withNode), verb and resource. Safe for concurrent use.
type counter struct {
	now func() time.Time

	mu    sync.Mutex
	since time.Time
	nodes map[int]*nodeRequests
}

// nodeRequests are one node's requests since the counter's last take.
type nodeRequests struct {
	byKind  map[string]int // "update resourceslices"
	writes  []time.Time
	watches int
}

func newCounter(now func() time.Time) *counter {
	return &counter{now: now, since: now(), nodes: make(map[int]*nodeRequests)}
}

// wrap returns next, its requests counted by c (a rest.Config's WrapTransport: each
// client made from the config wraps its own transport).
func (c *counter) wrap(next http.RoundTripper) http.RoundTripper {
	return countingTransport{c: c, next: next}
}

type countingTransport struct {
	c    *counter
	next http.RoundTripper
}

func (t countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	verb, resource := classify(req.Method, req.Header.Get("Content-Type"), req.URL)
	t.c.record(nodeOf(req.Context()), verb, resource)
	return t.next.RoundTrip(req)
}

func (c *counter) record(node int, verb, resource string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.nodes[node]
	if n == nil {
		n = &nodeRequests{byKind: make(map[string]int)}
		c.nodes[node] = n
	}
	n.byKind[verb+" "+resource]++
	if verb == "watch" {
		n.watches++
	}
	if isWrite(verb) {
		n.writes = append(n.writes, c.now())
	}
}

// watching is how many of the nodes 0..n-1 have opened a watch since the last take.
func (c *counter) watching(n int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	w := 0
	for i := range n {
		if r := c.nodes[i]; r != nil && r.watches > 0 {
			w++
		}
	}
	return w
}

// phase is what the nodes 0..n-1 asked of the API server over one phase.
type phase struct {
	name    string
	seconds float64
	nodes   int
	writes  int            // all nodes'
	min     int            // the fewest writes of one node
	max     int            // the most
	peak    int            // the most writes of one node within one second of the phase
	reads   int            // gets, lists and watches opened, all nodes'
	kinds   map[string]int // every request, all nodes', by "verb resource"
}

// take returns the nodes' requests since the last take, as phase name, and starts
// counting again.
func (c *counter) take(name string, n int) phase {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	p := phase{name: name, seconds: now.Sub(c.since).Seconds(), nodes: n, min: -1, kinds: make(map[string]int)}
	for i := range n {
		r := c.nodes[i]
		if r == nil {
			r = &nodeRequests{}
		}
		w := len(r.writes)
		p.writes += w
		p.max = max(p.max, w)
		if p.min < 0 || w < p.min {
			p.min = w
		}
		p.peak = max(p.peak, peakPerSecond(r.writes, c.since))
		for k, v := range r.byKind {
			p.kinds[k] += v
			if !isWrite(strings.Fields(k)[0]) {
				p.reads += v
			}
		}
	}
	p.min = max(p.min, 0)
	c.since = now
	clear(c.nodes)
	return p
}

// peakPerSecond is the most of times that fall within one second counted from start.
func peakPerSecond(times []time.Time, start time.Time) int {
	per := make(map[int64]int)
	peak := 0
	for _, t := range times {
		s := int64(t.Sub(start) / time.Second)
		per[s]++
		peak = max(peak, per[s])
	}
	return peak
}

// String is the phase as one line of the bench's output: WRITES, the phase, its
// seconds, the nodes, the writes of all nodes and a minute's of one node (all nodes'
// over the nodes, and the fewest and most of one node), the most of one node within a
// second, the reads, and the requests by verb and resource.
func (p phase) String() string {
	perMin := func(n int) float64 {
		if p.seconds <= 0 {
			return 0
		}
		return float64(n) * 60 / p.seconds
	}
	mean := 0.0
	if p.nodes > 0 {
		mean = perMin(p.writes) / float64(p.nodes)
	}
	var kinds []string
	for _, k := range slices.Sorted(maps.Keys(p.kinds)) {
		kinds = append(kinds, fmt.Sprintf("%s=%d", strings.ReplaceAll(k, " ", ":"), p.kinds[k]))
	}
	if len(kinds) == 0 {
		kinds = []string{"-"}
	}
	return fmt.Sprintf("WRITES %s %.0f %d %d %.1f %.1f %.1f %d %d %s", p.name, p.seconds, p.nodes, p.writes,
		mean, perMin(p.min), perMin(p.max), p.peak, p.reads, strings.Join(kinds, ","))
}

// churner makes the snapshots of one node whose reservations come and go: at each
// step one GPU of group changes hands, the next in turn: held when it was free,
// released when it was held. A snapshot shares every message but the held GPUs'
// with base (as the agent's stream gives an unchanged device as the same message),
// and base is never changed. Not safe for concurrent use.
type churner struct {
	base  *pb.FingerprintResponse
	group int                // the index of the GPUs' group in base
	owner func(k int) string // the owner of the k-th reservation
	held  map[int]*pb.Device // by the device's index in its group
	k     int
}

// newChurner returns the churner of base's group of devices of type typ; nil if base
// has none.
func newChurner(base *pb.FingerprintResponse, typ string, owner func(k int) string) *churner {
	i := slices.IndexFunc(base.GetGroups(), func(g *pb.DeviceGroup) bool { return g.GetType() == typ && len(g.GetDevices()) > 0 })
	if i < 0 {
		return nil
	}
	return &churner{base: base, group: i, owner: owner, held: make(map[int]*pb.Device)}
}

// step makes the next change and returns the snapshot after it.
func (c *churner) step() *pb.FingerprintResponse {
	devs := c.base.GetGroups()[c.group].GetDevices()
	j := c.k % len(devs)
	if c.held[j] != nil {
		delete(c.held, j)
	} else {
		d := proto.Clone(devs[j]).(*pb.Device)
		d.Holder = &pb.Holder{ReservationId: fmt.Sprintf("fleet-r%d", c.k), OwnerId: c.owner(c.k)}
		c.held[j] = d
	}
	c.k++
	out := &pb.FingerprintResponse{Timestamp: c.base.GetTimestamp(), CounterSets: c.base.GetCounterSets(),
		Groups: slices.Clone(c.base.GetGroups())}
	g := c.base.GetGroups()[c.group]
	ng := &pb.DeviceGroup{Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName(), Plugin: g.GetPlugin(),
		Attributes: g.GetAttributes(), Devices: slices.Clone(devs)}
	for j, d := range c.held {
		ng.Devices[j] = d
	}
	out.Groups[c.group] = ng
	return out
}

// measureWrites runs every node's pool through the driver's publish loop and returns
// its requests in each phase (rest, churn-claims, churn-other), each d long, the
// churn making a change on each node every interval.
func measureWrites(ctx context.Context, cfg *rest.Config, o options, fingerprint []byte) ([]phase, error) {
	base := &pb.FingerprintResponse{}
	if err := protojson.Unmarshal(fingerprint, base); err != nil {
		return nil, fmt.Errorf("fingerprint: %w", err)
	}
	// As the driver's client (devicehost-dra-plugin): protobuf, and the metadata
	// client for its informer; no rate limit, to see what the drivers ask.
	cfg = rest.CopyConfig(cfg)
	cfg.ContentType = runtime.ContentTypeProtobuf
	cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	cfg.QPS, cfg.Burst = 5000, 5000
	cnt := newCounter(time.Now)
	cfg.Wrap(cnt.wrap)
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	meta, err := metadata.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}

	ctx, stop := context.WithCancel(ctx)
	defer stop()
	pools, pctx := errgroup.WithContext(ctx)
	snaps := make([]chan *pb.FingerprintResponse, o.nodes)
	for i := range o.nodes {
		snaps[i] = make(chan *pb.FingerprintResponse)
		pools.Go(func() error {
			return dra.RunPool(withNode(pctx, i), kube, meta, nil, dra.DefaultDriverName, nodeName(i), snaps[i], nil)
		})
	}
	send := func(ctx context.Context, i int, s *pb.FingerprintResponse) bool {
		select {
		case snaps[i] <- s:
			return true
		case <-ctx.Done():
			return false
		}
	}
	wait := func(d time.Duration) error {
		select {
		case <-time.After(d):
			return nil
		case <-pctx.Done():
			if err := pools.Wait(); err != nil {
				return err
			}
			return pctx.Err()
		}
	}
	for i := range o.nodes {
		if !send(pctx, i, base) {
			return nil, pools.Wait()
		}
	}
	// Started: each pool's informer watching, and its first sync (which finds the
	// slices PublishPool wrote as it would write them) done a moment after.
	deadline := time.Now().Add(3 * time.Minute)
	for cnt.watching(o.nodes) < o.nodes {
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%d of %d pools watching their slices after 3m", cnt.watching(o.nodes), o.nodes)
		}
		if err := wait(200 * time.Millisecond); err != nil {
			return nil, err
		}
	}
	if err := wait(5 * time.Second); err != nil {
		return nil, err
	}
	phases := []phase{cnt.take("start", o.nodes)}
	fmt.Fprintf(os.Stderr, "fleet: %d pools run by the driver's publish loop; %s\n", o.nodes, phases[0])

	if err := wait(o.writes); err != nil {
		return nil, err
	}
	phases = append(phases, cnt.take("rest", o.nodes))
	fmt.Fprintf(os.Stderr, "fleet: %s\n", phases[len(phases)-1])

	for _, c := range []struct {
		name  string
		owner func(i, k int) string
	}{
		{"churn-claims", func(i, k int) string {
			return fmt.Sprintf("%s%s/churn-%d-%d/00000000-0000-0000-0000-%012d", dra.ClaimOwnerPrefix, namespace, i, k, k)
		}},
		{"churn-other", func(i, k int) string { return fmt.Sprintf("fleet-churn/%s/%d", nodeName(i), k) }},
	} {
		cctx, cstop := context.WithCancel(pctx)
		var churns sync.WaitGroup
		for i := range o.nodes {
			ch := newChurner(base, "gpu", func(k int) string { return c.owner(i, k) })
			if ch == nil {
				cstop()
				return nil, fmt.Errorf("the fingerprint has no GPUs to churn")
			}
			churns.Go(func() {
				// The nodes' changes spread over the interval, not all at once.
				first := time.Duration(int64(o.churnInterval) * int64(i) / int64(o.nodes))
				t := time.NewTimer(first)
				defer t.Stop()
				for {
					select {
					case <-t.C:
					case <-cctx.Done():
						return
					}
					if !send(cctx, i, ch.step()) {
						return
					}
					t.Reset(o.churnInterval)
				}
			})
		}
		err := wait(o.writes)
		cstop()
		churns.Wait()
		if err != nil {
			return nil, err
		}
		phases = append(phases, cnt.take(c.name, o.nodes))
		fmt.Fprintf(os.Stderr, "fleet: %s\n", phases[len(phases)-1])
		// Back to the pool as published, between the two kinds of churn, not counted.
		for i := range o.nodes {
			if !send(pctx, i, base) {
				return nil, pools.Wait()
			}
		}
		if err := wait(2 * time.Second); err != nil {
			return nil, err
		}
		cnt.take("between", o.nodes)
	}
	stop()
	if err := pools.Wait(); err != nil {
		return nil, err
	}
	return phases, nil
}
