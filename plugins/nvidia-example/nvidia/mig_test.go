package nvidia

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/deviceplugin"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

const h100 = "NVIDIA H100 80GB HBM3"

// onDemand is the config of an on-demand DGX H100 whose MIG state is in statePath.
func onDemand(statePath string) Config {
	return Config{Simulate: "dgxh100", MIG: MIGOnDemand, SimStateFile: ptr(statePath)}
}

// fingerprintOf takes one fingerprint of p and checks it passes the host's checks.
func fingerprintOf(t *testing.T, p *Plugin) *pb.FingerprintResponse {
	t.Helper()
	s := startFingerprint(t, p)
	resp := s.next(t)
	if err := s.stop(t); err != nil {
		t.Errorf("Fingerprint returned %v after cancel", err)
	}
	if err := validate.Fingerprint(resp); err != nil {
		t.Errorf("validate.Fingerprint: %v", err)
	}
	return resp
}

// groupSizes maps "vendor/type/name" to its number of devices.
func groupSizes(resp *pb.FingerprintResponse) map[string]int {
	out := make(map[string]int)
	for _, g := range resp.GetGroups() {
		out[g.GetVendor()+"/"+g.GetType()+"/"+g.GetName()] = len(g.GetDevices())
	}
	return out
}

// fits is the host's shared-capacity rule, computed from what the fingerprint
// declares: the devices can be held together only if no counter goes over its
// capacity. It returns the first counter that would, or "".
func fits(resp *pb.FingerprintResponse, held ...string) string {
	caps := make(map[string]map[string]int64)
	for _, s := range resp.GetCounterSets() {
		caps[s.GetName()] = s.GetCounters()
	}
	devs := devices(resp)
	use := make(map[string]int64)
	for _, id := range held {
		for _, c := range devs[id].GetConsumes() {
			for name, n := range c.GetCounters() {
				k := c.GetCounterSet() + "/" + name
				use[k] += n
				if use[k] > caps[c.GetCounterSet()][name] {
					return k
				}
			}
		}
	}
	return ""
}

func simOf(t *testing.T, p *Plugin) *simLib {
	t.Helper()
	rt, err := p.runtime()
	if err != nil {
		t.Fatal(err)
	}
	return rt.lib.(*simLib)
}

// simInstances returns the GPU instances of simulated GPU index, with their
// compute instances' MIG UUIDs: "<profile id>@<start>" -> UUIDs.
func simInstances(sim *simLib, index int) map[string][]string {
	out := make(map[string][]string)
	sim.mig.view(func(st *simMIGState) {
		for _, gi := range st.GPUs[index].GIs {
			k := fmt.Sprintf("%d@%d", gi.ProfileID, gi.Start)
			out[k] = []string{}
			for _, ci := range gi.CIs {
				out[k] = append(out[k], ci.UUID)
			}
		}
	})
	return out
}

// gpuDevices are the IDs of the devices of simulated dgxh100 GPU index, any group.
func gpuDevices(resp *pb.FingerprintResponse, index int) []string {
	prefix := simulatedUUID("dgxh100", index)
	var out []string
	for id := range devices(resp) {
		if strings.HasPrefix(id, prefix) {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

func onDemandIDs(index int, profile string, starts ...uint32) []string {
	var out []string
	for _, s := range starts {
		out = append(out, partitionID(simulatedUUID("dgxh100", index), profile, s))
	}
	return out
}

// An on-demand DGX H100 offers its 8 GPUs whole and every profile at every placement,
// each device consuming its GPU's counters.
func TestMIGOnDemandFingerprint(t *testing.T) {
	p, _ := newTestPlugin(t, onDemand(filepath.Join(t.TempDir(), "sim.json")))
	resp := fingerprintOf(t, p)
	got := groupSizes(resp)
	want := map[string]int{
		"nvidia/gpu/" + h100:    8,
		"nvidia/mig/1g.10gb":    56,
		"nvidia/mig/1g.10gb+me": 56,
		"nvidia/mig/1g.20gb":    56,
		"nvidia/mig/2g.20gb":    24,
		"nvidia/mig/3g.40gb":    16,
		"nvidia/mig/4g.40gb":    8,
		"nvidia/mig/7g.80gb":    8,
	}
	if !maps.Equal(got, want) {
		t.Errorf("groups = %v, want %v", got, want)
	}
	if n := len(resp.GetCounterSets()); n != 8 {
		t.Errorf("%d counter sets, want one per GPU", n)
	}
	gpu0 := simulatedUUID("dgxh100", 0)
	d := devices(resp)[onDemandIDs(0, "2g.20gb", 2)[0]]
	wantUse := map[string]int64{"memory-slice-2": 1, "memory-slice-3": 1, "compute-slices": 2}
	if c := d.GetConsumes(); len(c) != 1 || c[0].GetCounterSet() != gpu0 || !maps.Equal(c[0].GetCounters(), wantUse) {
		t.Errorf("2g.20gb at 2 consumes %v, want %v of %s", c, wantUse, gpu0)
	}
	for _, id := range gpuDevices(resp, 0) {
		if id != gpu0 && fits(resp, gpu0, id) == "" {
			t.Errorf("the whole GPU and %s fit together", id)
		}
	}
	if d := devices(resp)[gpu0]; d.GetLocality().GetPciBusId() == "" {
		t.Errorf("GPU 0 has no PCI bus ID")
	}
	t.Logf("on-demand DGX H100: %d devices, %d counter sets, %d bytes (limit %d)",
		len(devices(resp)), len(resp.GetCounterSets()), proto.Size(resp), validate.MaxFingerprintBytes)
}

// A node that mixes MIG-enabled and whole GPUs: with sim_mig_mode_off the simulated
// operator turns MIG mode off on those GPUs, which on-demand MIG then offers whole,
// consuming no counters; a GPU that still has instances keeps MIG mode on and the
// config is refused, naming it.
func TestMIGOnDemandMixedNode(t *testing.T) {
	state := filepath.Join(t.TempDir(), "sim.json")
	cfg := onDemand(state)
	cfg.SimMIGModeOff = []int{4, 5, 6, 7}
	p, _ := newTestPlugin(t, cfg)
	resp := fingerprintOf(t, p)
	got := groupSizes(resp)
	if got["nvidia/gpu/"+h100] != 8 || got["nvidia/mig/1g.10gb"] != 28 || got["nvidia/mig/7g.80gb"] != 4 {
		t.Errorf("groups = %v, want 8 whole GPUs and MIG partitions on 4 of them", got)
	}
	if n := len(resp.GetCounterSets()); n != 4 {
		t.Errorf("%d counter sets, want one per MIG-enabled GPU (4)", n)
	}
	for i := range 8 {
		d := devices(resp)[simulatedUUID("dgxh100", i)]
		if consumes := len(d.GetConsumes()) > 0; consumes != (i < 4) {
			t.Errorf("GPU %d consumes counters: %v, want %v (MIG mode on: %v)", i, consumes, i < 4, i < 4)
		}
	}

	// The operator's simulated `nvidia-smi -mig 0` refuses a GPU with instances.
	if _, err := p.Reserve(context.Background(), onDemandIDs(0, "1g.10gb", 0)); err != nil {
		t.Fatal(err)
	}
	cfg.SimMIGModeOff = []int{0}
	err := p.SetConfig(context.Background(), mustJSON(t, cfg))
	if err == nil || !strings.Contains(err.Error(), "GPUs [0] still have MIG instances") {
		t.Errorf("SetConfig turning MIG mode off under an instance = %v, want a refusal naming GPU 0", err)
	}
}

// profileNames are the MIG profiles of each simulated machine, as nvidia-smi names
// them, sorted.
var profileNames = map[string][]string{
	"dgxa100": {"1g.10gb", "1g.5gb", "1g.5gb+me", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"},
	"dgxh100": {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
	"dgxh200": {"1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"},
	"dgxb200": {"1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"},
}

// A fully partitionable machine (whole GPUs, every placement of every profile) fits the
// per-plugin fingerprint budget, on every simulated machine, with replicas on top.
func TestMIGFingerprintSize(t *testing.T) {
	for _, m := range machineNames() {
		t.Run(m, func(t *testing.T) {
			p, _ := newTestPlugin(t, Config{Simulate: m, MIG: MIGOnDemand, SimStateFile: ptr("")})
			resp := fingerprintOf(t, p)
			// With the most MPS shares per placement, the fingerprint still passes the
			// host's checks (fingerprintOf) and its size bound.
			shared, _ := newTestPlugin(t, Config{Simulate: m, MIG: MIGOnDemand, SimStateFile: ptr(""),
				Sharing: SharingModes{SharingMPS}, Replicas: MaxOnDemandMPSShares, MPSDir: mpsDir(t)})
			if size := proto.Size(fingerprintOf(t, shared)); size > validate.MaxFingerprintBytes {
				t.Errorf("with %d MPS shares per placement the fingerprint is %d bytes, over %d", MaxOnDemandMPSShares, size, validate.MaxFingerprintBytes)
			}
			size := proto.Size(resp)
			t.Logf("%s fully partitionable: %d devices in %d groups, %d counter sets, %d bytes (limit %d)",
				m, len(devices(resp)), len(resp.GetGroups()), len(resp.GetCounterSets()), size, validate.MaxFingerprintBytes)
			if size > validate.MaxFingerprintBytes {
				t.Errorf("fingerprint is %d bytes, over %d", size, validate.MaxFingerprintBytes)
			}
			var got []string
			for _, g := range resp.GetGroups() {
				if g.GetType() == "mig" {
					got = append(got, g.GetName())
				}
			}
			if want := profileNames[m]; !slices.Equal(got, want) {
				t.Errorf("MIG groups %v, want %v", got, want)
			}
		})
	}
}

// Seven 1g.10gb Reserves on one GPU make seven instances with distinct MIG UUIDs; the
// declared counters then leave room for nothing else on that GPU; Release destroys
// them and the whole GPU fits again.
func TestMIGOnDemandSevenOnOneGPU(t *testing.T) {
	dir := t.TempDir()
	cfg := onDemand(filepath.Join(t.TempDir(), "sim.json"))
	cfg.CDISpecDir = ptr(dir)
	p, _ := newTestPlugin(t, cfg)
	ctx := context.Background()
	resp := fingerprintOf(t, p)
	sim := simOf(t, p)

	ids := onDemandIDs(0, "1g.10gb", 0, 1, 2, 3, 4, 5, 6)
	var held []string
	seen := make(map[string]bool)
	for _, id := range ids {
		held = append(held, id)
		if c := fits(resp, held...); c != "" {
			t.Fatalf("%v do not fit: %s", held, c)
		}
		res, err := p.Reserve(ctx, []string{id})
		if err != nil {
			t.Fatalf("Reserve(%s): %v", id, err)
		}
		if err := validate.Reservation(res, []string{id}); err != nil {
			t.Errorf("reservation: %v", err)
		}
		mig := res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"]
		if !strings.HasPrefix(mig, "MIG-") || seen[mig] {
			t.Errorf("Reserve(%s): NVIDIA_VISIBLE_DEVICES = %q, want a new MIG UUID", id, mig)
		}
		seen[mig] = true
		if want := []string{"nvidia.com/gpu=" + id}; !slices.Equal(res.GetCdiDevices(), want) {
			t.Errorf("CDI devices = %v, want %v", res.GetCdiDevices(), want)
		}
		if !slices.Contains(cdiDevices(t, dir), id) {
			t.Errorf("the CDI spec does not hold %s after its Reserve", id)
		}
	}
	if got := simInstances(sim, 0); len(got) != 7 {
		t.Errorf("GPU 0 has %d instances, want 7: %v", len(got), got)
	}
	for _, id := range gpuDevices(resp, 0) {
		if slices.Contains(ids, id) {
			continue
		}
		if c := fits(resp, append(slices.Clone(held), id)...); c == "" {
			t.Errorf("%s fits beside seven 1g.10gb on its GPU", id)
		}
	}
	if c := fits(resp, append(slices.Clone(held), simulatedUUID("dgxh100", 1))...); c != "" {
		t.Errorf("GPU 1 does not fit beside GPU 0's partitions: %s", c)
	}
	t.Logf("with seven 1g.10gb held, %d other devices of GPU 0 are refused by the counters", len(gpuDevices(resp, 0))-7)

	for range 2 { // idempotent
		if err := p.Release(ctx, "r", ids); err != nil {
			t.Fatalf("Release: %v", err)
		}
	}
	if got := simInstances(sim, 0); len(got) != 0 {
		t.Errorf("after Release GPU 0 has instances %v", got)
	}
	for _, id := range cdiDevices(t, dir) {
		if strings.Contains(id, "-mig-") {
			t.Errorf("the CDI spec still holds %s after Release", id)
		}
	}
	if res, err := p.Reserve(ctx, []string{simulatedUUID("dgxh100", 0)}); err != nil || res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"] != simulatedUUID("dgxh100", 0) {
		t.Errorf("whole GPU after Release: %v, %v", res, err)
	}
}

// Reserves of distinct placements of one GPU may run at once.
func TestMIGOnDemandConcurrentReserves(t *testing.T) {
	p, _ := newTestPlugin(t, onDemand(filepath.Join(t.TempDir(), "sim.json")))
	ids := onDemandIDs(3, "1g.10gb", 0, 1, 2, 3, 4, 5, 6)
	uuids := make([]string, len(ids))
	errs := make([]error, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Go(func() {
			res, err := p.Reserve(context.Background(), []string{id})
			uuids[i], errs[i] = res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"], err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("Reserve(%s): %v", ids[i], err)
		}
	}
	slices.Sort(uuids)
	if len(slices.Compact(uuids)) != 7 {
		t.Errorf("MIG UUIDs %v, want 7 distinct", uuids)
	}
}

// 64 Reserves racing for placements that all cover memory slice 0 of one GPU: exactly
// one device wins (its racers share its one instance), every other Reserve is refused
// with FAILED_PRECONDITION, and one instance exists.
func TestMIGOnDemandRaceForOneSlice(t *testing.T) {
	p, _ := newTestPlugin(t, onDemand(filepath.Join(t.TempDir(), "sim.json")))
	var contenders []string
	for _, prof := range []string{"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"} {
		contenders = append(contenders, onDemandIDs(6, prof, 0)...)
	}
	const callers = 64
	won := make([]string, callers)
	codesSeen := make([]codes.Code, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			id := contenders[i%len(contenders)]
			_, err := p.Reserve(context.Background(), []string{id})
			if err == nil {
				won[i] = id
			}
			codesSeen[i] = status.Code(err)
		})
	}
	wg.Wait()
	winners := make(map[string]bool)
	for i, id := range won {
		if id != "" {
			winners[id] = true
		} else if codesSeen[i] != codes.FailedPrecondition {
			t.Errorf("caller %d: %v, want FAILED_PRECONDITION", i, codesSeen[i])
		}
	}
	if len(winners) != 1 {
		t.Errorf("winning devices %v, want exactly one", winners)
	}
	if n := simOf(t, p).mig.instanceCount(); n != 1 {
		t.Errorf("%d instances, want 1", n)
	}
}

// The simulated machine's instances outlive the plugin: a new plugin on the same state
// file sees them, and Reconcile keeps what live reservations hold (a GPU instance a
// crash left without its compute instance is completed) and destroys the rest.
func TestMIGStateOutlivesThePlugin(t *testing.T) {
	state := filepath.Join(t.TempDir(), "sim.json")
	ctx := context.Background()
	first, _ := newTestPlugin(t, onDemand(state))
	ids := onDemandIDs(0, "1g.10gb", 0, 1, 2)
	keep := onDemandIDs(1, "3g.40gb", 4)[0]
	var kept string
	for _, id := range append(slices.Clone(ids), keep) {
		res, err := first.Reserve(ctx, []string{id})
		if err != nil {
			t.Fatalf("Reserve(%s): %v", id, err)
		}
		if id == keep {
			kept = res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"]
		}
	}
	// A crash between the GPU instance and its compute instance, on GPU 2 (an orphan)
	// and on GPU 0 (a live reservation's, to adopt).
	sim := simOf(t, first)
	half := func(index int, profile int, start uint32) {
		dev := sim.devices[index]
		info, _ := dev.GetGpuInstanceProfileInfo(profile)
		if _, ret := dev.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: start, Size: 1}); ret != nvml.SUCCESS {
			t.Fatalf("creating a GPU instance: %v", ret)
		}
	}
	half(2, nvml.GPU_INSTANCE_PROFILE_1_SLICE, 5)
	half(0, nvml.GPU_INSTANCE_PROFILE_1_SLICE, 6)
	first.Close()

	second, _ := newTestPlugin(t, onDemand(state))
	sim2 := simOf(t, second)
	if n := sim2.mig.instanceCount(); n != 6 {
		t.Fatalf("the restarted plugin sees %d instances, want 6", n)
	}
	if got := simInstances(sim2, 1)[fmt.Sprintf("%d@4", nvml.GPU_INSTANCE_PROFILE_3_SLICE)]; !slices.Equal(got, []string{kept}) {
		t.Errorf("after restart GPU 1's 3g.40gb is %v, want %s", got, kept)
	}
	adopt := onDemandIDs(0, "1g.10gb", 6)[0]
	live := []deviceplugin.LiveReservation{{ID: "r1", DeviceIDs: []string{ids[1]}}, {ID: "r2", DeviceIDs: []string{keep}}, {ID: "r3", DeviceIDs: []string{adopt}}}
	for range 2 { // a host reattaching reconciles again: nothing more changes
		if err := second.Reconcile(ctx, live); err != nil {
			t.Fatalf("Reconcile: %v", err)
		}
		want0 := map[string]int{"0@1": 1, "0@6": 1}
		got0 := simInstances(sim2, 0)
		if len(got0) != len(want0) || len(got0["0@1"]) != 1 || len(got0["0@6"]) != 1 {
			t.Errorf("GPU 0 instances after Reconcile = %v, want one MIG device at 1 and at 6", got0)
		}
		if got := simInstances(sim2, 2); len(got) != 0 {
			t.Errorf("GPU 2 still has the orphan %v", got)
		}
		if got := simInstances(sim2, 1)[fmt.Sprintf("%d@4", nvml.GPU_INSTANCE_PROFILE_3_SLICE)]; !slices.Equal(got, []string{kept}) {
			t.Errorf("Reconcile changed the live 3g.40gb: %v, want %s", got, kept)
		}
	}
	// A Reserve the host retries (its answer lost) gets the same instance.
	res, err := second.Reserve(ctx, []string{keep})
	if err != nil || res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"] != kept {
		t.Errorf("Reserve again of a held partition = %v, %v; want %s", res, err, kept)
	}
	raw, err := os.ReadFile(state)
	if err != nil || !strings.Contains(string(raw), kept) {
		t.Errorf("state file does not hold %s: %v", kept, err)
	}
}

// An NVML create that fails fails the Reserve and leaves nothing behind, at either
// step and for any device of a multi-device request.
func TestMIGReserveCreateFailureLeavesNothing(t *testing.T) {
	for _, step := range []string{"gpu-instance", "compute-instance"} {
		t.Run(step, func(t *testing.T) {
			p, _ := newTestPlugin(t, onDemand(filepath.Join(t.TempDir(), "sim.json")))
			sim := simOf(t, p)
			sim.mig.fail = func(s string, gpu int) nvml.Return {
				if s == step && gpu == 5 {
					return nvml.ERROR_UNKNOWN
				}
				return nvml.SUCCESS
			}
			ids := []string{onDemandIDs(4, "1g.10gb", 0)[0], onDemandIDs(5, "1g.10gb", 0)[0]}
			res, err := p.Reserve(context.Background(), ids)
			if err == nil || !strings.Contains(err.Error(), ids[1]) {
				t.Fatalf("Reserve = %v, %v; want an error naming %s", res, err, ids[1])
			}
			if n := sim.mig.instanceCount(); n != 0 {
				t.Errorf("%d instances left behind", n)
			}
		})
	}
	t.Run("placement taken", func(t *testing.T) {
		p, _ := newTestPlugin(t, onDemand(filepath.Join(t.TempDir(), "sim.json")))
		ctx := context.Background()
		if _, err := p.Reserve(ctx, onDemandIDs(0, "2g.20gb", 0)); err != nil {
			t.Fatal(err)
		}
		_, err := p.Reserve(ctx, onDemandIDs(0, "1g.10gb", 1))
		if status.Code(err) != codes.FailedPrecondition {
			t.Errorf("Reserve of an overlapping placement = %v, want FAILED_PRECONDITION", err)
		}
		if n := simOf(t, p).mig.instanceCount(); n != 1 {
			t.Errorf("%d instances, want the first one only", n)
		}
	})
}

// replicas = 4: four shareable devices per GPU, each one of the GPU's four shares; the
// whole GPU takes all four.
func TestReplicas(t *testing.T) {
	p, _ := newTestPlugin(t, Config{Simulate: "dgxh100", Replicas: 4})
	resp := fingerprintOf(t, p)
	want := map[string]int{"nvidia/gpu/" + h100: 8, "nvidia/gpu.shared/" + h100: 32}
	if got := groupSizes(resp); !maps.Equal(got, want) {
		t.Errorf("groups = %v, want %v", got, want)
	}
	gpu := simulatedUUID("dgxh100", 2)
	var reps []string
	for k := range 4 {
		reps = append(reps, replicaID(gpu, k))
	}
	if c := fits(resp, reps...); c != "" {
		t.Errorf("four replicas of one GPU do not fit: %s", c)
	}
	for _, r := range reps {
		if c := fits(resp, r, gpu); c != gpu+"/time-slices" {
			t.Errorf("replica %s and its whole GPU: over %q, want %s/time-slices", r, c, gpu)
		}
	}
	res, err := p.Reserve(context.Background(), reps[:2])
	if err != nil || res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"] != gpu {
		t.Errorf("Reserve of two replicas = %v, %v; want NVIDIA_VISIBLE_DEVICES=%s", res, err, gpu)
	}
	if err := validate.Reservation(res, reps[:2]); err != nil {
		t.Errorf("reservation: %v", err)
	}
}

// A static layout creates what it needs at SetConfig and reports MIG devices by their
// UUIDs; a restart creates nothing more; GPUs outside the layout stay whole.
func TestMIGStaticLayout(t *testing.T) {
	state := filepath.Join(t.TempDir(), "sim.json")
	t.Run("every GPU", func(t *testing.T) {
		cfg := Config{Simulate: "dgxh100", MIGLayout: []byte(`"1g.10gb"`), SimStateFile: ptr(state)}
		p, _ := newTestPlugin(t, cfg)
		resp := fingerprintOf(t, p)
		if got, want := groupSizes(resp), map[string]int{"nvidia/mig/1g.10gb": 56}; !maps.Equal(got, want) {
			t.Errorf("groups = %v, want %v", got, want)
		}
		for id := range devices(resp) {
			if !strings.HasPrefix(id, "MIG-") {
				t.Errorf("device %s is not a MIG UUID", id)
			}
		}
		var one string
		for id := range devices(resp) {
			one = id
			break
		}
		res, err := p.Reserve(context.Background(), []string{one})
		if err != nil || res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"] != one {
			t.Errorf("Reserve(%s) = %v, %v", one, res, err)
		}
		p.Close()
		again, _ := newTestPlugin(t, cfg)
		if n := simOf(t, again).mig.instanceCount(); n != 56 {
			t.Errorf("after restart %d instances, want the same 56", n)
		}
		if !maps.EqualFunc(devices(resp), devices(fingerprintOf(t, again)), func(a, b *pb.Device) bool { return proto.Equal(a, b) }) {
			t.Errorf("the restarted plugin reports other devices")
		}
	})
	t.Run("by index", func(t *testing.T) {
		cfg := Config{Simulate: "dgxh100", SimStateFile: ptr(""),
			MIGLayout: []byte(`{"0": ["1g.10gb", "3g.40gb", "1g.10gb"], "1": ["7g.80gb"]}`)}
		p, _ := newTestPlugin(t, cfg)
		want := map[string]int{"nvidia/gpu/" + h100: 6, "nvidia/mig/1g.10gb": 2, "nvidia/mig/3g.40gb": 1, "nvidia/mig/7g.80gb": 1}
		if got := groupSizes(fingerprintOf(t, p)); !maps.Equal(got, want) {
			t.Errorf("groups = %v, want %v", got, want)
		}
	})
	t.Run("beside on demand", func(t *testing.T) {
		cfg := onDemand("")
		cfg.MIGLayout = []byte(`{"0": ["7g.80gb"]}`)
		p, _ := newTestPlugin(t, cfg)
		resp := fingerprintOf(t, p)
		got := groupSizes(resp)
		if got["nvidia/gpu/"+h100] != 7 || got["nvidia/mig/7g.80gb"] != 8 || got["nvidia/mig/1g.10gb"] != 49 {
			t.Errorf("groups = %v, want GPU 0 as one static 7g.80gb and GPUs 1-7 whole and on demand", got)
		}
		if n := len(resp.GetCounterSets()); n != 7 {
			t.Errorf("%d counter sets, want 7 (the static GPU shares nothing)", n)
		}
		// Reconcile never touches the static instance.
		if err := p.Reconcile(context.Background(), nil); err != nil || simOf(t, p).mig.instanceCount() != 1 {
			t.Errorf("Reconcile: %v, %d instances; want the static one kept", err, simOf(t, p).mig.instanceCount())
		}
	})
	t.Run("unknown profile", func(t *testing.T) {
		p, _ := newUnconfigured(t)
		err := p.SetConfig(context.Background(), mustJSON(t, Config{Simulate: "dgxh100", SimStateFile: ptr(""),
			MIGLayout: []byte(`{"2": ["5g.50gb"]}`)}))
		if err == nil || !strings.Contains(err.Error(), `"5g.50gb"`) || !strings.Contains(err.Error(), "1g.10gb") {
			t.Errorf("SetConfig = %v, want an error naming the profile and the ones offered", err)
		}
	})
}

// A partition's health follows its GPU's: an XID on the GPU makes its partitions
// unhealthy, and no other GPU's.
func TestMIGHealthFollowsTheGPU(t *testing.T) {
	cfg := onDemand("")
	cfg.InjectFaults = []FaultConfig{{GPUIndex: ptr(2), XID: 79, After: "1s"}}
	p, clk := newTestPlugin(t, cfg)
	fp := startFingerprint(t, p)
	fp.next(t)
	clk.Advance(time.Second)
	resp := fp.next(t)
	if err := validate.Fingerprint(resp); err != nil {
		t.Errorf("validate.Fingerprint: %v", err)
	}
	devs := devices(resp)
	for _, i := range []int{2, 3} {
		ids := gpuDevices(resp, i)
		if len(ids) != 29 {
			t.Errorf("GPU %d has %d devices, want 29 (whole + 28 placements)", i, len(ids))
		}
		for _, id := range ids {
			healthy := devs[id].GetHealth() == pb.Health_HEALTH_HEALTHY
			if healthy != (i != 2) {
				t.Errorf("%s is %v (%s)", id, devs[id].GetHealth(), devs[id].GetHealthReason())
			}
		}
	}
}

// Bad partitioning keys are refused naming the key; a state file of another machine
// is refused.
func TestMIGConfig(t *testing.T) {
	bad := []struct {
		cfg  string
		want string
	}{
		{`{"mig": "dynamic"}`, `mig = "dynamic"`},
		{`{"simulate": "dgxh100", "mig": "on-demand", "mig_layout": "1g.10gb"}`, "by GPU index"},
		{`{"mig_layout": {"x": ["1g.10gb"]}}`, `mig_layout["x"]`},
		{`{"mig_layout": {"0": []}}`, `mig_layout["0"]`},
		{`{"mig_layout": 7}`, "mig_layout = 7"},
		{`{"replicas": 1}`, "replicas = 1"},
		{`{"replicas": 1000}`, "replicas = 1000"},
		{`{"sim_state_file": "/x.json"}`, "only valid with simulate"},
		{`{"simulate": "dgxh100", "sim_state_file": "x.json"}`, "absolute"},
		{`{"sim_mig_mode_off": [1]}`, "sim_mig_mode_off: only valid with simulate"},
		{`{"simulate": "dgxh100", "sim_mig_mode_off": [-1]}`, "sim_mig_mode_off[0] = -1"},
		{`{"simulate": "dgxh100", "mig_layout": {"2": ["1g.10gb"]}, "sim_mig_mode_off": [2]}`, "GPU 2 has a mig_layout"},
	}
	for _, tt := range bad {
		if _, err := parseConfig([]byte(tt.cfg)); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("parseConfig(%s) = %v, want an error with %q", tt.cfg, err, tt.want)
		}
	}
	s, err := parseConfig([]byte(`{"simulate": "dgxa100"}`))
	if err != nil || s.simStateFile != DefaultSimStateFile("dgxa100") {
		t.Errorf("default sim_state_file = %q, %v; want %q", s.simStateFile, err, DefaultSimStateFile("dgxa100"))
	}

	state := filepath.Join(t.TempDir(), "sim.json")
	if h, _ := newTestPlugin(t, onDemand(state)); h != nil {
		if _, err := h.Reserve(context.Background(), onDemandIDs(0, "1g.10gb", 0)); err != nil {
			t.Fatal(err)
		}
	}
	p, _ := newUnconfigured(t)
	if err := p.SetConfig(context.Background(), mustJSON(t, Config{Simulate: "dgxa100", SimStateFile: ptr(state)})); err == nil || !strings.Contains(err.Error(), "dgxh100") {
		t.Errorf("SetConfig with another machine's state file = %v, want an error naming it", err)
	}
}

// On real NVML (here a simulated machine handed over as if it were the real library,
// so no simulated operator turns MIG mode on) the plugin never changes MIG mode and
// creates nothing unless configured: with mig = "on-demand" GPUs whose MIG mode is
// off are offered whole; once the operator has turned it on, instances appear only on
// Reserve.
func TestMIGRealNVMLChangesNothingUnasked(t *testing.T) {
	mig, err := loadSimMIG("", "dgxh100", simulatedUUIDs("dgxh100"))
	if err != nil {
		t.Fatal(err)
	}
	lib := newSimLib("dgxh100", newFakeClock(), mig)
	modes := func() []int {
		var out []int
		mig.view(func(st *simMIGState) {
			for _, g := range st.GPUs {
				out = append(out, g.MigMode)
			}
		})
		return out
	}
	for _, cfg := range []Config{{CDISpecDir: ptr("")}, {MIG: MIGOnDemand, CDISpecDir: ptr("")}} {
		p, _ := newUnconfigured(t)
		p.openNVML = func() nvml.Interface { return lib }
		if err := p.SetConfig(context.Background(), mustJSON(t, cfg)); err != nil {
			t.Fatal(err)
		}
		if got := groupSizes(fingerprintOf(t, p)); !maps.Equal(got, map[string]int{"nvidia/gpu/" + h100: 8}) {
			t.Errorf("config %+v: groups %v, want the 8 GPUs whole", cfg, got)
		}
		if got := modes(); slices.Max(got) != 0 || mig.instanceCount() != 0 {
			t.Errorf("config %+v: MIG modes %v, %d instances; want all off and none", cfg, got, mig.instanceCount())
		}
	}
	if _, err := mig.enableMIG([]int{0}); err != nil { // the operator, on GPU 0
		t.Fatal(err)
	}
	p, _ := newUnconfigured(t)
	p.openNVML = func() nvml.Interface { return lib }
	if err := p.SetConfig(context.Background(), mustJSON(t, Config{MIG: MIGOnDemand, CDISpecDir: ptr("")})); err != nil {
		t.Fatal(err)
	}
	resp := fingerprintOf(t, p)
	if got := groupSizes(resp)["nvidia/mig/1g.10gb"]; got != 7 {
		t.Errorf("1g.10gb devices = %d, want GPU 0's 7", got)
	}
	if mig.instanceCount() != 0 {
		t.Errorf("instances created before any Reserve")
	}
	if _, err := p.Reserve(context.Background(), onDemandIDs(0, "1g.10gb", 0)); err != nil || mig.instanceCount() != 1 {
		t.Errorf("Reserve: %v, %d instances; want one", err, mig.instanceCount())
	}
}

// On a machine with NVIDIA GPUs: with mig = "on-demand" the plugin only reads. It logs,
// per GPU, its MIG mode and the profiles and placements it would offer (compare with
// `nvidia-smi mig -lgip` and `-lgipp`), and MIG modes and instance counts are the same
// afterwards. Nothing is reserved, so nothing is created.
func TestRealNVMLMIGReadOnly(t *testing.T) {
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		t.Skipf("no usable NVML here (%v)", ret)
	}
	defer lib.Shutdown()
	type gpuState struct {
		mode      int
		instances int
	}
	read := func() []gpuState {
		n, _ := lib.DeviceGetCount()
		var out []gpuState
		for i := range n {
			dev, ret := lib.DeviceGetHandleByIndex(i)
			if ret != nvml.SUCCESS {
				continue
			}
			mode, _, ret := dev.GetMigMode()
			s := gpuState{mode: mode}
			if ret != nvml.SUCCESS {
				s.mode = -1
			}
			if c, ret := dev.GetMaxMigDeviceCount(); ret == nvml.SUCCESS {
				for j := range c {
					if _, ret := dev.GetMigDeviceHandleByIndex(j); ret == nvml.SUCCESS {
						s.instances++
					}
				}
			}
			out = append(out, s)
		}
		return out
	}
	before := read()
	p, _ := newUnconfigured(t)
	if err := p.SetConfig(context.Background(), mustJSON(t, Config{MIG: MIGOnDemand, CDISpecDir: ptr("")})); err != nil {
		t.Fatal(err)
	}
	resp := fingerprintOf(t, p)
	inv := p.rt.latest.Load()
	for i, g := range inv.gpus {
		plan := inv.plans[i]
		t.Logf("GPU %d %s: MIG mode %d, offered as mode %d", g.index, g.uuid, before[g.index].mode, plan.mode)
		for _, prof := range plan.profiles {
			var starts []string
			for _, pl := range prof.placements {
				starts = append(starts, fmt.Sprintf("%d:%d", pl.Start, pl.Size))
			}
			t.Logf("  profile %s (id %d, %d slices, %d MiB, %d instances): placements %s", prof.name, prof.info.Id,
				prof.info.SliceCount, prof.info.MemorySizeMB, prof.info.InstanceCount, strings.Join(starts, " "))
		}
	}
	t.Logf("fingerprint: %d devices, %d bytes", len(devices(resp)), proto.Size(resp))
	if after := read(); !slices.Equal(before, after) {
		t.Errorf("MIG state changed: before %v, after %v", before, after)
	}
}

// A MIG device's CDI entry carries its GPU's node and, where the driver lists them,
// the capability nodes of its GPU and compute instance.
func TestMIGCDICapabilityNodes(t *testing.T) {
	minors := filepath.Join(t.TempDir(), "mig-minors")
	if err := os.WriteFile(minors, []byte("config 1\nmonitor 2\ngpu0/gi0/access 21\ngpu0/gi0/ci0/access 22\ngpu1/gi0/access 30\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	p, _ := newUnconfigured(t)
	p.migMinors = minors
	p.charDevice = func(path string) bool { return strings.HasPrefix(path, "/dev/nvidia-caps/") }
	dir := t.TempDir()
	cfg := onDemand("")
	cfg.CDISpecDir = ptr(dir)
	if err := p.SetConfig(context.Background(), mustJSON(t, cfg)); err != nil {
		t.Fatal(err)
	}
	id := onDemandIDs(0, "2g.20gb", 4)[0]
	if _, err := p.Reserve(context.Background(), []string{id}); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(dir, cdiSpecName+".yaml"))
	if err != nil {
		t.Fatal(err)
	}
	spec := string(raw)
	for _, want := range []string{id, "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"} {
		if !strings.Contains(spec, want) {
			t.Errorf("CDI spec lacks %s:\n%s", want, spec)
		}
	}
	if strings.Contains(spec, "nvidia-cap30") {
		t.Errorf("CDI spec has GPU 1's capability node, which no MIG device of it needs")
	}
}
