package kubernetes

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	prapi "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// booking is what the bridge knows of one of its reservations. Guarded by
// Bridge.allocMu.
type booking struct {
	// freeSince is when the reservation was last known to be held by no pod: set by
	// Allocate (the pod does not exist yet) and by the first release pass that finds
	// no pod holding it; zero while a pod holds it. The reservation is released once
	// freeSince is ReleaseGrace old.
	freeSince time.Time
	// touched is when Allocate last returned the reservation.
	touched time.Time
	// pod is the container that holds it, "k8s/<namespace>/<pod>/<container>", as
	// last recorded; empty before PodResources reported one.
	pod string
}

// bookingLocked returns the booking of reservation id, making it. Called with allocMu.
func (b *Bridge) bookingLocked(id string) *booking {
	bk := b.bookings[id]
	if bk == nil {
		bk = &booking{}
		b.bookings[id] = bk
	}
	return bk
}

// allocate reserves ids, one container's devices of resource, at the agent and says
// how to expose them. The owner ID is derived from the resource and the set of
// devices, so the kubelet retrying an Allocate gets the same reservation back.
//
// The kubelet hands a device to one container at a time, so a device it allocates
// is free by its account: if one of the bridge's own earlier reservations of resource
// still holds it (its pod is gone, and the release loop has not released it yet),
// that reservation is taken over: the Reserve is made again with owner prefixes that
// cover those holders (take_over_owner_prefixes), and the agent releases them in the
// write that makes the new one. Before that, the kubelet's PodResources is asked
// afresh: a holder whose devices a container still holds by it is not taken over, nor
// is any holder when PodResources cannot be read. A device held by any other owner, or
// by a Reserve in flight, is an error naming the device and the holder.
func (b *Bridge) allocate(ctx context.Context, resource string, ids []string) (*dpapi.ContainerAllocateResponse, error) {
	if len(ids) == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "allocate %s: a container request with no devices", resource)
	}
	seen := make(map[string]bool, len(ids))
	for _, id := range ids {
		if seen[id] {
			return nil, status.Errorf(codes.InvalidArgument, "allocate %s: device %s asked for twice", resource, id)
		}
		seen[id] = true
	}
	v := b.state.view()
	r, _ := v.resource(resource)
	g, err := v.groupOf(r, ids)
	if err != nil {
		st := status.Convert(err)
		return nil, status.Errorf(st.Code(), "allocate %s: %s", resource, st.Message())
	}
	req := &pb.ReserveRequest{
		OwnerId:   ownerID(resource, ids),
		Vendor:    g.GetVendor(),
		Type:      g.GetType(),
		Name:      g.GetName(),
		DeviceIds: ids,
	}

	b.allocMu.Lock()
	defer b.allocMu.Unlock()
	res, err := b.c.Reserve(ctx, req)
	if held, ok := client.HeldError(err); ok && staleOwn(held, r, keyOf(g)) {
		if req.TakeOverOwnerPrefixes, err = b.takeOverPrefixes(ctx, resource, held); err == nil {
			res, err = b.c.Reserve(ctx, req)
		}
	}
	if err != nil {
		return nil, reserveError(resource, ids, err)
	}
	for _, id := range res.GetTakenOverReservationIds() {
		b.log.Info("took over an earlier reservation: the kubelet allocates its devices again",
			"resource", resource, "reservation", id, "new_reservation", res.GetReservationId(), "devices", ids,
			"pod", b.bookings[id].podOrNone())
		delete(b.bookings, id)
	}
	now := b.now()
	bk := b.bookingLocked(res.GetReservationId())
	bk.freeSince, bk.touched = now, now
	b.log.Debug("allocated", "resource", resource, "devices", ids, "reservation", res.GetReservationId(), "owner", req.OwnerId)
	return containerResponse(res.GetReservation(), b.cfg.DeviceListStrategy), nil
}

func (bk *booking) podOrNone() string {
	if bk == nil || bk.pod == "" {
		return "none recorded"
	}
	return bk.pod
}

// staleOwn reports whether every holder in held, of devices of group g, is a
// reservation the bridge made for r: held only because the release loop has not caught
// up with the kubelet.
func staleOwn(held *device.HeldError, r Resource, g groupKey) bool {
	if len(held.Conflicts) == 0 {
		return false
	}
	for _, c := range held.Conflicts {
		if !r.ownedBy(c.Holder.OwnerID, g) || c.Holder.ReservationID == "" {
			return false
		}
	}
	return true
}

// takeOverPrefixes returns the owner prefixes that let a Reserve take over the
// holders in held (each a reservation of the bridge for resource, see staleOwn),
// having asked PodResources afresh that no container holds any of their devices. It
// refuses (FAILED_PRECONDITION, naming the holders and why) when one does, or when
// PodResources cannot be read. Each prefix is a holder's owner up to its last "/"
// ("kubelet/<resource>/", "k8s/<namespace>/<pod>/"), so it covers that holder and the
// bridge's others like it; the agent applies it only to holders of the requested
// devices, and only the bridge (under allocMu) makes such holders. Past
// client.MaxTakeOverPrefixes distinct ones, the two roots "kubelet/<resource>/" and
// "k8s/" stand for them all.
func (b *Bridge) takeOverPrefixes(ctx context.Context, resource string, held *device.HeldError) ([]string, error) {
	refuse := func(why string) error {
		return status.Errorf(codes.FailedPrecondition, "%s: not taken over: %s", held.Holders(), why)
	}
	if b.pods == nil {
		return nil, refuse("cannot tell whether a pod still holds them: the PodResources socket cannot be used")
	}
	lctx, cancel := context.WithTimeout(ctx, podResourcesTimeout)
	defer cancel()
	list, err := b.pods.List(lctx, &prapi.ListPodResourcesRequest{})
	if err != nil {
		return nil, refuse("cannot tell whether a pod still holds them: PodResources: " + status.Convert(err).Message())
	}
	inUse := holders(list)[resource]
	var prefixes []string
	for _, c := range held.Conflicts {
		for _, dev := range c.Held {
			if pod := inUse[dev]; pod != "" {
				return nil, refuse(fmt.Sprintf("the kubelet's PodResources says container %s still holds %s of reservation %s",
					pod, dev, c.Holder.ReservationID))
			}
		}
		owner := c.Holder.OwnerID
		prefixes = append(prefixes, owner[:strings.LastIndexByte(owner, '/')+1])
	}
	slices.Sort(prefixes)
	prefixes = slices.Compact(prefixes)
	if len(prefixes) > client.MaxTakeOverPrefixes {
		prefixes = []string{podOwnerPrefix, ownerPrefix + resource + "/"}
	}
	return prefixes, nil
}

// reserveError is a failed Reserve as the status the kubelet gets: the agent's code,
// and a message that names the resource, the devices and, for a held device, each
// holder.
func reserveError(resource string, ids []string, err error) error {
	code := status.Code(err)
	if _, isStatus := status.FromError(err); !isStatus {
		code = codes.Unavailable
	}
	msg := status.Convert(err).Message()
	if held, ok := client.HeldError(err); ok {
		msg = held.Holders()
	}
	return status.Errorf(code, "allocate %s (%s): %s", resource, strings.Join(ids, ", "), msg)
}

// containerResponse maps the agent's container reservation onto the kubelet's, its
// env vars and CDI names as strategy says.
func containerResponse(cr *pb.ContainerReservation, strategy DeviceListStrategy) *dpapi.ContainerAllocateResponse {
	out := &dpapi.ContainerAllocateResponse{}
	if strategy.EnvVar {
		out.Envs = maps.Clone(cr.GetEnvs())
	}
	for _, m := range cr.GetMounts() {
		out.Mounts = append(out.Mounts, &dpapi.Mount{ContainerPath: m.GetContainerPath(), HostPath: m.GetHostPath(), ReadOnly: m.GetReadOnly()})
	}
	for _, d := range cr.GetDevices() {
		out.Devices = append(out.Devices, &dpapi.DeviceSpec{ContainerPath: d.GetContainerPath(), HostPath: d.GetHostPath(), Permissions: d.GetPermissions()})
	}
	for _, name := range cr.GetCdiDevices() {
		if !strategy.CDI {
			break
		}
		out.CdiDevices = append(out.CdiDevices, &dpapi.CDIDevice{Name: name})
	}
	return out
}
