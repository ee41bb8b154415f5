package inventory

import (
	"context"
	"sync"
	"time"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Stats keeps the latest stats of every plugin and fans them out to watchers. Plugins
// are sampled by their supervisors (one stream each); Run's tick publishes one
// StatsSnapshot per sampling interval to every watcher, downsampled for watchers that
// asked for a longer interval. Safe for concurrent use.
type Stats struct {
	interval time.Duration // the sampling interval
	now      func() time.Time
	watchers broadcast[device.StatsSnapshot]

	mu     sync.Mutex
	latest map[string]map[string]device.DeviceStats // plugin -> device ID -> stats
	cost   map[string]int                           // plugin -> charge of its latest stats (statsCost)
}

// NewStats returns a Stats sampled every interval (more than zero); now stamps its
// snapshots.
func NewStats(interval time.Duration, now func() time.Time) *Stats {
	return &Stats{
		interval: interval,
		now:      now,
		latest:   make(map[string]map[string]device.DeviceStats),
		cost:     make(map[string]int),
	}
}

// Set replaces a plugin's latest stats with resp, which validate.Stats accepted and
// which came at received (it stands in for a device's missing timestamp), unless their
// charge (the message's size, plus groupCost: Registry.StatsGroupCost) would take the
// host's Stats message over MaxStatsSnapshotBytes: then the plugin's previous stats stay
// and the error says why.
func (h *Stats) Set(plugin string, resp *pb.StatsResponse, received time.Time, groupCost int) error {
	return h.set(plugin, fromStats(resp, received), statsCost(resp, groupCost))
}

func (h *Stats) set(plugin string, stats map[string]device.DeviceStats, cost int) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	others := 0
	for p, c := range h.cost {
		if p != plugin {
			others += c
		}
	}
	if others+cost+timestampBytes > MaxStatsSnapshotBytes {
		return &budgetError{plugin: plugin, what: "stats", cost: cost, others: others, limit: MaxStatsSnapshotBytes}
	}
	h.latest[plugin], h.cost[plugin] = stats, cost
	return nil
}

// Clear forgets a plugin's stats, when it stops: they belonged to that process.
func (h *Stats) Clear(plugin string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.latest, plugin)
	delete(h.cost, plugin)
}

// Latest makes a snapshot of the latest stats, grouped as inv groups them; devices
// without stats (or no longer in the inventory) are left out, and so are groups with no
// stats at all. The snapshot is immutable.
func (h *Stats) Latest(inv device.Inventory) device.StatsSnapshot {
	h.mu.Lock()
	defer h.mu.Unlock()
	snap := device.StatsSnapshot{Time: h.now()}
	for _, g := range inv.Groups {
		latest := h.latest[g.Plugin]
		gs := device.GroupStats{GroupKey: g.GroupKey, Plugin: g.Plugin}
		for _, d := range g.Devices {
			if st, ok := latest[d.ID]; ok {
				gs.Devices = append(gs.Devices, st)
			}
		}
		if len(gs.Devices) > 0 {
			snap.Groups = append(snap.Groups, gs)
		}
	}
	return snap
}

// every converts a watcher's requested interval into "one of every n publications":
// zero or anything up to the sampling interval is every one, longer is rounded up.
func (h *Stats) every(interval time.Duration) int {
	if interval <= h.interval {
		return 1
	}
	n := interval / h.interval // rounded up without adding, which could overflow
	if interval%h.interval != 0 {
		n++
	}
	return int(n)
}

// Watch subscribes to stats snapshots at interval, starting with the current one for
// inv. The channel is closed when ctx ends or Close is called.
func (h *Stats) Watch(ctx context.Context, interval time.Duration, inv device.Inventory) <-chan device.StatsSnapshot {
	first := h.Latest(inv)
	return h.watchers.subscribe(ctx, h.every(interval), &first)
}

// Close closes every watcher's channel; later Watch calls get a closed channel.
func (h *Stats) Close() { h.watchers.close() }

// Run publishes a snapshot every sampling interval until ctx ends. inventory is asked
// for the current inventory at each tick.
func (h *Stats) Run(ctx context.Context, inventory func() device.Inventory) {
	t := time.NewTicker(h.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if h.watchers.len() == 0 {
				continue
			}
			h.watchers.publish(h.Latest(inventory()))
		}
	}
}
