package kubernetes

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// Bounds on what the kubelet may send, so that a careless caller cannot make the
// bridge do unbounded work.
const (
	maxContainerRequests = 256
	maxRequestDevices    = 4096
	// maxPreferredDevices bounds the devices of one GetPreferredAllocation container
	// request (available and must-include together), which keeps its search fast;
	// no node has more devices of one resource.
	maxPreferredDevices = 1024
)

// resourcePlugin is the DevicePlugin service of one resource. It holds no state of its
// own: every call reads the bridge's, so a server restarted on a new socket serves the
// same.
type resourcePlugin struct {
	dpapi.UnimplementedDevicePluginServer
	b        *Bridge
	resource string
}

var _ dpapi.DevicePluginServer = (*resourcePlugin)(nil)

// GetDevicePluginOptions says the plugin answers GetPreferredAllocation and needs no
// PreStartContainer.
func (p *resourcePlugin) GetDevicePluginOptions(context.Context, *dpapi.Empty) (*dpapi.DevicePluginOptions, error) {
	return &dpapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

// ListAndWatch sends the resource's devices at once and again on every change of
// them (health, devices added or gone), until the kubelet ends the stream or the
// server stops. A change reaches the stream as soon as the agent's Fingerprint stream
// delivers it: the state update wakes every stream.
func (p *resourcePlugin) ListAndWatch(_ *dpapi.Empty, stream dpapi.DevicePlugin_ListAndWatchServer) error {
	var last *dpapi.ListAndWatchResponse
	for {
		v := p.b.state.view()
		r, _ := v.resource(p.resource)
		msg := v.listAndWatchResponse(r)
		if !sameDevices(msg, last) {
			if err := stream.Send(msg); err != nil {
				return err
			}
			last = msg
		}
		select {
		case <-v.changed:
		case <-stream.Context().Done():
			return nil
		}
	}
}

// GetPreferredAllocation proposes, for each container request, allocation_size of the
// available devices that include every must-include one and span as few device
// groups, then NUMA nodes, then PCIe roots, then parent devices (counter sets) as
// possible.
func (p *resourcePlugin) GetPreferredAllocation(_ context.Context, req *dpapi.PreferredAllocationRequest) (*dpapi.PreferredAllocationResponse, error) {
	if n := len(req.GetContainerRequests()); n > maxContainerRequests {
		return nil, status.Errorf(codes.InvalidArgument, "%d container requests; at most %d", n, maxContainerRequests)
	}
	v := p.b.state.view()
	r, _ := v.resource(p.resource)
	places := map[string]placement{}
	for _, g := range v.groups(r) {
		for _, d := range g.GetDevices() {
			pl := placement{
				id:    d.GetId(),
				group: groupLabel(g),
				numa:  d.GetLocality().GetNumaNode(),
				root:  p.b.pcieRoot(d.GetLocality().GetPciBusId()),
			}
			if c := d.GetConsumes(); len(c) > 0 {
				pl.parent = c[0].GetCounterSet()
			}
			places[d.GetId()] = pl
		}
	}
	resp := &dpapi.PreferredAllocationResponse{}
	for i, cr := range req.GetContainerRequests() {
		avail, must := cr.GetAvailableDeviceIDs(), cr.GetMustIncludeDeviceIDs()
		if len(avail)+len(must) > maxPreferredDevices {
			return nil, status.Errorf(codes.InvalidArgument, "container request %d: %d devices; at most %d", i, len(avail)+len(must), maxPreferredDevices)
		}
		if cr.GetAllocationSize() < 0 {
			return nil, status.Errorf(codes.InvalidArgument, "container request %d: allocation size %d is negative", i, cr.GetAllocationSize())
		}
		cands := make([]placement, 0, len(avail)+len(must))
		for _, id := range append(append([]string(nil), avail...), must...) {
			pl, ok := places[id]
			if !ok {
				// A device the agent no longer reports: last choice, on its own.
				pl = placement{id: id, group: "\xff" + id, numa: -1}
			}
			cands = append(cands, pl)
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &dpapi.ContainerPreferredAllocationResponse{
			DeviceIDs: preferDevices(cands, must, int(cr.GetAllocationSize())),
		})
	}
	return resp, nil
}

// Allocate reserves each container request's devices at the agent (one Reserve per
// container) and answers how to expose them: env vars, mounts, device nodes and CDI
// device names. Any failure fails the whole call with a status the kubelet shows in the
// pod's events; reservations made for earlier containers of the call are released by
// the release loop, as no pod will hold them.
func (p *resourcePlugin) Allocate(ctx context.Context, req *dpapi.AllocateRequest) (*dpapi.AllocateResponse, error) {
	crs := req.GetContainerRequests()
	if len(crs) > maxContainerRequests {
		return nil, status.Errorf(codes.InvalidArgument, "%d container requests; at most %d", len(crs), maxContainerRequests)
	}
	resp := &dpapi.AllocateResponse{ContainerResponses: make([]*dpapi.ContainerAllocateResponse, 0, len(crs))}
	for i, cr := range crs {
		if n := len(cr.GetDevicesIds()); n > maxRequestDevices {
			return nil, status.Errorf(codes.InvalidArgument, "container request %d: %d devices; at most %d", i, n, maxRequestDevices)
		}
		car, err := p.b.allocate(ctx, p.resource, cr.GetDevicesIds())
		if err != nil {
			return nil, err
		}
		resp.ContainerResponses = append(resp.ContainerResponses, car)
	}
	return resp, nil
}

// PreStartContainer is not needed (GetDevicePluginOptions says so); it does nothing.
func (p *resourcePlugin) PreStartContainer(context.Context, *dpapi.PreStartContainerRequest) (*dpapi.PreStartContainerResponse, error) {
	return &dpapi.PreStartContainerResponse{}, nil
}
