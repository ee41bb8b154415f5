package metrics

import (
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/validate"
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
	cordonedDesc = prometheus.NewDesc("devicehost_device_cordoned",
		"1 while the device is cordoned (taken out of service: no new holder on any path), else 0: one series per device.", deviceLabels, nil)
	adminAccessDesc = prometheus.NewDesc("devicehost_device_admin_access",
		"Live admin accesses of the device (monitoring or debugging workloads that see it without holding it; not holders): one series per device.", deviceLabels, nil)
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
var reservedFamilies = map[string]bool{"devicehost_device_healthy": true, "devicehost_device_reserved": true, "devicehost_device_cordoned": true,
	"devicehost_device_admin_access": true}

// collector exports a device.Manager's devices, plugins and stats at each scrape, from
// its Snapshot and LatestStats: a scrape never costs the plugins a call. It is an
// unchecked collector (Describe sends nothing): the stat families depend on what the
// plugins send. Safe for concurrent scrapes; it keeps nothing between them.
type collector struct {
	mgr          device.Manager
	hostname     string
	maxSeries    int
	holderLabels bool // the dcgm-exporter series of a held device name its holder
	// reservationOf is the reservation a process of a device belongs to ("" for none
	// known; visible false when the agent cannot see the process): procReservation,
	// or a test's.
	reservationOf func(pid uint32) (reservation string, visible bool)
}

func newCollector(mgr device.Manager, hostname string, maxSeries int, holderLabels bool, reservationOf func(uint32) (string, bool)) *collector {
	if reservationOf == nil {
		reservationOf = procReservation
	}
	return &collector{mgr: mgr, hostname: hostname, maxSeries: maxSeries, holderLabels: holderLabels, reservationOf: reservationOf}
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
	s.stats(c.mgr.LatestStats(), snap)
	s.reportDropped()
}

// family is what a metric family's series must agree on: help and type. Its series
// may differ in their label names (a GPU's and a MIG device's dcgm-exporter series), as
// dcgm-exporter's do; each set of names has a Desc.
type family struct {
	help  string
	typ   prometheus.ValueType
	descs map[string]*prometheus.Desc // by label names, joined
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
			s.send(cordonedDesc, prometheus.GaugeValue, boolValue(st.Cordon != nil), labels...)
			s.send(adminAccessDesc, prometheus.GaugeValue, float64(len(st.AdminAccess)), labels...)
			owner, res := "", ""
			if st.Holder != nil {
				owner, res = st.Holder.OwnerID, st.Holder.ReservationID
			}
			s.send(reservedDesc, prometheus.GaugeValue, boolValue(st.Holder != nil), append(labels, owner, res)...)
		}
	}
}

// stats exports every device's stats: NVIDIA GPUs' and MIG devices' mapped stats under
// dcgm-exporter's names and labels, everything else as devicehost_device_<stat>.
func (s *scrape) stats(stats device.StatsSnapshot, snap device.Snapshot) {
	inv := snap.Inventory
	busIDs := make(map[string]string)
	models := make(map[groupID]device.Value) // MIG groups' GPU model
	for _, g := range inv.Groups {
		for _, d := range g.Devices {
			busIDs[d.ID] = d.Locality.PCIBusID
		}
		if isMIGGroup(g.GroupKey) {
			models[groupID{g.Plugin, g.GroupKey}] = g.Attributes[dcgmModelAttr]
		}
	}
	var shares map[string][]share
	var owners map[string]string // reservation ID -> owner, of every holder
	if s.c.holderLabels {
		shares = sharesOf(snap, stats)
		owners = make(map[string]string)
		for _, st := range snap.State.Devices {
			if h := st.Holder; h != nil {
				owners[h.ReservationID] = h.OwnerID
			}
		}
	}
	for _, g := range stats.Groups {
		for _, d := range g.Devices {
			l := s.dcgmLabelsOf(g, d, busIDs[d.ID], models[groupID{g.Plugin, g.GroupKey}])
			// One set of dcgm series per workload: the device's holder, or each holder of
			// its shares (time-sliced replicas) with the share it holds; else one plain.
			sets := []share{{ratio: -1}}
			if h := snap.State.Devices[d.ID].Holder; l.use && s.c.holderLabels && h != nil {
				sets = []share{{owner: h.OwnerID, labels: h.OwnerLabels, ratio: -1}}
			} else if l.use && len(shares[d.ID]) > 0 {
				sets = shares[d.ID]
			}
			// A shared device whose plugin reports its processes: each workload's
			// DCGM_FI_DEV_FB_USED is what its own processes use.
			// Likewise DCGM_FI_DEV_GPU_UTIL, where the plugin reports each process's
			// share of the SMs: a workload's is its processes' sum, one with none 0.
			var used, busy map[string]int64
			if len(d.Processes) > 0 && sets[0].ratio >= 0 {
				used, busy = s.c.usedByOwner(d.Processes, owners)
			}
			for _, sh := range sets {
				ln, lv := l.names, l.values
				if sh.owner != "" {
					names, values := holderLabels(sh.owner, sh.labels)
					ln = append(slices.Clip(ln), names...)
					lv = append(slices.Clip(lv), values...)
				}
				if sh.ratio >= 0 && !l.invalid {
					s.emit(g.Plugin, shareRatioName, shareRatioHelp, prometheus.GaugeValue, ln, lv, sh.ratio)
				}
				if sh.memBytes > 0 && !l.invalid {
					s.emit(g.Plugin, shareMemoryName, shareMemoryHelp, prometheus.GaugeValue, ln, lv, sh.memBytes)
				}
				for _, name := range slices.Sorted(maps.Keys(d.Values)) {
					v := d.Values[name]
					if l.use && l.isLabel(name) {
						continue
					}
					f, mapped := dcgmFields[name]
					switch {
					case l.use && mapped && l.invalid:
						s.drop(g.Plugin, dropInvalid)
					case l.use && mapped && name == memoryUsedStat && used != nil:
						s.dcgmSeries(g.Plugin, f, device.Value{Kind: device.KindInt, Int: used[sh.owner], Unit: "B"}, ln, lv)
					case l.use && mapped && name == utilizationStat && busy != nil:
						s.dcgmSeries(g.Plugin, f, device.Value{Kind: device.KindInt, Int: min(busy[sh.owner], 100), Unit: "%"}, ln, lv)
					case l.use && mapped:
						s.dcgmSeries(g.Plugin, f, v, ln, lv)
					case sh == sets[0]: // the devicehost_device_ series once, whatever the holders
						s.statSeries(g, d.ID, name, v)
					}
				}
			}
		}
	}
}

// memoryUsedStat is the stat of DCGM_FI_DEV_FB_USED: per workload on a shared device
// whose plugin reports its processes.
const memoryUsedStat = "memory_used"

// utilizationStat is the stat of DCGM_FI_DEV_GPU_UTIL: per workload on a shared
// device whose plugin reports its processes' SM utilization.
const utilizationStat = "gpu_utilization"

// usedByOwner sums the device memory of procs, and their SM utilization (%), by the
// workload each belongs to (its reservation's owner, by owners; as sharesOf keys them:
// "" for owners with no holder labels). A process of no known reservation counts for
// none. used is nil when the agent sees none of the processes (another PID namespace):
// it cannot tell whose they are, and the device's own figure stands; busy is nil then
// too, and when the plugin reports no process's utilization.
func (c *collector) usedByOwner(procs []device.ProcessMemory, owners map[string]string) (used, busy map[string]int64) {
	for _, p := range procs {
		res, visible := c.reservationOf(p.PID)
		if !visible {
			continue
		}
		if used == nil {
			used = make(map[string]int64)
		}
		if p.HasSMUtil && busy == nil {
			busy = make(map[string]int64)
		}
		if owner, ok := owners[res]; ok {
			used[shareOwner(owner)] += p.UsedBytes
			if p.HasSMUtil {
				busy[shareOwner(owner)] += int64(p.SMUtil)
			}
		}
	}
	return used, busy
}

// The share a workload holds of a time-sliced device (devicehost_share_compute_ratio).
const (
	shareRatioName = "devicehost_share_compute_ratio"
	shareRatioHelp = "The share of the device's compute its shares give this workload (time-sliced replicas: the slices it holds over the device's), on the dcgm-exporter labels of the device and the workload."
)

// The device memory a workload's MPS shares may pin (devicehost_share_memory_limit_bytes).
const (
	shareMemoryName = "devicehost_share_memory_limit_bytes"
	shareMemoryHelp = "The device memory this workload's MPS shares may use (their group's memory attribute, summed over the shares it holds), on the dcgm-exporter labels of the device and the workload."
)

// share is one workload's part of a device: its owner, the ratio of the device it
// holds (negative: the whole device, or none known), and the memory its MPS shares
// may use (0: no limit known).
type share struct {
	owner    string
	labels   device.OwnerLabels // the holder's
	ratio    float64
	memBytes float64
}

// mpsShareLimit is the memory one device of an MPS share group (type or name ending in
// ".mps", as the nvidia-example plugin's gpu.mps and mig/<profile>.mps) may use: its
// group's memory attribute, in MiB; 0 for other groups.
func mpsShareLimit(g device.Group) float64 {
	if !strings.HasSuffix(g.Type, ".mps") && !strings.HasSuffix(g.Name, ".mps") {
		return 0
	}
	if v, ok := g.Attributes["memory"]; ok && v.Kind == device.KindInt && v.Unit == "MiB" && v.Int > 0 {
		return float64(v.Int) * (1 << 20)
	}
	return 0
}

// sharesOf finds, for each device with stats of its own, the workloads that hold
// shares of it: held devices without stats of their own (time-sliced replicas, MPS
// shares) that consume every counter of the counter set named after it, each holder's
// ratio the largest of the counters' use over capacity, summed over its shares. Holders whose owners give no
// dcgm labels are folded into one set with no owner. Sorted by owner.
func sharesOf(snap device.Snapshot, stats device.StatsSnapshot) map[string][]share {
	withStats := make(map[string]bool)
	for _, g := range stats.Groups {
		for _, d := range g.Devices {
			withStats[d.ID] = true
		}
	}
	caps := make(map[device.CounterSetKey]map[string]int64, len(snap.Inventory.CounterSets))
	for _, cs := range snap.Inventory.CounterSets {
		caps[cs.Key] = cs.Capacity
	}
	byDevice := make(map[string]map[string]share) // device ID -> owner -> its share
	for _, g := range snap.Inventory.Groups {
		limit := mpsShareLimit(g)
		for _, d := range g.Devices {
			h := snap.State.Devices[d.ID].Holder
			if h == nil || withStats[d.ID] {
				continue
			}
			for _, c := range d.Consumes {
				if !withStats[c.Set.Name] || c.Set.Plugin != g.Plugin || !drawsOnAll(c, caps[c.Set]) {
					continue
				}
				ratio := 0.0
				for k, n := range c.Counters {
					if capacity := caps[c.Set][k]; capacity > 0 {
						ratio = max(ratio, float64(n)/float64(capacity))
					}
				}
				owner := shareOwner(h.OwnerID)
				if byDevice[c.Set.Name] == nil {
					byDevice[c.Set.Name] = make(map[string]share)
				}
				sh := byDevice[c.Set.Name][owner]
				sh.owner, sh.ratio, sh.memBytes = owner, sh.ratio+ratio, sh.memBytes+limit
				if owner != "" {
					sh.labels = h.OwnerLabels // one owner's reservations: the DRA driver gives each the same
				}
				byDevice[c.Set.Name][owner] = sh
			}
		}
	}
	out := make(map[string][]share, len(byDevice))
	for id, owners := range byDevice {
		for _, owner := range slices.Sorted(maps.Keys(owners)) {
			out[id] = append(out[id], owners[owner])
		}
	}
	return out
}

// shareOwner is the key of owner's set of series on a shared device: owner, or "" for
// an owner whose ID gives no holder labels (all such holders share one set).
func shareOwner(owner string) string {
	if names, _ := holderLabels(owner, device.OwnerLabels{}); len(names) == 0 {
		return ""
	}
	return owner
}

// drawsOnAll says whether c draws on every counter of its set (capacity caps), or on
// the set as one sharing mode's (c has compatibility groups: a GPU offered time-sliced
// and in MPS shares, each mode on counters of its own): a share of the device the set
// is named after. A share of an on-demand MIG placement draws on that placement's
// slices of its GPU's set only; its workload is no share of the GPU's series.
func drawsOnAll(c device.Consumption, caps map[string]int64) bool {
	if len(c.Groups) > 0 {
		return true
	}
	for k := range caps {
		if _, ok := c.Counters[k]; !ok {
			return false
		}
	}
	return true
}

// groupID names a group of one plugin.
type groupID struct {
	plugin string
	key    device.GroupKey
}

// dcgmDevice is how one device's stats are exported under dcgm-exporter's names.
type dcgmDevice struct {
	use           bool     // its mapped stats get dcgm-exporter's names
	mig           bool     // a GPU instance: the MIG stats are labels too
	invalid       bool     // a label from a plugin string is not fit to be one
	names, values []string // the labels
}

// isLabel says whether a stat of the device is one of its labels rather than a series.
func (l dcgmDevice) isLabel(stat string) bool {
	return stat == dcgmIndexStat || l.mig && (stat == dcgmInstanceStat || stat == dcgmParentStat)
}

// dcgmLabelsOf returns dcgm-exporter's labels of device d of group g, at PCI bus ID
// busID, whose group's GPU model (MIG groups) is model.
//
// A GPU (nvidia/gpu) is labelled as dcgm-exporter labels a GPU: gpu from its index
// stat, UUID its device ID, modelName its group's name. A MIG device (nvidia/mig/
// <profile>) is labelled as dcgm-exporter labels a GPU instance: its GPU's gpu, UUID
// (the gpu_uuid stat; the device ID when there is none), device, modelName (the group's
// gpu_model attribute) and pci_bus_id, plus GPU_I_PROFILE (the group's name) and
// GPU_I_ID (the gpu_instance_id stat). A MIG device without a gpu_instance_id (no
// instance, or not an integer of 0 or more) is not a GPU instance: its stats keep
// devicehost's names.
func (s *scrape) dcgmLabelsOf(g device.GroupStats, d device.DeviceStats, busID string, model device.Value) dcgmDevice {
	if !isDCGMGroup(g.GroupKey) {
		return dcgmDevice{}
	}
	index := ""
	if v, ok := number(d.Values[dcgmIndexStat]); ok {
		index = strconv.FormatInt(int64(v), 10)
	}
	dev := ""
	if index != "" {
		dev = "nvidia" + index
	}
	if !isMIGGroup(g.GroupKey) {
		return dcgmDevice{use: true, names: dcgmLabels, values: []string{index, d.ID, dev, g.Name, dcgmBusID(busID), s.c.hostname}}
	}
	gi := d.Values[dcgmInstanceStat]
	if gi.Kind != device.KindInt || gi.Int < 0 {
		return dcgmDevice{}
	}
	l := dcgmDevice{use: true, mig: true, names: dcgmMIGLabels}
	uuid := d.ID
	if v, ok := d.Values[dcgmParentStat]; ok {
		uuid = v.Str
		l.invalid = v.Kind != device.KindString || uuid == "" || !labelValue(uuid)
	}
	if model.Kind != device.KindUnset && (model.Kind != device.KindString || !labelValue(model.Str)) {
		l.invalid = true
	}
	l.values = []string{index, uuid, dev, model.Str, dcgmBusID(busID), g.Name, strconv.FormatInt(gi.Int, 10), s.c.hostname}
	return l
}

func (s *scrape) dcgmSeries(plugin string, f dcgmField, v device.Value, labelNames, labels []string) {
	x, ok := number(v)
	if !ok {
		s.drop(plugin, dropNotANumber)
		return
	}
	to := f.unit
	if to == dcgmRatio {
		to = "%"
	}
	if x, ok = convert(x, v.Unit, to); !ok {
		s.drop(plugin, dropUnit)
		return
	}
	if f.unit == dcgmRatio {
		x /= 100
	}
	s.emit(plugin, f.name, f.help, f.typ, labelNames, labels, x)
}

func (s *scrape) statSeries(g device.GroupStats, id, stat string, v device.Value) {
	x, ok := number(v)
	if !ok {
		s.drop(g.Plugin, dropNotANumber)
		return
	}
	u, ok := validate.LookupUnit(v.Unit)
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
		[]string{g.Plugin, g.Vendor, g.Type, g.Name, id}, x*u.Factor)
}

// emit sends one stat series of plugin, unless the plugin is at its limit, the series
// was sent already, or its family disagrees with an earlier series of that name.
func (s *scrape) emit(plugin, name, help string, typ prometheus.ValueType, labelNames, labelValues []string, v float64) {
	if s.series[plugin] >= s.c.maxSeries {
		s.drop(plugin, dropLimit)
		return
	}
	joined := strings.Join(labelNames, ",")
	key := name + "\xff" + joined + "\xff" + strings.Join(labelValues, "\xff")
	if s.seen[key] {
		s.drop(plugin, dropDuplicate)
		return
	}
	fam, ok := s.families[name]
	switch {
	case !ok:
		fam = family{help: help, typ: typ, descs: make(map[string]*prometheus.Desc)}
		s.families[name] = fam
	case fam.help != help || fam.typ != typ:
		s.drop(plugin, dropConflict)
		return
	}
	desc, ok := fam.descs[joined]
	if !ok {
		desc = prometheus.NewDesc(name, help, labelNames, nil)
		fam.descs[joined] = desc
	}
	m, err := prometheus.NewConstMetric(desc, typ, v, labelValues...)
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

// holderLabels are the labels dcgm-exporter gives the workload of a device, from its
// holder's owner ID (docs/reservations.md, owner IDs): pod, namespace and container of
// a kubelet bridge's container (k8s/<namespace>/<pod>/<container>); dra_claim_name and
// dra_claim_namespace of a DRA claim (k8s-claim/<namespace>/<claim>/<uid>), with pod
// and namespace from the reservation's owner labels where the driver gave them (the
// pods the claim is reserved for); nomad_namespace, nomad_job, nomad_alloc_id and
// nomad_task of a Nomad task (nomad/<namespace>/<job>/<alloc>/<task>). Other owners get
// none.
func holderLabels(owner string, ownerLabels device.OwnerLabels) (names, values []string) {
	parts := strings.Split(owner, "/")
	switch {
	case len(parts) == 4 && parts[0] == "k8s":
		return []string{"pod", "namespace", "container"}, []string{parts[2], parts[1], parts[3]}
	case len(parts) == 4 && parts[0] == "k8s-claim":
		names, values = []string{"dra_claim_name", "dra_claim_namespace"}, []string{parts[2], parts[1]}
		if ownerLabels.Pod != "" {
			names, values = append(names, "pod"), append(values, ownerLabels.Pod)
		}
		if ownerLabels.Namespace != "" {
			names, values = append(names, "namespace"), append(values, ownerLabels.Namespace)
		}
		return names, values
	case len(parts) == 5 && parts[0] == "nomad":
		return []string{"nomad_namespace", "nomad_job", "nomad_alloc_id", "nomad_task"}, parts[1:5]
	}
	return nil, nil
}
