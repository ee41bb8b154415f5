package nvidia

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/uuid"
)

// simMIG is the MIG state of a simulated machine: each GPU's MIG mode and its GPU and
// compute instances. Like a real GPU's, it outlives the plugin process: every change
// is written to a state file (sim_state_file) before the NVML call that made it
// returns, so a plugin restarted (or killed and restarted) finds the instances its
// predecessor made. Path "" keeps the state in memory only. Safe for concurrent use;
// one process at a time may use a state file.
//
// The NVML calls on simulated GPUs answer from it with real NVML's rules: instances
// only with MIG mode on, only at the profile's placements, no overlap, no more of a
// profile than its instance count; a GPU instance with compute instances cannot be
// destroyed.
type simMIG struct {
	path    string
	machine string

	mu sync.Mutex
	st simMIGState
	// fail, when set, is asked before each create ("gpu-instance" or
	// "compute-instance"); a result other than SUCCESS fails the create. A seam for
	// tests that inject NVML failures.
	fail func(step string, gpuIndex int) nvml.Return
}

// simMIGState is the state file's content.
type simMIGState struct {
	Machine string       `json:"machine"`
	GPUs    []*simMIGGPU `json:"gpus"`
}

type simMIGGPU struct {
	UUID    string   `json:"uuid"`
	MigMode int      `json:"mig_mode"`
	NextGI  uint32   `json:"next_gpu_instance_id"`
	GIs     []*simGI `json:"gpu_instances,omitempty"`
}

type simGI struct {
	ID        uint32   `json:"id"`
	ProfileID uint32   `json:"profile_id"`
	Start     uint32   `json:"start"`
	Size      uint32   `json:"size"`
	NextCI    uint32   `json:"next_compute_instance_id"`
	CIs       []*simCI `json:"compute_instances,omitempty"`
}

type simCI struct {
	ID        uint32 `json:"id"`
	ProfileID uint32 `json:"profile_id"`
	UUID      string `json:"uuid"` // the MIG device's UUID, "MIG-..."
}

// loadSimMIG reads the state of machine (whose GPUs have uuids, by index) from path,
// or starts with MIG off and no instances when there is no file yet (or path is "").
// A file that holds another machine is refused.
func loadSimMIG(path, machine string, uuids []string) (*simMIG, error) {
	m := &simMIG{path: path, machine: machine}
	raw, err := os.ReadFile(path)
	switch {
	case path == "" || errors.Is(err, os.ErrNotExist):
		m.st = simMIGState{Machine: machine}
		for _, id := range uuids {
			m.st.GPUs = append(m.st.GPUs, &simMIGGPU{UUID: id})
		}
		return m, nil
	case err != nil:
		return nil, fmt.Errorf("config: sim_state_file = %q: %w", path, err)
	}
	if err := json.Unmarshal(raw, &m.st); err != nil {
		return nil, fmt.Errorf("config: sim_state_file = %q: not a simulator state file: %w", path, err)
	}
	if m.st.Machine != machine || len(m.st.GPUs) != len(uuids) {
		return nil, fmt.Errorf("config: sim_state_file = %q holds the state of a simulated %s with %d GPUs, not of this %s; remove it or choose another file",
			path, m.st.Machine, len(m.st.GPUs), machine)
	}
	for i, g := range m.st.GPUs {
		if g == nil || g.UUID != uuids[i] {
			return nil, fmt.Errorf("config: sim_state_file = %q: GPU %d is not this machine's", path, i)
		}
	}
	return m, nil
}

// update applies change to a copy of the state and, when it succeeds, writes the
// copy to the state file and makes it current. A failed write fails the call with
// ERROR_UNKNOWN and changes nothing.
func (m *simMIG) update(change func(st *simMIGState) nvml.Return) nvml.Return {
	m.mu.Lock()
	defer m.mu.Unlock()
	next := m.st.clone()
	if ret := change(&next); ret != nvml.SUCCESS {
		return ret
	}
	if err := m.write(next); err != nil {
		return nvml.ERROR_UNKNOWN
	}
	m.st = next
	return nvml.SUCCESS
}

// view calls read with the current state, which it must not keep or change.
func (m *simMIG) view(read func(st *simMIGState)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	read(&m.st)
}

// clone is a deep copy, field by field: update runs it on every create and destroy,
// and a JSON round trip made a Reserve's cost grow with every instance already held.
func (st simMIGState) clone() simMIGState {
	out := simMIGState{Machine: st.Machine, GPUs: make([]*simMIGGPU, len(st.GPUs))}
	for i, g := range st.GPUs {
		cg := *g
		cg.GIs = make([]*simGI, len(g.GIs))
		for j, gi := range g.GIs {
			cgi := *gi
			cgi.CIs = make([]*simCI, len(gi.CIs))
			for k, ci := range gi.CIs {
				cci := *ci
				cgi.CIs[k] = &cci
			}
			cg.GIs[j] = &cgi
		}
		out.GPUs[i] = &cg
	}
	return out
}

// write replaces the state file atomically: a temporary file in the same directory,
// synced, renamed over the old one, and the directory synced.
func (m *simMIG) write(st simMIGState) error {
	if m.path == "" {
		return nil
	}
	raw, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	dir := filepath.Dir(m.path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(m.path)+".*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // after a successful rename, there is nothing to remove
	if _, err := f.Write(append(raw, '\n')); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, m.path); err != nil {
		return err
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// enableMIG turns MIG mode on for the GPUs at indexes, as an operator's
// `nvidia-smi -i N -mig 1` would; it returns the indexes it changed. The simulation's
// stand-in for the operator: the plugin itself never changes MIG mode.
func (m *simMIG) enableMIG(indexes []int) (changed []int, err error) {
	m.view(func(st *simMIGState) {
		for _, i := range indexes {
			if i < len(st.GPUs) && st.GPUs[i].MigMode != nvml.DEVICE_MIG_ENABLE {
				changed = append(changed, i)
			}
		}
	})
	if len(changed) == 0 {
		return nil, nil
	}
	changed = nil
	ret := m.update(func(st *simMIGState) nvml.Return {
		for _, i := range indexes {
			if i < len(st.GPUs) && st.GPUs[i].MigMode != nvml.DEVICE_MIG_ENABLE {
				st.GPUs[i].MigMode = nvml.DEVICE_MIG_ENABLE
				changed = append(changed, i)
			}
		}
		return nvml.SUCCESS
	})
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("sim_state_file %q: %w", m.path, ret)
	}
	return changed, nil
}

// disableMIG turns MIG mode off for the GPUs at indexes, as an operator's
// `nvidia-smi -i N -mig 0` would; like that, it refuses a GPU that still has GPU
// instances. It returns the indexes it changed.
func (m *simMIG) disableMIG(indexes []int) (changed []int, err error) {
	on := false
	m.view(func(st *simMIGState) {
		for _, i := range indexes {
			on = on || i < len(st.GPUs) && st.GPUs[i].MigMode == nvml.DEVICE_MIG_ENABLE
		}
	})
	if !on {
		return nil, nil
	}
	var busy []int
	ret := m.update(func(st *simMIGState) nvml.Return {
		for _, i := range indexes {
			if i >= len(st.GPUs) || st.GPUs[i].MigMode != nvml.DEVICE_MIG_ENABLE {
				continue
			}
			if len(st.GPUs[i].GIs) > 0 {
				busy = append(busy, i)
				continue
			}
			st.GPUs[i].MigMode = nvml.DEVICE_MIG_DISABLE
			changed = append(changed, i)
		}
		return nvml.SUCCESS
	})
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("sim_state_file %q: %w", m.path, ret)
	}
	if len(busy) > 0 {
		return changed, fmt.Errorf("sim_mig_mode_off: GPUs %v still have MIG instances (sim_state_file %q); MIG mode stays on", busy, m.path)
	}
	return changed, nil
}

// instanceCount is the number of GPU instances on every GPU together.
func (m *simMIG) instanceCount() int {
	n := 0
	m.view(func(st *simMIGState) {
		for _, g := range st.GPUs {
			n += len(g.GIs)
		}
	})
	return n
}

func (g *simMIGGPU) gi(id uint32) *simGI {
	for _, gi := range g.GIs {
		if gi.ID == id {
			return gi
		}
	}
	return nil
}

// MIG calls of a simulated GPU, answered from the machine's simMIG.

func (d *simDevice) migGPU(st *simMIGState) *simMIGGPU { return st.GPUs[d.index] }

func (d *simDevice) GetMigMode() (current, pending int, ret nvml.Return) {
	d.lib.mig.view(func(st *simMIGState) { current = d.migGPU(st).MigMode })
	return current, current, nvml.SUCCESS
}

func (d *simDevice) migEnabled() bool {
	mode, _, _ := d.GetMigMode()
	return mode == nvml.DEVICE_MIG_ENABLE
}

func (d *simDevice) GetGpuInstanceProfileInfo(profile int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
	if !d.migEnabled() {
		return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
	}
	info, ok := d.mock.Config.MIGProfiles.GpuInstanceProfiles[profile]
	if !ok {
		return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
	}
	return info, nvml.SUCCESS
}

func (d *simDevice) GetGpuInstancePossiblePlacements(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstancePlacement, nvml.Return) {
	if !d.migEnabled() {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	if info == nil {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	return slices.Clone(d.mock.Config.MIGProfiles.GpuInstancePlacements[int(info.Id)]), nvml.SUCCESS
}

// maxSlices is the GPU's compute slices: the most any one profile takes.
func (d *simDevice) maxSlices() uint32 {
	var n uint32
	for _, p := range d.mock.Config.MIGProfiles.GpuInstanceProfiles {
		n = max(n, p.SliceCount)
	}
	return n
}

func (d *simDevice) CreateGpuInstanceWithPlacement(info *nvml.GpuInstanceProfileInfo, pl *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
	if info == nil || pl == nil {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	prof, ok := d.mock.Config.MIGProfiles.GpuInstanceProfiles[int(info.Id)]
	if !ok {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if !slices.Contains(d.mock.Config.MIGProfiles.GpuInstancePlacements[int(info.Id)], *pl) {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if f := d.lib.mig.fail; f != nil {
		if ret := f("gpu-instance", d.index); ret != nvml.SUCCESS {
			return nil, ret
		}
	}
	var id uint32
	ret := d.lib.mig.update(func(st *simMIGState) nvml.Return {
		g := d.migGPU(st)
		if g.MigMode != nvml.DEVICE_MIG_ENABLE {
			return nvml.ERROR_NOT_SUPPORTED
		}
		same, used := uint32(0), prof.SliceCount
		for _, gi := range g.GIs {
			if gi.Start < pl.Start+pl.Size && pl.Start < gi.Start+gi.Size {
				return nvml.ERROR_INSUFFICIENT_RESOURCES // overlapping placement
			}
			if gi.ProfileID == prof.Id {
				same++
			}
			used += d.mock.Config.MIGProfiles.GpuInstanceProfiles[int(gi.ProfileID)].SliceCount
		}
		if same >= prof.InstanceCount || used > d.maxSlices() {
			return nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		id = g.NextGI
		g.NextGI++
		g.GIs = append(g.GIs, &simGI{ID: id, ProfileID: prof.Id, Start: pl.Start, Size: pl.Size})
		return nvml.SUCCESS
	})
	if ret != nvml.SUCCESS {
		return nil, ret
	}
	return &simGpuInstance{dev: d, id: id}, nvml.SUCCESS
}

func (d *simDevice) GetGpuInstances(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstance, nvml.Return) {
	if info == nil {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if !d.migEnabled() {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	var out []nvml.GpuInstance
	d.lib.mig.view(func(st *simMIGState) {
		for _, gi := range d.migGPU(st).GIs {
			if gi.ProfileID == info.Id {
				out = append(out, &simGpuInstance{dev: d, id: gi.ID})
			}
		}
	})
	return out, nvml.SUCCESS
}

func (d *simDevice) GetGpuInstanceById(id int) (nvml.GpuInstance, nvml.Return) {
	found := false
	d.lib.mig.view(func(st *simMIGState) { found = d.migGPU(st).gi(uint32(id)) != nil })
	if !found {
		return nil, nvml.ERROR_NOT_FOUND
	}
	return &simGpuInstance{dev: d, id: uint32(id)}, nvml.SUCCESS
}

func (d *simDevice) GetMaxMigDeviceCount() (int, nvml.Return) {
	return int(d.maxSlices()), nvml.SUCCESS
}

// GetMigDeviceHandleByIndex returns the index-th MIG device (compute instance) of
// the GPU, ordered by GPU instance and compute instance ID.
func (d *simDevice) GetMigDeviceHandleByIndex(index int) (nvml.Device, nvml.Return) {
	var all []*simMigDevice
	d.lib.mig.view(func(st *simMIGState) {
		for _, gi := range d.migGPU(st).GIs {
			for _, ci := range gi.CIs {
				all = append(all, &simMigDevice{parent: d, gi: gi.ID, ci: ci.ID, uuid: ci.UUID})
			}
		}
	})
	slices.SortFunc(all, func(a, b *simMigDevice) int {
		if a.gi != b.gi {
			return int(a.gi) - int(b.gi)
		}
		return int(a.ci) - int(b.ci)
	})
	if index < 0 || index >= len(all) {
		return nil, nvml.ERROR_NOT_FOUND
	}
	return all[index], nvml.SUCCESS
}

// simGpuInstance is a handle to GPU instance id of dev; it reads the state on each
// call, so a destroyed instance answers ERROR_NOT_FOUND.
type simGpuInstance struct {
	nvml.GpuInstance // nil: only the methods below are called
	dev              *simDevice
	id               uint32
}

func (g *simGpuInstance) read(f func(gi *simGI)) nvml.Return {
	ret := nvml.ERROR_NOT_FOUND
	g.dev.lib.mig.view(func(st *simMIGState) {
		if gi := g.dev.migGPU(st).gi(g.id); gi != nil {
			f(gi)
			ret = nvml.SUCCESS
		}
	})
	return ret
}

func (g *simGpuInstance) GetInfo() (nvml.GpuInstanceInfo, nvml.Return) {
	var info nvml.GpuInstanceInfo
	ret := g.read(func(gi *simGI) {
		info = nvml.GpuInstanceInfo{Device: g.dev, Id: gi.ID, ProfileId: gi.ProfileID,
			Placement: nvml.GpuInstancePlacement{Start: gi.Start, Size: gi.Size}}
	})
	return info, ret
}

func (g *simGpuInstance) profile() (uint32, nvml.Return) {
	var p uint32
	return p, g.read(func(gi *simGI) { p = gi.ProfileID })
}

func (g *simGpuInstance) GetComputeInstanceProfileInfo(profile, engine int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	gp, ret := g.profile()
	if ret != nvml.SUCCESS {
		return nvml.ComputeInstanceProfileInfo{}, ret
	}
	if engine != nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
		return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
	}
	info, ok := g.dev.mock.Config.MIGProfiles.ComputeInstanceProfiles[int(gp)][profile]
	if !ok {
		return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
	}
	return info, nvml.SUCCESS
}

func (g *simGpuInstance) CreateComputeInstance(info *nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
	if info == nil {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if f := g.dev.lib.mig.fail; f != nil {
		if ret := f("compute-instance", g.dev.index); ret != nvml.SUCCESS {
			return nil, ret
		}
	}
	profiles := g.dev.mock.Config.MIGProfiles
	var id uint32
	ret := g.dev.lib.mig.update(func(st *simMIGState) nvml.Return {
		gi := g.dev.migGPU(st).gi(g.id)
		if gi == nil {
			return nvml.ERROR_NOT_FOUND
		}
		prof, ok := profiles.ComputeInstanceProfiles[int(gi.ProfileID)][int(info.Id)]
		if !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		used := prof.SliceCount
		for _, ci := range gi.CIs {
			used += profiles.ComputeInstanceProfiles[int(gi.ProfileID)][int(ci.ProfileID)].SliceCount
		}
		if used > profiles.GpuInstanceProfiles[int(gi.ProfileID)].SliceCount {
			return nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		id = gi.NextCI
		gi.NextCI++
		gi.CIs = append(gi.CIs, &simCI{ID: id, ProfileID: prof.Id, UUID: "MIG-" + uuid.NewString()})
		return nvml.SUCCESS
	})
	if ret != nvml.SUCCESS {
		return nil, ret
	}
	return &simComputeInstance{gi: g, id: id}, nvml.SUCCESS
}

func (g *simGpuInstance) GetComputeInstances(info *nvml.ComputeInstanceProfileInfo) ([]nvml.ComputeInstance, nvml.Return) {
	if info == nil {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	var out []nvml.ComputeInstance
	ret := g.read(func(gi *simGI) {
		for _, ci := range gi.CIs {
			if ci.ProfileID == info.Id {
				out = append(out, &simComputeInstance{gi: g, id: ci.ID})
			}
		}
	})
	return out, ret
}

// Destroy removes the GPU instance; like NVML, it refuses while compute instances
// remain (ERROR_IN_USE).
func (g *simGpuInstance) Destroy() nvml.Return {
	return g.dev.lib.mig.update(func(st *simMIGState) nvml.Return {
		mg := g.dev.migGPU(st)
		i := slices.IndexFunc(mg.GIs, func(gi *simGI) bool { return gi.ID == g.id })
		switch {
		case i < 0:
			return nvml.ERROR_NOT_FOUND
		case len(mg.GIs[i].CIs) > 0:
			return nvml.ERROR_IN_USE
		}
		mg.GIs = slices.Delete(mg.GIs, i, i+1)
		return nvml.SUCCESS
	})
}

// simComputeInstance is a handle to compute instance id of a GPU instance.
type simComputeInstance struct {
	nvml.ComputeInstance // nil: only the methods below are called
	gi                   *simGpuInstance
	id                   uint32
}

func (c *simComputeInstance) GetInfo() (nvml.ComputeInstanceInfo, nvml.Return) {
	var info nvml.ComputeInstanceInfo
	ret := nvml.ERROR_NOT_FOUND
	c.gi.read(func(gi *simGI) {
		for _, ci := range gi.CIs {
			if ci.ID == c.id {
				info = nvml.ComputeInstanceInfo{Device: c.gi.dev, GpuInstance: c.gi, Id: ci.ID, ProfileId: ci.ProfileID}
				ret = nvml.SUCCESS
			}
		}
	})
	return info, ret
}

func (c *simComputeInstance) Destroy() nvml.Return {
	return c.gi.dev.lib.mig.update(func(st *simMIGState) nvml.Return {
		gi := c.gi.dev.migGPU(st).gi(c.gi.id)
		if gi == nil {
			return nvml.ERROR_NOT_FOUND
		}
		i := slices.IndexFunc(gi.CIs, func(ci *simCI) bool { return ci.ID == c.id })
		if i < 0 {
			return nvml.ERROR_NOT_FOUND
		}
		gi.CIs = slices.Delete(gi.CIs, i, i+1)
		return nvml.SUCCESS
	})
}

// simMigDevice is the device handle of one MIG device (a compute instance).
type simMigDevice struct {
	nvml.Device // nil: only the methods below are called
	parent      *simDevice
	gi, ci      uint32
	uuid        string
}

func (m *simMigDevice) GetUUID() (string, nvml.Return)           { return m.uuid, nvml.SUCCESS }
func (m *simMigDevice) GetGpuInstanceId() (int, nvml.Return)     { return int(m.gi), nvml.SUCCESS }
func (m *simMigDevice) GetComputeInstanceId() (int, nvml.Return) { return int(m.ci), nvml.SUCCESS }
func (m *simMigDevice) IsMigDeviceHandle() (bool, nvml.Return)   { return true, nvml.SUCCESS }
func (m *simMigDevice) GetDeviceHandleFromMigDeviceHandle() (nvml.Device, nvml.Return) {
	return m.parent, nvml.SUCCESS
}
