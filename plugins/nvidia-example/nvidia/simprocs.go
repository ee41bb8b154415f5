package nvidia

import (
	"bytes"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Simulated GPU processes. A simulated GPU has no processes of its own; a process on
// this machine counts as one of a simulated device when the environment it started with
// names the device in NVIDIA_VISIBLE_DEVICES (the GPU's or a MIG device's UUID, as a
// reservation's container gets it), and it uses simFBUsedEnv MiB of the device's
// memory (0 without it). So the host's per-holder memory can be tested end to end
// without a GPU: a workload's processes are its containers'.
const simFBUsedEnv = "DEVICEHOST_SIM_FB_USED_MIB"

// simProcs is the last scan of /proc: each device UUID's processes. The stats loop
// rescans once per sample (rescanProcesses), so what a sample reports is what ran then.
type simProcs struct {
	mu       sync.Mutex
	byDevice map[string][]nvml.ProcessInfo
}

// maxSimEnviron bounds what is read of one process's environment.
const maxSimEnviron = 256 << 10

// rescanProcesses reads every process's environment under /proc for the simulated
// devices it names; processes it may not read, or that are gone, are skipped.
func (l *simLib) rescanProcesses() {
	byDevice := make(map[string][]nvml.ProcessInfo)
	entries, _ := os.ReadDir("/proc")
	self := os.Getpid()
	for _, e := range entries {
		pid, err := strconv.ParseUint(e.Name(), 10, 32)
		if err != nil || int(pid) == self {
			continue
		}
		visible, mib := simProcessEnv(int(pid))
		if visible == "" {
			continue
		}
		for _, uuid := range strings.Split(visible, ",") {
			byDevice[uuid] = append(byDevice[uuid], nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: mib << 20})
		}
	}
	l.procs.mu.Lock()
	l.procs.byDevice = byDevice
	l.procs.mu.Unlock()
}

// simProcessEnv reads NVIDIA_VISIBLE_DEVICES and simFBUsedEnv from process pid's
// environment.
func simProcessEnv(pid int) (visible string, mib uint64) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		return "", 0
	}
	defer f.Close()
	env, err := io.ReadAll(io.LimitReader(f, maxSimEnviron))
	if err != nil {
		return "", 0
	}
	for _, kv := range bytes.Split(env, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("NVIDIA_VISIBLE_DEVICES=")); ok {
			visible = string(v)
		} else if v, ok := bytes.CutPrefix(kv, []byte(simFBUsedEnv+"=")); ok {
			mib, _ = strconv.ParseUint(string(v), 10, 32)
		}
	}
	return visible, mib
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
