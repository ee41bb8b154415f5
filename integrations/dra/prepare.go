package dra

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// PrepareResourceClaims implements kubeletplugin.DRAPlugin: each claim's devices of
// this driver become one Reserve per device group at the agent, owner
// "k8s-claim/<namespace>/<name>/<uid>" (the kubelet asking again gets the same
// reservations back), and the claim's CDI spec is written. A claim fails alone, with
// a message that names what stopped it (the holder of a device, a counter over its
// capacity, an unhealthy device, the agent being unreachable); the kubelet retries it.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	d.kubelet.enter()
	defer d.kubelet.leave()
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		devs, err := d.prepare(ctx, c)
		if err != nil {
			d.log.Warn("claim not prepared", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "error", err)
		} else {
			d.log.Info("claim prepared", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "devices", len(devs))
		}
		out[c.UID] = kubeletplugin.PrepareResult{Err: err, Devices: devs}
	}
	return out, nil
}

// allocated is one device of a claim's allocation, with the agent's device it is.
type allocated struct {
	request string
	ref     deviceRef
	// admin: the claim has the device with admin access (DRAAdminAccess): it sees the
	// device without holding it.
	admin bool
	// consumed is the capacity the allocation takes of a consumable device, and
	// shareID the allocation's share of it.
	consumed map[resourceapi.QualifiedName]resource.Quantity
	shareID  *types.UID
}

// ownerLabels are the agent's owner labels for c's reservations (the pod and namespace
// labels of its devices' metrics): the pods c is reserved for, sorted and joined by ","
// as far as they fit client.MaxOwnerLabelLen, and c's namespace; nil when it is
// reserved for no pod.
func ownerLabels(c *resourceapi.ResourceClaim) map[string]string {
	var pods []string
	for _, r := range c.Status.ReservedFor {
		if r.APIGroup == "" && r.Resource == "pods" && r.Name != "" {
			pods = append(pods, r.Name)
		}
	}
	if len(pods) == 0 {
		return nil
	}
	slices.Sort(pods)
	joined := pods[0]
	for _, p := range pods[1:] {
		if len(joined)+1+len(p) > client.MaxOwnerLabelLen {
			break
		}
		joined += "," + p
	}
	return map[string]string{"pod": joined, "namespace": c.Namespace}
}

func (d *Driver) prepare(ctx context.Context, c *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	ref := claimRef{c.Namespace, c.Name, string(c.UID)}
	if !validUID(ref.uid) {
		return nil, fmt.Errorf("claim UID %q: not usable in a CDI name", ref.uid)
	}
	if c.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", c.Namespace, c.Name)
	}
	var results []resourceapi.DeviceRequestAllocationResult
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver == d.cfg.DriverName {
			results = append(results, r)
		}
	}
	if len(results) == 0 {
		return []kubeletplugin.Device{}, nil
	}
	devs, err := d.resolve(ctx, results)
	if err != nil {
		return nil, err
	}
	// The claim's sharing config, checked before anything is reserved.
	configFor, err := sharingConfigs(c, d.cfg.DriverName)
	if err != nil {
		return nil, err
	}
	if err := checkSharing(devs, configFor); err != nil {
		return nil, err
	}

	// One Reserve per device group, in the order the groups first appear; the devices
	// of an admin access request apart (an admin access of the agent: no holder).
	type reserveKey struct {
		group groupKey
		admin bool
	}
	var order []reserveKey
	byGroup := make(map[reserveKey][]string)
	// Shares pooled as one consumable device (mpspool.go: MPS shares, holders): as many
	// shares as the claim's allocations of it consume, in one Reserve per pooled device.
	// Its options are those of the requests' SharingConfig mps, which must agree: one
	// Reserve, one daemon, one holder's limits.
	var poolOrder []*sharePool
	poolShares := make(map[*sharePool]int)
	type poolOptions struct {
		request string
		device  string // the pooled device's name in the slices
		cfg     *SharingConfig
		opts    map[string]string
	}
	poolOpts := make(map[*sharePool]poolOptions)
	for _, a := range devs {
		if p := a.ref.pool; p != nil && !a.admin {
			cfg := configFor(a.request)
			opts := cfg.pluginOptions()
			if _, ok := poolShares[p]; !ok {
				poolOrder = append(poolOrder, p)
				poolOpts[p] = poolOptions{a.request, a.ref.name, cfg, opts}
			} else if first := poolOpts[p]; !maps.Equal(first.opts, opts) {
				return nil, fmt.Errorf("requests %q and %q ask shares of device %s with other SharingConfig mps (%s; %s): a claim's shares of one device are one reservation, served by one MPS daemon with one holder's limits; give both requests one mps",
					first.request, a.request, a.ref.name, limitsName(first.opts), limitsName(opts))
			}
			poolShares[p] += p.sharesFor(a.consumed)
			continue
		}
		k, ids := reserveKey{a.ref.group, a.admin}, []string{a.ref.id}
		if p := a.ref.pool; p != nil { // admin access to a pooled device: to all its shares
			k.group, ids = p.group, p.shares
		}
		if _, ok := byGroup[k]; !ok {
			order = append(order, k)
		}
		for _, id := range ids {
			if !slices.Contains(byGroup[k], id) {
				byGroup[k] = append(byGroup[k], id)
			}
		}
	}
	// A pinned memory limit may lower what the claim's shares of a device take, never
	// raise it (the scheduler counted the shares).
	for _, p := range poolOrder {
		po := poolOpts[p]
		if po.cfg == nil || po.cfg.MPS == nil || p.kind != poolMPS {
			continue
		}
		if got := resource.NewQuantity(int64(poolShares[p])*p.unit, resource.BinarySI); po.cfg.MPS.pinnedMiB<<20 > got.Value() {
			shares := "1 MPS share"
			if n := poolShares[p]; n > 1 {
				shares = fmt.Sprintf("%d MPS shares", n)
			}
			return nil, fmt.Errorf("request %q: SharingConfig mps.pinnedDeviceMemoryLimit %s is above the %s the claim's %s of device %s take (its capacity memory); it may lower the limit, not raise it",
				po.request, po.cfg.MPS.PinnedDeviceMemoryLimit, got, shares, po.device)
		}
	}
	owner, labels := ref.owner(), ownerLabels(c)
	var reservations []*pb.Reservation
	cdiByDevice := make(map[string][]string) // agent device ID -> CDI IDs
	for _, p := range poolOrder {
		resp, ids, err := d.reserveShares(ctx, owner, labels, poolOpts[p].opts, p, poolShares[p])
		if err != nil {
			return nil, reserveError(ids, err)
		}
		reservations = append(reservations, &pb.Reservation{ReservationId: resp.GetReservationId(), Reservation: resp.GetReservation()})
		id := p.id()
		cdiByDevice[id] = append(slices.Clone(resp.GetReservation().GetCdiDevices()), d.cdi.id(ref.uid, resp.GetReservationId()))
	}
	for _, k := range order {
		g, ids := k.group, byGroup[k]
		resp, err := d.agent.Reserve(ctx, &pb.ReserveRequest{OwnerId: owner, Vendor: g.vendor, Type: g.typ, Name: g.name, DeviceIds: ids, AdminAccess: k.admin, OwnerLabels: labels})
		if err != nil {
			return nil, reserveError(ids, err)
		}
		reservations = append(reservations, &pb.Reservation{ReservationId: resp.GetReservationId(), Reservation: resp.GetReservation()})
		claimID := d.cdi.id(ref.uid, resp.GetReservationId())
		var common []string // plugin CDI names that name none of the devices
		for _, n := range resp.GetReservation().GetCdiDevices() {
			matched := false
			for _, id := range ids {
				if strings.HasSuffix(n, "="+id) {
					cdiByDevice[id] = append(cdiByDevice[id], n)
					matched = true
				}
			}
			if !matched {
				common = append(common, n)
			}
		}
		// The device's own CDI names first: the kubelet names a device by its first
		// CDI ID in the pod's status (allocatedResourcesStatus) and keeps one entry
		// per ID, so a claim-wide ID first would hide all but one device's health.
		for _, id := range ids {
			cdiByDevice[id] = append(append(cdiByDevice[id], claimID), common...)
		}
	}
	for _, a := range devs {
		if p := a.ref.pool; p != nil && a.admin {
			for _, id := range p.shares {
				cdiByDevice[a.ref.id] = append(cdiByDevice[a.ref.id], cdiByDevice[id]...)
			}
			slices.Sort(cdiByDevice[a.ref.id])
			cdiByDevice[a.ref.id] = slices.Compact(cdiByDevice[a.ref.id])
		}
	}
	if err := d.cdi.write(ref.uid, c.Namespace+"/"+c.Name, reservations); err != nil {
		// The reservations stay: the kubelet's retry gets them back and writes again.
		return nil, fmt.Errorf("write CDI spec: %w", err)
	}
	// The claim's device status is written by statusLoop, after the answer: the
	// kubelet waits on nothing the API server does.
	if d.cfg.Kube != nil {
		d.statuses.add(ref.uid, &preparedClaim{namespace: c.Namespace, name: c.Name, devices: devs, cdi: cdiByDevice})
	}
	out := make([]kubeletplugin.Device, 0, len(devs))
	for _, a := range devs {
		out = append(out, kubeletplugin.Device{
			Requests:     []string{a.request},
			PoolName:     d.cfg.NodeName,
			DeviceName:   a.ref.name,
			CDIDeviceIDs: cdiByDevice[a.ref.id],
			ShareID:      a.shareID,
		})
	}
	return out, nil
}

// resolve finds the agent's device for each allocated DRA device, in the current
// view, or in a fresh snapshot when the view does not have it (a driver that just
// started, a device that just appeared).
func (d *Driver) resolve(ctx context.Context, results []resourceapi.DeviceRequestAllocationResult) ([]allocated, error) {
	lookup := func(v *view) ([]allocated, []string) {
		var out []allocated
		var missing []string
		for _, r := range results {
			var ref *deviceRef
			if v != nil && r.Pool == v.pool {
				ref = v.devices[r.Device]
			}
			if ref == nil {
				missing = append(missing, r.Pool+"/"+r.Device)
				continue
			}
			out = append(out, allocated{request: r.Request, ref: *ref, admin: r.AdminAccess != nil && *r.AdminAccess, consumed: r.ConsumedCapacity, shareID: r.ShareID})
		}
		return out, missing
	}
	v, _ := d.current()
	if out, missing := lookup(v); len(missing) == 0 {
		return out, nil
	}
	snap, err := d.agent.Devices(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the agent's devices: %w", err)
	}
	fresh, _ := buildView(snap, buildOptions{driver: d.cfg.DriverName, pool: d.cfg.NodeName, pci: d.pci})
	out, missing := lookup(fresh)
	if len(missing) > 0 {
		return nil, fmt.Errorf("allocated devices %s are not devices the agent reports on node %s", strings.Join(missing, ", "), d.cfg.NodeName)
	}
	return out, nil
}

// reserveError explains a refused Reserve of ids: a held device or a counter over its
// capacity in the contract's words (device.HeldError, device.CapacityError), with the
// claim's owner, each holder and each counter; any other error as the agent sent it.
func reserveError(ids []string, err error) error {
	if held, ok := client.HeldError(err); ok {
		err = held
	} else if ce, ok := client.CapacityError(err); ok {
		err = ce
	}
	return fmt.Errorf("reserve %s: %w", strings.Join(ids, ", "), err)
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: Release of every
// reservation of each claim's owner, whichever process made them (the ledger says
// what is prepared), and removal of the claim's CDI spec. Unpreparing a claim that is
// not prepared is not an error.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.kubelet.enter()
	defer d.kubelet.leave()
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		ref := claimRef{c.Namespace, c.Name, string(c.UID)}
		err := d.unprepare(ctx, ref)
		if err != nil {
			d.log.Warn("claim not unprepared", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "error", err)
		}
		out[c.UID] = err
	}
	return out, nil
}

func (d *Driver) unprepare(ctx context.Context, ref claimRef) error {
	resp, err := d.agent.ReleaseOwner(ctx, ref.owner())
	if err != nil {
		return fmt.Errorf("release %s: %w", ref.owner(), err)
	}
	if err := d.cdi.remove(ref.uid); err != nil {
		return fmt.Errorf("remove CDI spec: %w", err)
	}
	if err := d.clearClaimStatus(ctx, ref); err != nil {
		d.log.Warn("claim unprepared, its device status not cleared", "error", err)
	}
	if n := len(resp.GetReleasedReservationIds()); n > 0 {
		d.log.Info("claim unprepared", "claim", ref.namespace+"/"+ref.name, "uid", ref.uid, "released", resp.GetReleasedReservationIds())
	}
	return nil
}
