package kubernetes_test

import (
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/kubernetes/kubelettest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// A node moving from another device plugin: PodResources says a running pod holds two
// GPUs of the bridge's resource that no reservation holds (NVIDIA's plugin allocated
// them before the bridge served nvidia.com/gpu). The bridge reserves them for that
// pod's container, so the agent hands them to no one else, and releases them once the
// pod is gone, as it does its own.
func TestAdoptsDevicesAnotherPluginAllocated(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent, withGrace)
	h.healthyPlugin(t, ctx) // the bridge knows the agent's devices
	h.pods.SetPods(kubelettest.Pod("ml", "old-0", "main", gpuResource, gpuID(3), gpuID(2)))
	start := time.Now()
	h.passDoneAfter(t, ctx, start)
	rs := agent.active()
	if len(rs) != 1 || rs[0].OwnerID != "k8s/ml/old-0/main" || strings.Join(rs[0].DeviceIDs, ",") != gpuID(2)+","+gpuID(3) {
		t.Fatalf("active reservations after a pass: %+v; want GPUs 2 and 3 held by k8s/ml/old-0/main", rs)
	}
	if !strings.Contains(h.logs.String(), "adopted devices a container held before the bridge served them") {
		t.Errorf("no log line of the adoption:\n%s", h.logs)
	}
	_, err := h.client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-1", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{gpuID(2)}})
	if _, held := client.HeldError(err); !held {
		t.Errorf("Reserve of an adopted GPU by another owner: %v; want it held by the pod", err)
	}
	// Further passes adopt nothing more while the pod runs.
	h.passDoneAfter(t, ctx, time.Now().Add(2*grace))
	if now := agent.active(); len(now) != 1 || now[0].ID != rs[0].ID {
		t.Fatalf("active reservations while the pod runs: %+v; want %s alone", now, rs[0].ID)
	}
	h.pods.SetPods()
	h.waitReleased(t, ctx, rs[0].ID)
}

// What the bridge cannot adopt stays as it is and is logged once: a device the agent
// does not serve (NVIDIA's plugin with deviceIDStrategy=index says "0"), and one
// another owner holds.
func TestAdoptRefusals(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	h := startBridge(t, agent, withGrace)
	h.healthyPlugin(t, ctx)
	theirs, err := h.client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-42", Vendor: h100.Vendor, Type: h100.Type, Name: h100.Name, DeviceIds: []string{gpuID(5)}})
	if err != nil {
		t.Fatal(err)
	}
	h.pods.SetPods(
		kubelettest.Pod("ml", "by-index", "main", gpuResource, "0"),
		kubelettest.Pod("ml", "clash", "main", gpuResource, gpuID(5)),
	)
	h.passDoneAfter(t, ctx, time.Now())
	h.passDoneAfter(t, ctx, time.Now()) // a second pass: logged once
	rs := agent.active()
	if len(rs) != 1 || rs[0].ID != theirs.GetReservationId() {
		t.Errorf("active reservations: %+v; want job-42's alone", rs)
	}
	logs := h.logs.String()
	if n := strings.Count(logs, "the kubelet says a container holds devices the agent cannot reserve for it"); n != 1 {
		t.Errorf("%d warnings of a device the agent does not serve, want 1 (once):\n%s", n, logs)
	}
	if n := strings.Count(logs, "the kubelet says a container holds a device that another owner holds at the agent"); n != 1 {
		t.Errorf("%d warnings of a device another owner holds, want 1 (once):\n%s", n, logs)
	}
	for _, want := range []string{"pod=k8s/ml/by-index/main", "not a device of " + gpuResource, "pod=k8s/ml/clash/main", "job-42"} {
		if !strings.Contains(logs, want) {
			t.Errorf("the warnings do not say %q:\n%s", want, logs)
		}
	}
}
