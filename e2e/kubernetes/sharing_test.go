package kubernetes

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/testwait"
)

// Sharing chosen per workload, every mode on one node of 8 simulated H100s: the agent
// restarted with the nvidia-example plugin's sharing = ["time-slicing", "mps"] (each
// whole GPU offered as 4 time-sliced replicas and 4 MPS shares, each mode in a
// compatibility group of its own) and mig = "on-demand" on GPUs 0 and 1 (MIG mode off on
// the others); the API server and scheduler with DRADeviceCompatibilityGroups.
//
// Two time-sliced claims share a GPU (X); an MPS claim pinned to X stays pending (the
// scheduler sees X in the other mode); an MPS claim of one share lands on another GPU
// (Y), and a second one of two shares pinned to Y joins it with its own limits on the
// same daemon (its SharingConfig asks Shared), and a third, pinned to Y and asking
// PerHolder with lower limits (10%, 8Gi), gets a daemon of its own there with them; a device-plugin pod asking nvidia.com/gpu.mps
// lands anywhere but X (the bridge hides X's shares); an exclusive claim gets a whole GPU
// of its own, a MIG claim a 1g.10gb partition; a time-sliced claim pinned to Y and the whole X stay
// pending. The ledger and each container's environment show every GPU in one mode.
func (d *draStack) caseSharingModes(t *testing.T) {
	mpsDir := filepath.Join(d.n.run, "ds", "mps")
	d.withAgentConfig(t, d.agentConfigVariant(t, "modes", `replicas       = 4
        sharing        = ["time-slicing", "mps"]
        mps_dir        = "`+mpsDir+`"
        mig            = "on-demand"
        sim_mig_mode_off = [2, 3, 4, 5, 6, 7]
        sim_state_file = "`+filepath.Join(d.n.run, "ds", "nvidia-sim-modes.json")+`"`))
	dPool := d.waitPool(t, 60*time.Second, "8 GPUs, 24 replicas, 6 shareable MPS devices and MIG placements", func(p pool) (bool, string) {
		return len(p.ofType("gpu")) == 8 && len(p.ofType("gpu.shared")) == 24 && len(p.ofType("gpu.mps")) == 6 && len(p.ofType("mig")) > 0, p.String()
	})
	t.Logf("agent restarted offering every mode: pool ready %v after", dPool.Round(time.Millisecond))
	parentIs := func(gpu string) string { return `device.attributes["` + draDriver + `"].parent == "` + gpu + `"` }
	// mpsTemplate is a claim template of MPS shares of memory; with isolation, its
	// SharingConfig asks that MPS isolation (Shared, PerHolder) of the plugin, and the
	// limits (field, value pairs of its mps) below what the shares give.
	mpsTemplate := func(prefix, memory, selector, isolation string, limits ...any) string {
		req := map[string]any{"deviceClassName": "gpu-mps.devicehost.io", "capacity": map[string]any{"requests": map[string]any{"memory": memory}}}
		if selector != "" {
			req["selectors"] = []any{map[string]any{"cel": map[string]any{"expression": selector}}}
		}
		devices := map[string]any{"requests": []any{map[string]any{"name": "gpus", "exactly": req}}}
		if isolation != "" {
			mps := map[string]any{"isolation": isolation}
			for i := 0; i+1 < len(limits); i += 2 {
				mps[limits[i].(string)] = limits[i+1]
			}
			devices["config"] = []any{map[string]any{"requests": []any{"gpus"}, "opaque": map[string]any{"driver": draDriver, "parameters": map[string]any{
				"apiVersion": "devicehost.io/v1alpha1", "kind": "SharingConfig", "strategy": "MPS", "mps": mps}}}}
		}
		return d.submitTemplate(t, prefix, map[string]any{"devices": devices})
	}
	type row struct{ pod, mode, gpu, devices, env string }
	var table []row
	var pods []string
	defer func() {
		for _, p := range pods {
			d.deletePod(t, p)
		}
	}()
	// run runs a pod of one claim from tmpl, checks its reservation is of typ and its
	// container's environment, and returns the pod and its environment.
	run := func(prefix, tmpl, mode, typ string) (string, map[string]string, map[string]string) {
		t.Helper()
		name := d.submitPod(t, prefix, func(spec, container map[string]any) {
			spec["resourceClaims"] = []any{map[string]any{"name": "gpus", "resourceClaimTemplateName": tmpl}}
			container["resources"] = map[string]any{"claims": []any{map[string]any{"name": "gpus"}}}
			container["command"] = []string{"/bin/sh", "-c", mpsScript}
		})
		pods = append(pods, name)
		out, _ := d.waitPodReady(t, name, 90*time.Second)
		_, res := d.claimReservation(t, name, 30*time.Second)
		env := envOf(out)
		ids := slices.Sorted(slices.Values(res.GetDeviceIds()))
		if res.GetType() != typ || len(ids) == 0 {
			t.Errorf("pod %s (%s): reservation %s %v; want %s devices", name, mode, res.GetType(), ids, typ)
		}
		if hasPipe := env["PIPE"] != ""; hasPipe != strings.HasPrefix(mode, "mps") {
			t.Errorf("pod %s (%s): MPS pipe directory %q in its environment", name, mode, env["PIPE"])
		}
		table = append(table, row{name, mode, env["NVIDIA_VISIBLE_DEVICES"], strings.Join(ids, ","),
			fmt.Sprintf("THREADS=%s MEM=%s PIPE=%s", env["THREADS"], env["MEM"], env["PIPE"])})
		return name, env, res.GetPluginOptions()
	}
	pending := func(what, prefix, tmpl string) {
		t.Helper()
		name := d.createClaimPod(t, prefix, tmpl)
		pods = append(pods, name)
		msg, dVerdict := d.waitUnschedulable(t, name, 60*time.Second)
		t.Logf("%s: unschedulable after %v: %s", what, dVerdict.Round(time.Millisecond), msg)
	}

	_, envA, _ := run("modes-ts-a", d.createTemplate(t, "ts-any", "gpu-shared.devicehost.io", 1, ""), "time-slicing", "gpu.shared")
	x := envA["NVIDIA_VISIBLE_DEVICES"]
	_, envB, _ := run("modes-ts-b", d.createTemplate(t, "ts-on", "gpu-shared.devicehost.io", 1, parentIs(x)), "time-slicing", "gpu.shared")
	if envB["NVIDIA_VISIBLE_DEVICES"] != x {
		t.Errorf("the second time-sliced pod on %s; want %s", envB["NVIDIA_VISIBLE_DEVICES"], x)
	}
	pending("an MPS claim pinned to time-sliced "+x, "modes-mps-on-ts", mpsTemplate("mps-on-ts", "20Gi", parentIs(x), ""))
	_, envM, _ := run("modes-mps-a", mpsTemplate("mps-20gi", "20Gi", "", ""), "mps", "gpu.mps")
	y := envM["NVIDIA_VISIBLE_DEVICES"]
	if y == x {
		t.Errorf("the MPS pod landed on %s, which two time-sliced pods hold", x)
	}
	_, envM2, _ := run("modes-mps-b", mpsTemplate("mps-40gi-on", "40Gi", parentIs(y), "Shared"), "mps", "gpu.mps")
	if envM2["NVIDIA_VISIBLE_DEVICES"] != y || envM2["PIPE"] != envM["PIPE"] || envM2["THREADS"] != "50" || envM["THREADS"] != "25" {
		t.Errorf("two MPS claims on %s: THREADS %s and %s, pipes %s and %s; want 25 and 50 on one daemon", y, envM["THREADS"], envM2["THREADS"], envM["PIPE"], envM2["PIPE"])
	}
	// A third MPS claim on Y asks a daemon of its own (SharingConfig mps.isolation
	// PerHolder), with limits below its one share's 25% and 20Gi: the same GPU, in the
	// same mode, beside the shared daemon.
	_, envM3, opts := run("modes-mps-own", mpsTemplate("mps-own-on", "20Gi", parentIs(y), "PerHolder", "activeThreadPercentage", 10, "pinnedDeviceMemoryLimit", "8Gi"), "mps per-holder", "gpu.mps")
	if envM3["NVIDIA_VISIBLE_DEVICES"] != y || envM3["PIPE"] == "" || envM3["PIPE"] == envM["PIPE"] || !strings.Contains(envM3["PIPE"], "/holder-") || envM3["CONTROL"] != "present" || opts["mps_isolation"] != "per-holder" {
		t.Errorf("a PerHolder MPS claim on %s: GPU %s, pipe %q (control socket %q; the shared daemon's pipe: %q), reservation's plugin options %v; want its own daemon's pipe on %s, its control socket, mps_isolation=per-holder",
			y, envM3["NVIDIA_VISIBLE_DEVICES"], envM3["PIPE"], envM3["CONTROL"], envM["PIPE"], opts, y)
	}
	if envM3["THREADS"] != "10" || envM3["MEM"] != "0=8192M" || opts["mps_thread_percentage"] != "10" || opts["mps_memory_limit"] != "8192" {
		t.Errorf("a PerHolder MPS claim asking 10%% and 8Gi: THREADS=%s MEM=%s, plugin options %v; want 10 and 0=8192M", envM3["THREADS"], envM3["MEM"], opts)
	}

	// The device-plugin path draws on the same GPUs through the ledger: the bridge offers
	// nvidia.com/gpu.mps without X's four shares (blocked) and the four the claims hold.
	d.withBridgeResource(t, mpsResource, "gpu.mps")
	dAlloc := testwait.Until(t, 60*time.Second, "node allocatable "+mpsResource+"=16", func() (bool, string) {
		n, err := d.allocatableOf(mpsResource)
		return err == nil && n == 16, fmt.Sprintf("allocatable %d (%v)", n, err)
	})
	t.Logf("bridge serving %s: 16 allocatable (24 less %s's 4 blocked and the claims' 4) %v after", mpsResource, x, dAlloc.Round(time.Millisecond))
	dp := d.submitPod(t, "modes-dp-mps", func(_, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{mpsResource: "1"}}
		container["command"] = []string{"/bin/sh", "-c", mpsScript}
	})
	pods = append(pods, dp)
	out, _ := d.waitPodReady(t, dp, 90*time.Second)
	envDP := envOf(out)
	if envDP["NVIDIA_VISIBLE_DEVICES"] == x || envDP["PIPE"] == "" {
		t.Errorf("the device-plugin MPS pod on %s with pipe %q; want a GPU other than time-sliced %s, with MPS", envDP["NVIDIA_VISIBLE_DEVICES"], envDP["PIPE"], x)
	}
	table = append(table, row{dp, "mps (device plugin)", envDP["NVIDIA_VISIBLE_DEVICES"], mpsResource + ": 1",
		fmt.Sprintf("THREADS=%s MEM=%s PIPE=%s", envDP["THREADS"], envDP["MEM"], envDP["PIPE"])})

	_, envW, _ := run("modes-whole", d.createTemplate(t, "whole-any", gpuClass, 1, ""), "exclusive", "gpu")
	if w := envW["NVIDIA_VISIBLE_DEVICES"]; w == x || w == y || w == envDP["NVIDIA_VISIBLE_DEVICES"] {
		t.Errorf("the exclusive pod on %s, a GPU another pod shares", w)
	}
	_, envMIG, _ := run("modes-mig", d.createTemplate(t, "mig-1g", migClass, 1, `device.attributes["`+draDriver+`"].productName == "1g.10gb"`), "mig", "mig")
	if !strings.HasPrefix(envMIG["NVIDIA_VISIBLE_DEVICES"], "MIG-") {
		t.Errorf("the MIG pod sees %q; want a MIG device", envMIG["NVIDIA_VISIBLE_DEVICES"])
	}
	pending("a time-sliced claim pinned to "+y+" in MPS shares", "modes-ts-on-mps", d.createTemplate(t, "ts-on-mps", "gpu-shared.devicehost.io", 1, parentIs(y)))
	pending("the whole of time-sliced "+x, "modes-whole-x", d.createTemplate(t, "whole-of-ts", gpuClass, 1, `device.attributes["`+draDriver+`"].id == "`+x+`"`))

	// The ledger: every GPU held in one mode, whichever path holds it.
	rs, err := d.reservations("-state", "active")
	if err != nil {
		t.Fatal(err)
	}
	modes := make(map[string]map[string]bool)
	for _, r := range rs {
		for _, id := range r.GetDeviceIds() {
			g, _, _ := strings.Cut(id, "::")
			g, _, _ = strings.Cut(g, "-mig-")
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
	t.Log("| pod | mode | GPU (NVIDIA_VISIBLE_DEVICES) | devices | MPS environment |")
	for _, r := range table {
		t.Logf("| %s | %s | %s | %s | %s |", r.pod, r.mode, r.gpu, r.devices, r.env)
	}
	for _, p := range pods {
		d.deletePod(t, p)
	}
	// Every GPU whole again: the claims released at once, the device-plugin pod's
	// shares after the bridge's release grace.
	start := time.Now()
	d.waitAllocatable(t, 8, d.releaseGrace+60*time.Second)
	t.Logf("all 8 GPUs whole again %v after the pods were gone (bridge's release grace %v)", time.Since(start).Round(time.Millisecond), d.releaseGrace)
}
