package kubernetes

import (
	"fmt"
	"slices"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// state is the bridge's view of the agent: the newest inventory snapshot, whether the
// device watch is connected, and the resources served. Its methods are safe for
// concurrent use; what they return is never modified afterwards.
type state struct {
	// configured is true when the resources were configured: the set is fixed. Else a
	// resource is added for each new (vendor, type) the inventory shows.
	configured bool

	mu        sync.Mutex
	snap      *pb.FingerprintResponse // nil before the first snapshot
	connected bool
	lastErr   error // why the watch is disconnected
	resources []Resource
	refused   map[string]bool // default names that are not valid resource names
	changed   chan struct{}   // closed (and replaced) on every change
}

func newState(configured []Resource) *state {
	return &state{
		configured: len(configured) > 0,
		resources:  slices.Clone(configured),
		refused:    map[string]bool{},
		changed:    make(chan struct{}),
	}
}

// view is one immutable reading of state.
type view struct {
	snap      *pb.FingerprintResponse
	connected bool
	lastErr   error
	resources []Resource
	// changed is closed at the next change of state.
	changed <-chan struct{}
}

func (s *state) view() view {
	s.mu.Lock()
	defer s.mu.Unlock()
	return view{snap: s.snap, connected: s.connected, lastErr: s.lastErr, resources: s.resources, changed: s.changed}
}

// stateChange is what update found new: resources to serve from now on (default
// naming), and default names refused as invalid, each reported once.
type stateChange struct {
	added   []Resource
	refused []refusedGroup
}

type refusedGroup struct {
	group *pb.DeviceGroup
	err   error
}

// update applies one update of the device watch: a new snapshot, or word that the
// agent is unreachable (the last snapshot stays, its devices then count as unhealthy).
func (s *state) update(u client.Update[*pb.FingerprintResponse]) stateChange {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ch stateChange
	if u.Disconnected() {
		s.connected, s.lastErr = false, u.Err
	} else {
		s.snap, s.connected, s.lastErr = u.Snapshot, true, nil
		if !s.configured {
			ch = s.addDefaultResources(u.Snapshot)
		}
	}
	close(s.changed)
	s.changed = make(chan struct{})
	return ch
}

// addDefaultResources adds a resource "<vendor>.com/<type>" for each (vendor, type) of
// snap not served yet, "<vendor>.com/mig-<name>" for each partition group and
// "devicehost.io/<type>" for each host-device type (DefaultResourceName). Called with
// mu held.
func (s *state) addDefaultResources(snap *pb.FingerprintResponse) stateChange {
	var ch stateChange
	for _, g := range snap.GetGroups() {
		name := DefaultResourceName(g.GetVendor(), g.GetType(), g.GetName())
		if slices.ContainsFunc(s.resources, func(r Resource) bool { return r.Name == name }) || s.refused[name] {
			continue
		}
		if err := ValidateResourceName(name); err != nil {
			s.refused[name] = true
			ch.refused = append(ch.refused, refusedGroup{group: g, err: err})
			continue
		}
		r := Resource{Name: name, Vendor: g.GetVendor(), Type: g.GetType()}
		if g.GetType() == PartitionType {
			r.Model = g.GetName()
		}
		// Copy on write: views handed out keep their slice.
		s.resources = append(slices.Clip(s.resources), r)
		ch.added = append(ch.added, r)
	}
	return ch
}

// resource returns the served resource named name.
func (v view) resource(name string) (Resource, bool) {
	i := slices.IndexFunc(v.resources, func(r Resource) bool { return r.Name == name })
	if i < 0 {
		return Resource{}, false
	}
	return v.resources[i], true
}

// groups returns the snapshot's groups that belong to r.
func (v view) groups(r Resource) []*pb.DeviceGroup {
	var gs []*pb.DeviceGroup
	for _, g := range v.snap.GetGroups() {
		if r.matches(g) {
			gs = append(gs, g)
		}
	}
	return gs
}

// devices is what ListAndWatch reports for r: every device of r's groups with its
// NUMA node. A device is Healthy only while the agent is reachable, reports it healthy
// and not cordoned (devicehost cordon: offered to no new holder), and nothing outside the kubelet's own allocations of r holds it (a device another
// owner reserved through the agent must not be handed to a pod), nor blocks it (a
// partition whose GPU's slices, or a whole GPU whose partitions, live reservations use:
// the agent would refuse it; it is Healthy again once they are released). While the
// agent is unreachable every device of the last snapshot is Unhealthy: the kubelet keeps
// counting it, but allocates none of them.
func (v view) devices(r Resource) []*dpapi.Device {
	var out []*dpapi.Device
	for _, g := range v.groups(r) {
		for _, d := range g.GetDevices() {
			dev := &dpapi.Device{ID: d.GetId(), Health: dpapi.Unhealthy}
			owner := d.GetHolder().GetOwnerId()
			if v.connected && d.GetHealth() == pb.Health_HEALTH_HEALTHY && d.GetCordon() == nil && (owner == "" || r.ownedBy(owner, keyOf(g))) && len(d.GetBlockedBy()) == 0 {
				dev.Health = dpapi.Healthy
			}
			if n := d.GetLocality().GetNumaNode(); n >= 0 {
				dev.Topology = &dpapi.TopologyInfo{Nodes: []*dpapi.NUMANode{{ID: int64(n)}}}
			}
			out = append(out, dev)
		}
	}
	return out
}

// listAndWatchResponse is devices(r) as the message ListAndWatch sends.
func (v view) listAndWatchResponse(r Resource) *dpapi.ListAndWatchResponse {
	return &dpapi.ListAndWatchResponse{Devices: v.devices(r)}
}

// sameDevices reports whether two ListAndWatch messages say the same.
func sameDevices(a, b *dpapi.ListAndWatchResponse) bool {
	return a != nil && b != nil && proto.Equal(a, b)
}

// groupOf returns the one group of r that holds every device in ids, or a status error
// the kubelet shows in the pod's events: the agent unreachable (UNAVAILABLE), a device
// r does not have (NOT_FOUND), devices of two groups (INVALID_ARGUMENT: one container
// request is one reservation, of one group).
func (v view) groupOf(r Resource, ids []string) (*pb.DeviceGroup, error) {
	if v.snap == nil || !v.connected {
		return nil, status.Errorf(codes.Unavailable, "the devicehost agent is not reachable: %v", v.lastErr)
	}
	byID := map[string]*pb.DeviceGroup{}
	for _, g := range v.groups(r) {
		for _, d := range g.GetDevices() {
			byID[d.GetId()] = g
		}
	}
	var group *pb.DeviceGroup
	var unknown []string
	for _, id := range ids {
		g, ok := byID[id]
		switch {
		case !ok:
			unknown = append(unknown, id)
		case group == nil:
			group = g
		case g != group:
			return nil, status.Errorf(codes.InvalidArgument,
				"devices %s are of two device groups, %q and %q; a container gets devices of one group "+
					"(configure a resource per model to let pods choose)", strings.Join(ids, ", "), group.GetName(), g.GetName())
		}
	}
	if len(unknown) > 0 {
		return nil, status.Errorf(codes.NotFound, "%s: not a device of %s on this node (the agent does not report it)",
			strings.Join(unknown, ", "), r.Name)
	}
	if group == nil {
		return nil, status.Error(codes.InvalidArgument, "no device requested")
	}
	return group, nil
}

func groupLabel(g *pb.DeviceGroup) string {
	return fmt.Sprintf("%s/%s/%s", g.GetVendor(), g.GetType(), g.GetName())
}
