package kubernetes

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// Sharing chosen per claim on the real node: the agent restarted with the nvidia-example
// plugin's sharing = ["time-slicing", "mps"] (each GPU offered as 4 time-sliced
// replicas and 4 MPS shares, each mode in a compatibility group of its own), the API
// server and scheduler with DRADeviceCompatibilityGroups. A time-sliced claim lands on
// a GPU, a second one pinned to that GPU shares it; an MPS claim pinned to that GPU
// stays pending (the scheduler sees the GPU in the other mode) while an MPS claim on
// any GPU lands on another one, and so does a device-plugin pod asking for
// nvidia.com/gpu.mps (the bridge hides the time-sliced GPU's shares); a time-sliced
// claim pinned to the MPS GPU and the whole time-sliced GPU stay pending. The ledger
// and each container's environment show every GPU in one mode.
func (d *draStack) caseSharingModes(t *testing.T) {
	mpsDir := filepath.Join(d.n.run, "ds", "mps")
	d.withAgentConfig(t, d.agentConfigVariant(t, "modes", `replicas       = 4
        sharing        = ["time-slicing", "mps"]
        mps_dir        = "`+mpsDir+`"`))
	dPool := d.waitPool(t, 60*time.Second, "8 GPUs, 32 replicas and 8 shareable MPS devices", func(p pool) (bool, string) {
		return len(p.ofType("gpu")) == 8 && len(p.ofType("gpu.shared")) == 32 && len(p.ofType("gpu.mps")) == 8, p.String()
	})
	t.Logf("agent restarted offering both modes: pool ready %v after", dPool.Round(time.Millisecond))
	parentIs := func(gpu string) string { return `device.attributes["` + draDriver + `"].parent == "` + gpu + `"` }
	mpsTemplate := func(prefix, memory, selector string) string {
		req := map[string]any{"deviceClassName": "gpu-mps.devicehost.io", "capacity": map[string]any{"requests": map[string]any{"memory": memory}}}
		if selector != "" {
			req["selectors"] = []any{map[string]any{"cel": map[string]any{"expression": selector}}}
		}
		return d.submitTemplate(t, prefix, map[string]any{"devices": map[string]any{"requests": []any{map[string]any{"name": "gpus", "exactly": req}}}})
	}
	type row struct{ pod, mode, gpu, devices, env string }
	var table []row
	run := func(prefix, tmpl, mode string) (string, map[string]string) {
		t.Helper()
		name := d.submitPod(t, prefix, func(spec, container map[string]any) {
			spec["resourceClaims"] = []any{map[string]any{"name": "gpus", "resourceClaimTemplateName": tmpl}}
			container["resources"] = map[string]any{"claims": []any{map[string]any{"name": "gpus"}}}
			container["command"] = []string{"/bin/sh", "-c", mpsScript}
		})
		out, _ := d.waitPodReady(t, name, 90*time.Second)
		_, res := d.claimReservation(t, name, 30*time.Second)
		env := envOf(out)
		gpu := env["NVIDIA_VISIBLE_DEVICES"]
		ids := slices.Sorted(slices.Values(res.GetDeviceIds()))
		want := map[string]string{"time-slicing": "gpu.shared", "mps": "gpu.mps"}[mode]
		if res.GetType() != want || len(ids) != 1 || !strings.HasPrefix(ids[0], gpu+"::") {
			t.Errorf("pod %s (%s): reservation %s %v, container on %s; want one %s device of that GPU", name, mode, res.GetType(), ids, gpu, want)
		}
		if hasPipe := env["PIPE"] != ""; hasPipe != (mode == "mps") {
			t.Errorf("pod %s (%s): MPS pipe directory %q in its environment", name, mode, env["PIPE"])
		}
		table = append(table, row{name, mode, gpu, strings.Join(ids, ","), fmt.Sprintf("THREADS=%s MEM=%s PIPE=%s", env["THREADS"], env["MEM"], env["PIPE"])})
		return name, env
	}
	tsA, envA := run("modes-ts-a", d.createTemplate(t, "ts-any", "gpu-shared.devicehost.io", 1, ""), "time-slicing")
	defer d.deletePod(t, tsA)
	gpu := envA["NVIDIA_VISIBLE_DEVICES"]
	tsB, envB := run("modes-ts-b", d.createTemplate(t, "ts-on", "gpu-shared.devicehost.io", 1, parentIs(gpu)), "time-slicing")
	defer d.deletePod(t, tsB)
	if envB["NVIDIA_VISIBLE_DEVICES"] != gpu {
		t.Errorf("the second time-sliced pod on %s; want %s", envB["NVIDIA_VISIBLE_DEVICES"], gpu)
	}

	pendingMPS := d.createClaimPod(t, "modes-mps-on-ts", mpsTemplate("mps-on-ts", "20Gi", parentIs(gpu)))
	defer d.deletePod(t, pendingMPS)
	msg, dVerdict := d.waitUnschedulable(t, pendingMPS, 60*time.Second)
	t.Logf("an MPS claim pinned to time-sliced %s: unschedulable after %v: %s", gpu, dVerdict.Round(time.Millisecond), msg)
	mpsA, envM := run("modes-mps-a", mpsTemplate("mps-any", "20Gi", ""), "mps")
	defer d.deletePod(t, mpsA)
	if envM["NVIDIA_VISIBLE_DEVICES"] == gpu {
		t.Errorf("the MPS pod landed on %s, which two time-sliced pods hold", gpu)
	}
	// The device-plugin path draws on the same GPUs through the ledger: the bridge offers
	// nvidia.com/gpu.mps without time-sliced GPU X's four shares (blocked) and the share
	// the MPS claim holds, and a pod asking for one lands beside the MPS claim or on a
	// free GPU, never on X.
	d.withBridgeResource(t, mpsResource, "gpu.mps")
	dAlloc := waitFor(t, 60*time.Second, "node allocatable "+mpsResource+"=27", func() (bool, string) {
		n, err := d.allocatableOf(mpsResource)
		return err == nil && n == 27, fmt.Sprintf("allocatable %d (%v)", n, err)
	})
	t.Logf("bridge serving %s: 27 allocatable (32 less %s's 4 blocked and the claim's 1) %v after", mpsResource, gpu, dAlloc.Round(time.Millisecond))
	dp := d.submitPod(t, "modes-dp-mps", func(_, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{mpsResource: "1"}}
		container["command"] = []string{"/bin/sh", "-c", mpsScript}
	})
	defer d.deletePod(t, dp)
	out, _ := d.waitPodReady(t, dp, 90*time.Second)
	envDP := envOf(out)
	if envDP["NVIDIA_VISIBLE_DEVICES"] == gpu || envDP["PIPE"] == "" {
		t.Errorf("the device-plugin MPS pod on %s with pipe %q; want a GPU other than time-sliced %s, with MPS", envDP["NVIDIA_VISIBLE_DEVICES"], envDP["PIPE"], gpu)
	}
	table = append(table, row{dp, "mps (device plugin)", envDP["NVIDIA_VISIBLE_DEVICES"], mpsResource + ": 1",
		fmt.Sprintf("THREADS=%s MEM=%s PIPE=%s", envDP["THREADS"], envDP["MEM"], envDP["PIPE"])})

	tsOnMPS := d.createClaimPod(t, "modes-ts-on-mps", d.createTemplate(t, "ts-on-mps", "gpu-shared.devicehost.io", 1, parentIs(envM["NVIDIA_VISIBLE_DEVICES"])))
	defer d.deletePod(t, tsOnMPS)
	msg2, dVerdict2 := d.waitUnschedulable(t, tsOnMPS, 60*time.Second)
	t.Logf("a time-sliced claim pinned to %s in MPS shares: unschedulable after %v: %s", envM["NVIDIA_VISIBLE_DEVICES"], dVerdict2.Round(time.Millisecond), msg2)
	whole := d.createClaimPod(t, "modes-whole", d.createTemplate(t, "whole-of-ts", gpuClass, 1, `device.attributes["`+draDriver+`"].id == "`+gpu+`"`))
	defer d.deletePod(t, whole)
	msg3, dVerdict3 := d.waitUnschedulable(t, whole, 60*time.Second)
	t.Logf("the whole of time-sliced %s: unschedulable after %v: %s", gpu, dVerdict3.Round(time.Millisecond), msg3)

	// The ledger: every GPU held in one mode, whichever path holds it.
	rs, err := d.reservations("-state", "active")
	if err != nil {
		t.Fatal(err)
	}
	modes := make(map[string]map[string]bool)
	for _, r := range rs {
		for _, id := range r.GetDeviceIds() {
			g, _, _ := strings.Cut(id, "::")
			if modes[g] == nil {
				modes[g] = make(map[string]bool)
			}
			modes[g][r.GetType()] = true
		}
	}
	for g, m := range modes {
		if len(m) != 1 {
			t.Errorf("GPU %s held in modes %v at once", g, m)
		}
	}
	t.Logf("the ledger's GPUs by mode: %v", modes)
	for _, r := range table {
		t.Logf("| %s | %s | %s | %s | %s |", r.pod, r.mode, r.gpu, r.devices, r.env)
	}
	for _, p := range []string{whole, tsOnMPS, dp, pendingMPS, mpsA, tsB, tsA} {
		d.deletePod(t, p)
	}
	// Every GPU whole again: the claims released at once, the device-plugin pod's
	// shares after the bridge's release grace.
	start := time.Now()
	d.waitAllocatable(t, 8, d.releaseGrace+60*time.Second)
	t.Logf("all 8 GPUs whole again %v after the pods were gone (bridge's release grace %v)", time.Since(start).Round(time.Millisecond), d.releaseGrace)
}
