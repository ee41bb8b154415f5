package nvidia

import (
	"cmp"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/deviceplugin/cdi"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// gpu is one GPU NVML reports.
type gpu struct {
	index int
	uuid  string
	dev   nvml.Device
}

// listGPUs returns NVML's GPUs in index order, leaving out ignored ones. A GPU whose
// handle or UUID cannot be read is left out too and described in problems; err is set
// only when NVML cannot count its GPUs.
func (rt *runtime) listGPUs() (gpus []gpu, problems []error, err error) {
	n, ret := rt.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, nil, fmt.Errorf("nvml: counting GPUs: %w", ret)
	}
	for i := range n {
		dev, ret := rt.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			problems = append(problems, fmt.Errorf("nvml: GPU %d: handle: %w", i, ret))
			continue
		}
		id, ret := dev.GetUUID()
		if ret != nvml.SUCCESS {
			problems = append(problems, fmt.Errorf("nvml: GPU %d: UUID: %w", i, ret))
			continue
		}
		if rt.ignored[id] {
			continue
		}
		gpus = append(gpus, gpu{index: i, uuid: id, dev: dev})
	}
	return gpus, problems, nil
}

// inventory is one reading of the GPUs' static facts and of how each is offered.
type inventory struct {
	gpus    []gpu
	descs   []gpuDesc // same order as gpus
	plans   []gpuPlan // same order as gpus
	targets map[string]target
	at      time.Time
}

// target is what a device ID reserves.
type target struct {
	kind      targetKind
	gpu       int         // index into inventory.gpus
	profile   *migProfile // targetPartition, and targetMPS of a partition
	placement nvml.GpuInstancePlacement
	uuid      string    // what NVIDIA_VISIBLE_DEVICES names: the GPU's or the MIG device's ("" for a partition: made at Reserve)
	mps       mpsLimits // targetMPS: what the share may use
	divides   string    // targetMPS: the device the share is of (a GPU's or static MIG device's UUID, or a partition's ID)
}

// onDemand says whether the target is of an on-demand MIG placement, whose instance
// exists only while something holds it.
func (t target) onDemand() bool {
	return t.kind == targetPartition || t.kind == targetMPS && t.uuid == ""
}

type targetKind int

const (
	targetGPU       targetKind = iota // the whole GPU
	targetReplica                     // a time-sliced replica
	targetPartition                   // an on-demand MIG device
	targetStatic                      // a MIG device of a static layout
	targetMPS                         // an MPS share of a GPU, a static MIG device or an on-demand placement
)

// String names the kind for a refusal: "a whole GPU", "an MPS share"...
func (k targetKind) String() string {
	switch k {
	case targetGPU:
		return "a whole GPU"
	case targetReplica:
		return "a time-sliced replica"
	case targetPartition:
		return "an on-demand MIG device"
	case targetStatic:
		return "a MIG device"
	case targetMPS:
		return "an MPS share"
	}
	return "a device"
}

// gpuDesc is what a fingerprint says about one GPU.
type gpuDesc struct {
	id       string
	name     string
	attrs    map[string]*pb.Value
	locality *pb.Locality
}

// scan reads every GPU's static facts. Unreadable GPUs and attributes are logged and
// left out; the error is NVML failing to count GPUs at all.
func (rt *runtime) scan() (*inventory, error) {
	gpus, problems, err := rt.listGPUs()
	if err != nil {
		return nil, err
	}
	for _, p := range problems {
		rt.logger.Warn("GPU left out of the fingerprint", "error", p)
	}
	driver, ret := rt.lib.SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		rt.logger.Debug("driver version unknown", "error", ret)
		driver = ""
	}
	cuda := ""
	if v, ret := rt.lib.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS && v > 0 {
		cuda = fmt.Sprintf("%d.%d", v/1000, v%1000/10) // 12040 is CUDA 12.4
	} else {
		rt.logger.Debug("CUDA version unknown", "error", ret)
	}
	inv := &inventory{gpus: gpus, targets: make(map[string]target), at: rt.clock.Now()}
	for i, g := range gpus {
		inv.descs = append(inv.descs, rt.describe(g, driver, cuda))
		plan := rt.planGPU(g)
		inv.plans = append(inv.plans, plan)
		switch plan.mode {
		case modeStatic:
			for _, m := range plan.static {
				inv.targets[m.uuid] = target{kind: targetStatic, gpu: i, profile: m.profile, placement: m.placement, uuid: m.uuid}
				if plan.mps > 0 && m.profile != nil {
					share := mpsShare(int64(m.profile.info.MemorySizeMB), plan.mps)
					for k := range plan.mps {
						inv.targets[mpsShareID(m.uuid, k)] = target{kind: targetMPS, gpu: i, uuid: m.uuid, mps: share, divides: m.uuid}
					}
				}
			}
			continue // the whole GPU is carved up
		case modeOnDemand:
			for _, prof := range plan.offered {
				share := mpsShare(int64(prof.info.MemorySizeMB), plan.mps)
				for _, pl := range prof.placements {
					id := partitionID(g.uuid, prof.name, pl.Start)
					inv.targets[id] = target{kind: targetPartition, gpu: i, profile: prof, placement: pl}
					for k := range plan.mps {
						inv.targets[mpsShareID(id, k)] = target{kind: targetMPS, gpu: i, profile: prof, placement: pl, mps: share, divides: id}
					}
				}
			}
		}
		inv.targets[g.uuid] = target{kind: targetGPU, gpu: i, uuid: g.uuid}
		for k := range plan.replicas {
			inv.targets[replicaID(g.uuid, k)] = target{kind: targetReplica, gpu: i, uuid: g.uuid}
		}
		if plan.mode == modeWhole {
			for k := range plan.mps {
				inv.targets[mpsShareID(g.uuid, k)] = target{kind: targetMPS, gpu: i, uuid: g.uuid, mps: mpsShare(plan.memMiB, plan.mps), divides: g.uuid}
			}
		}
	}
	rt.latest.Store(inv)
	return inv, nil
}

// current returns the latest scan, scanning again when there is none or it is older
// than fingerprint_period.
func (rt *runtime) current() (*inventory, error) {
	if inv := rt.latest.Load(); inv != nil && rt.clock.Now().Sub(inv.at) < rt.fingerprintPeriod {
		return inv, nil
	}
	return rt.scan()
}

// Units of the values this plugin reports.
const (
	unitMiB     = "MiB"
	unitMHz     = "MHz"
	unitWatt    = "W"
	unitMBps    = "MB/s"
	unitPercent = "%"
	unitCelsius = "C"
	unitCount   = "count"
)

// pcieLaneMBps is the usable bandwidth of one PCIe lane in MB/s, by generation.
var pcieLaneMBps = map[int]int64{1: 250, 2: 500, 3: 985, 4: 1969, 5: 3938, 6: 7563}

// describe reads g's static facts: its name and attributes (driver and cuda, the
// system's driver and CUDA versions, are attributes of every GPU; "" leaves them out).
func (rt *runtime) describe(g gpu, driver, cuda string) gpuDesc {
	d := gpuDesc{id: g.uuid, attrs: make(map[string]*pb.Value)}
	miss := func(what string, ret nvml.Return) {
		rt.logger.Debug("GPU attribute unavailable", "gpu", g.uuid, "attribute", what, "error", ret)
	}
	var ret nvml.Return
	if d.name, ret = g.dev.GetName(); ret != nvml.SUCCESS || d.name == "" {
		miss("name", ret)
		d.name = "NVIDIA GPU"
	}
	if mem, ret := g.dev.GetMemoryInfo(); ret == nvml.SUCCESS {
		d.attrs["memory"] = intValue(int64(mem.Total>>20), unitMiB)
	} else {
		miss("memory", ret)
	}
	if mw, ret := g.dev.GetPowerManagementLimit(); ret == nvml.SUCCESS {
		d.attrs["power_limit"] = intValue(int64(mw/1000), unitWatt)
	} else {
		miss("power_limit", ret)
	}
	if bar1, ret := g.dev.GetBAR1MemoryInfo(); ret == nvml.SUCCESS {
		d.attrs["bar1"] = intValue(int64(bar1.Bar1Total>>20), unitMiB)
	} else {
		miss("bar1", ret)
	}
	if mhz, ret := g.dev.GetMaxClockInfo(nvml.CLOCK_SM); ret == nvml.SUCCESS {
		d.attrs["sm_clock"] = intValue(int64(mhz), unitMHz)
	} else {
		miss("sm_clock", ret)
	}
	if mhz, ret := g.dev.GetMaxClockInfo(nvml.CLOCK_MEM); ret == nvml.SUCCESS {
		d.attrs["memory_clock"] = intValue(int64(mhz), unitMHz)
	} else {
		miss("memory_clock", ret)
	}
	if gen, ret := g.dev.GetMaxPcieLinkGeneration(); ret != nvml.SUCCESS {
		miss("pci_bandwidth", ret)
	} else if width, ret := g.dev.GetMaxPcieLinkWidth(); ret != nvml.SUCCESS {
		miss("pci_bandwidth", ret)
	} else if lane, ok := pcieLaneMBps[gen]; ok && width > 0 {
		d.attrs["pci_bandwidth"] = intValue(lane*int64(width), unitMBps)
	}
	if driver != "" {
		d.attrs["driver_version"] = stringValue(driver)
	}
	if cuda != "" {
		d.attrs["cuda_version"] = stringValue(cuda)
	}
	// NVML answers MIG mode on GPUs that can run MIG, NOT_SUPPORTED on the others.
	_, _, ret = g.dev.GetMigMode()
	d.attrs["mig_capable"] = boolValue(ret == nvml.SUCCESS)
	if major, minor, ret := g.dev.GetCudaComputeCapability(); ret == nvml.SUCCESS {
		d.attrs["compute_capability"] = stringValue(fmt.Sprintf("%d.%d", major, minor))
	} else {
		miss("compute_capability", ret)
	}

	d.locality = &pb.Locality{NumaNode: -1}
	if pci, ret := g.dev.GetPciInfo(); ret == nvml.SUCCESS {
		d.locality.PciBusId = normalizeBusID(cString(pci.BusId[:]))
	} else {
		miss("pci_bus_id", ret)
	}
	d.locality.NumaNode = rt.numaNode(g, d.locality.PciBusId)
	return d
}

// numaNode asks NVML for the GPU's NUMA node when the driver has the call, else
// sysfs; -1 when neither knows.
func (rt *runtime) numaNode(g gpu, busID string) int32 {
	if rt.numaFromNVML {
		if n, ret := g.dev.GetNumaNodeId(); ret == nvml.SUCCESS && n >= 0 {
			return int32(n)
		}
	}
	if busID == "" {
		return -1
	}
	raw, err := os.ReadFile(filepath.Join("/sys/bus/pci/devices", busID, "numa_node"))
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil || n < 0 {
		return -1
	}
	return int32(n)
}

// fingerprint builds the message for the inventory with health at now: one group per
// product name for whole GPUs (nvidia/gpu/<name>), their replicas
// (nvidia/gpu.shared/<name>) and their MPS shares (nvidia/gpu.mps/<name>), one per MIG
// profile (nvidia/mig/<profile>) and its MPS shares (nvidia/mig/<profile>.mps), and a
// counter set per GPU whose devices share it (and per static MIG device with shares).
// An MPS share is unhealthy while its control daemon is down (mps may be nil). A partition's health is its GPU's. recovery is
// the earliest time an unhealthy GPU turns healthy (zero when none is unhealthy).
// With cdiNames (the plugin keeps a CDI spec) every device but an on-demand MIG
// partition carries its CDI name, which its spec resolves whoever holds it; a
// partition's instance exists only while it is reserved.
func (inv *inventory) fingerprint(h *healthBook, now time.Time, cdiNames bool, mps *mpsSupervisor) (resp *pb.FingerprintResponse, recovery time.Time) {
	type key struct{ typ, name string }
	groups := make(map[key]*pb.DeviceGroup)
	add := func(typ, name string, attrs func() map[string]*pb.Value, dev *pb.Device) {
		k := key{typ, name}
		g, ok := groups[k]
		if !ok {
			// Every device of one group shares these facts; the first one speaks for all.
			g = &pb.DeviceGroup{Vendor: "nvidia", Type: typ, Name: name, Attributes: attrs()}
			groups[k] = g
		}
		g.Devices = append(g.Devices, dev)
	}
	resp = &pb.FingerprintResponse{}
	for i, d := range inv.descs {
		plan := &inv.plans[i]
		healthy, reason, until := h.status(d.id, now)
		if !healthy && !until.IsZero() && (recovery.IsZero() || until.Before(recovery)) {
			recovery = until
		}
		// A device is handed out as it is (Release has nothing to do for it) unless it
		// is an MPS share or an on-demand MIG placement, below.
		deviceIn := func(id, set string, use map[string]int64) *pb.Device {
			dev := &pb.Device{Id: id, Health: pb.Health_HEALTH_HEALTHY, Locality: d.locality, NothingToRelease: true}
			if !healthy {
				dev.Health = pb.Health_HEALTH_UNHEALTHY
				dev.HealthReason = reason
			}
			if use != nil {
				dev.Consumes = []*pb.CounterConsumption{{CounterSet: set, Counters: use}}
			}
			if cdiNames {
				dev.CdiDevices = []string{cdi.Name(cdiKind, id)}
			}
			return dev
		}
		device := func(id string, use map[string]int64) *pb.Device { return deviceIn(id, d.id, use) }
		// share is MPS share k of the device divided (the GPU, a static MIG device or an
		// on-demand placement), consuming use of counter set set.
		share := func(divided string, k int, set string, use map[string]int64) *pb.Device {
			dev := deviceIn(mpsShareID(divided, k), set, use)
			dev.NothingToRelease = false // Release stops its daemon when it is the last share
			if dev.Health == pb.Health_HEALTH_HEALTHY {
				if ok, why := mps.health(dev.Id, divided); !ok {
					dev.Health, dev.HealthReason = pb.Health_HEALTH_UNHEALTHY, why
				}
			}
			return dev
		}
		shareAttrs := func(base map[string]*pb.Value, l mpsLimits) map[string]*pb.Value {
			a := maps.Clone(base)
			a["memory"] = intValue(l.MemMiB, unitMiB)
			a["mps_shares"] = intValue(int64(plan.mps), "")
			a["mps_active_thread_percentage"] = intValue(int64(l.Threads), unitPercent)
			return a
		}
		var whole map[string]int64
		if plan.hasCounters() {
			resp.CounterSets = append(resp.CounterSets, &pb.CounterSet{Name: d.id, Counters: plan.counters()})
			whole = plan.counters() // the whole GPU takes everything
		}
		gpuAttrs := func() map[string]*pb.Value { return d.attrs }
		switch plan.mode {
		case modeStatic:
			for _, m := range plan.static {
				if plan.mps == 0 || m.profile == nil {
					add("mig", migGroupName(m.profile), func() map[string]*pb.Value { return migAttrs(m.profile, d) }, device(m.uuid, nil))
					continue
				}
				l := mpsShare(int64(m.profile.info.MemorySizeMB), plan.mps)
				resp.CounterSets = append(resp.CounterSets, &pb.CounterSet{Name: m.uuid, Counters: l.times(plan.mps).counters()})
				add("mig", migGroupName(m.profile), func() map[string]*pb.Value { return migAttrs(m.profile, d) },
					deviceIn(m.uuid, m.uuid, l.times(plan.mps).counters()))
				for k := range plan.mps {
					add("mig", migGroupName(m.profile)+".mps", func() map[string]*pb.Value { return shareAttrs(migAttrs(m.profile, d), l) },
						share(m.uuid, k, m.uuid, l.counters()))
				}
			}
			continue
		case modeOnDemand:
			for _, prof := range plan.offered {
				l := mpsShare(int64(prof.info.MemorySizeMB), plan.mps)
				for _, pl := range prof.placements {
					id := partitionID(d.id, prof.name, pl.Start)
					dev := device(id, partitionUse(prof, pl, plan.partitionScale()))
					dev.CdiDevices = nil
					dev.NothingToRelease = false // Release destroys the instance Reserve made
					add("mig", prof.name, func() map[string]*pb.Value { return migAttrs(prof, d) }, dev)
					for k := range plan.mps {
						sh := share(id, k, d.id, partitionUse(prof, pl, 1))
						sh.CdiDevices = nil
						add("mig", prof.name+".mps", func() map[string]*pb.Value { return shareAttrs(migAttrs(prof, d), l) }, sh)
					}
				}
			}
		}
		add("gpu", d.name, gpuAttrs, device(d.id, whole))
		// A GPU offered both time-sliced and in MPS shares serves one mode at a time:
		// each mode's uses of its counters carry a compatibility group of their own.
		both := plan.mode == modeWhole && plan.replicas > 0 && plan.mps > 0
		grouped := func(dev *pb.Device, group string) *pb.Device {
			if both {
				dev.Consumes[0].CompatibilityGroups = []string{group}
			}
			return dev
		}
		for k := range plan.replicas {
			add("gpu.shared", d.name, func() map[string]*pb.Value {
				a := maps.Clone(d.attrs)
				a["replicas"] = intValue(int64(plan.replicas), "")
				return a
			}, grouped(device(replicaID(d.id, k), map[string]int64{counterTimeSlices: 1}), groupTimeSlicing))
		}
		if plan.mode == modeWhole {
			l := mpsShare(plan.memMiB, plan.mps)
			for k := range plan.mps {
				add("gpu.mps", d.name, func() map[string]*pb.Value { return shareAttrs(d.attrs, l) },
					grouped(share(d.id, k, d.id, l.counters()), groupMPS))
			}
		}
	}
	for _, g := range groups {
		g.Attributes = maps.Clone(g.Attributes) // the GPU's own map is shared between fingerprints
		g.Attributes["sharing"] = stringValue(sharingOf(g))
		resp.Groups = append(resp.Groups, g)
	}
	slices.SortFunc(resp.Groups, func(a, b *pb.DeviceGroup) int {
		return cmp.Or(strings.Compare(a.Type, b.Type), strings.Compare(a.Name, b.Name))
	})
	return resp, recovery
}

// sharingOf is how a group's devices are held, as its "sharing" attribute says, so that
// a selector or constraint can name the mode: "time-slicing" (replicas), "mps" (MPS
// shares) or "exclusive" (a whole GPU or MIG device).
func sharingOf(g *pb.DeviceGroup) string {
	switch {
	case g.GetType() == "gpu.shared":
		return SharingTimeSlicing
	case strings.HasSuffix(g.GetType(), ".mps") || strings.HasSuffix(g.GetName(), ".mps"):
		return SharingMPS
	}
	return "exclusive"
}

// migGroupName is the group of a MIG device of profile p ("unknown" when the plugin
// could not read it).
func migGroupName(p *migProfile) string {
	if p == nil {
		return "unknown"
	}
	return p.name
}

// migAttrs are the attributes of a MIG profile's group on the GPU d describes.
func migAttrs(p *migProfile, d gpuDesc) map[string]*pb.Value {
	a := map[string]*pb.Value{"gpu_model": stringValue(d.name)}
	for _, k := range []string{"driver_version", "cuda_version", "compute_capability"} {
		if v, ok := d.attrs[k]; ok {
			a[k] = v
		}
	}
	if p != nil {
		a["memory"] = intValue(int64(p.info.MemorySizeMB), unitMiB)
		a["multiprocessors"] = intValue(int64(p.info.MultiprocessorCount), "")
		a["compute_slices"] = intValue(int64(p.info.SliceCount), "")
	}
	return a
}

// sample reads every GPU's stats, and every MIG device's that exists, stamped now.
// Values a device cannot give are left out; gpm reads tensor activity, which needs a
// sample before (see gpmSampler).
//
// Besides the load figures, each GPU reports "index" (its NVML index, as nvidia-smi
// and dcgm-exporter's gpu label number GPUs; it is not always the /dev/nvidiaN minor)
// and "last_xid" (the last XID event it raised while a Fingerprint stream watched it,
// critical or application, 0 when none: DCGM's XID_ERRORS field), so the host's
// metrics can carry dcgm-exporter's names and labels. A MIG device (a static layout's,
// or an on-demand device whose instance exists) reports its GPU's index, temperature,
// power, clocks, XID and ECC figures, as DCGM reports them for a GPU instance, with
// "gpu_uuid" (its GPU's UUID), "gpu_instance_id" (its GPU instance's ID), its own
// memory and tensor activity; it has no utilization (NVML has none in MIG mode).
func (rt *runtime) sample(now time.Time, gpm *gpmSampler) (*pb.StatsResponse, error) {
	gpus, _, err := rt.listGPUs()
	if err != nil {
		return nil, err
	}
	plans := make(map[string]*gpuPlan)
	if inv, err := rt.current(); err == nil {
		for i, g := range inv.gpus {
			plans[g.uuid] = &inv.plans[i]
		}
	}
	ts := timestamppb.New(now)
	resp := &pb.StatsResponse{}
	if sim, ok := rt.lib.(interface{ rescanProcesses() }); ok {
		sim.rescanProcesses()
	}
	for _, g := range gpus {
		plan := plans[g.uuid]
		shared := rt.gpuStats(g)
		v := maps.Clone(shared)
		if u, ret := g.dev.GetUtilizationRates(); ret == nvml.SUCCESS {
			v["gpu_utilization"] = intValue(int64(u.Gpu), unitPercent)
			v["memory_utilization"] = intValue(int64(u.Memory), unitPercent)
		}
		addMemory(v, g.dev)
		// A static layout's GPU is no device of its own: no GPM samples for it.
		if plan == nil || plan.mode != modeStatic {
			if pct, ok := gpm.tensorActive(g, wholeGPU); ok {
				v["tensor_active"] = floatValue(pct, unitPercent)
			}
		}
		resp.Devices = append(resp.Devices, &pb.DeviceStats{DeviceId: g.uuid, Values: v, Timestamp: ts, Processes: processesOf(g.dev)})
		if plan == nil || plan.mode == modeWhole {
			continue
		}
		for _, m := range readMIGDevices(g, plan.profiles) {
			id := m.uuid
			if plan.mode == modeOnDemand {
				if m.profile == nil {
					continue // not at a placement the plugin offers
				}
				id = partitionID(g.uuid, m.profile.name, m.placement.Start)
			}
			mv := maps.Clone(shared)
			mv["gpu_uuid"] = stringValue(g.uuid)
			mv["gpu_instance_id"] = intValue(int64(m.gi), "")
			if m.dev != nil {
				addMemory(mv, m.dev)
			}
			if pct, ok := gpm.tensorActive(g, m.gi); ok {
				mv["tensor_active"] = floatValue(pct, unitPercent)
			}
			var procs []*pb.ProcessMemory
			if m.dev != nil {
				procs = processesOf(m.dev)
			}
			resp.Devices = append(resp.Devices, &pb.DeviceStats{DeviceId: id, Values: mv, Timestamp: ts, Processes: procs})
		}
	}
	gpm.endRound()
	return resp, nil
}

// gpuStats are the stats of g that its MIG devices share with it: index, last XID,
// clocks, temperature, power and ECC counts.
func (rt *runtime) gpuStats(g gpu) map[string]*pb.Value {
	v := map[string]*pb.Value{
		"index":    intValue(int64(g.index), ""),
		"last_xid": intValue(int64(rt.health.lastXID(g.uuid)), ""),
	}
	if mhz, ret := g.dev.GetClockInfo(nvml.CLOCK_SM); ret == nvml.SUCCESS {
		v["sm_clock"] = intValue(int64(mhz), unitMHz)
	}
	if mhz, ret := g.dev.GetClockInfo(nvml.CLOCK_MEM); ret == nvml.SUCCESS {
		v["memory_clock"] = intValue(int64(mhz), unitMHz)
	}
	if c, ret := g.dev.GetTemperature(nvml.TEMPERATURE_GPU); ret == nvml.SUCCESS {
		v["temperature"] = intValue(int64(c), unitCelsius)
	}
	if mw, ret := g.dev.GetPowerUsage(); ret == nvml.SUCCESS {
		v["power"] = floatValue(float64(mw)/1000, unitWatt)
	}
	if n, ret := g.dev.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC); ret == nvml.SUCCESS {
		v["ecc_errors_corrected"] = intValue(int64(n), unitCount)
	}
	if n, ret := g.dev.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); ret == nvml.SUCCESS {
		v["ecc_errors_uncorrected"] = intValue(int64(n), unitCount)
	}
	return v
}

// maxProcesses is the most processes a device's stats report (the host's bound).
const maxProcesses = 64

// processesOf returns the compute processes on dev (a GPU or a MIG device) and the
// memory each uses, as NVML reports them: a PID listed twice (once per compute
// instance) once with its memory summed, a use NVML cannot tell (its "not available"
// value) as 0, at most maxProcesses, lowest PIDs first; none when NVML cannot say.
func processesOf(dev nvml.Device) []*pb.ProcessMemory {
	infos, ret := dev.GetComputeRunningProcesses()
	if ret != nvml.SUCCESS || len(infos) == 0 {
		return nil
	}
	used := make(map[uint32]int64, len(infos))
	for _, p := range infos {
		if p.Pid == 0 {
			continue
		}
		b := p.UsedGpuMemory
		if b > 1<<50 { // NVML's "not available"
			b = 0
		}
		used[p.Pid] += int64(b)
	}
	pids := slices.Sorted(maps.Keys(used))
	if len(pids) > maxProcesses {
		pids = pids[:maxProcesses]
	}
	util := smUtilOf(dev)
	out := make([]*pb.ProcessMemory, len(pids))
	for i, pid := range pids {
		out[i] = &pb.ProcessMemory{Pid: pid, UsedBytes: min(used[pid], 1<<50)}
		if util != nil { // NVML sampled the device: a process without a sample ran no kernel
			u := util[pid]
			out[i].SmUtilization = &u
		}
	}
	return out
}

// smUtilOf returns each process's share of dev's SMs in NVML's latest utilization
// sample of it (capped at 100 %); nil where NVML has none (a MIG device, no samples).
func smUtilOf(dev nvml.Device) map[uint32]uint32 {
	samples, ret := dev.GetProcessUtilization(0)
	if ret != nvml.SUCCESS {
		return nil
	}
	latest := make(map[uint32]nvml.ProcessUtilizationSample, len(samples))
	for _, s := range samples {
		if l, ok := latest[s.Pid]; !ok || s.TimeStamp > l.TimeStamp {
			latest[s.Pid] = s
		}
	}
	out := make(map[uint32]uint32, len(latest))
	for pid, s := range latest {
		out[pid] = min(s.SmUtil, 100)
	}
	return out
}

// addMemory adds dev's memory use (a GPU's, or a MIG device's own) to v.
func addMemory(v map[string]*pb.Value, dev nvml.Device) {
	if m, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
		v["memory_used"] = intValue(int64(m.Used>>20), unitMiB)
		v["memory_free"] = intValue(int64(m.Free>>20), unitMiB)
		v["memory_total"] = intValue(int64(m.Total>>20), unitMiB)
	}
}

func intValue(n int64, unit string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_IntValue{IntValue: n}, Unit: unit}
}

func floatValue(f float64, unit string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: f}, Unit: unit}
}

func boolValue(b bool) *pb.Value {
	return &pb.Value{Kind: &pb.Value_BoolValue{BoolValue: b}}
}

func stringValue(s string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_StringValue{StringValue: s}}
}

func protoEqual(a, b proto.Message) bool { return proto.Equal(a, b) }

// cString turns a NUL-terminated C char array into a string.
func cString(chars []int8) string {
	b := make([]byte, 0, len(chars))
	for _, c := range chars {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

// normalizeBusID turns NVML's "00000000:1B:00.0" into the sysfs form "0000:1b:00.0".
// Anything it cannot parse comes back lower-cased.
func normalizeBusID(id string) string {
	var domain, bus, dev, fn uint64
	if _, err := fmt.Sscanf(id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn); err != nil {
		return strings.ToLower(id)
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", domain, bus, dev, fn)
}
