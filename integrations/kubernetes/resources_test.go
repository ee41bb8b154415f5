package kubernetes_test

import (
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/integrations/kubernetes"
	"github.com/devicehost/devicehost/integrations/kubernetes/kubelettest"
)

var (
	a100 = device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA A100"}
	fpga = device.GroupKey{Vendor: "acme", Type: "fpga", Name: "Widget 9000"}
)

func group(key device.GroupKey, ids ...string) device.Group {
	g := device.Group{GroupKey: key, Plugin: key.Vendor}
	for _, id := range ids {
		g.Devices = append(g.Devices, device.DeviceInfo{ID: id, Locality: device.Locality{NUMANode: -1}})
	}
	return g
}

// Without configured resources there is one per vendor and type: nvidia.com/gpu for
// both GPU models, acme.com/fpga; a group whose default name the kubelet would refuse
// is left out, with a log line saying why.
func TestDefaultResources(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs(), group(a100, "A-0", "A-1"), group(fpga, "F-0"),
		group(device.GroupKey{Vendor: "Big Corp", Type: "npu", Name: "x"}, "N-0"))
	h := startBridge(t, agent)

	if _, err := h.kubelet.WaitRegistrations(ctx, "acme.com/fpga", 1); err != nil {
		t.Fatal(err)
	}
	u, err := h.kubelet.WaitDevices(ctx, "acme.com/fpga", kubelettest.AllHealth(1, dpapi.Healthy))
	if err != nil {
		t.Fatal(err)
	}
	if d := u.Devices[0]; d.GetID() != "F-0" || d.GetTopology() != nil {
		t.Errorf("acme.com/fpga device = %v, want F-0 with no topology (NUMA unknown)", d)
	}
	u = h.waitGPUs(t, ctx, "10 healthy GPUs of two models", kubelettest.AllHealth(10, dpapi.Healthy))
	if ids := deviceIDs(u.Devices); !slices.Contains(ids, "A-1") || !slices.Contains(ids, gpuID(7)) {
		t.Errorf("nvidia.com/gpu devices %v, want both models'", ids)
	}
	for _, r := range h.kubelet.Registrations() {
		if name := r.Request.GetResourceName(); name != gpuResource && name != "acme.com/fpga" {
			t.Errorf("registered %q, want only nvidia.com/gpu and acme.com/fpga", name)
		}
	}
	if !strings.Contains(h.logs.String(), `device group not served: its default resource name is not one the kubelet accepts; configure a resource for it: group="Big Corp/npu/x"`) {
		t.Errorf("no log line about the group with an invalid default name")
	}
	if !strings.Contains(h.logs.String(), `resource covers several device groups: each container gets devices of one of them; configure a resource per model to let pods choose: resource=nvidia.com/gpu groups=["NVIDIA H100 80GB HBM3", "NVIDIA A100"]`) {
		t.Errorf("no log line about nvidia.com/gpu covering two models")
	}

	// One container's devices are one reservation, of one group.
	c := h.plugin(t, ctx)
	_, err = allocate(ctx, c, gpuID(0), "A-0")
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `are of two device groups, "NVIDIA H100 80GB HBM3" and "NVIDIA A100"`) {
		t.Errorf("Allocate across models: %v, want InvalidArgument naming both groups", err)
	}
	if got, err := allocate(ctx, c, "A-0", "A-1"); err != nil || got.GetEnvs()["NVIDIA_VISIBLE_DEVICES"] != "A-0,A-1" {
		t.Errorf("Allocate of two A100s: %v, %v", got, err)
	}
	// GetPreferredAllocation keeps a request to one model.
	resp, err := c.GetPreferredAllocation(ctx, &dpapi.PreferredAllocationRequest{ContainerRequests: []*dpapi.ContainerPreferredAllocationRequest{{
		AvailableDeviceIDs: []string{gpuID(0), "A-0", "A-1", gpuID(5)}, MustIncludeDeviceIDs: []string{"A-1"}, AllocationSize: 2,
	}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetContainerResponses()[0].GetDeviceIDs(); !slices.Equal(got, []string{"A-0", "A-1"}) {
		t.Errorf("preferred allocation with A-1 included = %v, want [A-0 A-1]", got)
	}
}

// Configured resources serve just the groups they select: one resource per model.
// MIG partitions get a resource per profile, as NVIDIA's "mixed" strategy names them,
// beside nvidia.com/gpu; a partition another reservation's use of its GPU blocks is
// unhealthy to the kubelet, so it never picks one the agent would refuse, and healthy
// again once freed.
func TestPartitionResources(t *testing.T) {
	ctx := testContext(t)
	mig := device.GroupKey{Vendor: "nvidia", Type: kubernetes.PartitionType, Name: "1g.10gb"}
	big := device.GroupKey{Vendor: "nvidia", Type: kubernetes.PartitionType, Name: "3g.40gb"}
	agent := startAgent(t, eightGPUs(), group(mig, "MIG-0-0", "MIG-0-1"), group(big, "MIG-0-3g"))
	h := startBridge(t, agent)
	for _, name := range []string{"nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"} {
		if _, err := h.kubelet.WaitRegistrations(ctx, name, 1); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	if _, err := h.kubelet.WaitDevices(ctx, "nvidia.com/mig-1g.10gb", kubelettest.AllHealth(2, dpapi.Healthy)); err != nil {
		t.Fatal(err)
	}
	h.waitGPUs(t, ctx, "8 healthy GPUs, no partition among them", kubelettest.AllHealth(8, dpapi.Healthy))

	agent.block("MIG-0-1", device.Holder{ReservationID: "res-x", OwnerID: "job-x"})
	if _, err := h.kubelet.WaitDevices(ctx, "nvidia.com/mig-1g.10gb", withHealth(2, "MIG-0-1", dpapi.Unhealthy)); err != nil {
		t.Fatalf("blocked partition: %v", err)
	}
	agent.block("MIG-0-1")
	if _, err := h.kubelet.WaitDevices(ctx, "nvidia.com/mig-1g.10gb", kubelettest.AllHealth(2, dpapi.Healthy)); err != nil {
		t.Fatalf("unblocked partition: %v", err)
	}
}

func TestConfiguredResources(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs(), group(a100, "A-0", "A-1"), group(fpga, "F-0"))
	h := startBridge(t, agent, func(c *kubernetes.Config) {
		c.Resources = []kubernetes.Resource{
			{Name: "nvidia.com/a100", Vendor: "nvidia", Type: "gpu", Model: a100.Name},
			{Name: "example.com/h100", Vendor: "nvidia", Type: "gpu", Model: h100.Name},
		}
	})
	u, err := h.kubelet.WaitDevices(ctx, "nvidia.com/a100", kubelettest.AllHealth(2, dpapi.Healthy))
	if err != nil {
		t.Fatal(err)
	}
	if ids := deviceIDs(u.Devices); !slices.Equal(ids, []string{"A-0", "A-1"}) {
		t.Errorf("nvidia.com/a100 devices %v, want [A-0 A-1]", ids)
	}
	if _, err := h.kubelet.WaitDevices(ctx, "example.com/h100", kubelettest.AllHealth(8, dpapi.Healthy)); err != nil {
		t.Fatal(err)
	}
	for _, r := range h.kubelet.Registrations() {
		if name := r.Request.GetResourceName(); name != "nvidia.com/a100" && name != "example.com/h100" {
			t.Errorf("registered %q, which is not configured", name)
		}
	}
	c, err := h.kubelet.Client("nvidia.com/a100")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := allocate(ctx, c, gpuID(0)); status.Code(err) != codes.NotFound {
		t.Errorf("Allocate of an H100 through nvidia.com/a100: %v, want NotFound", err)
	}
}

// New refuses a configuration the kubelet or the bridge could not serve.
func TestNewRefusesBadResources(t *testing.T) {
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent)
	for _, tc := range []struct {
		rs   []kubernetes.Resource
		want string
	}{
		{[]kubernetes.Resource{{Name: "gpu", Vendor: "nvidia", Type: "gpu"}}, `resource name "gpu" has no domain`},
		{[]kubernetes.Resource{{Name: "nvidia.com/gpu", Vendor: "nvidia", Type: "gpu"}, {Name: "nvidia.com/h100", Vendor: "nvidia", Type: "gpu", Model: "H100"}}, "both match device groups"},
	} {
		_, err := kubernetes.New(kubernetes.Config{Client: h.client, Resources: tc.rs})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%v): %v, want an error containing %q", tc.rs, err, tc.want)
		}
	}
	if _, err := kubernetes.New(kubernetes.Config{}); err == nil {
		t.Error("New without a client: no error")
	}
}

// GetPreferredAllocation over gRPC, as the kubelet asks: must-include honoured, the
// rest on the same NUMA node; bad requests refused.
func TestGetPreferredAllocation(t *testing.T) {
	ctx := testContext(t)
	h := startBridge(t, startAgent(t, eightGPUs()))
	c := h.healthyPlugin(t, ctx)
	all := make([]string, 8)
	for i := range all {
		all[i] = gpuID(i)
	}
	resp, err := c.GetPreferredAllocation(ctx, &dpapi.PreferredAllocationRequest{ContainerRequests: []*dpapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: all, MustIncludeDeviceIDs: []string{gpuID(5)}, AllocationSize: 3},
		{AvailableDeviceIDs: all[1:], AllocationSize: 4},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := resp.GetContainerResponses()[0].GetDeviceIDs(), []string{gpuID(4), gpuID(5), gpuID(6)}; !slices.Equal(got, want) {
		t.Errorf("3 with GPU 5: %v, want %v (NUMA node 1)", got, want)
	}
	if got, want := resp.GetContainerResponses()[1].GetDeviceIDs(), all[4:]; !slices.Equal(got, want) {
		t.Errorf("4 of GPUs 1-7: %v, want %v (the whole of NUMA node 1)", got, want)
	}

	huge := make([]string, 1025)
	for i := range huge {
		huge[i] = "X"
	}
	_, err = c.GetPreferredAllocation(ctx, &dpapi.PreferredAllocationRequest{ContainerRequests: []*dpapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: huge, AllocationSize: 1},
	}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "1025 devices; at most 1024") {
		t.Errorf("1025 devices: %v, want InvalidArgument", err)
	}
}

func deviceIDs(devs []*dpapi.Device) []string {
	ids := make([]string, len(devs))
	for i, d := range devs {
		ids[i] = d.GetID()
	}
	return ids
}
