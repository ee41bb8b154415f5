package dra

import (
	"context"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
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

// deploy/kubernetes/dra.yaml has the DeviceClass gpu.devicehost.io, whose selector
// picks the GPUs the driver publishes and not their MIG partitions (and
// mig.devicehost.io the other way round); the example claims 2 of it.
func TestDeployManifests(t *testing.T) {
	classes := make(map[string]*resourceapi.DeviceClass)
	for _, obj := range readManifests(t, "dra.yaml") {
		if c, ok := obj.(*resourceapi.DeviceClass); ok {
			classes[c.Name] = c
		}
	}
	snap := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{
		{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3", Plugin: "nvidia", Devices: []*pb.Device{{Id: "GPU-1", Health: pb.Health_HEALTH_HEALTHY}}},
		{Vendor: "nvidia", Type: "mig", Name: "1g.10gb", Plugin: "nvidia", Devices: []*pb.Device{{Id: "MIG-1", Health: pb.Health_HEALTH_HEALTHY}}},
	}}
	v, _ := buildView(snap, buildOptions{driver: DefaultDriverName, pool: testNode})
	devs := v.slices[0].Devices
	for class, want := range map[string]string{"gpu.devicehost.io": DeviceName("GPU-1"), "mig.devicehost.io": DeviceName("MIG-1")} {
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
