package kubernetes

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/testwait"
)

// simulatedGPUs are the IDs of the 8 GPUs of the simulated DGX H100 that the release's
// agent serves, read from a throwaway agent -dev (the simulator's UUIDs are stable).
func (h *helmStack) simulatedGPUs(t *testing.T) []string {
	t.Helper()
	dir := filepath.Join(h.n.run, "helm", "throwaway")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "dh.sock")
	p := &hostProc{name: "throwaway agent", bin: h.n.devicehost, log: filepath.Join(h.n.logs, "throwaway-agent.log"),
		c: hostContainer{args: []string{"agent", "-dev", "-listen", "unix://" + sock, "-state-dir", filepath.Join(dir, "state")}}}
	p.start(t)
	defer p.stop(t, syscall.SIGTERM)
	s := &stack{n: h.n, ds: &daemonSet{agentSocket: sock}}
	var ids []string
	testwait.Until(t, 60*time.Second, "the throwaway agent's 8 GPUs", func() (bool, string) {
		fp, err := s.devices()
		if err != nil {
			return false, err.Error()
		}
		ids = nil
		for _, g := range fp.GetGroups() {
			if g.GetType() == "gpu" {
				for _, d := range g.GetDevices() {
					ids = append(ids, d.GetId())
				}
			}
		}
		return len(ids) == 8, fmt.Sprintf("%d GPUs", len(ids))
	})
	return ids
}

// Moving a running node over from NVIDIA's device plugin: a stand-in plugin registered
// under nvidia.com/gpu (the same GPU IDs, no ledger) gives a running pod 2 GPUs; then
// devicehost is installed with the device-plugin path and the stand-in removed. The
// bridge adopts the pod's GPUs from PodResources (a reservation owned by its container),
// so the agent hands them to no one else; a new pod gets other GPUs; and once the old
// pod is gone they are released as the bridge's own are.
func (h *helmStack) caseAdopt(t *testing.T) {
	ids := h.simulatedGPUs(t)
	bin := filepath.Join(h.n.run, "standin", "standin")
	build := exec.Command("go", "build", "-o", bin, "./e2e/kubernetes/standin")
	build.Dir = h.n.root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./e2e/kubernetes/standin: %v\n%s", err, out)
	}
	standin := &hostProc{name: "stand-in device plugin", bin: bin, log: filepath.Join(h.n.logs, "standin.log"),
		c: hostContainer{args: []string{"-dir", filepath.Join(h.n.kubeletRoot, "device-plugins"), "-resource", gpuResource, "-ids", strings.Join(ids, ",")}}}
	standin.start(t)
	defer standin.stop(t, syscall.SIGTERM)
	h.s.waitAllocatable(t, 8, 60*time.Second)
	old := h.s.createPod(t, "pre-move", 2)
	out, _ := h.s.waitPodReady(t, old, 90*time.Second)
	env, _ := containerView(out)
	oldGPUs := strings.Split(env, ",")
	slices.Sort(oldGPUs)
	t.Logf("before devicehost: pod %s runs with %v from the stand-in plugin, which keeps no ledger", old, oldGPUs)

	start := time.Now()
	h.install(t, "devicePlugin", 0)
	standin.stop(t, syscall.SIGTERM) // the operator removes NVIDIA's plugin
	res, d := h.s.waitPodReservation(t, old, 60*time.Second)
	got := slices.Sorted(slices.Values(res.GetDeviceIds()))
	if !slices.Equal(got, oldGPUs) || res.GetOwnerId() != podOwner(old) {
		t.Fatalf("adopted reservation %s of %s holds %v; want %v owned by %s", res.GetReservationId(), res.GetOwnerId(), got, oldGPUs, podOwner(old))
	}
	t.Logf("the bridge adopted pod %s's GPUs %v as %s (owner %s), %v after the reservation was looked for, %v after helm install",
		old, got, res.GetReservationId(), res.GetOwnerId(), d.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	if out, err := h.s.cli("reserve", "-owner", "someone-else", "-device", oldGPUs[0]); err == nil || !strings.Contains(err.Error(), podOwner(old)) {
		t.Errorf("a Reserve of the adopted %s by another owner: %v %s; want it refused naming %s", oldGPUs[0], err, out, podOwner(old))
	} else {
		t.Logf("another owner's Reserve of %s refused: %s", oldGPUs[0], textTrim(err.Error(), 200))
	}
	h.gpuPodsRunning(t, "after the move", old)

	fresh := h.s.createPod(t, "post-move", 6)
	out, _ = h.s.waitPodReady(t, fresh, 90*time.Second)
	env, _ = containerView(out)
	for _, g := range strings.Split(env, ",") {
		if slices.Contains(oldGPUs, g) {
			t.Errorf("the new pod %s got %s, which pod %s holds", fresh, g, old)
		}
	}
	t.Logf("a new pod of 6 GPUs runs with the other six: %s", env)
	h.deletePodReleased(t, old)
	h.deletePodReleased(t, fresh)
	h.uninstall(t)
}
