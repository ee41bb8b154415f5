package nvidia

import (
	"bytes"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Simulated GPU processes. A simulated GPU has no processes of its own; a process on
// this machine counts as one of a simulated device when the environment it started with
// names the device in NVIDIA_VISIBLE_DEVICES (the GPU's or a MIG device's UUID, as a
// reservation's container gets it), and it uses simFBUsedEnv MiB of the device's
// memory (0 without it). So the host's per-holder memory can be tested end to end
// without a GPU: a workload's processes are its containers'.
const simFBUsedEnv = "DEVICEHOST_SIM_FB_USED_MIB"

// simSMUtilEnv, in a simulated device's process's environment, is the share of the
// device's SMs it keeps busy, in % (0 without it): its NVML process utilization
// sample. A device with such processes is as busy as they are together (capped at
// 100 %), so that the host's per-holder utilization can be checked to add up.
const simSMUtilEnv = "DEVICEHOST_SIM_SM_UTIL"

// simProcs is the last scan of /proc: each device UUID's processes. The stats loop
// rescans once per sample (rescanProcesses), so what a sample reports is what ran then.
type simProcs struct {
	mu       sync.Mutex
	byDevice map[string][]nvml.ProcessInfo
	smUtil   map[string]map[uint32]uint32 // by device UUID, by PID: the processes that set simSMUtilEnv
}

// maxSimEnviron bounds what is read of one process's environment.
const maxSimEnviron = 256 << 10

// rescanProcesses reads every process's environment under /proc for the simulated
// devices it names; processes it may not read, or that are gone, are skipped.
func (l *simLib) rescanProcesses() {
	byDevice := make(map[string][]nvml.ProcessInfo)
	smUtil := make(map[string]map[uint32]uint32)
	entries, _ := os.ReadDir("/proc")
	self := os.Getpid()
	for _, e := range entries {
		pid, err := strconv.ParseUint(e.Name(), 10, 32)
		if err != nil || int(pid) == self {
			continue
		}
		visible, mib, util, hasUtil := simProcessEnv(int(pid))
		if visible == "" {
			continue
		}
		for _, uuid := range strings.Split(visible, ",") {
			byDevice[uuid] = append(byDevice[uuid], nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: mib << 20})
			if hasUtil {
				if smUtil[uuid] == nil {
					smUtil[uuid] = make(map[uint32]uint32)
				}
				smUtil[uuid][uint32(pid)] = util
			}
		}
	}
	l.procs.mu.Lock()
	l.procs.byDevice, l.procs.smUtil = byDevice, smUtil
	l.procs.mu.Unlock()
}

// simProcessEnv reads NVIDIA_VISIBLE_DEVICES, simFBUsedEnv and simSMUtilEnv (capped at
// 100; hasUtil when set to a number) from process pid's environment.
func simProcessEnv(pid int) (visible string, mib uint64, util uint32, hasUtil bool) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		return "", 0, 0, false
	}
	defer f.Close()
	env, err := io.ReadAll(io.LimitReader(f, maxSimEnviron))
	if err != nil {
		return "", 0, 0, false
	}
	for _, kv := range bytes.Split(env, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("NVIDIA_VISIBLE_DEVICES=")); ok {
			visible = string(v)
		} else if v, ok := bytes.CutPrefix(kv, []byte(simFBUsedEnv+"=")); ok {
			mib, _ = strconv.ParseUint(string(v), 10, 32)
		} else if v, ok := bytes.CutPrefix(kv, []byte(simSMUtilEnv+"=")); ok {
			if n, err := strconv.ParseUint(string(v), 10, 32); err == nil {
				util, hasUtil = uint32(min(n, 100)), true
			}
		}
	}
	return visible, mib, util, hasUtil
}

// processesOf returns the processes of the last scan on device uuid.
func (l *simLib) processesOf(uuid string) ([]nvml.ProcessInfo, nvml.Return) {
	l.procs.mu.Lock()
	defer l.procs.mu.Unlock()
	return l.procs.byDevice[uuid], nvml.SUCCESS
}

func (d *simDevice) GetComputeRunningProcesses() ([]nvml.ProcessInfo, nvml.Return) {
	return d.lib.processesOf(d.uuid)
}

func (m *simMigDevice) GetComputeRunningProcesses() ([]nvml.ProcessInfo, nvml.Return) {
	return m.parent.lib.processesOf(m.uuid)
}

// GetProcessUtilization answers one sample per process of the last scan: its
// simSMUtilEnv, 0 without it; NOT_FOUND with no process, as NVML answers with no
// sample.
func (d *simDevice) GetProcessUtilization(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
	procs, _ := d.lib.processesOf(d.uuid)
	if len(procs) == 0 {
		return nil, nvml.ERROR_NOT_FOUND
	}
	d.lib.procs.mu.Lock()
	defer d.lib.procs.mu.Unlock()
	now := uint64(time.Now().UnixMicro())
	out := make([]nvml.ProcessUtilizationSample, len(procs))
	for i, p := range procs {
		out[i] = nvml.ProcessUtilizationSample{Pid: p.Pid, TimeStamp: now, SmUtil: d.lib.procs.smUtil[d.uuid][p.Pid]}
	}
	return out, nvml.SUCCESS
}

// simBusy is how busy the processes that set simSMUtilEnv keep device uuid together,
// capped at 100 %; ok is false when none does.
func (l *simLib) simBusy(uuid string) (util uint32, ok bool) {
	l.procs.mu.Lock()
	defer l.procs.mu.Unlock()
	var sum uint32
	for _, u := range l.procs.smUtil[uuid] {
		sum += u
	}
	return min(sum, 100), len(l.procs.smUtil[uuid]) > 0
}

// GetProcessUtilization is not supported on a MIG device, as on real NVML.
func (m *simMigDevice) GetProcessUtilization(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
	return nil, nvml.ERROR_NOT_SUPPORTED
}
