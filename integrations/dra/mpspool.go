package dra

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Shares as DRA consumable capacity (DRAConsumableCapacity), of two kinds.
//
// MPS shares: the agent's MPS shares (a group whose type or name ends in ".mps": N
// shares of a GPU or MIG device, each consuming 1/N of that device's counter set) are
// published as one device per device they divide, with allowMultipleAllocations and a
// memory capacity of all N shares, whose request policy is one share: a default of one,
// steps of one. A claim asking capacity.requests.memory gets that much of one device
// (the scheduler rounds it up to whole shares), and Prepare reserves as many of the
// device's shares at the agent, so the MPS limits its container gets are what it asked
// for.
//
// Holders: a device a plugin offers to N holders at once (hostdev's count: N copies,
// each consuming one "holders" of a counter set of N, client.HoldersCounter) is
// published as one device of its group's type and name with allowMultipleAllocations
// and a "holders" capacity of N, one per allocation by default: a claim takes one
// holder (or as many as it asks), the rest stay for other claims, and Prepare reserves
// as many copies at the agent.
//
// Either way the pooled device consumes the whole counter set (once, however many
// claims share it), so that the scheduler never gives the device whole and in shares
// at once, as the agent's ledger never does.
//
// A pooled MPS device's type is its divided device's with ".mps" after it, and its
// product name the divided device's: gpu.mps and the GPU's product for a GPU's shares,
// mig.mps and the MIG profile for a static MIG device's. The nvidia-example plugin puts
// the suffix of a MIG device's shares on their group's name (mig/3g.40gb.mps); published
// as it is, the pooled device would be of type mig, which the DeviceClass of whole MIG
// devices selects, so that a claim for a MIG device could get one share of one, and
// selectors of a MIG profile (productName == "3g.40gb") would not match its shares.

// poolKind is what a pool's shares are.
type poolKind int

const (
	poolMPS     poolKind = iota + 1 // MPS shares of a GPU or MIG device: memory
	poolHolders                     // holders of a device offered N times: holders
)

// sharePool is one pooled device: the shares of the device parent.
type sharePool struct {
	kind     poolKind
	parent   string                    // the divided device's counter set: its UUID, or the held device's ID
	shares   []string                  // the agent's share IDs, in order
	capacity resourceapi.QualifiedName // "memory" or "holders"
	unit     int64                     // one share's capacity: its memory in bytes, or 1 holder
	group    groupKey                  // the agent's share group
}

// poolID is the agent-side ID a pooled device of kind is known by in the view.
func poolID(parent string, kind poolKind) string {
	if kind == poolHolders {
		return parent + "::holders"
	}
	return parent + "::mps"
}

func (p *sharePool) id() string { return poolID(p.parent, p.kind) }

// groupPoolKind says whether g's devices are pooled, and how: an MPS share group with
// its memory in MiB (one share's: unit, in bytes), or a group whose every device is one
// holder of a counter set of holders.
func groupPoolKind(g *pb.DeviceGroup) (kind poolKind, unit int64) {
	if client.IsShareGroup(g) {
		if mem := g.GetAttributes()["memory"]; mem.GetUnit() == "MiB" && mem.GetIntValue() > 0 {
			return poolMPS, mem.GetIntValue() << 20
		}
		return 0, 0
	}
	if len(g.GetDevices()) == 0 {
		return 0, 0
	}
	for _, d := range g.GetDevices() {
		if !client.IsHolder(d) {
			return 0, 0
		}
	}
	return poolHolders, 1
}

// poolShares returns snap with each MPS share group, and each group of holders,
// replaced by a group of pooled devices, one per divided (or held) device, and the
// pools by pooled ID. snap is not changed. A share group without a memory attribute in
// MiB is left as it is. Shares that divide no device of their own counter set (an
// on-demand MIG placement's: they draw on the placement's slices of the GPU's set, see
// client.ShareParent) are left out: no pooled device could stand for them, and
// published one by one a claim could get shares of two placements, which no container
// can use at once.
func poolShares(snap *pb.FingerprintResponse) (*pb.FingerprintResponse, map[string]*sharePool) {
	if !slices.ContainsFunc(snap.GetGroups(), func(g *pb.DeviceGroup) bool { k, _ := groupPoolKind(g); return k != 0 }) {
		return snap, nil
	}
	sets := client.IndexCounterSets(snap)
	pools := make(map[string]*sharePool)
	out := &pb.FingerprintResponse{CounterSets: snap.GetCounterSets(), Timestamp: snap.GetTimestamp()}
	for _, g := range snap.GetGroups() {
		kind, unit := groupPoolKind(g)
		if kind == 0 {
			out.Groups = append(out.Groups, g)
			continue
		}
		byParent := make(map[string]*pb.Device)
		var order []string
		for _, d := range g.GetDevices() {
			parent, ok := sets.ShareParent(g.GetPlugin(), d)
			if !ok {
				continue // not a share of one device
			}
			c := d.GetConsumes()[0]
			p, ok := pools[poolID(parent, kind)]
			if !ok {
				p = &sharePool{kind: kind, parent: parent, capacity: "memory", unit: unit, group: groupKey{g.GetVendor(), g.GetType(), g.GetName()}}
				if kind == poolHolders {
					p.capacity = client.HoldersCounter
				}
				pools[p.id()] = p
				byParent[parent] = &pb.Device{Id: p.id(), Health: pb.Health_HEALTH_HEALTHY, Locality: d.GetLocality(),
					Consumes: []*pb.CounterConsumption{{CounterSet: parent, Counters: map[string]int64{},
						CompatibilityGroups: c.GetCompatibilityGroups()}}} // the shares' mode: "mps" on a GPU offered two ways
				order = append(order, parent)
			}
			p.shares = append(p.shares, d.GetId())
			pd := byParent[parent]
			for k, n := range c.GetCounters() {
				pd.Consumes[0].Counters[k] += n
			}
			if d.GetHealth() != pb.Health_HEALTH_HEALTHY && pd.GetHealth() == pb.Health_HEALTH_HEALTHY {
				pd.Health, pd.HealthReason = d.GetHealth(), d.GetHealthReason()
			}
			if d.GetCordon() != nil && pd.GetCordon() == nil {
				pd.Cordon = d.GetCordon()
			}
			// Shares held outside DRA (the kubelet bridge, Nomad, by hand) keep the
			// pooled device from the scheduler: it cannot know how many are left.
			if h := d.GetHolder(); h != nil && !strings.HasPrefix(h.GetOwnerId(), ClaimOwnerPrefix) && pd.GetHolder() == nil {
				pd.Holder = h
			}
			pd.BlockedBy = append(pd.BlockedBy, d.GetBlockedBy()...)
		}
		typ, name := g.GetType(), g.GetName()
		attrs := maps.Clone(g.GetAttributes())
		if kind == poolMPS {
			typ, name = pooledGroup(g)
		}
		pg := &pb.DeviceGroup{Vendor: g.GetVendor(), Type: typ, Name: name, Plugin: g.GetPlugin(), Attributes: attrs}
		for _, parent := range order {
			pd := byParent[parent]
			slices.SortFunc(pd.BlockedBy, func(a, b *pb.Holder) int { return strings.Compare(a.GetReservationId(), b.GetReservationId()) })
			pd.BlockedBy = slices.CompactFunc(pd.BlockedBy, func(a, b *pb.Holder) bool { return a.GetReservationId() == b.GetReservationId() })
			pg.Devices = append(pg.Devices, pd)
		}
		if len(pg.Devices) > 0 {
			if kind == poolMPS {
				// Every pooled device of the group has all its shares' memory.
				n := int64(len(pools[poolID(order[0], kind)].shares))
				pg.Attributes["memory"] = &pb.Value{Kind: &pb.Value_IntValue{IntValue: n * unit >> 20}, Unit: "MiB"}
			}
			out.Groups = append(out.Groups, pg)
		}
	}
	return out, pools
}

// pooledGroup is the type and name a share group's pooled devices are published under
// (see the top of this file): the suffix on the type, the divided device's name.
func pooledGroup(g *pb.DeviceGroup) (typ, name string) {
	if strings.HasSuffix(g.GetType(), ".mps") {
		return g.GetType(), g.GetName()
	}
	return g.GetType() + ".mps", strings.TrimSuffix(g.GetName(), ".mps")
}

// consumable makes dev, the pooled device of p, consumable: many allocations, each of
// whole shares of its capacity (memory, or holders).
//
// That capacity is its only one: every capacity of a device that allows multiple
// allocations is consumable, and one without a request policy is consumed whole by each
// allocation (the GPU's bar1 would let one claim in).
func (p *sharePool) consumable(dev *resourceapi.Device) {
	dev.AllowMultipleAllocations = ptr.To(true)
	format := resource.BinarySI
	if p.kind == poolHolders {
		format = resource.DecimalSI
	}
	share := *resource.NewQuantity(p.unit, format)
	dev.Capacity = make(map[resourceapi.QualifiedName]resourceapi.DeviceCapacity, 1)
	dev.Capacity[p.capacity] = resourceapi.DeviceCapacity{
		Value: *resource.NewQuantity(int64(len(p.shares))*p.unit, format),
		RequestPolicy: &resourceapi.CapacityRequestPolicy{
			Default:    &share,
			ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: &share, Step: &share},
		},
	}
}

// sharesFor is how many shares of p a claim's consumed capacity takes (one when the
// allocation says none).
func (p *sharePool) sharesFor(consumed map[resourceapi.QualifiedName]resource.Quantity) int {
	q, ok := consumed[p.capacity]
	if !ok {
		return 1
	}
	return max(1, int((q.Value()+p.unit-1)/p.unit))
}

// reserveShares reserves k shares of p for owner (with its labels and the plugin options
// opts of its requests' SharingConfig) at the agent: the ones a reservation
// of owner already holds (the kubelet asking again), else free ones, retrying with a
// fresh reading when another claim took one first.
func (d *Driver) reserveShares(ctx context.Context, owner string, labels, opts map[string]string, p *sharePool, k int) (*pb.ReserveResponse, []string, error) {
	if k > len(p.shares) {
		return nil, nil, fmt.Errorf("%d shares of %s asked for; it has %d", k, p.parent, len(p.shares))
	}
	held, err := d.agent.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: owner, State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil {
		return nil, nil, fmt.Errorf("read the claim's reservations: %w", err)
	}
	for _, r := range held {
		if len(r.GetDeviceIds()) > 0 && slices.Contains(p.shares, r.GetDeviceIds()[0]) {
			ids := r.GetDeviceIds()
			resp, err := d.agent.Reserve(ctx, &pb.ReserveRequest{OwnerId: owner, Vendor: p.group.vendor, Type: p.group.typ, Name: p.group.name, DeviceIds: ids, OwnerLabels: labels, PluginOptions: opts})
			return resp, ids, err
		}
	}
	var lastErr error
	for range 3 {
		snap, err := d.agent.Devices(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("read the agent's devices: %w", err)
		}
		// Unheld, healthy, uncordoned devices, and whether their shared counters are
		// taken (blocked).
		blocked := make(map[string]bool)
		for _, g := range snap.GetGroups() {
			for _, dv := range g.GetDevices() {
				if dv.GetHolder() == nil && dv.GetHealth() == pb.Health_HEALTH_HEALTHY && dv.GetCordon() == nil {
					blocked[dv.GetId()] = len(dv.GetBlockedBy()) > 0
				}
			}
		}
		var ids, others []string
		for _, id := range p.shares {
			b, unheld := blocked[id]
			switch {
			case unheld && !b && len(ids) < k:
				ids = append(ids, id)
			case unheld && b:
				others = append(others, id)
			}
		}
		if len(ids) < k && len(ids)+len(others) >= k {
			// Shares blocked by their device's other users (the GPU held whole, or in
			// another sharing mode): the agent's refusal names them and why.
			ids = append(ids, others[:k-len(ids)]...)
		} else if len(ids) < k {
			return nil, nil, fmt.Errorf("%d shares of %s asked for; %d are free at the agent", k, p.parent, len(ids))
		}
		resp, err := d.agent.Reserve(ctx, &pb.ReserveRequest{OwnerId: owner, Vendor: p.group.vendor, Type: p.group.typ, Name: p.group.name, DeviceIds: ids, OwnerLabels: labels, PluginOptions: opts})
		if _, taken := client.HeldError(err); !taken {
			return resp, ids, err
		}
		lastErr = err
	}
	return nil, nil, lastErr
}
