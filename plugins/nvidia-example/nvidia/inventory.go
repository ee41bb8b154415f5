package nvidia

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

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

// inventory is one reading of the GPUs' static facts.
type inventory struct {
	gpus  []gpu
	descs []gpuDesc // same order as gpus
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
	inv := &inventory{gpus: gpus}
	for _, g := range gpus {
		inv.descs = append(inv.descs, rt.describe(g, driver))
	}
	return inv, nil
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

func (rt *runtime) describe(g gpu, driver string) gpuDesc {
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

// fingerprint builds the message for the inventory with health at now, one group per
// product name. recovery is the earliest time an unhealthy GPU turns healthy (zero
// when none is unhealthy).
func (inv *inventory) fingerprint(h *healthBook, now time.Time) (resp *pb.FingerprintResponse, recovery time.Time) {
	groups := make(map[string]*pb.DeviceGroup)
	for _, d := range inv.descs {
		g, ok := groups[d.name]
		if !ok {
			// Every GPU of one product shares these facts; the first one speaks for all.
			g = &pb.DeviceGroup{Vendor: "nvidia", Type: "gpu", Name: d.name, Attributes: d.attrs}
			groups[d.name] = g
		}
		healthy, reason, until := h.status(d.id, now)
		dev := &pb.Device{Id: d.id, Health: pb.Health_HEALTH_HEALTHY, Locality: d.locality}
		if !healthy {
			dev.Health = pb.Health_HEALTH_UNHEALTHY
			dev.HealthReason = reason
			if recovery.IsZero() || until.Before(recovery) {
				recovery = until
			}
		}
		g.Devices = append(g.Devices, dev)
	}
	resp = &pb.FingerprintResponse{}
	for _, g := range groups {
		resp.Groups = append(resp.Groups, g)
	}
	slices.SortFunc(resp.Groups, func(a, b *pb.DeviceGroup) int { return strings.Compare(a.Name, b.Name) })
	return resp, recovery
}

// sample reads every GPU's stats, stamped now. Values a GPU cannot give are left out.
//
// Besides the load figures, each GPU reports "index" (its NVML index, as nvidia-smi
// and dcgm-exporter's gpu label number GPUs; it is not always the /dev/nvidiaN minor)
// and "last_xid" (the last XID event it raised while a Fingerprint stream watched it,
// critical or application, 0 when none: DCGM's XID_ERRORS field), so the host's
// metrics can carry dcgm-exporter's names and labels.
func (rt *runtime) sample(now time.Time) (*pb.StatsResponse, error) {
	gpus, _, err := rt.listGPUs()
	if err != nil {
		return nil, err
	}
	ts := timestamppb.New(now)
	resp := &pb.StatsResponse{}
	for _, g := range gpus {
		v := map[string]*pb.Value{
			"index":    intValue(int64(g.index), ""),
			"last_xid": intValue(int64(rt.health.lastXID(g.uuid)), ""),
		}
		if u, ret := g.dev.GetUtilizationRates(); ret == nvml.SUCCESS {
			v["gpu_utilization"] = intValue(int64(u.Gpu), unitPercent)
			v["memory_utilization"] = intValue(int64(u.Memory), unitPercent)
		}
		if m, ret := g.dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			v["memory_used"] = intValue(int64(m.Used>>20), unitMiB)
			v["memory_free"] = intValue(int64(m.Free>>20), unitMiB)
			v["memory_total"] = intValue(int64(m.Total>>20), unitMiB)
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
		resp.Devices = append(resp.Devices, &pb.DeviceStats{DeviceId: g.uuid, Values: v, Timestamp: ts})
	}
	return resp, nil
}

func intValue(n int64, unit string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_IntValue{IntValue: n}, Unit: unit}
}

func floatValue(f float64, unit string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: f}, Unit: unit}
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
