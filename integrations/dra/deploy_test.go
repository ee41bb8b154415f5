package dra

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime"
	dracel "k8s.io/dynamic-resource-allocation/cel"

	"github.com/devicehost/devicehost/integrations/dra/internal/manifests"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// readManifests decodes every object of a file in deploy/kubernetes, strictly.
func readManifests(t *testing.T, name string) []runtime.Object {
	t.Helper()
	objs, err := manifests.Read(filepath.Join("..", "..", "deploy", "kubernetes", name))
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// deviceClasses are the DeviceClasses of deploy/kubernetes/dra.yaml by name.
func deviceClasses(t *testing.T) map[string]*resourceapi.DeviceClass {
	t.Helper()
	classes := make(map[string]*resourceapi.DeviceClass)
	for _, obj := range readManifests(t, "dra.yaml") {
		if c, ok := obj.(*resourceapi.DeviceClass); ok {
			classes[c.Name] = c
		}
	}
	return classes
}

// example reads an example of deploy/kubernetes: its one ResourceClaimTemplate and its
// one Pod, failing the test without both.
func example(t *testing.T, file string) (*resourceapi.ResourceClaimTemplate, *corev1.Pod) {
	t.Helper()
	var tmpl *resourceapi.ResourceClaimTemplate
	var pod *corev1.Pod
	for _, obj := range readManifests(t, file) {
		switch o := obj.(type) {
		case *resourceapi.ResourceClaimTemplate:
			tmpl = o
		case *corev1.Pod:
			pod = o
		}
	}
	if tmpl == nil || pod == nil {
		t.Fatalf("%s: template %v, pod %v; want both", file, tmpl, pod)
	}
	return tmpl, pod
}

// deploy/kubernetes/dra.yaml has the DeviceClass gpu.devicehost.io, whose selector
// picks the GPUs the driver publishes and not their MIG partitions (and
// mig.devicehost.io the other way round), and one for the MPS shares of each, which
// neither of the first two picks; the example claims 2 of it.
func TestDeployManifests(t *testing.T) {
	classes := make(map[string]*resourceapi.DeviceClass)
	for _, obj := range readManifests(t, "dra.yaml") {
		if c, ok := obj.(*resourceapi.DeviceClass); ok {
			classes[c.Name] = c
		}
	}
	// A static MIG device's shares, as the nvidia-example plugin groups them: the
	// ".mps" on the group's name, pooled by the driver.
	snap := &pb.FingerprintResponse{
		CounterSets: []*pb.CounterSet{{Plugin: "nvidia", Name: "MIG-2", Capacity: map[string]int64{"mps-compute-percent": 100, "mps-memory-mib": 10240}}},
		Groups: []*pb.DeviceGroup{
			{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3", Plugin: "nvidia", Devices: []*pb.Device{{Id: "GPU-1", Health: pb.Health_HEALTH_HEALTHY}}},
			{Vendor: "nvidia", Type: "mig", Name: "1g.10gb", Plugin: "nvidia", Devices: []*pb.Device{{Id: "MIG-1", Health: pb.Health_HEALTH_HEALTHY}}},
			{Vendor: "nvidia", Type: "gpu.mps", Name: "NVIDIA H100 80GB HBM3", Plugin: "nvidia", Devices: []*pb.Device{{Id: "GPU-1::mps::0", Health: pb.Health_HEALTH_HEALTHY}}},
			{Vendor: "nvidia", Type: "gpu.shared", Name: "NVIDIA H100 80GB HBM3", Plugin: "nvidia", Devices: []*pb.Device{{Id: "GPU-1::0", Health: pb.Health_HEALTH_HEALTHY}}},
			{Vendor: "nvidia", Type: "mig", Name: "1g.10gb.mps", Plugin: "nvidia",
				Attributes: map[string]*pb.Value{"memory": {Kind: &pb.Value_IntValue{IntValue: 5120}, Unit: "MiB"}},
				Devices:    []*pb.Device{migShare("MIG-2", 0, 2, 10240), migShare("MIG-2", 1, 2, 10240)}},
		},
	}
	v, problems := buildView(snap, buildOptions{driver: DefaultDriverName, pool: testNode})
	if len(problems) > 0 {
		t.Fatalf("building the view: %v", problems)
	}
	var devs []resourceapi.Device
	for _, sl := range v.slices {
		devs = append(devs, sl.Devices...)
	}
	for class, want := range map[string]string{"gpu.devicehost.io": DeviceName("GPU-1"), "mig.devicehost.io": DeviceName("MIG-1"),
		"gpu-mps.devicehost.io": DeviceName("GPU-1::mps::0"), "mig-mps.devicehost.io": DeviceName("MIG-2::mps"),
		"gpu-shared.devicehost.io": DeviceName("GPU-1::0")} {
		c := classes[class]
		if c == nil || len(c.Spec.Selectors) != 1 || c.Spec.Selectors[0].CEL == nil {
			t.Fatalf("DeviceClass %s: %v; want one with a CEL selector", class, c)
		}
		prog := dracel.GetCompiler(dracel.Features{}).CompileCELExpression(c.Spec.Selectors[0].CEL.Expression, dracel.Options{})
		if prog.Error != nil {
			t.Fatalf("DeviceClass %s: %v", class, prog.Error)
		}
		for _, d := range devs {
			got, _, err := prog.DeviceMatches(context.Background(), dracel.Device{Driver: DefaultDriverName, Attributes: d.Attributes, Capacity: d.Capacity})
			if err != nil {
				t.Fatalf("DeviceClass %s on %s: %v", class, d.Name, err)
			}
			if got != (d.Name == want) {
				t.Errorf("DeviceClass %s selects %s: %v; want %v", class, d.Name, got, d.Name == want)
			}
		}
	}

	// The examples: a pod claiming 2 GPUs, one claiming a MIG partition, each from a
	// template of its own.
	tmpls := map[string]*resourceapi.ResourceClaimTemplate{}
	pods := map[string]*corev1.Pod{}
	for _, obj := range readManifests(t, "example-dra-pod.yaml") {
		switch o := obj.(type) {
		case *resourceapi.ResourceClaimTemplate:
			tmpls[o.Name] = o
		case *corev1.Pod:
			pods[o.Name] = o
		}
	}
	for _, tc := range []struct {
		pod, tmpl, class string
		count            int64
	}{
		{"cuda-pair-dra", "two-gpus", "gpu.devicehost.io", 2},
		{"cuda-mig-dra", "one-mig", "mig.devicehost.io", 1},
	} {
		tmpl, pod := tmpls[tc.tmpl], pods[tc.pod]
		if tmpl == nil || pod == nil {
			t.Errorf("example-dra-pod.yaml: template %s %v, pod %s %v; want both", tc.tmpl, tmpl, tc.pod, pod)
			continue
		}
		if classes[tc.class] == nil {
			t.Errorf("template %s: DeviceClass %s is not in dra.yaml", tc.tmpl, tc.class)
		}
		req := tmpl.Spec.Spec.Devices.Requests
		if len(req) != 1 || req[0].Exactly == nil || req[0].Exactly.DeviceClassName != tc.class || req[0].Exactly.Count != tc.count {
			t.Errorf("template %s requests %+v; want exactly %d of %s", tc.tmpl, req, tc.count, tc.class)
		}
		if len(pod.Spec.ResourceClaims) != 1 || pod.Spec.ResourceClaims[0].ResourceClaimTemplateName == nil || *pod.Spec.ResourceClaims[0].ResourceClaimTemplateName != tmpl.Name {
			t.Errorf("pod %s claims %+v; want one from template %s", tc.pod, pod.Spec.ResourceClaims, tmpl.Name)
		}
	}
}

// deploy/kubernetes/examples/mps-shares.yaml asks for 40Gi of a GPU's MPS shares, of
// the gpu-mps DeviceClass, which selects the pooled devices the driver publishes (one
// per GPU, consumable, in steps of one share); its pod uses the claim.
func TestMPSSharesExample(t *testing.T) {
	classes := deviceClasses(t)
	tmpl, pod := example(t, "examples/mps-shares.yaml")
	if len(pod.Spec.ResourceClaims) != 1 || pod.Spec.ResourceClaims[0].ResourceClaimTemplateName == nil || *pod.Spec.ResourceClaims[0].ResourceClaimTemplateName != tmpl.Name {
		t.Errorf("pod %s claims %+v; want one from template %s", pod.Name, pod.Spec.ResourceClaims, tmpl.Name)
	}
	reqs := tmpl.Spec.Spec.Devices.Requests
	if len(reqs) != 1 || reqs[0].Exactly == nil || classes[reqs[0].Exactly.DeviceClassName] == nil || reqs[0].Exactly.Capacity == nil {
		t.Fatalf("template %s requests %+v; want one device of a DeviceClass of dra.yaml, with a capacity request", tmpl.Name, reqs)
	}
	asked := reqs[0].Exactly.Capacity.Requests["memory"]
	share := func(gpu string, k int) *pb.Device {
		return &pb.Device{Id: fmt.Sprintf("%s::mps::%d", gpu, k), Health: pb.Health_HEALTH_HEALTHY,
			Consumes: []*pb.CounterConsumption{{CounterSet: gpu, Counters: map[string]int64{"mps-compute-percent": 25, "mps-memory-mib": 20480}}}}
	}
	snap := &pb.FingerprintResponse{
		CounterSets: []*pb.CounterSet{{Plugin: "nvidia", Name: "GPU-1", Capacity: map[string]int64{"mps-compute-percent": 100, "mps-memory-mib": 81920}}},
		Groups: []*pb.DeviceGroup{
			{Vendor: "nvidia", Type: "gpu", Name: "H100", Plugin: "nvidia", Devices: []*pb.Device{{Id: "GPU-1", Health: pb.Health_HEALTH_HEALTHY}}},
			{Vendor: "nvidia", Type: "gpu.mps", Name: "H100", Plugin: "nvidia",
				Attributes: map[string]*pb.Value{"memory": {Kind: &pb.Value_IntValue{IntValue: 20480}, Unit: "MiB"}, "bar1": {Kind: &pb.Value_IntValue{IntValue: 131072}, Unit: "MiB"}},
				Devices:    []*pb.Device{share("GPU-1", 0), share("GPU-1", 1), share("GPU-1", 2), share("GPU-1", 3)}},
		},
	}
	v, problems := buildView(snap, buildOptions{driver: DefaultDriverName, pool: testNode})
	var pooled []resourceapi.Device
	for _, sl := range v.slices {
		for _, d := range sl.Devices {
			if *d.Attributes["type"].StringValue == "gpu.mps" {
				pooled = append(pooled, d)
			}
		}
	}
	if len(pooled) != 1 {
		t.Fatalf("gpu.mps devices %+v (problems %v); want the 4 shares pooled as one", pooled, problems)
	}
	d := pooled[0]
	prog := dracel.GetCompiler(dracel.Features{}).CompileCELExpression(classes[reqs[0].Exactly.DeviceClassName].Spec.Selectors[0].CEL.Expression, dracel.Options{})
	if ok, _, err := prog.DeviceMatches(context.Background(), dracel.Device{Driver: DefaultDriverName, Attributes: d.Attributes, Capacity: d.Capacity}); err != nil || !ok {
		t.Errorf("the class does not select the pooled device: %v, %v", ok, err)
	}
	mem := d.Capacity["memory"]
	if d.AllowMultipleAllocations == nil || !*d.AllowMultipleAllocations || mem.RequestPolicy == nil || mem.RequestPolicy.ValidRange == nil ||
		mem.Value.Cmp(resource.MustParse("80Gi")) != 0 || mem.RequestPolicy.ValidRange.Step.Cmp(resource.MustParse("20Gi")) != 0 {
		t.Errorf("pooled device: multiple allocations %v, memory %+v; want consumable 80Gi in steps of 20Gi", d.AllowMultipleAllocations, mem)
	}
	// Each allocation would consume a capacity without a request policy whole.
	if len(d.Capacity) != 1 {
		t.Errorf("pooled device capacities %v; want memory alone", d.Capacity)
	}
	if p := *d.Attributes["parent"].StringValue; p != "GPU-1" {
		t.Errorf("pooled device's parent %q, want GPU-1", p)
	}
	use := d.ConsumesCounters[0].Counters
	memUse, computeUse := use[label("mps-memory-mib")].Value, use[label("mps-compute-percent")].Value
	if len(d.ConsumesCounters) != 1 || memUse.Value() != 81920 || computeUse.Value() != 100 {
		t.Errorf("pooled device consumes %+v; want all 4 shares' counters", d.ConsumesCounters)
	}
	// What the example asks is two shares; a request between steps takes whole shares.
	p := v.devices[d.Name].pool
	for q, want := range map[string]int{asked.String(): 2, "10Gi": 1, "41Gi": 3} {
		if got := p.sharesFor(map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse(q)}); got != want {
			t.Errorf("%s of shares of 20Gi: %d shares, want %d", q, got, want)
		}
	}
}

// migShare is share k of n of the static MIG device mig of memMiB, as the nvidia-example
// plugin reports it.
func migShare(mig string, k, n int, memMiB int64) *pb.Device {
	return &pb.Device{Id: fmt.Sprintf("%s::mps::%d", mig, k), Health: pb.Health_HEALTH_HEALTHY,
		Consumes: []*pb.CounterConsumption{{CounterSet: mig, Counters: map[string]int64{"mps-compute-percent": int64(100 / n), "mps-memory-mib": memMiB / int64(n)}}}}
}

// deploy/kubernetes/examples/mig-mps-shares.yaml asks for 20Gi of the MPS shares of a
// 3g.40gb MIG device, of the mig-mps DeviceClass and a selector of the profile, which
// together select the pooled shares of each 3g.40gb device and nothing else (not the MIG
// device whole, not another profile's shares, not a GPU's); what it asks is two of
// the device's four shares; its pod uses the claim.
func TestMIGMPSSharesExample(t *testing.T) {
	classes := deviceClasses(t)
	tmpl, pod := example(t, "examples/mig-mps-shares.yaml")
	if len(pod.Spec.ResourceClaims) != 1 || pod.Spec.ResourceClaims[0].ResourceClaimTemplateName == nil || *pod.Spec.ResourceClaims[0].ResourceClaimTemplateName != tmpl.Name {
		t.Errorf("pod %s claims %+v; want one from template %s", pod.Name, pod.Spec.ResourceClaims, tmpl.Name)
	}
	reqs := tmpl.Spec.Spec.Devices.Requests
	if len(reqs) != 1 || reqs[0].Exactly == nil || classes[reqs[0].Exactly.DeviceClassName] == nil || reqs[0].Exactly.Capacity == nil {
		t.Fatalf("template %s requests %+v; want one device of a DeviceClass of dra.yaml, with a capacity request", tmpl.Name, reqs)
	}
	exprs := []string{classes[reqs[0].Exactly.DeviceClassName].Spec.Selectors[0].CEL.Expression}
	for _, sel := range reqs[0].Exactly.Selectors {
		if sel.CEL == nil {
			t.Fatalf("template %s: selector %+v; want CEL", tmpl.Name, sel)
		}
		exprs = append(exprs, sel.CEL.Expression)
	}
	mem := func(mib int64) map[string]*pb.Value {
		return map[string]*pb.Value{"memory": {Kind: &pb.Value_IntValue{IntValue: mib}, Unit: "MiB"}}
	}
	set := func(name string, mib int64) *pb.CounterSet {
		return &pb.CounterSet{Plugin: "nvidia", Name: name, Capacity: map[string]int64{"mps-compute-percent": 100, "mps-memory-mib": mib}}
	}
	whole := func(mig string, mib int64) *pb.Device {
		return &pb.Device{Id: mig, Health: pb.Health_HEALTH_HEALTHY,
			Consumes: []*pb.CounterConsumption{{CounterSet: mig, Counters: map[string]int64{"mps-compute-percent": 100, "mps-memory-mib": mib}}}}
	}
	snap := &pb.FingerprintResponse{
		CounterSets: []*pb.CounterSet{set("MIG-3g", 40960), set("MIG-2g", 20480), set("GPU-1", 81920)},
		Groups: []*pb.DeviceGroup{
			{Vendor: "nvidia", Type: "mig", Name: "3g.40gb", Plugin: "nvidia", Attributes: mem(40960), Devices: []*pb.Device{whole("MIG-3g", 40960)}},
			{Vendor: "nvidia", Type: "mig", Name: "2g.20gb", Plugin: "nvidia", Attributes: mem(20480), Devices: []*pb.Device{whole("MIG-2g", 20480)}},
			{Vendor: "nvidia", Type: "mig", Name: "3g.40gb.mps", Plugin: "nvidia", Attributes: mem(10240),
				Devices: []*pb.Device{migShare("MIG-3g", 0, 4, 40960), migShare("MIG-3g", 1, 4, 40960), migShare("MIG-3g", 2, 4, 40960), migShare("MIG-3g", 3, 4, 40960)}},
			{Vendor: "nvidia", Type: "mig", Name: "2g.20gb.mps", Plugin: "nvidia", Attributes: mem(5120),
				Devices: []*pb.Device{migShare("MIG-2g", 0, 4, 20480), migShare("MIG-2g", 1, 4, 20480), migShare("MIG-2g", 2, 4, 20480), migShare("MIG-2g", 3, 4, 20480)}},
			{Vendor: "nvidia", Type: "gpu.mps", Name: "3g.40gb", Plugin: "nvidia", Attributes: mem(20480), // a GPU named like the profile
				Devices: []*pb.Device{migShare("GPU-1", 0, 4, 81920), migShare("GPU-1", 1, 4, 81920), migShare("GPU-1", 2, 4, 81920), migShare("GPU-1", 3, 4, 81920)}},
		},
	}
	v, problems := buildView(snap, buildOptions{driver: DefaultDriverName, pool: testNode})
	if len(problems) > 0 {
		t.Fatalf("building the view: %v", problems)
	}
	var selected []resourceapi.Device
	for _, sl := range v.slices {
		for _, d := range sl.Devices {
			all := true
			for _, e := range exprs {
				prog := dracel.GetCompiler(dracel.Features{}).CompileCELExpression(e, dracel.Options{})
				if prog.Error != nil {
					t.Fatal(prog.Error)
				}
				ok, _, err := prog.DeviceMatches(context.Background(), dracel.Device{Driver: DefaultDriverName, Attributes: d.Attributes, Capacity: d.Capacity})
				if err != nil {
					t.Fatalf("%s on %s: %v", e, d.Name, err)
				}
				all = all && ok
			}
			if all {
				selected = append(selected, d)
			}
		}
	}
	if len(selected) != 1 || selected[0].Name != DeviceName("MIG-3g::mps") {
		var names []string
		for _, d := range selected {
			names = append(names, d.Name)
		}
		t.Fatalf("the example's class and selector pick %v; want the 3g.40gb device's shares alone, %s", names, DeviceName("MIG-3g::mps"))
	}
	d := selected[0]
	if p := *d.Attributes["parent"].StringValue; p != "MIG-3g" {
		t.Errorf("pooled shares' parent %q, want their MIG device MIG-3g", p)
	}
	capMem := d.Capacity["memory"]
	if d.AllowMultipleAllocations == nil || !*d.AllowMultipleAllocations || capMem.RequestPolicy == nil || capMem.RequestPolicy.ValidRange == nil ||
		capMem.Value.Cmp(resource.MustParse("40Gi")) != 0 || capMem.RequestPolicy.ValidRange.Step.Cmp(resource.MustParse("10Gi")) != 0 {
		t.Errorf("pooled shares: multiple allocations %v, memory %+v; want consumable 40Gi in steps of 10Gi", d.AllowMultipleAllocations, capMem)
	}
	asked := reqs[0].Exactly.Capacity.Requests["memory"]
	if got := v.devices[d.Name].pool.sharesFor(map[resourceapi.QualifiedName]resource.Quantity{"memory": asked}); got != 2 {
		t.Errorf("the example's %s of shares of 10Gi: %d shares, want 2", asked.String(), got)
	}
}

// deploy/kubernetes/examples/mig-or-gpu.yaml asks first for a 1g.10gb MIG instance (its
// selector matches that profile and no other) and then for a whole GPU, each by a
// DeviceClass of dra.yaml; its pod uses the claim.
func TestPrioritizedExample(t *testing.T) {
	classes := deviceClasses(t)
	tmpl, pod := example(t, "examples/mig-or-gpu.yaml")
	reqs := tmpl.Spec.Spec.Devices.Requests
	if len(reqs) != 1 || len(reqs[0].FirstAvailable) != 2 {
		t.Fatalf("template %s requests %+v; want one request with 2 alternatives", tmpl.Name, reqs)
	}
	alts := reqs[0].FirstAvailable
	if alts[0].DeviceClassName != "mig.devicehost.io" || alts[1].DeviceClassName != "gpu.devicehost.io" || len(alts[1].Selectors) != 0 {
		t.Errorf("alternatives %+v; want a MIG instance first, then any whole GPU", alts)
	}
	for _, a := range alts {
		if classes[a.DeviceClassName] == nil {
			t.Errorf("alternative %s: DeviceClass %s is not in dra.yaml", a.Name, a.DeviceClassName)
		}
	}
	snap := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{
		{Vendor: "nvidia", Type: "mig", Name: "1g.10gb", Plugin: "nvidia", Devices: []*pb.Device{{Id: "MIG-1", Health: pb.Health_HEALTH_HEALTHY}}},
		{Vendor: "nvidia", Type: "mig", Name: "2g.20gb", Plugin: "nvidia", Devices: []*pb.Device{{Id: "MIG-2", Health: pb.Health_HEALTH_HEALTHY}}},
	}}
	v, _ := buildView(snap, buildOptions{driver: DefaultDriverName, pool: testNode})
	if len(alts[0].Selectors) != 1 || alts[0].Selectors[0].CEL == nil {
		t.Fatalf("the MIG alternative's selectors %+v; want one CEL expression", alts[0].Selectors)
	}
	prog := dracel.GetCompiler(dracel.Features{}).CompileCELExpression(alts[0].Selectors[0].CEL.Expression, dracel.Options{})
	if prog.Error != nil {
		t.Fatal(prog.Error)
	}
	for _, d := range v.slices[0].Devices {
		got, _, err := prog.DeviceMatches(context.Background(), dracel.Device{Driver: DefaultDriverName, Attributes: d.Attributes, Capacity: d.Capacity})
		if err != nil {
			t.Fatal(err)
		}
		if want := d.Name == DeviceName("MIG-1"); got != want {
			t.Errorf("the MIG alternative's selector on %s: %v, want %v", d.Name, got, want)
		}
	}
	if len(pod.Spec.ResourceClaims) != 1 || pod.Spec.ResourceClaims[0].ResourceClaimTemplateName == nil || *pod.Spec.ResourceClaims[0].ResourceClaimTemplateName != tmpl.Name {
		t.Errorf("pod %s claims %+v; want one from template %s", pod.Name, pod.Spec.ResourceClaims, tmpl.Name)
	}
}
