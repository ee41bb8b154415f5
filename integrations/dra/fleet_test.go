package dra

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PublishPool, the fleet bench's hook, writes the pool a driver on that node would:
// the recorded DGX H100's 8 GPUs and its on-demand MIG recording's placements with
// their counter sets, under the node's name; a fingerprint that is no protojson is
// refused naming it.
func TestPublishPool(t *testing.T) {
	for _, c := range []struct {
		file       string
		devices    int
		counterSet bool
	}{
		{"dgxh100.json", 8, false},
		{"dgxh100-mig-on-demand.json", 232, true},
	} {
		t.Run(c.file, func(t *testing.T) {
			fp, err := os.ReadFile(filepath.Join("cmd", "devicehost-fleet", "fingerprints", c.file))
			if err != nil {
				t.Fatal(err)
			}
			kube := newKube()
			writes, problems, err := PublishPool(context.Background(), kube, resourceREST(t, kube), testDriver, testNode, fp, nil)
			if err != nil || writes == 0 {
				t.Fatalf("PublishPool = %d writes, %v (problems %v)", writes, err, problems)
			}
			slices, err := kube.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			devices, sets := 0, 0
			for _, s := range slices.Items {
				if s.Spec.Driver != testDriver || s.Spec.Pool.Name != testNode || s.Spec.NodeName == nil || *s.Spec.NodeName != testNode {
					t.Errorf("slice %s: driver %s, pool %s, node %v; want %s, %s, %s", s.Name, s.Spec.Driver, s.Spec.Pool.Name, s.Spec.NodeName, testDriver, testNode, testNode)
				}
				devices += len(s.Spec.Devices)
				sets += len(s.Spec.SharedCounters)
			}
			if devices != c.devices || (sets > 0) != c.counterSet {
				t.Errorf("%d slices with %d devices and %d counter sets; want %d devices, counter sets %v", len(slices.Items), devices, sets, c.devices, c.counterSet)
			}
		})
	}
	if _, _, err := PublishPool(context.Background(), newKube(), nil, testDriver, testNode, []byte("{not json"), nil); err == nil {
		t.Error("PublishPool took a fingerprint that is no protojson")
	}
}
