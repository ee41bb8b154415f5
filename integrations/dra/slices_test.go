package dra

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/proto"
	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// fakeSysfs makes a sysfs tree in which busID sits under PCIe root pci0000:16.
func fakeSysfs(t *testing.T, busID string) string {
	t.Helper()
	root := t.TempDir()
	dev := filepath.Join(root, "devices", "pci0000:16", "0000:16:01.0", busID)
	if err := os.MkdirAll(dev, 0o755); err != nil {
		t.Fatal(err)
	}
	links := filepath.Join(root, "bus", "pci", "devices")
	if err := os.MkdirAll(links, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join("..", "..", "..", "devices", "pci0000:16", "0000:16:01.0", busID), filepath.Join(links, busID)); err != nil {
		t.Fatal(err)
	}
	return root
}

func intValue(n int64, unit string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_IntValue{IntValue: n}, Unit: unit}
}

func stringValue(s string) *pb.Value { return &pb.Value{Kind: &pb.Value_StringValue{StringValue: s}} }

// partitionedSnapshot is an agent snapshot of one H100 (at PCI bus ID bus, held by a
// Kubernetes pod) and one of its MIG placements (unhealthy, blocked by that pod).
func partitionedSnapshot(gpu, mig, bus string) *pb.FingerprintResponse {
	return &pb.FingerprintResponse{
		CounterSets: []*pb.CounterSet{{Plugin: "nvidia", Name: "gpu-0", Capacity: map[string]int64{"memory_slices": 8, "compute_slices": 7}}},
		Groups: []*pb.DeviceGroup{
			{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3", Plugin: "nvidia",
				Attributes: map[string]*pb.Value{
					"memory":             intValue(81559, "MiB"),
					"power_limit":        intValue(700, "W"),
					"driver_version":     stringValue("535.104.05"),
					"cuda_version":       stringValue("12.2"),
					"compute_capability": stringValue("9.0"),
				},
				Devices: []*pb.Device{{Id: gpu, Health: pb.Health_HEALTH_HEALTHY,
					Locality: &pb.Locality{PciBusId: bus, NumaNode: 1},
					Consumes: []*pb.CounterConsumption{{CounterSet: "gpu-0", Counters: map[string]int64{"memory_slices": 8, "compute_slices": 7}}},
					Holder:   &pb.Holder{ReservationId: "res-1", OwnerId: "k8s/default/trainer/main"}}}},
			{Vendor: "nvidia", Type: "mig", Name: "1g.10gb", Plugin: "nvidia",
				Devices: []*pb.Device{{Id: mig, Health: pb.Health_HEALTH_UNHEALTHY, HealthReason: "XID 79",
					Locality:  &pb.Locality{NumaNode: -1},
					Consumes:  []*pb.CounterConsumption{{CounterSet: "gpu-0", Counters: map[string]int64{"memory_slices": 1, "compute_slices": 1}}},
					BlockedBy: []*pb.Holder{{ReservationId: "res-1", OwnerId: "k8s/default/trainer/main"}}}}},
		},
	}
}

// A snapshot with a partitionable GPU becomes a counter-set slice and a device slice,
// every field as DRA wants it.
func TestBuildViewFieldByField(t *testing.T) {
	const (
		gpu = "GPU-8f3a4b2c-1d2e-3f40-5a6b-7c8d9e0f1a2b"
		mig = "MIG-8f3a4b2c-1d2e-3f40-5a6b-7c8d9e0f1a2b-1g.10gb-0"
		bus = "0000:17:00.0"
	)
	snap := partitionedSnapshot(gpu, mig, bus)
	v, problems := buildView(snap, buildOptions{driver: "devicehost.io", pool: "node-a",
		pci: &pciAttributes{sysfs: []deviceattribute.MachineModifier{deviceattribute.WithFSFromRoot(fakeSysfs(t, bus))}}})
	if len(problems) > 0 {
		t.Errorf("problems: %q", problems)
	}
	q := func(s string) resourceapi.Counter { return resourceapi.Counter{Value: resource.MustParse(s)} }
	sv := func(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }
	ver := func(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{VersionValue: &s} }
	wantSets := []resourceapi.CounterSet{{Name: "nvidia-gpu-0", Counters: map[string]resourceapi.Counter{
		label("memory_slices"): q("8"), label("compute_slices"): q("7")}}}
	wantDevices := []resourceapi.Device{
		{
			Name: DeviceName(gpu),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"id": sv(gpu), "uuid": sv(gpu), "vendor": sv("nvidia"), "type": sv("gpu"),
				"parent":        sv("gpu-0"), // the fixture's counter set is not named after the GPU
				"productName":   sv("NVIDIA H100 80GB HBM3"),
				"powerLimit":    {IntValue: ptr.To[int64](700)},
				"driverVersion": ver("535.104.5"), "cudaVersion": ver("12.2.0"), "computeCapability": ver("9.0.0"),
				"resource.kubernetes.io/pciBusID": sv(bus),
				"resource.kubernetes.io/pcieRoot": sv("pci0000:16"),
				"resource.kubernetes.io/numaNode": {IntValue: ptr.To[int64](1)},
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": {Value: resource.MustParse("81559Mi")}},
			ConsumesCounters: []resourceapi.DeviceCounterConsumption{{CounterSet: "nvidia-gpu-0", Counters: map[string]resourceapi.Counter{
				label("memory_slices"): q("8"), label("compute_slices"): q("7")}}},
			Taints: []resourceapi.DeviceTaint{{Key: "devicehost.io/held", Value: "k8s.default.trainer.main", Effect: resourceapi.DeviceTaintEffectNoSchedule}},
		},
		{
			Name: DeviceName(mig),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"id": sv(mig), "uuid": sv(mig), "vendor": sv("nvidia"), "type": sv("mig"), "productName": sv("1g.10gb"),
				"parent": sv("gpu-0"),
			},
			ConsumesCounters: []resourceapi.DeviceCounterConsumption{{CounterSet: "nvidia-gpu-0", Counters: map[string]resourceapi.Counter{
				label("memory_slices"): q("1"), label("compute_slices"): q("1")}}},
			Taints: []resourceapi.DeviceTaint{
				{Key: "devicehost.io/unhealthy", Value: "XID.79", Effect: resourceapi.DeviceTaintEffectNoSchedule},
				{Key: "devicehost.io/blocked", Value: "k8s.default.trainer.main", Effect: resourceapi.DeviceTaintEffectNoSchedule},
			},
		},
	}
	if len(v.slices) != 2 {
		t.Fatalf("got %d slices, want 2 (counter sets apart from devices)", len(v.slices))
	}
	if diff := cmp.Diff(wantSets, v.slices[0].SharedCounters); diff != "" || len(v.slices[0].Devices) != 0 {
		t.Errorf("counter-set slice (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantDevices, v.slices[1].Devices); diff != "" || len(v.slices[1].SharedCounters) != 0 {
		t.Errorf("device slice (-want +got):\n%s", diff)
	}
	if ref := v.devices[DeviceName(gpu)]; ref.id != gpu || ref.group != (groupKey{"nvidia", "gpu", "NVIDIA H100 80GB HBM3"}) {
		t.Errorf("device ref of %s = %+v", gpu, ref)
	}

	// Held by a claim of this driver: no taint, the scheduler counts it itself.
	snap.Groups[0].Devices[0].Holder.OwnerId = "k8s-claim/default/pair/uid-1"
	snap.Groups[1].Devices[0].BlockedBy[0].OwnerId = "k8s-claim/default/pair/uid-1"
	snap.Groups[1].Devices[0].Health = pb.Health_HEALTH_HEALTHY
	v, _ = buildView(snap, buildOptions{driver: "devicehost.io", pool: "node-a"})
	for _, d := range v.slices[1].Devices {
		if len(d.Taints) != 0 {
			t.Errorf("device %s held by a claim: taints %v, want none", d.Name, d.Taints)
		}
	}

	// Cordoned by an operator: tainted NoSchedule with the reason, even while a claim of
	// this driver holds it; NoExecute for a drain, so Kubernetes evicts the claim's pod.
	snap.Groups[1].Devices[0].Cordon = &pb.Cordon{Reason: "ECC storm", By: "admin"}
	v, _ = buildView(snap, buildOptions{driver: "devicehost.io", pool: "node-a"})
	cordoned := func(v *view) []resourceapi.DeviceTaint {
		for _, sl := range v.slices {
			for _, d := range sl.Devices {
				if d.Name == DeviceName(snap.Groups[1].Devices[0].GetId()) {
					return d.Taints
				}
			}
		}
		t.Fatalf("no device %s in the slices", snap.Groups[1].Devices[0].GetId())
		return nil
	}
	if diff := cmp.Diff([]resourceapi.DeviceTaint{{Key: "devicehost.io/cordoned", Value: "ECC.storm", Effect: resourceapi.DeviceTaintEffectNoSchedule}}, cordoned(v)); diff != "" {
		t.Errorf("cordoned device: taints (-want +got):\n%s", diff)
	}
	snap.Groups[1].Devices[0].Cordon.Drain = true
	v, _ = buildView(snap, buildOptions{driver: "devicehost.io", pool: "node-a"})
	if diff := cmp.Diff([]resourceapi.DeviceTaint{{Key: "devicehost.io/cordoned", Value: "ECC.storm", Effect: resourceapi.DeviceTaintEffectNoExecute}}, cordoned(v)); diff != "" {
		t.Errorf("drained device: taints (-want +got):\n%s", diff)
	}
	snap.Groups[1].Devices[0].Cordon = nil

	// Agent unreachable: every device tainted, health unknown.
	v, _ = buildView(snap, buildOptions{driver: "devicehost.io", pool: "node-a", disconnected: errors.New("connection refused")})
	for _, d := range v.slices[1].Devices {
		want := []resourceapi.DeviceTaint{{Key: "devicehost.io/unhealthy", Value: "agent-unreachable", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
		if diff := cmp.Diff(want, d.Taints); diff != "" {
			t.Errorf("device %s while disconnected: taints (-want +got):\n%s", d.Name, diff)
		}
	}
	for _, h := range v.healthReport(time.Time{}).Devices {
		if h.Health != "Unknown" {
			t.Errorf("device %s while disconnected: health %s, want Unknown", h.DeviceName, h.Health)
		}
	}
}

// The publisher writes a slice again exactly when a snapshot changes what it says:
// a view built again from the same snapshot is the same, and each change a user would
// see in the ResourceSlice (a taint coming or going, a health reason, an attribute, a
// counter, a device more or fewer) is a difference.
func TestSliceEncodingSeesEveryChange(t *testing.T) {
	const (
		gpu = "GPU-8f3a4b2c-1d2e-3f40-5a6b-7c8d9e0f1a2b"
		mig = "MIG-8f3a4b2c-1d2e-3f40-5a6b-7c8d9e0f1a2b-1g.10gb-0"
		bus = "0000:17:00.0"
	)
	o := buildOptions{driver: "devicehost.io", pool: "node-a", pci: &pciAttributes{}}
	base, _ := buildView(partitionedSnapshot(gpu, mig, bus), o)
	again, _ := buildView(partitionedSnapshot(gpu, mig, bus), o)
	same := func(a, b *view) bool {
		if !allEncoded(a) || !allEncoded(b) {
			t.Fatal("slices would not encode")
		}
		return changedSlices(a, b) == 0
	}
	if !same(base, again) {
		t.Fatal("the same snapshot built twice: slices differ")
	}
	changes := map[string]func(*pb.FingerprintResponse){
		"holder becomes a claim (taint goes)": func(s *pb.FingerprintResponse) {
			s.Groups[0].Devices[0].Holder.OwnerId = "k8s-claim/default/pair/uid-1"
		},
		"held by another owner": func(s *pb.FingerprintResponse) { s.Groups[0].Devices[0].Holder.OwnerId = "nomad/x" },
		"health reason":         func(s *pb.FingerprintResponse) { s.Groups[1].Devices[0].HealthReason = "XID 48" },
		"healthy again":         func(s *pb.FingerprintResponse) { s.Groups[1].Devices[0].Health = pb.Health_HEALTH_HEALTHY },
		"attribute":             func(s *pb.FingerprintResponse) { s.Groups[0].Attributes["power_limit"] = intValue(600, "W") },
		"counter capacity":      func(s *pb.FingerprintResponse) { s.CounterSets[0].Capacity["compute_slices"] = 6 },
		"counter consumption":   func(s *pb.FingerprintResponse) { s.Groups[1].Devices[0].Consumes[0].Counters["memory_slices"] = 2 },
		"NUMA node":             func(s *pb.FingerprintResponse) { s.Groups[0].Devices[0].Locality.NumaNode = 0 },
		"a device fewer":        func(s *pb.FingerprintResponse) { s.Groups[1].Devices = nil },
		"a device more": func(s *pb.FingerprintResponse) {
			s.Groups[1].Devices = append(s.Groups[1].Devices, &pb.Device{Id: mig + "x"})
		},
		"a counter set fewer":    func(s *pb.FingerprintResponse) { s.CounterSets = nil },
		"a group's product name": func(s *pb.FingerprintResponse) { s.Groups[0].Name = "NVIDIA H200" },
	}
	for name, change := range changes {
		snap := partitionedSnapshot(gpu, mig, bus)
		change(snap)
		v, _ := buildView(snap, o)
		if same(base, v) {
			t.Errorf("%s: slices reported the same, want a difference (the change would never be published)", name)
		}
	}
}

// sliceSpec drops none of a Slice's fields: a field the library adds to Slice must be
// compared too, or a change in it alone would never be published.
func TestSliceSpecHasEveryField(t *testing.T) {
	var s resourceslice.Slice
	sv := reflect.ValueOf(&s).Elem()
	for i := range sv.NumField() {
		f := sv.Field(i)
		switch f.Kind() {
		case reflect.Pointer:
			f.Set(reflect.New(f.Type().Elem()))
		case reflect.Slice:
			f.Set(reflect.MakeSlice(f.Type(), 1, 1))
		default:
			t.Fatalf("Slice.%s: kind %s not handled by this test", sv.Type().Field(i).Name, f.Kind())
		}
	}
	spec := reflect.ValueOf(sliceSpec(s)).Elem()
	for i := range sv.NumField() {
		name := sv.Type().Field(i).Name
		got := spec.FieldByName(name)
		if !got.IsValid() {
			t.Errorf("ResourceSliceSpec has no field %s of Slice", name)
			continue
		}
		if !reflect.DeepEqual(got.Interface(), sv.Field(i).Interface()) {
			t.Errorf("sliceSpec does not carry Slice.%s", name)
		}
	}
}

// The PCI lookups are kept per bus ID, up to maxPCIMemo of them: a plugin reporting
// ever new bus IDs cannot grow the driver without bound, and bus IDs past the bound
// still get their attributes.
func TestPCIAttributesBounded(t *testing.T) {
	const bus = "0000:17:00.0"
	p := &pciAttributes{sysfs: []deviceattribute.MachineModifier{deviceattribute.WithFSFromRoot(fakeSysfs(t, bus))}}
	for i := range maxPCIMemo + 100 {
		b := fmt.Sprintf("0000:%02x:%02x.%d", i>>8&0xff, i>>3&0x1f, i&7)
		if b == bus {
			continue
		}
		if l := p.lookup(b); l.busErr != nil || l.rootOK {
			t.Fatalf("bus %s: %+v, want a pciBusID and no pcieRoot (not in sysfs)", b, l)
		}
	}
	if l := p.lookup(bus); l.busErr != nil || !l.rootOK || *l.root.Value.StringValue != "pci0000:16" {
		t.Errorf("bus %s past the bound: %+v, want pcieRoot pci0000:16", bus, l)
	}
	if n := len(p.memo); n != maxPCIMemo {
		t.Errorf("%d bus IDs kept, want the bound %d", n, maxPCIMemo)
	}
	if l := p.lookup("not-a-bus-id"); l.busErr == nil {
		t.Error("bus ID \"not-a-bus-id\": no error")
	}
}

// A view built with the cache is the view built without it, change after change (the
// changes of TestSliceEncodingSeesEveryChange, one after another, each undone or not at
// random, the agent lost and found; each device that did not change given as the last
// snapshot's message, as the stream gives it); and its encoding is equal to the last exactly when
// the slices are.
func TestViewCacheBuildsWhatAFreshBuildDoes(t *testing.T) {
	const (
		gpu = "GPU-8f3a4b2c-1d2e-3f40-5a6b-7c8d9e0f1a2b"
		mig = "MIG-8f3a4b2c-1d2e-3f40-5a6b-7c8d9e0f1a2b-1g.10gb-0"
		bus = "0000:17:00.0"
	)
	changes := []func(*pb.FingerprintResponse){
		func(s *pb.FingerprintResponse) {
			s.Groups[0].Devices[0].Holder.OwnerId = "k8s-claim/default/pair/uid-1"
		},
		func(s *pb.FingerprintResponse) { s.Groups[0].Devices[0].Holder = nil },
		func(s *pb.FingerprintResponse) { s.Groups[1].Devices[0].HealthReason = "XID 48" },
		func(s *pb.FingerprintResponse) { s.Groups[1].Devices[0].Health = pb.Health_HEALTH_HEALTHY },
		func(s *pb.FingerprintResponse) { s.Groups[0].Attributes["power_limit"] = intValue(600, "W") },
		func(s *pb.FingerprintResponse) { s.CounterSets[0].Capacity["compute_slices"] = 6 },
		func(s *pb.FingerprintResponse) { s.CounterSets[0].Used = map[string]int64{"compute_slices": 1} },
		func(s *pb.FingerprintResponse) { s.Groups[1].Devices[0].Consumes[0].Counters["memory_slices"] = 2 },
		func(s *pb.FingerprintResponse) { s.Groups[0].Devices[0].Locality.NumaNode = 0 },
		func(s *pb.FingerprintResponse) { s.Groups[1].Devices = nil },
		func(s *pb.FingerprintResponse) {
			s.Groups[1].Devices = append(s.Groups[1].Devices, &pb.Device{Id: mig + "x"})
		},
		func(s *pb.FingerprintResponse) {
			s.CounterSets[0].Name = "gpu-1"
			s.Groups[0].Devices[0].Consumes[0].CounterSet = "gpu-1"
		},
		func(s *pb.FingerprintResponse) { s.CounterSets = nil },
		func(s *pb.FingerprintResponse) { s.Groups[0].Name = "NVIDIA H200" },
		func(s *pb.FingerprintResponse) {
			s.Groups[0].Devices[0].Cordon = &pb.Cordon{Reason: "ECC storm", Drain: true}
		},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	cache := newViewCache()
	var lastSlices []resourceslice.Slice
	var last *view
	var lastSnap *pb.FingerprintResponse
	for step := range 300 {
		snap := partitionedSnapshot(gpu, mig, bus)
		var applied []int
		for i, change := range changes {
			if rng.IntN(4) == 0 {
				change(snap)
				applied = append(applied, i)
			}
		}
		shareUnchanged(lastSnap, snap)
		lastSnap = snap
		var lost error
		if rng.IntN(8) == 0 {
			lost = errors.New("connection refused")
		}
		o := buildOptions{driver: "devicehost.io", pool: "node-a", pci: &pciAttributes{}, disconnected: lost}
		fresh, freshProblems := buildView(proto.Clone(snap).(*pb.FingerprintResponse), o)
		o.cache = cache
		cached, cachedProblems := buildView(snap, o)
		if !apiequality.Semantic.DeepEqual(fresh.slices, cached.slices) || !slices.Equal(fresh.order, cached.order) ||
			!maps.EqualFunc(fresh.devices, cached.devices, func(a, b *deviceRef) bool { return *a == *b }) || !slices.Equal(freshProblems, cachedProblems) {
			t.Fatalf("step %d (changes %v, agent lost: %v): the cached build differs from a fresh one:\nfresh  %+v\ncached %+v", step, applied, lost, fresh.slices, cached.slices)
		}
		if !allEncoded(cached) {
			t.Fatalf("step %d: a cached build has no encoding", step)
		}
		if !slices.EqualFunc(fresh.encs, cached.encs, sliceEnc.equal) {
			t.Fatalf("step %d (changes %v, agent lost: %v): the cached build's encodings differ from a fresh one's", step, applied, lost)
		}
		if changedSlices(fresh, cached) != 0 {
			t.Fatalf("step %d (changes %v): the cached build encodes otherwise than a fresh one", step, applied)
		}
		if sameSlices, sameEnc := apiequality.Semantic.DeepEqual(lastSlices, cached.slices), changedSlices(last, cached) == 0; sameSlices != sameEnc {
			t.Fatalf("step %d (changes %v): slices equal to the last: %v, encodings equal: %v", step, applied, sameSlices, sameEnc)
		}
		lastSlices, last = cached.slices, cached
	}
}

// shareUnchanged makes each device and counter set of s that is equal to one of last
// the same message, as the stream's decoder gives them (client.WatchDevices).
func shareUnchanged(last, s *pb.FingerprintResponse) {
	was := make(map[string]*pb.Device)
	for _, g := range last.GetGroups() {
		for _, d := range g.GetDevices() {
			was[d.GetId()] = d
		}
	}
	for _, g := range s.GetGroups() {
		for i, d := range g.GetDevices() {
			if w := was[d.GetId()]; w != nil && proto.Equal(w, d) {
				g.Devices[i] = w
			}
		}
	}
	sets := make(map[[2]string]*pb.CounterSet)
	for _, c := range last.GetCounterSets() {
		sets[[2]string{c.GetPlugin(), c.GetName()}] = c
	}
	for i, c := range s.GetCounterSets() {
		if w := sets[[2]string{c.GetPlugin(), c.GetName()}]; w != nil && proto.Equal(w, c) {
			s.CounterSets[i] = w
		}
	}
}

// allEncoded reports whether every slice of v encoded.
func allEncoded(v *view) bool {
	return !slices.ContainsFunc(v.encs, func(e sliceEnc) bool { return !e.valid })
}

// onDemandSnapshot is a node of gpus GPUs, each a counter set consumed by the GPU and by
// perProfile placements of each of three MIG profiles, listed as the agent lists them:
// the GPUs' group, then one group per profile with every GPU's placements.
func onDemandSnapshot(gpus, perProfile int) *pb.FingerprintResponse {
	snap := &pb.FingerprintResponse{}
	use := func(set string, n int64) []*pb.CounterConsumption {
		return []*pb.CounterConsumption{{CounterSet: set, Counters: map[string]int64{"memory_slices": n}}}
	}
	gpuGroup := &pb.DeviceGroup{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100", Plugin: "nvidia"}
	for i := range gpus {
		set := fmt.Sprintf("gpu-%d", i)
		snap.CounterSets = append(snap.CounterSets, &pb.CounterSet{Plugin: "nvidia", Name: set, Capacity: map[string]int64{"memory_slices": 8}})
		gpuGroup.Devices = append(gpuGroup.Devices, &pb.Device{Id: fmt.Sprintf("GPU-%d", i), Consumes: use(set, 8)})
	}
	snap.Groups = append(snap.Groups, gpuGroup)
	for _, profile := range []string{"1g.10gb", "2g.20gb", "3g.40gb"} {
		g := &pb.DeviceGroup{Vendor: "nvidia", Type: "mig", Name: profile, Plugin: "nvidia"}
		for i := range gpus {
			for j := range perProfile {
				g.Devices = append(g.Devices, &pb.Device{Id: fmt.Sprintf("GPU-%d-mig-%s-%d", i, profile, j), Consumes: use(fmt.Sprintf("gpu-%d", i), 1)})
			}
		}
		snap.Groups = append(snap.Groups, g)
	}
	return snap
}

// The devices of one GPU (those consuming its counter set) share a slice, so that
// holding one of its partitions, which taints the GPU and the placements it blocks,
// changes one slice: the publisher then updates that slice alone instead of writing
// every slice of the pool again at a new generation.
func TestOneGPUsDevicesShareASlice(t *testing.T) {
	const gpus, perProfile = 8, 7 // 8 GPUs of 22 devices: more than two slices
	o := buildOptions{driver: "devicehost.io", pool: "node-a", pci: &pciAttributes{}}
	before, _ := buildView(onDemandSnapshot(gpus, perProfile), o)
	sliceOf := map[string]int{}
	total := 0
	for i, s := range before.slices {
		if len(s.Devices) > maxDevicesPerSlice {
			t.Fatalf("slice %d holds %d devices, DRA allows %d", i, len(s.Devices), maxDevicesPerSlice)
		}
		for _, d := range s.Devices {
			sliceOf[d.Name] = i
			total++
		}
	}
	if want := gpus * (1 + 3*perProfile); total != want {
		t.Fatalf("%d devices in the slices, want %d", total, want)
	}
	gpusOf := map[int]map[string]bool{} // slice -> the GPUs its devices divide
	for _, ref := range before.devices {
		gpu := ref.id[:len("GPU-0")]
		if got, want := sliceOf[ref.name], sliceOf[before.devices[DeviceName(gpu)].name]; got != want {
			t.Errorf("%s in slice %d, its GPU %s in slice %d", ref.id, got, gpu, want)
		}
		if gpusOf[sliceOf[ref.name]] == nil {
			gpusOf[sliceOf[ref.name]] = map[string]bool{}
		}
		gpusOf[sliceOf[ref.name]][gpu] = true
	}
	// Each GPU's devices alone in their slice: a change of one GPU encodes 22 devices,
	// not those of the GPUs beside it.
	for i, g := range gpusOf {
		if len(g) != 1 {
			t.Errorf("slice %d holds the devices of GPUs %v, want one GPU's", i, slices.Sorted(maps.Keys(g)))
		}
	}

	snap := onDemandSnapshot(gpus, perProfile)
	holder := &pb.Holder{ReservationId: "res-1", OwnerId: "nomad/default/job/a/t"} // a holder outside DRA: tainted
	for _, g := range snap.Groups {
		for _, d := range g.Devices {
			switch {
			case d.Id == "GPU-5-mig-1g.10gb-0":
				d.Holder = holder
			case d.Id == "GPU-5" || strings.HasPrefix(d.Id, "GPU-5-mig-3g"):
				d.BlockedBy = []*pb.Holder{holder}
			}
		}
	}
	after, _ := buildView(snap, o)
	if len(after.slices) != len(before.slices) {
		t.Fatalf("%d slices after the change, %d before", len(after.slices), len(before.slices))
	}
	var changed []int
	for i := range after.slices {
		if !apiequality.Semantic.DeepEqual(before.slices[i], after.slices[i]) {
			changed = append(changed, i)
		}
	}
	if len(changed) != 1 {
		t.Errorf("holding a partition of one GPU changed slices %v, want one", changed)
	}
}

// Devices beyond what one slice holds still fill whole slices: a counter set consumed
// by more devices than a slice holds spans slices, and devices that consume nothing
// keep their order.
func TestSliceChunksBounds(t *testing.T) {
	dev := func(name, set string) *resourceapi.Device {
		d := &resourceapi.Device{Name: name}
		if set != "" {
			d.ConsumesCounters = []resourceapi.DeviceCounterConsumption{{CounterSet: set}}
		}
		return d
	}
	var devices []*resourceapi.Device
	for i := range 3 {
		devices = append(devices, dev(fmt.Sprintf("plain-%d", i), ""))
	}
	for i := range 5 {
		devices = append(devices, dev(fmt.Sprintf("big-%d", i), "big"))
	}
	devices = append(devices, dev("small-0", "small"), dev("plain-3", ""), dev("small-1", "small"))
	got := sliceChunks(devices, 4)
	names := make([][]string, len(got))
	for i, c := range got {
		for _, j := range c {
			names[i] = append(names[i], devices[j].Name)
		}
	}
	want := [][]string{{"plain-0", "plain-1", "plain-2"}, {"big-0", "big-1", "big-2", "big-3"}, {"big-4"}, {"small-0", "small-1"}, {"plain-3"}}
	if !slices.EqualFunc(names, want, slices.Equal) {
		t.Errorf("sliceChunks = %q, want %q", names, want)
	}
}
