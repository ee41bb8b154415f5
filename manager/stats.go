package manager

import (
	"context"
	"sync"
	"time"

	"github.com/devicehost/devicehost/manager/device"
)

// statsHub keeps the latest stats of every plugin and fans them out to watchers. Plugins
// are sampled by their supervisors (one stream each); the hub's tick publishes one
// StatsSnapshot per sampling interval to every watcher, downsampled for watchers that
// asked for a longer interval. Safe for concurrent use.
type statsHub struct {
	interval time.Duration // the sampling interval
	now      func() time.Time
	watchers broadcast[device.StatsSnapshot]

	mu     sync.Mutex
	latest map[string]map[string]device.DeviceStats // plugin -> device ID -> stats
	cost   map[string]int                           // plugin -> charge of its latest stats (statsCost)
}

func newStatsHub(interval time.Duration, now func() time.Time) *statsHub {
	return &statsHub{
		interval: interval,
		now:      now,
		latest:   make(map[string]map[string]device.DeviceStats),
		cost:     make(map[string]int),
	}
}

// set replaces a plugin's latest stats, charged cost bytes of the host's Stats message,
// unless that would take the message over MaxStatsSnapshotBytes: then the plugin's
// previous stats stay and a *budgetError says why.
func (h *statsHub) set(plugin string, stats map[string]device.DeviceStats, cost int) error {
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

// clear forgets a plugin's stats, when it stops: they belonged to that process.
func (h *statsHub) clear(plugin string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.latest, plugin)
	delete(h.cost, plugin)
}

// build makes a snapshot of the latest stats, grouped as inv groups them; devices
// without stats (or no longer in the inventory) are left out, and so are groups with no
// stats at all.
func (h *statsHub) build(inv device.Inventory) device.StatsSnapshot {
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
func (h *statsHub) every(interval time.Duration) int {
	if interval <= h.interval {
		return 1
	}
	n := interval / h.interval // rounded up without adding, which could overflow
	if interval%h.interval != 0 {
		n++
	}
	return int(n)
}

// watch subscribes to stats snapshots at interval, starting with the current one.
func (h *statsHub) watch(ctx context.Context, interval time.Duration, inv device.Inventory) <-chan device.StatsSnapshot {
	first := h.build(inv)
	return h.watchers.subscribe(ctx, h.every(interval), &first)
}

// run publishes a snapshot every sampling interval until ctx ends. inventory is asked
// for the current inventory at each tick.
func (h *statsHub) run(ctx context.Context, inventory func() device.Inventory) {
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
			h.watchers.publish(h.build(inventory()))
		}
	}
}

// LatestStats returns the latest stats of every plugin, grouped as the inventory groups
// them: what the plugins' stats streams last brought, read without asking any plugin
// and without waiting for the next sampling tick, so callers that poll (a metrics
// scrape) cost the plugins nothing however often they ask. Safe for concurrent use;
// the snapshot is immutable.
func (m *Manager) LatestStats() device.StatsSnapshot { return m.stats.build(m.Inventory()) }
