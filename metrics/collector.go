package metrics

import (
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/devicehost/devicehost/manager/device"
)

// Labels of the device and plugin metrics.
var (
	deviceLabels   = []string{"plugin", "vendor", "type", "name", "device"}
	reservedLabels = append(slices.Clone(deviceLabels), "owner", "reservation")
)

// pluginStatuses are the values of devicehost_plugin_status's status label.
var pluginStatuses = []device.PluginStatus{device.PluginStarting, device.PluginRunning, device.PluginRestarting, device.PluginFailed}

// Reasons a stat series is left out of a scrape (devicehost_metrics_series_dropped).
const (
	dropLimit      = "limit"        // past the plugin's MaxSeriesPerPlugin
	dropName       = "name"         // nothing of the stat's name is usable in a metric name
	dropDuplicate  = "duplicate"    // another stat of the device made the same series
	dropReserved   = "reserved"     // the name is one of the agent's own metrics
	dropConflict   = "conflict"     // the name's family has another type, help or labels
	dropNotANumber = "not_a_number" // a string value
	dropUnit       = "unit"         // a unit that does not convert
	dropInvalid    = "invalid"      // a label value Prometheus refuses (not UTF-8)
)

var (
	healthyDesc = prometheus.NewDesc("devicehost_device_healthy",
		"1 when the device is healthy; 0 when it is unhealthy or its health is unknown.", deviceLabels, nil)
	reservedDesc = prometheus.NewDesc("devicehost_device_reserved",
		"1 when a live reservation holds the device (owner and reservation name it), else 0 with both empty: one series per device.",
		reservedLabels, nil)
	pluginStatusDesc = prometheus.NewDesc("devicehost_plugin_status",
		"1 for the plugin's current status, 0 for the others (starting, running, restarting, failed).", []string{"plugin", "status"}, nil)
	pluginRestartsDesc = prometheus.NewDesc("devicehost_plugin_restarts_total",
		"Times the plugin was restarted since the agent started.", []string{"plugin"}, nil)
	pluginLastErrorDesc = prometheus.NewDesc("devicehost_plugin_last_error_timestamp_seconds",
		"When the plugin's last error happened (Unix time); absent while it has had none.", []string{"plugin"}, nil)
	pluginDevicesDesc = prometheus.NewDesc("devicehost_plugin_devices",
		"Devices the plugin reports.", []string{"plugin"}, nil)
	droppedDesc = prometheus.NewDesc("devicehost_metrics_series_dropped",
		"Stat series of the plugin left out of this scrape, by reason (limit, name, duplicate, reserved, conflict, not_a_number, unit, invalid).",
		[]string{"plugin", "reason"}, nil)
)

// reservedFamilies are the agent's own families that a stat's name must not take.
var reservedFamilies = map[string]bool{"devicehost_device_healthy": true, "devicehost_device_reserved": true}

// collector exports a device.Manager's devices, plugins and stats at each scrape, from
// its Snapshot and LatestStats: a scrape never costs the plugins a call. It is an
// unchecked collector (Describe sends nothing): the stat families depend on what the
// plugins send. Safe for concurrent scrapes; it keeps nothing between them.
type collector struct {
	mgr       device.Manager
	hostname  string
	maxSeries int
}

func newCollector(mgr device.Manager, hostname string, maxSeries int) *collector {
	return &collector{mgr: mgr, hostname: hostname, maxSeries: maxSeries}
}

// Describe implements prometheus.Collector; it describes nothing (unchecked).
func (c *collector) Describe(chan<- *prometheus.Desc) {}

// Collect implements prometheus.Collector.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	snap := c.mgr.Snapshot()
	s := &scrape{
		c:        c,
		ch:       ch,
		seen:     make(map[string]bool),
		families: make(map[string]family),
		series:   make(map[string]int),
		dropped:  make(map[string]map[string]int),
	}
	s.plugins(snap.State)
	s.devices(snap)
	s.stats(c.mgr.LatestStats(), snap.Inventory)
	s.reportDropped()
}

// family is what a metric family's series must agree on.
type family struct {
	desc   *prometheus.Desc
	help   string
	typ    prometheus.ValueType
	labels string // label names, joined
}

// scrape is one Collect's work.
type scrape struct {
	c        *collector
	ch       chan<- prometheus.Metric
	seen     map[string]bool           // series sent: family and label values
	families map[string]family         // stat families made in this scrape
	series   map[string]int            // plugin -> stat series sent
	dropped  map[string]map[string]int // plugin -> reason -> stat series left out
}

func (s *scrape) send(desc *prometheus.Desc, typ prometheus.ValueType, v float64, labels ...string) {
	if m, err := prometheus.NewConstMetric(desc, typ, v, labels...); err == nil {
		s.ch <- m
	}
}

func (s *scrape) plugins(st device.State) {
	for _, p := range st.Plugins {
		for _, status := range pluginStatuses {
			s.send(pluginStatusDesc, prometheus.GaugeValue, boolValue(p.Status == status), p.Name, status.String())
		}
		s.send(pluginRestartsDesc, prometheus.CounterValue, float64(p.Restarts), p.Name)
		s.send(pluginDevicesDesc, prometheus.GaugeValue, float64(p.DeviceCount), p.Name)
		if !p.LastErrorAt.IsZero() {
			s.send(pluginLastErrorDesc, prometheus.GaugeValue, float64(p.LastErrorAt.UnixNano())/1e9, p.Name)
		}
	}
}

func (s *scrape) devices(snap device.Snapshot) {
	for _, g := range snap.Inventory.Groups {
		for _, d := range g.Devices {
			st := snap.State.Devices[d.ID]
			labels := []string{g.Plugin, g.Vendor, g.Type, g.Name, d.ID}
			s.send(healthyDesc, prometheus.GaugeValue, boolValue(st.Health == device.HealthHealthy), labels...)
			owner, res := "", ""
			if st.Holder != nil {
				owner, res = st.Holder.OwnerID, st.Holder.ReservationID
			}
			s.send(reservedDesc, prometheus.GaugeValue, boolValue(st.Holder != nil), append(labels, owner, res)...)
		}
	}
}

// stats exports every device's stats: NVIDIA GPUs' mapped stats under dcgm-exporter's
// names and labels, everything else as devicehost_device_<stat>.
func (s *scrape) stats(stats device.StatsSnapshot, inv device.Inventory) {
	busIDs := make(map[string]string)
	for _, g := range inv.Groups {
		for _, d := range g.Devices {
			busIDs[d.ID] = d.Locality.PCIBusID
		}
	}
	for _, g := range stats.Groups {
		dcgm := isDCGMGroup(g.GroupKey)
		for _, d := range g.Devices {
			var dcgmLabelValues []string
			if dcgm {
				index := ""
				if v, ok := number(d.Values[dcgmIndexStat]); ok {
					index = strconv.FormatInt(int64(v), 10)
				}
				dev := ""
				if index != "" {
					dev = "nvidia" + index
				}
				dcgmLabelValues = []string{index, d.ID, dev, g.Name, dcgmBusID(busIDs[d.ID]), s.c.hostname}
			}
			for _, name := range slices.Sorted(maps.Keys(d.Values)) {
				v := d.Values[name]
				if dcgm && name == dcgmIndexStat {
					continue // a label
				}
				f, mapped := dcgmFields[name]
				if dcgm && mapped {
					s.dcgmSeries(g.Plugin, f, v, dcgmLabelValues)
					continue
				}
				s.statSeries(g, d.ID, name, v)
			}
		}
	}
}

func (s *scrape) dcgmSeries(plugin string, f dcgmField, v device.Value, labels []string) {
	x, ok := number(v)
	if !ok {
		s.drop(plugin, dropNotANumber)
		return
	}
	if x, ok = convert(x, v.Unit, f.unit); !ok {
		s.drop(plugin, dropUnit)
		return
	}
	s.emit(plugin, f.name, f.help, f.typ, dcgmLabels, labels, x)
}

func (s *scrape) statSeries(g device.GroupStats, id, stat string, v device.Value) {
	x, ok := number(v)
	if !ok {
		s.drop(g.Plugin, dropNotANumber)
		return
	}
	u, ok := units[v.Unit]
	if !ok {
		s.drop(g.Plugin, dropUnit)
		return
	}
	name := statName(stat, u)
	switch {
	case name == "":
		s.drop(g.Plugin, dropName)
		return
	case reservedFamilies[name]:
		s.drop(g.Plugin, dropReserved)
		return
	}
	s.emit(g.Plugin, name, statHelp, prometheus.GaugeValue, deviceLabels,
		[]string{g.Plugin, g.Vendor, g.Type, g.Name, id}, x*u.factor)
}

// emit sends one stat series of plugin, unless the plugin is at its limit, the series
// was sent already, or its family disagrees with an earlier series of that name.
func (s *scrape) emit(plugin, name, help string, typ prometheus.ValueType, labelNames, labelValues []string, v float64) {
	if s.series[plugin] >= s.c.maxSeries {
		s.drop(plugin, dropLimit)
		return
	}
	key := name + "\xff" + strings.Join(labelValues, "\xff")
	if s.seen[key] {
		s.drop(plugin, dropDuplicate)
		return
	}
	joined := strings.Join(labelNames, ",")
	fam, ok := s.families[name]
	switch {
	case !ok:
		fam = family{desc: prometheus.NewDesc(name, help, labelNames, nil), help: help, typ: typ, labels: joined}
		s.families[name] = fam
	case fam.help != help || fam.typ != typ || fam.labels != joined:
		s.drop(plugin, dropConflict)
		return
	}
	m, err := prometheus.NewConstMetric(fam.desc, typ, v, labelValues...)
	if err != nil {
		s.drop(plugin, dropInvalid)
		return
	}
	s.seen[key] = true
	s.series[plugin]++
	s.ch <- m
}

func (s *scrape) drop(plugin, reason string) {
	if s.dropped[plugin] == nil {
		s.dropped[plugin] = make(map[string]int)
	}
	s.dropped[plugin][reason]++
}

func (s *scrape) reportDropped() {
	for plugin, reasons := range s.dropped {
		for reason, n := range reasons {
			s.send(droppedDesc, prometheus.GaugeValue, float64(n), plugin, reason)
		}
	}
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
