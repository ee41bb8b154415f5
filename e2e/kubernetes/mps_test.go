package kubernetes

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/testwait"
)

const mpsResource = "nvidia.com/gpu.mps"

// MPS shares through the device plugin on the real node: the agent restarted with the
// nvidia-example plugin's sharing = "mps" (4 shares per GPU, one control daemon per GPU,
// simulated by the agent's binary), the bridge restarted serving nvidia.com/gpu.mps
// beside nvidia.com/gpu. A pod asking for 2 shares runs with two shares of one GPU:
// its container sees that GPU, the daemon's pipe directory (mounted: its control socket
// is there) and two shares' limits; the GPU leaves nvidia.com/gpu's allocatable while
// the shares are held; after the pod is gone (and the bridge's release grace), the
// daemon is stopped and the GPU is back.
func (d *draStack) caseMPSDevicePlugin(t *testing.T) {
	mpsDir := filepath.Join(d.n.run, "ds", "mps")
	d.withAgentConfig(t, withMetrics(t, d.agentConfigVariant(t, "mps", `replicas       = 4
        sharing        = "mps"
        mps_dir        = "`+mpsDir+`"`)))
	d.withBridgeResource(t, mpsResource, "gpu.mps")
	dReg := testwait.Until(t, 60*time.Second, "node allocatable "+mpsResource+"=32", func() (bool, string) {
		n, err := d.allocatableOf(mpsResource)
		return err == nil && n == 32, fmt.Sprintf("allocatable %d (%v)", n, err)
	})
	t.Logf("agent with MPS shares, bridge serving %s: 32 allocatable %v after", mpsResource, dReg.Round(time.Millisecond))

	start := time.Now()
	name := d.submitPod(t, "mps", func(_, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{mpsResource: "2"}}
		container["command"] = []string{"/bin/sh", "-c", mpsScript}
		container["env"] = []any{map[string]any{"name": "DEVICEHOST_SIM_FB_USED_MIB", "value": strconv.Itoa(simFBUsedMiB)}}
	})
	defer d.deletePod(t, name)
	out, _ := d.waitPodReady(t, name, 90*time.Second)
	env := envOf(out)
	res, _ := d.waitPodReservation(t, name, 60*time.Second)
	gpu := env["NVIDIA_VISIBLE_DEVICES"]
	ids := slices.Sorted(slices.Values(res.GetDeviceIds()))
	if len(ids) != 2 || res.GetType() != "gpu.mps" || !strings.HasPrefix(ids[0], gpu+"::mps::") || !strings.HasPrefix(ids[1], gpu+"::mps::") {
		t.Errorf("reservation %s: %s %v, container NVIDIA_VISIBLE_DEVICES=%s; want two MPS shares of that GPU", res.GetReservationId(), res.GetType(), ids, gpu)
	}
	if !strings.HasPrefix(env["PIPE"], mpsDir+"/") || env["THREADS"] != "50" || !strings.HasPrefix(env["MEM"], "0=") || env["CONTROL"] != "present" {
		t.Errorf("the container's MPS environment %v: want a pipe directory under %s with its control socket, 50%% of the threads, a memory limit", env, mpsDir)
	}
	t.Logf("pod %s ran %v after its create, on %v: %s", name, time.Since(start).Round(time.Millisecond), ids, strings.Join([]string{"THREADS=" + env["THREADS"], "MEM=" + env["MEM"], "PIPE=" + env["PIPE"]}, " "))
	start = time.Now()
	holder := map[string]string{"pod": name, "namespace": podNamespace, "container": podContainer}
	line := d.dcgmSeries(t, "DCGM_FI_DEV_GPU_UTIL", gpu, holder, nil, 30*time.Second)
	fb := d.dcgmSeries(t, "DCGM_FI_DEV_FB_USED", gpu, holder, usesSimMemory, 30*time.Second)
	t.Logf("the agent's metrics show the pod on its GPU's series %v after it ran: %s; its processes' memory: %s", time.Since(start).Round(time.Millisecond), line, fb)
	dGone := d.waitAllocatable(t, 7, 30*time.Second)
	t.Logf("%s left %s's allocatable (7) %v after the pod ran", gpu, gpuResource, dGone.Round(time.Millisecond))

	d.deletePod(t, name)
	start = time.Now()
	testwait.Until(t, d.releaseGrace+60*time.Second, "the daemon stopped after the pod was gone", func() (bool, string) {
		entries, err := os.ReadDir(mpsDir)
		return err == nil && len(entries) == 0, fmt.Sprintf("%d daemon directories (%v)", len(entries), err)
	})
	d.waitAllocatable(t, 8, 30*time.Second)
	t.Logf("daemon stopped and %s back %v after the pod was gone (bridge's release grace %v)", gpu, time.Since(start).Round(time.Millisecond), d.releaseGrace)
}

// mpsScript prints what a container of MPS shares sees: its GPU, the daemon's pipe
// directory (and whether its control socket is there) and its limits.
const mpsScript = `echo "NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"; echo "DEVICEHOST_CLAIM=$DEVICEHOST_CLAIM"; ` +
	`echo "PIPE=$CUDA_MPS_PIPE_DIRECTORY"; echo "THREADS=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"; ` +
	`echo "MEM=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"; [ -S "$CUDA_MPS_PIPE_DIRECTORY/control" ] && echo "CONTROL=present"; ` +
	`echo READY; trap 'exit 0' TERM; sleep 86400 & wait`

// envOf reads the KEY=value lines of a container's output.
func envOf(out string) map[string]string {
	env := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), "="); ok {
			env[k] = v
		}
	}
	return env
}

// MPS shares through DRA consumable capacity on the real node: the agent restarted with
// sharing = "mps" (4 shares of 20Gi per simulated 80Gi GPU), the pool carries each GPU
// once more as a shareable device whose memory is taken in steps of one share. A pod of
// deploy/kubernetes/examples/mps-shares.yaml (40Gi, any GPU) and a second one asking
// 40Gi of the same GPU share it, each with the daemon's pipe directory mounted and two
// shares' limits in its environment; a third asking 10Gi (one share) lands on another
// GPU; a claim for the first GPU whole stays pending while its shares are held; once
// the pods are gone, the daemons are stopped.
func (d *draStack) caseMPSClaims(t *testing.T) {
	mpsDir := filepath.Join(d.n.run, "ds", "mps")
	d.withAgentConfig(t, withMetrics(t, d.agentConfigVariant(t, "mps", `replicas       = 4
        sharing        = "mps"
        mps_dir        = "`+mpsDir+`"`)))
	dPool := d.waitPool(t, 60*time.Second, "8 GPUs and 8 shareable MPS devices", func(p pool) (bool, string) {
		return len(p.ofType("gpu")) == 8 && len(p.ofType("gpu.mps")) == 8, p.String()
	})
	t.Logf("agent restarted with MPS shares: pool ready %v after", dPool.Round(time.Millisecond))
	memTemplate := func(prefix, memory, selector string) string {
		req := map[string]any{"deviceClassName": "gpu-mps.devicehost.io", "capacity": map[string]any{"requests": map[string]any{"memory": memory}}}
		if selector != "" {
			req["selectors"] = []any{map[string]any{"cel": map[string]any{"expression": selector}}}
		}
		return d.submitTemplate(t, prefix, map[string]any{"devices": map[string]any{"requests": []any{map[string]any{"name": "share", "exactly": req}}}})
	}
	run := func(prefix, tmpl string, shares int) (string, map[string]string) {
		t.Helper()
		start := time.Now()
		name := d.submitPod(t, prefix, func(spec, container map[string]any) {
			spec["resourceClaims"] = []any{map[string]any{"name": "share", "resourceClaimTemplateName": tmpl}}
			container["resources"] = map[string]any{"claims": []any{map[string]any{"name": "share"}}}
			container["command"] = []string{"/bin/sh", "-c", mpsScript}
			container["env"] = []any{map[string]any{"name": "DEVICEHOST_SIM_FB_USED_MIB", "value": strconv.Itoa(simFBUsedMiB)}}
		})
		out, _ := d.waitPodReady(t, name, 90*time.Second)
		c, res := d.claimReservation(t, name, 30*time.Second)
		env := envOf(out)
		ids := slices.Sorted(slices.Values(res.GetDeviceIds()))
		on := env["NVIDIA_VISIBLE_DEVICES"]
		ofGPU := len(ids) == shares && res.GetType() == "gpu.mps"
		for _, id := range ids {
			ofGPU = ofGPU && strings.HasPrefix(id, on+"::mps::")
		}
		if !ofGPU {
			t.Errorf("pod %s: reservation %s %v, container NVIDIA_VISIBLE_DEVICES=%s; want %d MPS shares of that GPU", name, res.GetType(), ids, on, shares)
		}
		if want := strconv.Itoa(25 * shares); !strings.HasPrefix(env["PIPE"], mpsDir+"/") || env["THREADS"] != want || env["MEM"] != fmt.Sprintf("0=%dM", 20480*shares) || env["CONTROL"] != "present" {
			t.Errorf("pod %s: the container's MPS environment %v; want a pipe directory under %s with its control socket, %s%% of the threads, %d MiB", name, env, mpsDir, want, 20480*shares)
		}
		var alloc string
		if err := d.n.kubectlJSON(c, "-n", podNamespace, "get", "resourceclaim", c.Metadata.Name); err == nil && c.Status.Allocation != nil {
			for _, r := range c.Status.Allocation.Devices.Results {
				alloc += fmt.Sprintf("%s share %s consumed %v; ", r.Device, r.ShareID, r.ConsumedCapacity)
			}
		}
		t.Logf("pod %s ran %v after its create on %v: THREADS=%s MEM=%s PIPE=%s; allocation: %s", name, time.Since(start).Round(time.Millisecond), ids, env["THREADS"], env["MEM"], env["PIPE"], alloc)
		return name, env
	}
	a, envA := run("dra-mps-a", d.manifestTemplate(t, "examples/mps-shares.yaml", "mps-40gi"), 2)
	defer d.deletePod(t, a)
	gpu := envA["NVIDIA_VISIBLE_DEVICES"]
	b, envB := run("dra-mps-b", memTemplate("mps-40gi-on", "40Gi", `device.attributes["`+draDriver+`"].parent == "`+gpu+`"`), 2)
	defer d.deletePod(t, b)
	if envB["NVIDIA_VISIBLE_DEVICES"] != gpu || envA["PIPE"] != envB["PIPE"] {
		t.Errorf("pod b on %s with pipe %s; want %s, the daemon %s", envB["NVIDIA_VISIBLE_DEVICES"], envB["PIPE"], gpu, envA["PIPE"])
	}
	c, envC := run("dra-mps-c", memTemplate("mps-10gi", "10Gi", ""), 1)
	defer d.deletePod(t, c)
	if envC["NVIDIA_VISIBLE_DEVICES"] == gpu {
		t.Errorf("pod c on %s, whose 4 shares a and b hold; want another GPU", gpu)
	}
	// Each pod on its GPU's series: a and b on one GPU, one series each, c on its own.
	start := time.Now()
	for _, p := range []struct{ pod, gpu string }{{a, gpu}, {b, gpu}, {c, envC["NVIDIA_VISIBLE_DEVICES"]}} {
		claim, _ := d.claimReservation(t, p.pod, 30*time.Second)
		holder := map[string]string{"pod": p.pod, "namespace": podNamespace, "dra_claim_name": claim.Metadata.Name}
		line := d.dcgmSeries(t, "DCGM_FI_DEV_GPU_UTIL", p.gpu, holder, nil, 30*time.Second)
		fb := d.dcgmSeries(t, "DCGM_FI_DEV_FB_USED", p.gpu, holder, usesSimMemory, 30*time.Second)
		t.Logf("pod %s on %s's series: %s; its processes' memory: %s", p.pod, p.gpu, line, fb)
	}
	t.Logf("the agent's metrics show each pod on its GPU's series %v after the last ran", time.Since(start).Round(time.Millisecond))

	whole := d.createTemplate(t, "whole-of-shared", gpuClass, 1, `device.attributes["`+draDriver+`"].id == "`+gpu+`"`)
	pending := d.createClaimPod(t, "dra-whole-of-shared", whole)
	defer d.deletePod(t, pending)
	msg, dVerdict := d.waitUnschedulable(t, pending, 60*time.Second)
	t.Logf("a claim for the whole %s while its shares are held: unschedulable after %v: %s", gpu, dVerdict.Round(time.Millisecond), msg)
	d.deletePod(t, pending)

	for _, p := range []string{a, b, c} {
		d.deletePod(t, p)
	}
	start = time.Now()
	testwait.Until(t, 60*time.Second, "the daemons stopped after the pods were gone", func() (bool, string) {
		entries, err := os.ReadDir(mpsDir)
		return err == nil && len(entries) == 0, fmt.Sprintf("%d daemon directories (%v)", len(entries), err)
	})
	t.Logf("daemons stopped %v after the pods were gone", time.Since(start).Round(time.Millisecond))
}

// withBridgeResource restarts the bridge with a copy of its config that also serves the
// agent's nvidia devices of type typ as resource, and restores its own config when the
// test ends.
func (s *stack) withBridgeResource(t *testing.T, resource, typ string) {
	t.Helper()
	plain := s.bridge.c
	const anchor = "kubernetes {"
	block := fmt.Sprintf("%s\n  resource %q {\n    vendor = \"nvidia\"\n    type   = %q\n  }\n", anchor, resource, typ)
	c := configVariant(t, plain, strings.ReplaceAll(typ, ".", "-"), anchor, block)
	restart := func(c hostContainer) {
		s.bridge.stop(t, syscall.SIGTERM)
		s.bridge.c = c
		s.bridge.start(t)
	}
	restart(c)
	t.Cleanup(func() {
		restart(plain)
		s.waitAllocatable(t, 8, 60*time.Second)
	})
}
