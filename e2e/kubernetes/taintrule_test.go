package kubernetes

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/testwait"
)

// createTaintRule creates a DeviceTaintRule (cluster-scoped, resource.k8s.io/v1) that
// taints one device of the suite's pool with effect, and returns a func that deletes it
// (once; later calls do nothing).
func (d *draStack) createTaintRule(t *testing.T, name, poolName, device, effect string) func() {
	t.Helper()
	obj := map[string]any{
		"apiVersion": "resource.k8s.io/v1",
		"kind":       "DeviceTaintRule",
		"metadata":   map[string]any{"name": name, "labels": map[string]string{"app": podLabel}},
		"spec": map[string]any{
			"deviceSelector": map[string]any{"driver": draDriver, "pool": poolName, "device": device},
			"taint":          map[string]any{"key": "example.com/maintenance", "value": "e2e", "effect": effect},
		},
	}
	data, err := json.Marshal(obj)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := d.n.kubectl(data, "create", "-f", "-"); err != nil {
		t.Fatalf("create DeviceTaintRule %s: %v %s", name, err, out)
	}
	deleted := false
	del := func() {
		if deleted {
			return
		}
		deleted = true
		if out, err := d.n.kubectl(nil, "delete", "devicetaintrule", name, "--ignore-not-found"); err != nil {
			t.Errorf("delete DeviceTaintRule %s: %v %s", name, err, out)
		}
	}
	t.Cleanup(del)
	return del
}

// deviceName is the DRA name of the agent's device id in p.
func (p pool) deviceName(id string) string {
	for _, dv := range p.devices {
		if dv.attr("id") == id {
			return dv.Name
		}
	}
	return ""
}

// An administrator's DeviceTaintRule on devicehost GPUs: NoSchedule keeps new claims off
// them while the holder runs on; NoExecute evicts the holder's pod and the driver's
// Unprepare frees its GPUs in the ledger. The driver publishes no taint for either: the
// rule is Kubernetes' alone, and the ledger needs none.
func (d *draStack) caseTaintRule(t *testing.T) {
	tmpl := d.createTemplate(t, "two", gpuClass, 2, "")
	holder, hc, hres, _ := d.runClaimPod(t, "dra-rule-holder", tmpl)
	defer d.deletePod(t, holder)
	results := hc.Status.Allocation.Devices.Results
	if len(results) != 2 {
		t.Fatalf("claim %s: %d allocation results, want 2", hc.Metadata.Name, len(results))
	}
	p := d.completePool(t)
	held, poolName := results[0].Device, results[0].Pool
	freeID := d.freeGPUs(t)[0]
	free := p.deviceName(freeID)
	if free == "" {
		t.Fatalf("free GPU %s not in the pool: %s", freeID, p)
	}

	start := time.Now()
	d.createTaintRule(t, "e2e-held-noschedule", poolName, held, "NoSchedule")
	unFree := d.createTaintRule(t, "e2e-free-noschedule", poolName, free, "NoSchedule")
	// 8 GPUs: 2 the claim's, 1 more tainted by the rule: a claim for 6 would need it.
	tmpl6 := d.createTemplate(t, "six", gpuClass, 6, "")
	six := d.createClaimPod(t, "dra-rule-six", tmpl6)
	defer d.deletePod(t, six)
	msg, _ := d.waitUnschedulable(t, six, 60*time.Second)
	dVerdict := time.Since(start)
	d.stillRunning(t, holder)
	if rs, err := d.reservations("-owner", hc.owner(), "-state", "active"); err != nil || len(rs) != 1 || rs[0].GetReservationId() != hres.GetReservationId() {
		t.Errorf("the holder's reservations under a NoSchedule rule: %v (%v), want its one, %s", rs, err, hres.GetReservationId())
	}
	if p2, err := d.pool(); err == nil && len(p2.tainted(p2.devices)) != 0 {
		t.Errorf("the driver tainted devices itself: %v", p2.tainted(p2.devices))
	}
	t.Logf("NoSchedule rules on %s (held) and %s (free): a claim for 6 GPUs unschedulable %v after the rules were created, holder running: %s",
		held, free, dVerdict.Round(time.Millisecond), msg)

	start = time.Now()
	unFree()
	d.waitPodReady(t, six, 90*time.Second)
	t.Logf("rule on %s deleted: the 6-GPU claim's pod running %v after", free, time.Since(start).Round(time.Millisecond))
	d.deletePod(t, six)

	// NoExecute: Kubernetes' device-taint eviction controller evicts the holder's pod;
	// the kubelet unprepares its claim and the ledger frees both GPUs.
	d.createTaintRule(t, "e2e-held-noexecute", poolName, held, "NoExecute")
	dFree := testwait.Until(t, 90*time.Second, "the evicted holder's GPUs free in the ledger", func() (bool, string) {
		rs, err := d.reservations("-owner", hc.owner(), "-state", "active")
		if err != nil {
			return false, err.Error()
		}
		return len(rs) == 0, fmt.Sprintf("%d active: %v", len(rs), rs)
	})
	testwait.Until(t, 60*time.Second, "pod "+holder+" gone or failed after the NoExecute rule", func() (bool, string) {
		p, err := d.getPod(holder)
		if err != nil {
			return strings.Contains(err.Error(), "NotFound") || strings.Contains(err.Error(), "not found"), err.Error()
		}
		return p.Status.Phase == "Failed" || p.Status.Phase == "Succeeded", "phase " + p.Status.Phase
	})
	for _, id := range hres.GetDeviceIds() {
		if !slices.Contains(d.freeGPUs(t), id) {
			t.Errorf("GPU %s still held after the eviction", id)
		}
	}
	t.Logf("NoExecute rule on %s: holder evicted, its claim unprepared, both its GPUs free in the ledger %v after the rule was created",
		held, dFree.Round(time.Millisecond))
}
