package kubelet

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/client"
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
// that reservation is released and the Reserve tried again. A device held by any
// other owner is an error naming the device and the holder.
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
	if held, ok := client.IsHeld(err); ok && staleOwn(held, r, keyOf(g)) {
		for _, c := range held.GetConflicts() {
			if _, err := b.c.ReleaseReservation(ctx, c.GetReservationId()); err != nil && !client.IsReservationNotFound(err) {
				return nil, reserveError(resource, ids, fmt.Errorf("release the earlier reservation %s of %s: %w",
					c.GetReservationId(), strings.Join(c.GetDeviceIds(), ", "), err))
			}
			b.log.Info("released an earlier reservation: the kubelet allocates its devices again",
				"resource", resource, "reservation", c.GetReservationId(), "devices", c.GetHeldDeviceIds(),
				"pod", b.bookings[c.GetReservationId()].podOrNone())
			delete(b.bookings, c.GetReservationId())
		}
		res, err = b.c.Reserve(ctx, req)
	}
	if err != nil {
		return nil, reserveError(resource, ids, err)
	}
	now := b.now()
	bk := b.bookingLocked(res.GetReservationId())
	bk.freeSince, bk.touched = now, now
	b.log.Debug("allocated", "resource", resource, "devices", ids, "reservation", res.GetReservationId(), "owner", req.OwnerId)
	return containerResponse(res.GetReservation()), nil
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
func staleOwn(held *pb.DeviceHeld, r Resource, g groupKey) bool {
	if len(held.GetConflicts()) == 0 {
		return false
	}
	for _, c := range held.GetConflicts() {
		if !r.ownedBy(c.GetOwnerId(), g) || c.GetReservationId() == "" {
			return false
		}
	}
	return true
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
	if held, ok := client.IsHeld(err); ok && len(held.GetConflicts()) > 0 {
		parts := make([]string, 0, len(held.GetConflicts()))
		for _, c := range held.GetConflicts() {
			if c.GetReservationId() == "" {
				parts = append(parts, fmt.Sprintf("%s being reserved by owner %q", strings.Join(c.GetDeviceIds(), ", "), c.GetOwnerId()))
				continue
			}
			parts = append(parts, fmt.Sprintf("%s held by reservation %s of owner %q", strings.Join(c.GetDeviceIds(), ", "), c.GetReservationId(), c.GetOwnerId()))
		}
		msg = strings.Join(parts, "; ")
	}
	return status.Errorf(code, "allocate %s (%s): %s", resource, strings.Join(ids, ", "), msg)
}

// containerResponse maps the agent's container reservation onto the kubelet's.
func containerResponse(cr *pb.ContainerReservation) *dpapi.ContainerAllocateResponse {
	out := &dpapi.ContainerAllocateResponse{Envs: maps.Clone(cr.GetEnvs())}
	for _, m := range cr.GetMounts() {
		out.Mounts = append(out.Mounts, &dpapi.Mount{ContainerPath: m.GetContainerPath(), HostPath: m.GetHostPath(), ReadOnly: m.GetReadOnly()})
	}
	for _, d := range cr.GetDevices() {
		out.Devices = append(out.Devices, &dpapi.DeviceSpec{ContainerPath: d.GetContainerPath(), HostPath: d.GetHostPath(), Permissions: d.GetPermissions()})
	}
	for _, name := range cr.GetCdiDevices() {
		out.CdiDevices = append(out.CdiDevices, &dpapi.CDIDevice{Name: name})
	}
	return out
}
