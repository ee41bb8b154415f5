package shim

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/nomad/plugins/device"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/client"
	dev "github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Fingerprint streams the agent's inventory as Nomad device groups: a message at
// once, then one whenever what Nomad sees changes (a device's health or reason, the
// devices of a group, an attribute). While the agent cannot be reached, every device
// last seen is reported unhealthy with the reason (none before the agent was ever
// reached), and the real state again once it is back. The stream never reports an
// error (Nomad would stop using the plugin for good); it ends when ctx does.
func (p *Plugin) Fingerprint(ctx context.Context) (<-chan *device.FingerprintResponse, error) {
	c, _, err := p.conn()
	if err != nil {
		return nil, err
	}
	out := make(chan *device.FingerprintResponse)
	go p.fingerprint(ctx, c.Address(), c.WatchDevices(ctx), out)
	return out, nil
}

// fingerprint turns the agent's updates into Nomad messages on out, which it closes
// when updates closes or ctx ends.
func (p *Plugin) fingerprint(ctx context.Context, addr string, updates <-chan client.Update[*pb.FingerprintResponse], out chan<- *device.FingerprintResponse) {
	defer close(out)
	var good, sent []*device.DeviceGroup
	first := true
	for u := range updates {
		var groups []*device.DeviceGroup
		if u.Disconnected() {
			reason := fmt.Sprintf("devicehost agent at %s unreachable (%s)", addr, status.Code(u.Err))
			groups = allUnhealthy(good, reason)
		} else {
			p.inv.set(u.Snapshot)
			good = groupsToNomad(u.Snapshot)
			groups = good
		}
		if !first && reflect.DeepEqual(groups, sent) {
			continue
		}
		select {
		case out <- device.NewFingerprint(groups...):
			sent, first = groups, false
		case <-ctx.Done():
			return
		}
	}
}

// Stats streams the agent's device statistics every interval as Nomad stats. While the
// agent cannot be reached nothing is sent (Nomad keeps the last values); the stream
// never reports an error (Nomad would back off for up to 30 minutes).
func (p *Plugin) Stats(ctx context.Context, interval time.Duration) (<-chan *device.StatsResponse, error) {
	c, _, err := p.conn()
	if err != nil {
		return nil, err
	}
	out := make(chan *device.StatsResponse)
	go func() {
		defer close(out)
		for u := range c.WatchStats(ctx, interval) {
			if u.Disconnected() {
				continue
			}
			select {
			case out <- &device.StatsResponse{Groups: statsToNomad(u.Snapshot)}:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

// Reserve reserves the devices in the agent for a fresh "nomad/" owner and returns
// what the task gets: the agent's envs, mounts and device nodes. CDI device names have
// no place in Nomad's reservation; they are logged at DEBUG. The follower, if one runs,
// is told, so that it names the reservation after its task soon.
//
// Devices that live reservations of "nomad/" owners hold (allocations Nomad has since
// moved the devices away from) are taken over in the same call: the agent releases
// those reservations in the durable write that makes the new one
// (take_over_owner_prefixes), so the devices are never free in between and a refusal
// releases nothing. A device held by any other owner, or by a Reserve still in flight,
// is refused with an error naming the holder (see refusal).
func (p *Plugin) Reserve(deviceIDs []string) (*device.ContainerReservation, error) {
	c, timeout, err := p.conn()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	key, err := p.groupOf(ctx, c, deviceIDs)
	if err != nil {
		return nil, err
	}
	req := &pb.ReserveRequest{OwnerId: p.newOwner(), Vendor: key.vendor, Type: key.typ, Name: key.name, DeviceIds: deviceIDs,
		TakeOverOwnerPrefixes: []string{OwnerPrefix}}
	res, err := c.Reserve(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("devicehost: reserve %s: %w", strings.Join(deviceIDs, ", "), refusal(err))
	}
	p.nudge()
	for _, id := range res.GetTakenOverReservationIds() {
		p.log.Info("took over devices from an earlier Nomad reservation (Nomad does not say when allocations end)",
			"released", id, "reservation", res.GetReservationId(), "owner", req.GetOwnerId(), "devices", deviceIDs)
	}
	if cdi := res.GetReservation().GetCdiDevices(); len(cdi) > 0 {
		p.log.Debug("CDI device names have no place in a Nomad reservation", "cdi_devices", cdi)
	}
	return reservationToNomad(res.GetReservation()), nil
}

// refusal is err, a failed Reserve, in Nomad's terms: a held device names its holders
// (device.HeldError.Holders), a counter over its capacity the counters and their users
// (device.CapacityError.Counters), without the asking owner, which is the shim's own
// placeholder (the allocation is not known yet). Any other error is err.
func refusal(err error) error {
	if held, ok := client.HeldError(err); ok {
		return fmt.Errorf("%s: %w", held.Holders(), dev.ErrDeviceHeld)
	}
	if ce, ok := client.CapacityError(err); ok {
		return fmt.Errorf("%s: %w", ce.Counters(), dev.ErrCapacityExceeded)
	}
	return err
}

// groupOf finds the one group that holds every device, from the latest snapshot, or,
// if it does not know them all, from a fresh one.
func (p *Plugin) groupOf(ctx context.Context, c *client.Client, ids []string) (groupKey, error) {
	if len(ids) == 0 {
		return groupKey{}, errors.New("devicehost: reserve: no device IDs")
	}
	if k, err := p.inv.groupOf(ids); err == nil {
		return k, nil
	}
	snap, err := c.Devices(ctx)
	if err != nil {
		return groupKey{}, fmt.Errorf("devicehost: reserve %s: read the inventory: %w", strings.Join(ids, ", "), err)
	}
	p.inv.set(snap)
	k, err := p.inv.groupOf(ids)
	if err != nil {
		return groupKey{}, fmt.Errorf("devicehost: reserve: %w", err)
	}
	return k, nil
}

// groupKey names a device group.
type groupKey struct{ vendor, typ, name string }

// inventory maps device IDs to their group. Safe for concurrent use.
type inventory struct {
	mu    sync.RWMutex
	group map[string]groupKey
	dup   map[string]bool // IDs found in more than one group
}

func (inv *inventory) set(snap *pb.FingerprintResponse) {
	group := make(map[string]groupKey)
	dup := make(map[string]bool)
	for _, g := range snap.GetGroups() {
		k := groupKey{g.GetVendor(), g.GetType(), g.GetName()}
		for _, d := range g.GetDevices() {
			if prev, ok := group[d.GetId()]; ok && prev != k {
				dup[d.GetId()] = true
			}
			group[d.GetId()] = k
		}
	}
	inv.mu.Lock()
	inv.group, inv.dup = group, dup
	inv.mu.Unlock()
}

// groupOf returns the group of ids, or an error naming the IDs that are unknown, in
// more than one group, or in another group than the first ID.
func (inv *inventory) groupOf(ids []string) (groupKey, error) {
	inv.mu.RLock()
	defer inv.mu.RUnlock()
	var k groupKey
	var unknown []string
	for i, id := range ids {
		g, ok := inv.group[id]
		switch {
		case !ok:
			unknown = append(unknown, id)
		case inv.dup[id]:
			return groupKey{}, fmt.Errorf("device %s is in more than one group", id)
		case i > 0 && len(unknown) == 0 && g != k:
			return groupKey{}, fmt.Errorf("devices %s and %s are in different groups", ids[0], id)
		default:
			k = g
		}
	}
	if len(unknown) > 0 {
		return groupKey{}, fmt.Errorf("unknown devices %s", strings.Join(unknown, ", "))
	}
	return k, nil
}
