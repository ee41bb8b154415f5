package nvidia

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxb200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/google/uuid"
)

// machine is a simulated DGX: go-nvml's mock server for it, plus the figures the mock
// does not carry. The figures are approximate public specs, good enough to simulate.
type machine struct {
	newServer   func() *server.Server
	powerLimitW uint32
	idlePowerW  uint32
	bar1MiB     uint64
	smClockMHz  uint32
	memClockMHz uint32
	pcieGen     int
	pcieWidth   int
	pciBuses    []uint8 // PCI bus number of each GPU, by index
	gpm         bool    // GPU performance monitoring: Hopper and later
}

var (
	busesA100   = []uint8{0x07, 0x0f, 0x47, 0x4e, 0x87, 0x90, 0xb7, 0xbd}
	busesHopper = []uint8{0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb}
)

// machines are the values config key "simulate" accepts.
var machines = map[string]machine{
	"dgxa100": {newServer: dgxa100.New, powerLimitW: 400, idlePowerW: 55, bar1MiB: 65536,
		smClockMHz: 1410, memClockMHz: 1215, pcieGen: 4, pcieWidth: 16, pciBuses: busesA100},
	"dgxh100": {newServer: dgxh100.New, powerLimitW: 700, idlePowerW: 70, bar1MiB: 131072,
		smClockMHz: 1980, memClockMHz: 2619, pcieGen: 5, pcieWidth: 16, pciBuses: busesHopper, gpm: true},
	"dgxh200": {newServer: dgxh200.New, powerLimitW: 700, idlePowerW: 75, bar1MiB: 262144,
		smClockMHz: 1980, memClockMHz: 3201, pcieGen: 5, pcieWidth: 16, pciBuses: busesHopper, gpm: true},
	"dgxb200": {newServer: dgxb200.New, powerLimitW: 1000, idlePowerW: 120, bar1MiB: 262144,
		smClockMHz: 1965, memClockMHz: 3996, pcieGen: 5, pcieWidth: 16, pciBuses: busesHopper, gpm: true},
}

// simNamespace seeds the name-based UUIDs of simulated GPUs. Never change it: the
// UUIDs are device IDs that reservations refer to.
var simNamespace = uuid.MustParse("5b0c0f6e-4a53-4b7e-9a31-3c1d2f8e9a10")

// simulatedUUIDs are the UUIDs of every GPU of a simulated machine, by index.
func simulatedUUIDs(machineName string) []string {
	n := len(machines[machineName].newServer().Devices)
	out := make([]string, n)
	for i := range out {
		out[i] = simulatedUUID(machineName, i)
	}
	return out
}

// simulatedUUID is the stable UUID of GPU index on a simulated machine.
func simulatedUUID(machineName string, index int) string {
	return "GPU-" + uuid.NewSHA1(simNamespace, fmt.Appendf(nil, "%s/%d", machineName, index)).String()
}

// simLib is the nvml.Interface of a simulated machine: go-nvml's mock server, with the
// calls the plugin makes answered here. Stats move with the clock, UUIDs are stable
// and injected faults come out of EventSet.Wait as XID events, so the plugin runs the
// same code as on real NVML.
//
// Every call with arguments that the plugin makes repeatedly is answered here rather
// than by the mock: go-nvml's mocks record each call with its arguments, which would
// grow without bound in a long-running simulation. (Recording an argument-less call
// appends a zero-size value and allocates nothing, so GetName and friends go to the
// mock.)
type simLib struct {
	nvml.Interface // the mock server: Init, Shutdown, SystemGetDriverVersion, ...

	clock   clock
	devices []*simDevice
	mig     *simMIG // MIG mode and instances, shared by every simLib of one state file

	mu     sync.Mutex // guards faults[i].delivered
	faults []*simFault
	// actions are the injected recovery actions; with any, the simulated driver
	// reports recovery actions (none outside them), else it does not.
	actions []simAction
	// gpmSamples counts the GPM samples allocated and not yet freed.
	gpmSamples atomic.Int64
	procs      simProcs // the processes the stats report (simprocs.go)
}

// simAction is a recovery action a GPU asks for from from until until (zero: for
// good).
type simAction struct {
	device      *simDevice
	from, until time.Time
	action      nvml.DeviceGpuRecoveryAction
}

// simFault is one scheduled XID event.
type simFault struct {
	at        time.Time
	device    *simDevice
	xid       uint64
	delivered bool
}

// newSimLib builds the simulated machine name, whose MIG state is mig; name must be a
// key of machines.
func newSimLib(name string, clk clock, mig *simMIG) *simLib {
	spec := machines[name]
	srv := spec.newServer()
	lib := &simLib{Interface: srv, clock: clk, mig: mig}
	for i, dev := range srv.Devices {
		mockDev := dev.(*server.Device)
		id := simulatedUUID(name, i)
		// The mock server looks devices up by these fields; keep them consistent.
		mockDev.UUID = id
		bus := spec.pciBuses[i%len(spec.pciBuses)]
		mockDev.PciBusID = fmt.Sprintf("00000000:%02X:00.0", bus)
		lib.devices = append(lib.devices, &simDevice{
			Device: mockDev,
			mock:   mockDev,
			lib:    lib,
			spec:   spec,
			index:  i,
			uuid:   id,
			bus:    bus,
			numa:   i / 4, // two sockets, four GPUs each
		})
	}
	return lib
}

// scheduleFaults turns checked fault specs into XID events counted from start. It is
// called once, before the library is shared.
func (l *simLib) scheduleFaults(start time.Time, faults []faultSpec) error {
	uuids := make([]string, len(l.devices))
	for i, d := range l.devices {
		uuids[i] = d.uuid
	}
	for _, f := range faults {
		i, err := faultGPU(f, uuids)
		if err != nil {
			return err
		}
		dev := l.devices[i]
		l.faults = append(l.faults, &simFault{at: start.Add(f.after), device: dev, xid: f.xid})
		if f.action != nil {
			a := simAction{device: dev, from: start.Add(f.after), action: *f.action}
			if f.lasts > 0 {
				a.until = a.from.Add(f.lasts)
			}
			l.actions = append(l.actions, a)
			continue // the action ends; no second XID
		}
		if f.lasts > 0 {
			l.faults = append(l.faults, &simFault{at: start.Add(f.after + f.lasts), device: dev, xid: f.xid})
		}
	}
	return nil
}

// checkFaults refuses faults that name no GPU of a simulated machine whose GPUs have
// uuids (by index), as scheduleFaults does.
func checkFaults(faults []faultSpec, uuids []string) error {
	for _, f := range faults {
		if _, err := faultGPU(f, uuids); err != nil {
			return err
		}
	}
	return nil
}

// faultGPU is the index of the simulated GPU that f names, among GPUs with uuids.
func faultGPU(f faultSpec, uuids []string) (int, error) {
	if f.gpuIndex >= 0 {
		if f.gpuIndex >= len(uuids) {
			return 0, fmt.Errorf("config: %s.gpu_index = %d: the simulated machine has GPUs 0 to %d",
				f.key, f.gpuIndex, len(uuids)-1)
		}
		return f.gpuIndex, nil
	}
	if i := slices.Index(uuids, f.gpuID); i >= 0 {
		return i, nil
	}
	return 0, fmt.Errorf("config: %s.gpu_id = %q: no such simulated GPU", f.key, f.gpuID)
}

func (l *simLib) DeviceGetCount() (int, nvml.Return) { return len(l.devices), nvml.SUCCESS }

func (l *simLib) DeviceGetHandleByIndex(i int) (nvml.Device, nvml.Return) {
	if i < 0 || i >= len(l.devices) {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	return l.devices[i], nvml.SUCCESS
}

func (l *simLib) EventSetCreate() (nvml.EventSet, nvml.Return) {
	return &simEventSet{lib: l, registered: make(map[*simDevice]uint64)}, nvml.SUCCESS
}

// simDevice is one simulated GPU.
type simDevice struct {
	nvml.Device // the mock device: name, compute capability, architecture, ...

	mock  *server.Device
	lib   *simLib
	spec  machine
	index int
	uuid  string
	bus   uint8
	numa  int
}

// wave is a deterministic load in [0.05, 0.95] that cycles every period, shifted per
// GPU, so every GPU's stats move over time and two plugin runs agree.
func (d *simDevice) wave(period time.Duration, shift float64) float64 {
	now := d.lib.clock.Now()
	frac := float64(now.UnixNano()%int64(period)) / float64(period)
	return 0.5 + 0.45*math.Sin(2*math.Pi*frac+shift+0.9*float64(d.index))
}

func (d *simDevice) computeLoad() float64 { return d.wave(2*time.Minute, 0) }
func (d *simDevice) memoryLoad() float64  { return d.wave(5*time.Minute, 1.3) }

func (d *simDevice) GetUUID() (string, nvml.Return) { return d.uuid, nvml.SUCCESS }

func (d *simDevice) GetPciInfo() (nvml.PciInfo, nvml.Return) {
	info := nvml.PciInfo{Bus: uint32(d.bus), PciDeviceId: d.mock.Config.PciDeviceId}
	for i, c := range d.mock.PciBusID {
		if i >= len(info.BusId)-1 {
			break
		}
		info.BusId[i] = int8(c)
	}
	return info, nvml.SUCCESS
}

func (d *simDevice) GetNumaNodeId() (int, nvml.Return) { return d.numa, nvml.SUCCESS }

func (d *simDevice) GetMemoryInfo() (nvml.Memory, nvml.Return) {
	total := d.mock.MemoryInfo.Total
	used := uint64(float64(total) * (0.1 + 0.8*d.memoryLoad()))
	return nvml.Memory{Total: total, Used: used, Free: total - used}, nvml.SUCCESS
}

func (d *simDevice) GetPowerManagementLimit() (uint32, nvml.Return) {
	return d.spec.powerLimitW * 1000, nvml.SUCCESS
}

func (d *simDevice) GetBAR1MemoryInfo() (nvml.BAR1Memory, nvml.Return) {
	total := d.spec.bar1MiB << 20
	return nvml.BAR1Memory{Bar1Total: total, Bar1Free: total}, nvml.SUCCESS
}

func (d *simDevice) GetMaxClockInfo(t nvml.ClockType) (uint32, nvml.Return) {
	switch t {
	case nvml.CLOCK_SM, nvml.CLOCK_GRAPHICS:
		return d.spec.smClockMHz, nvml.SUCCESS
	case nvml.CLOCK_MEM:
		return d.spec.memClockMHz, nvml.SUCCESS
	default:
		return 0, nvml.ERROR_NOT_SUPPORTED
	}
}

// GetClockInfo is the current clock: the SM clock follows the load from an idle
// floor up to its maximum; the memory clock stays at its maximum, as on real GPUs.
func (d *simDevice) GetClockInfo(t nvml.ClockType) (uint32, nvml.Return) {
	switch t {
	case nvml.CLOCK_SM, nvml.CLOCK_GRAPHICS:
		const idleMHz = 345
		return uint32(math.Round(idleMHz + float64(d.spec.smClockMHz-idleMHz)*d.computeLoad())), nvml.SUCCESS
	case nvml.CLOCK_MEM:
		return d.spec.memClockMHz, nvml.SUCCESS
	default:
		return 0, nvml.ERROR_NOT_SUPPORTED
	}
}

func (d *simDevice) GetMaxPcieLinkGeneration() (int, nvml.Return) {
	return d.spec.pcieGen, nvml.SUCCESS
}
func (d *simDevice) GetMaxPcieLinkWidth() (int, nvml.Return) { return d.spec.pcieWidth, nvml.SUCCESS }

func (d *simDevice) GetUtilizationRates() (nvml.Utilization, nvml.Return) {
	load := d.computeLoad()
	u := nvml.Utilization{
		Gpu:    uint32(math.Round(100 * load)),
		Memory: uint32(math.Round(60 * load * d.memoryLoad())),
	}
	if busy, ok := d.lib.simBusy(d.uuid); ok { // its processes say how busy it is
		u.Gpu = busy
	}
	return u, nvml.SUCCESS
}

func (d *simDevice) GetTemperature(sensor nvml.TemperatureSensors) (uint32, nvml.Return) {
	if sensor != nvml.TEMPERATURE_GPU {
		return 0, nvml.ERROR_NOT_SUPPORTED
	}
	return uint32(math.Round(32 + 45*d.computeLoad())), nvml.SUCCESS
}

func (d *simDevice) GetPowerUsage() (uint32, nvml.Return) {
	idle, limit := float64(d.spec.idlePowerW*1000), float64(d.spec.powerLimitW*1000)
	return uint32(idle + (limit-idle)*d.computeLoad()), nvml.SUCCESS
}

// GetTotalEccErrors reports no ECC errors: the simulation injects XIDs, not ECC faults.
func (d *simDevice) GetTotalEccErrors(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) {
	return 0, nvml.SUCCESS
}

// GetFieldValues answers FI_DEV_GET_GPU_RECOVERY_ACTION when the machine has injected
// recovery actions (the latest one begun and not ended, else none); every other field
// is not supported.
func (d *simDevice) GetFieldValues(values []nvml.FieldValue) nvml.Return {
	now := d.lib.clock.Now()
	for i := range values {
		v := &values[i]
		if v.FieldId != nvml.FI_DEV_GET_GPU_RECOVERY_ACTION || len(d.lib.actions) == 0 {
			v.NvmlReturn = uint32(nvml.ERROR_NOT_SUPPORTED)
			continue
		}
		action, since := nvml.GPU_RECOVERY_ACTION_NONE, time.Time{}
		for _, a := range d.lib.actions {
			if a.device == d && !now.Before(a.from) && (a.until.IsZero() || now.Before(a.until)) && !a.from.Before(since) {
				action, since = a.action, a.from
			}
		}
		v.ValueType = uint32(nvml.VALUE_TYPE_UNSIGNED_INT)
		v.Value = [8]byte{}
		binary.LittleEndian.PutUint32(v.Value[:4], uint32(action))
		v.NvmlReturn = uint32(nvml.SUCCESS)
		v.Timestamp = now.UnixMicro()
	}
	return nvml.SUCCESS
}

func (d *simDevice) GetSupportedEventTypes() (uint64, nvml.Return) {
	return nvml.EventTypeXidCriticalError | nvml.EventTypeSingleBitEccError | nvml.EventTypeDoubleBitEccError, nvml.SUCCESS
}

func (d *simDevice) RegisterEvents(types uint64, set nvml.EventSet) nvml.Return {
	es, ok := set.(*simEventSet)
	if !ok || es.lib != d.lib {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	es.mu.Lock()
	defer es.mu.Unlock()
	es.registered[d] |= types
	return nvml.SUCCESS
}

// simEventSet delivers the simulated machine's injected faults as XID events. Each
// fault is delivered once, to the first event set whose Wait finds it due and whose
// GPU is registered for XID events. Wait and Free may be called from any goroutine.
type simEventSet struct {
	nvml.EventSet // nil: the plugin calls only Wait and Free

	lib        *simLib
	mu         sync.Mutex
	registered map[*simDevice]uint64
	freed      bool
}

// Wait returns the next due fault. It waits for the next one on the simulation clock,
// but never longer than timeoutms of real time, so a caller that polls with a short
// timeout notices cancellation promptly even under a fake clock.
func (s *simEventSet) Wait(timeoutms uint32) (nvml.EventData, nvml.Return) {
	deadline := time.NewTimer(time.Duration(timeoutms) * time.Millisecond)
	defer deadline.Stop()
	for {
		next, due, ret := s.take()
		if ret != nvml.SUCCESS {
			return nvml.EventData{}, ret
		}
		if next == nil {
			<-deadline.C
			return nvml.EventData{}, nvml.ERROR_TIMEOUT
		}
		if due {
			return nvml.EventData{
				Device:            next.device,
				EventType:         nvml.EventTypeXidCriticalError,
				EventData:         next.xid,
				GpuInstanceId:     0xFFFFFFFF,
				ComputeInstanceId: 0xFFFFFFFF,
			}, nvml.SUCCESS
		}
		t := s.lib.clock.TimerAt(next.at)
		select {
		case <-t.C():
		case <-deadline.C:
			t.Stop()
			return nvml.EventData{}, nvml.ERROR_TIMEOUT
		}
	}
}

// take finds the earliest undelivered fault for a registered GPU and marks it
// delivered when it is due (due is then true). It returns nil when there is none.
func (s *simEventSet) take() (next *simFault, due bool, ret nvml.Return) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.freed {
		return nil, false, nvml.ERROR_UNINITIALIZED
	}
	s.lib.mu.Lock()
	defer s.lib.mu.Unlock()
	for _, f := range s.lib.faults {
		if f.delivered || s.registered[f.device]&nvml.EventTypeXidCriticalError == 0 {
			continue
		}
		if next == nil || f.at.Before(next.at) {
			next = f
		}
	}
	if next != nil && !s.lib.clock.Now().Before(next.at) {
		next.delivered = true
		due = true
	}
	return next, due, nvml.SUCCESS
}

func (s *simEventSet) Free() nvml.Return {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.freed = true
	return nvml.SUCCESS
}
