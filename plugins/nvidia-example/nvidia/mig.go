package nvidia

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// gpuMode is how the plugin offers one GPU.
type gpuMode int

const (
	// modeWhole: the whole GPU, and its time-sliced replicas when replicas is set.
	modeWhole gpuMode = iota
	// modeOnDemand: the whole GPU and every MIG profile at every placement, consuming
	// the GPU's counters; Reserve creates the instance.
	modeOnDemand
	// modeStatic: the MIG devices that exist (mig_layout created the missing ones).
	modeStatic
)

// migProfile is one GPU instance profile a MIG-enabled GPU offers.
type migProfile struct {
	name       string // "1g.10gb", as nvidia-smi and NVIDIA's device plugins name it
	info       nvml.GpuInstanceProfileInfo
	placements []nvml.GpuInstancePlacement
}

// migDevice is a MIG device that exists: a compute instance in a GPU instance.
type migDevice struct {
	dev       nvml.Device // its MIG device handle
	uuid      string      // "MIG-..."
	gi, ci    int
	profile   *migProfile // nil when its profile is not one the plugin knows
	placement nvml.GpuInstancePlacement
}

// gpuPlan is how one GPU is offered, as read at a scan.
type gpuPlan struct {
	mode          gpuMode
	profiles      []*migProfile // MIG modes only
	offered       []*migProfile // modeOnDemand: the profiles whose placements are offered (mig_profiles)
	memSlices     uint32        // the memory slices placements cover
	computeSlices uint32
	static        []migDevice // modeStatic: the GPU's MIG devices
	replicas      int         // modeWhole: time-sliced replicas, 0 for none
	mps           int         // MPS shares per device (a whole GPU, a static MIG device or an on-demand placement), 0 for none
	memMiB        int64       // modeWhole: the GPU's memory, which its MPS shares divide
}

// Counter names of a GPU's counter set (see gpuPlan.counters).
const (
	counterComputeSlices = "compute-slices"
	counterTimeSlices    = "time-slices"
)

// Compatibility groups of a GPU's uses when it is offered both time-sliced and in MPS
// shares (sharing = ["time-slicing", "mps"]): the host never lets the two hold one GPU
// at once. The names are the sharing modes'.
const (
	groupTimeSlicing = SharingTimeSlicing
	groupMPS         = SharingMPS
)

func memorySliceCounter(i uint32) string { return fmt.Sprintf("memory-slice-%d", i) }

func instancesCounter(profile string) string { return "instances-" + profile }

// hasCounters says whether the GPU shares capacity between its devices.
func (p *gpuPlan) hasCounters() bool {
	return p.mode == modeOnDemand || p.replicas > 0 || p.mode == modeWhole && p.mps > 0
}

// counters is the capacity of the GPU's counter set: for on-demand MIG one counter
// per memory slice (capacity 1, so placements that overlap conflict), its compute
// slices, and, for a profile that allows fewer instances than it has placements
// (1g.10gb+me: one), its instance count; for replicas, its time slices; for MPS
// shares of a whole GPU, its memory and compute as its shares divide them. With MPS
// shares of on-demand placements every on-demand counter is N times as large (see
// partitionUse).
func (p *gpuPlan) counters() map[string]int64 {
	c := make(map[string]int64)
	if p.mode == modeOnDemand {
		n := p.partitionScale()
		for i := range p.memSlices {
			c[memorySliceCounter(i)] = n
		}
		c[counterComputeSlices] = int64(p.computeSlices) * n
		for _, prof := range p.profiles {
			if limited(prof) {
				c[instancesCounter(prof.name)] = int64(prof.info.InstanceCount) * n
			}
		}
	}
	if p.replicas > 0 {
		c[counterTimeSlices] = int64(p.replicas)
	}
	if p.mode == modeWhole && p.mps > 0 {
		maps.Copy(c, mpsShare(p.memMiB, p.mps).times(p.mps).counters())
	}
	return c
}

func limited(p *migProfile) bool { return int(p.info.InstanceCount) < len(p.placements) }

// partitionScale is what an on-demand GPU's counters are multiplied by: its MPS
// shares per placement, or 1 without MPS.
func (p *gpuPlan) partitionScale() int64 { return int64(max(p.mps, 1)) }

// partitionUse is what profile at placement consumes of its GPU's counters, times
// scale. A whole on-demand MIG device consumes its placement times the GPU's
// partitionScale; one MPS share of it consumes the placement once, so its N shares
// together take what the device takes. Shares of two different placements that
// overlap fit the counters (1 + 1 of N), but never the hardware: the second
// placement's instance cannot be created while the first exists, and its Reserve is
// refused then (additive counters cannot say "the same placement's shares only").
func partitionUse(prof *migProfile, pl nvml.GpuInstancePlacement, scale int64) map[string]int64 {
	c := map[string]int64{counterComputeSlices: int64(prof.info.SliceCount) * scale}
	for s := pl.Start; s < pl.Start+pl.Size; s++ {
		c[memorySliceCounter(s)] = scale
	}
	if limited(prof) {
		c[instancesCounter(prof.name)] = scale
	}
	return c
}

// partitionID is the device ID of an on-demand MIG device, e.g.
// "GPU-<uuid>-mig-1g.10gb-3": stable before the instance exists and the same after
// every restart. It is also the device's CDI name, so a profile's "+" becomes "_"
// (CDI names allow letters, digits and "-_.:").
func partitionID(gpuUUID, profile string, start uint32) string {
	return fmt.Sprintf("%s-mig-%s-%d", gpuUUID, strings.ReplaceAll(profile, "+", "_"), start)
}

// replicaID is the device ID of time-sliced replica k of a GPU, as NVIDIA's device
// plugin names replicas.
func replicaID(gpuUUID string, k int) string { return fmt.Sprintf("%s::%d", gpuUUID, k) }

// profileSuffix names the media-engine and graphics variants as nvidia-smi does.
var profileSuffix = map[int]string{
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1:   "+me",
	nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1:   "+me",
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_GFX:    "+gfx",
	nvml.GPU_INSTANCE_PROFILE_2_SLICE_GFX:    "+gfx",
	nvml.GPU_INSTANCE_PROFILE_4_SLICE_GFX:    "+gfx",
	nvml.GPU_INSTANCE_PROFILE_3_SLICE_GFX:    "+gfx",
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_NO_ME:  "-me",
	nvml.GPU_INSTANCE_PROFILE_2_SLICE_NO_ME:  "-me",
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME: "+me.all",
	nvml.GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME: "+me.all",
}

// profileName is "<slices>g.<GB>gb" plus the variant's suffix. With totalBytes, the
// memory is rounded as NVIDIA's device plugin does (up to the next eighth of the
// GPU's memory, times the GPU's memory in whole GB), which gives the names nvidia-smi
// shows; with 0, it is the profile's own memory rounded up to whole GB.
func profileName(info nvml.GpuInstanceProfileInfo, totalBytes uint64) string {
	const mib, gib = 1 << 20, 1 << 30
	gb := math.Ceil(float64(info.MemorySizeMB) / 1024)
	if totalBytes > 0 {
		frac := float64(info.MemorySizeMB) * mib / float64(totalBytes)
		frac = math.Ceil(frac*8) / 8
		gb = math.Round(frac * float64((totalBytes+gib-1)/gib))
	}
	return fmt.Sprintf("%dg.%dgb%s", info.SliceCount, uint64(gb), profileSuffix[int(info.Id)])
}

// readProfiles reads the GPU instance profiles of a MIG-enabled GPU, with their
// placements. Profiles without placements are left out. When NVIDIA's rounding
// gives two profiles one name (go-nvml's H200 and B200 mocks carry memory sizes no
// real GPU has), the GPU's profiles are named by their own memory instead.
func readProfiles(dev nvml.Device, totalBytes uint64) []*migProfile {
	var out []*migProfile
	for id := range nvml.GPU_INSTANCE_PROFILE_COUNT {
		info, ret := dev.GetGpuInstanceProfileInfo(id)
		if ret != nvml.SUCCESS {
			continue
		}
		pls, ret := dev.GetGpuInstancePossiblePlacements(&info)
		if ret != nvml.SUCCESS || len(pls) == 0 {
			continue
		}
		out = append(out, &migProfile{info: info, placements: pls})
	}
	for _, total := range []uint64{totalBytes, 0} {
		seen := make(map[string]bool)
		for _, p := range out {
			p.name = profileName(p.info, total)
			seen[p.name] = true
		}
		if len(seen) == len(out) {
			return out
		}
	}
	seen := make(map[string]bool)
	return slices.DeleteFunc(out, func(p *migProfile) bool {
		dup := seen[p.name]
		seen[p.name] = true
		return dup
	})
}

// planGPU decides how g is offered: by MIG when the config asks for it and the GPU's
// MIG mode is on (the plugin never changes MIG mode), else whole.
func (rt *runtime) planGPU(g gpu) gpuPlan {
	p := gpuPlan{mode: modeWhole}
	if rt.wantsMIG(g.index) {
		if cur, _, ret := g.dev.GetMigMode(); ret == nvml.SUCCESS && cur == nvml.DEVICE_MIG_ENABLE {
			var total uint64
			if mem, ret := g.dev.GetMemoryInfo(); ret == nvml.SUCCESS {
				total = mem.Total
			}
			p.profiles = readProfiles(g.dev, total)
		}
		if len(p.profiles) > 0 {
			p.mode = modeOnDemand
			if _, _, static := rt.layoutFor(g.index); static {
				p.mode = modeStatic
			}
			for _, prof := range p.profiles {
				p.computeSlices = max(p.computeSlices, prof.info.SliceCount)
				for _, pl := range prof.placements {
					p.memSlices = max(p.memSlices, pl.Start+pl.Size)
				}
			}
		}
	}
	switch p.mode {
	case modeStatic:
		p.static = readMIGDevices(g, p.profiles)
		p.mps = rt.mps.shares
	case modeOnDemand:
		p.mps = rt.mps.shares
		// The counters above come from every profile: a placement's use of them is
		// the same whichever profiles are offered.
		p.offered = p.profiles
		if rt.migProfiles != nil {
			p.offered = slices.DeleteFunc(slices.Clone(p.profiles), func(m *migProfile) bool { return !slices.Contains(rt.migProfiles, m.name) })
		}
	case modeWhole:
		p.replicas = rt.replicas
		if rt.mps.shares > 0 {
			if mem, ret := g.dev.GetMemoryInfo(); ret == nvml.SUCCESS {
				p.mps, p.memMiB = rt.mps.shares, int64(mem.Total>>20)
			} else {
				rt.logger.Warn("GPU offers no MPS shares: its memory is unknown", "gpu", g.uuid, "error", ret)
			}
		}
	}
	return p
}

// readMIGDevices lists the MIG devices on g; with profiles, each with its GPU
// instance's profile and placement.
func readMIGDevices(g gpu, profiles []*migProfile) []migDevice {
	n, ret := g.dev.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return nil
	}
	var out []migDevice
	for i := range n {
		md, ret := g.dev.GetMigDeviceHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue // NVML answers NOT_FOUND for the empty slots
		}
		m := migDevice{dev: md}
		var r1, r2, r3 nvml.Return
		m.uuid, r1 = md.GetUUID()
		m.gi, r2 = md.GetGpuInstanceId()
		m.ci, r3 = md.GetComputeInstanceId()
		if r1 != nvml.SUCCESS || r2 != nvml.SUCCESS || r3 != nvml.SUCCESS {
			continue
		}
		if profiles == nil {
			out = append(out, m)
			continue
		}
		if gi, ret := g.dev.GetGpuInstanceById(m.gi); ret == nvml.SUCCESS {
			if info, ret := gi.GetInfo(); ret == nvml.SUCCESS {
				m.placement = info.Placement
				for _, p := range profiles {
					if p.info.Id == info.ProfileId {
						m.profile = p
					}
				}
			}
		}
		out = append(out, m)
	}
	return out
}

// gpuInstance is a GPU instance that exists, with its profile.
type gpuInstance struct {
	gi      nvml.GpuInstance
	info    nvml.GpuInstanceInfo
	profile *migProfile
}

// listGPUInstances returns the GPU instances on g of the given profiles.
func listGPUInstances(g gpu, profiles []*migProfile) ([]gpuInstance, error) {
	var out []gpuInstance
	for _, p := range profiles {
		gis, ret := g.dev.GetGpuInstances(&p.info)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("nvml: GPU %s: listing %s instances: %w", g.uuid, p.name, ret)
		}
		for _, gi := range gis {
			info, ret := gi.GetInfo()
			if ret != nvml.SUCCESS {
				return nil, fmt.Errorf("nvml: GPU %s: %s instance: %w", g.uuid, p.name, ret)
			}
			out = append(out, gpuInstance{gi: gi, info: info, profile: p})
		}
	}
	return out, nil
}

// migUUIDOf returns the UUID of a MIG device in GPU instance giID of g, if any.
func migUUIDOf(g gpu, giID uint32) (string, bool) {
	for _, m := range readMIGDevices(g, nil) {
		if m.gi == int(giID) {
			return m.uuid, true
		}
	}
	return "", false
}

// createComputeInstance creates, in gi of profile prof, the compute instance that
// takes all of it.
func createComputeInstance(gi nvml.GpuInstance, prof *migProfile) (nvml.ComputeInstance, error) {
	var best nvml.ComputeInstanceProfileInfo
	found := false
	for id := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		info, ret := gi.GetComputeInstanceProfileInfo(id, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret != nvml.SUCCESS || info.SliceCount > prof.info.SliceCount {
			continue
		}
		if !found || info.SliceCount > best.SliceCount {
			best, found = info, true
		}
	}
	if !found {
		return nil, fmt.Errorf("nvml: %s instance: no compute instance profile", prof.name)
	}
	ci, ret := gi.CreateComputeInstance(&best)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvml: creating the compute instance of a %s instance: %w", prof.name, ret)
	}
	return ci, nil
}

// destroyGPUInstance destroys gi's compute instances, then gi. Instances already gone
// count as destroyed.
func destroyGPUInstance(gi nvml.GpuInstance) error {
	var errs []error
	for id := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		info, ret := gi.GetComputeInstanceProfileInfo(id, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret != nvml.SUCCESS {
			continue
		}
		cis, ret := gi.GetComputeInstances(&info)
		if ret != nvml.SUCCESS {
			continue
		}
		for _, ci := range cis {
			if ret := ci.Destroy(); ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_FOUND {
				errs = append(errs, fmt.Errorf("nvml: destroying a compute instance: %w", ret))
			}
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if ret := gi.Destroy(); ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_FOUND {
		return fmt.Errorf("nvml: destroying a GPU instance: %w", ret)
	}
	return nil
}

// createPartition creates the GPU instance of prof at pl on g, and its compute
// instance, and returns the MIG device's UUID. An instance already there (one left
// by a Reserve whose answer was never recorded) is adopted, its compute instance
// created if it has none; created says whether anything was made. On failure nothing
// this call made is left behind. Called with the plugin's MIG lock held.
func createPartition(g gpu, prof *migProfile, pl nvml.GpuInstancePlacement) (uuid string, created bool, err error) {
	existing, err := listGPUInstances(g, []*migProfile{prof})
	if err != nil {
		return "", false, err
	}
	for _, e := range existing {
		if e.info.Placement.Start != pl.Start {
			continue
		}
		if id, ok := migUUIDOf(g, e.info.Id); ok {
			return id, false, nil
		}
		if _, err := createComputeInstance(e.gi, prof); err != nil {
			return "", false, err
		}
		if id, ok := migUUIDOf(g, e.info.Id); ok {
			return id, true, nil
		}
		return "", false, fmt.Errorf("nvml: GPU %s: the %s instance at %d has no MIG device", g.uuid, prof.name, pl.Start)
	}
	gi, ret := g.dev.CreateGpuInstanceWithPlacement(&prof.info, &pl)
	if ret != nvml.SUCCESS {
		return "", false, fmt.Errorf("nvml: GPU %s: creating a %s instance at placement %d: %w", g.uuid, prof.name, pl.Start, ret)
	}
	undo := func(cause error) (string, bool, error) {
		if err := destroyGPUInstance(gi); err != nil {
			return "", false, errors.Join(cause, fmt.Errorf("and the GPU instance it made was not destroyed: %w", err))
		}
		return "", false, cause
	}
	if _, err := createComputeInstance(gi, prof); err != nil {
		return undo(err)
	}
	info, ret := gi.GetInfo()
	if ret != nvml.SUCCESS {
		return undo(fmt.Errorf("nvml: GPU %s: reading the new %s instance: %w", g.uuid, prof.name, ret))
	}
	id, ok := migUUIDOf(g, info.Id)
	if !ok {
		return undo(fmt.Errorf("nvml: GPU %s: the new %s instance has no MIG device", g.uuid, prof.name))
	}
	return id, true, nil
}

// destroyPartition destroys the instance of prof at start on g, if there is one.
// Called with the plugin's MIG lock held.
func destroyPartition(g gpu, prof *migProfile, start uint32) error {
	existing, err := listGPUInstances(g, []*migProfile{prof})
	if err != nil {
		return err
	}
	for _, e := range existing {
		if e.info.Placement.Start == start {
			if err := destroyGPUInstance(e.gi); err != nil {
				return fmt.Errorf("GPU %s: %s instance at %d: %w", g.uuid, prof.name, start, err)
			}
		}
	}
	return nil
}

// reportMIGModes logs, for mig = "on-demand", the GPUs that stay whole because their
// MIG mode is off or they cannot do MIG.
func (rt *runtime) reportMIGModes() {
	if !rt.migOnDemand {
		return
	}
	gpus, _, err := rt.listGPUs()
	if err != nil {
		return
	}
	var off, unable []int
	for _, g := range gpus {
		if _, _, static := rt.layoutFor(g.index); static {
			continue
		}
		switch cur, _, ret := g.dev.GetMigMode(); {
		case ret != nvml.SUCCESS:
			unable = append(unable, g.index)
		case cur != nvml.DEVICE_MIG_ENABLE:
			off = append(off, g.index)
		}
	}
	if len(off) > 0 {
		rt.logger.Warn(`mig = "on-demand": these GPUs have MIG mode off and are offered whole; enable it with nvidia-smi -i <index> -mig 1 (the plugin never changes it)`,
			"gpu_indexes", off)
	}
	if len(unable) > 0 {
		rt.logger.Info(`mig = "on-demand": these GPUs cannot do MIG and are offered whole`, "gpu_indexes", unable)
	}
}

// checkOffered refuses a mig_profiles name that no GPU offered on demand has.
func (rt *runtime) checkOffered(gpus []gpu) error {
	has := map[string]bool{}
	var names []string
	for _, g := range gpus {
		plan := rt.planGPU(g)
		if plan.mode != modeOnDemand {
			continue
		}
		for _, p := range plan.profiles {
			if !has[p.name] {
				has[p.name] = true
				names = append(names, p.name)
			}
		}
	}
	for _, n := range rt.migProfiles {
		if !has[n] {
			if len(names) == 0 {
				return fmt.Errorf("config: mig_profiles: %q: no GPU is offered on demand (MIG mode off or not MIG-capable)", n)
			}
			return fmt.Errorf("config: mig_profiles: %q is a profile of no GPU offered on demand (they offer %s)", n, strings.Join(names, ", "))
		}
	}
	return nil
}

// applyLayout makes the GPUs that mig_layout names hold their layout: instances the
// layout needs are created, instances already there are kept (those the layout does
// not name are left alone and logged). A profile a GPU does not offer refuses the
// config; a GPU whose MIG mode is off is logged and offered whole.
func (rt *runtime) applyLayout() error {
	if rt.layoutAll == "" && len(rt.layout) == 0 && rt.migProfiles == nil {
		return nil
	}
	gpus, _, err := rt.listGPUs()
	if err != nil {
		return err
	}
	if err := rt.checkOffered(gpus); err != nil {
		return err
	}
	if rt.layoutAll == "" && len(rt.layout) == 0 {
		return nil
	}
	byIndex := make(map[int]gpu)
	for _, g := range gpus {
		byIndex[g.index] = g
	}
	for i := range rt.layout {
		if _, ok := byIndex[i]; !ok {
			return fmt.Errorf("config: mig_layout[%q]: no such GPU (or it is ignored)", fmt.Sprint(i))
		}
	}
	var errs []error
	for _, g := range gpus {
		if _, _, ok := rt.layoutFor(g.index); !ok {
			continue
		}
		plan := rt.planGPU(g)
		if plan.mode != modeStatic {
			rt.logger.Warn("mig_layout not applied: MIG mode is off on this GPU (or it has no MIG profiles); enable it with nvidia-smi -i <index> -mig 1, the plugin never changes it",
				"gpu", g.uuid, "index", g.index)
			continue
		}
		if err := rt.applyGPULayout(g, plan); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (rt *runtime) applyGPULayout(g gpu, plan gpuPlan) error {
	byName := make(map[string]*migProfile)
	var names []string
	for _, p := range plan.profiles {
		byName[p.name] = p
		names = append(names, p.name)
	}
	list, fill, _ := rt.layoutFor(g.index)
	key := fmt.Sprintf("mig_layout[%q]", fmt.Sprint(g.index))
	if fill != "" {
		key = "mig_layout"
		p, ok := byName[fill]
		if !ok {
			return fmt.Errorf("config: %s = %q: GPU %d does not offer it (it offers %s)", key, fill, g.index, strings.Join(names, ", "))
		}
		list = slices.Repeat([]string{fill}, min(int(p.info.InstanceCount), len(p.placements)))
	}
	var want []*migProfile
	for _, n := range list {
		p, ok := byName[n]
		if !ok {
			return fmt.Errorf("config: %s: GPU %d does not offer profile %q (it offers %s)", key, g.index, n, strings.Join(names, ", "))
		}
		want = append(want, p)
	}

	rt.migMu.Lock()
	defer rt.migMu.Unlock()
	existing, err := listGPUInstances(g, plan.profiles)
	if err != nil {
		return err
	}
	var used []nvml.GpuInstancePlacement
	for _, e := range existing {
		used = append(used, e.info.Placement)
		if i := slices.Index(want, e.profile); i >= 0 {
			want = slices.Delete(want, i, i+1)
			if _, ok := migUUIDOf(g, e.info.Id); !ok {
				if _, err := createComputeInstance(e.gi, e.profile); err != nil {
					rt.logger.Error("mig_layout: compute instance not created", "gpu", g.uuid, "profile", e.profile.name, "error", err)
				}
			}
			continue
		}
		rt.logger.Warn("mig_layout: instance not in the layout, left alone", "gpu", g.uuid, "profile", e.profile.name,
			"placement", e.info.Placement.Start)
	}
	// Largest first, each at the first placement that overlaps nothing.
	slices.SortStableFunc(want, func(a, b *migProfile) int { return int(b.info.SliceCount) - int(a.info.SliceCount) })
	created := 0
	for _, p := range want {
		i := slices.IndexFunc(p.placements, func(pl nvml.GpuInstancePlacement) bool {
			return !slices.ContainsFunc(used, func(u nvml.GpuInstancePlacement) bool {
				return u.Start < pl.Start+pl.Size && pl.Start < u.Start+u.Size
			})
		})
		if i < 0 {
			if fill == "" {
				rt.logger.Error("mig_layout: no free placement for a profile", "gpu", g.uuid, "profile", p.name)
			}
			continue
		}
		if _, _, err := createPartition(g, p, p.placements[i]); err != nil {
			if fill == "" {
				rt.logger.Error("mig_layout: instance not created", "gpu", g.uuid, "profile", p.name, "error", err)
			}
			continue
		}
		used = append(used, p.placements[i])
		created++
	}
	rt.logger.Info("mig_layout applied", "gpu", g.uuid, "index", g.index, "created", created, "kept", len(existing))
	return nil
}

// partitionRefusal is the error of a Reserve of ids whose on-demand placement t could
// not be made: FAILED_PRECONDITION when the GPU has no room for it, naming the
// instances in its way (a placement's MPS shares share its one instance, but shares of
// two placements that overlap cannot both have one, though the counters let them by).
func (rt *runtime) partitionRefusal(inv *inventory, ids []string, t target, err error) error {
	code := codes.Internal
	if errors.Is(err, nvml.ERROR_INSUFFICIENT_RESOURCES) || errors.Is(err, nvml.ERROR_IN_USE) {
		code = codes.FailedPrecondition
		g := inv.gpus[t.gpu]
		var inWay []string
		if existing, lerr := listGPUInstances(g, inv.plans[t.gpu].profiles); lerr == nil {
			for _, e := range existing {
				pl := e.info.Placement
				if pl.Start < t.placement.Start+t.placement.Size && t.placement.Start < pl.Start+pl.Size {
					inWay = append(inWay, partitionID(g.uuid, e.profile.name, pl.Start))
				}
			}
		}
		if len(inWay) > 0 {
			err = fmt.Errorf("%w: its placement overlaps the MIG instance of %s, held whole or in MPS shares", err, strings.Join(inWay, ", "))
		}
	}
	return status.Errorf(code, "reserve %s: %v", strings.Join(ids, ", "), err)
}
