package kubernetes

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/proc"
	"github.com/devicehost/devicehost/tools/testwait"
)

// devicehost as its users install it: devicehost's image (scripts/image), imported into
// the node's containerd, and `helm install` of deploy/helm/devicehost, so that the
// kubelet runs the DaemonSet's pods from the image, with the chart's mounts, service
// account, RBAC and probes. The node has no NVIDIA runtime: no runtime class, and the
// nvidia-example plugin simulates a DGX H100 through the chart's agent config.

const (
	// The namespace docs/kubernetes.md installs into: the agent container is privileged,
	// which Pod Security's baseline refuses elsewhere.
	helmNamespace = "kube-system"
	helmRelease   = "devicehost"
	// helmImageRepo is the image's repository: scripts/image names it devicehost:TAG.
	helmImageRepo = "devicehost"
	// The release's pods, by the chart's label.
	helmPodLabel = "app.kubernetes.io/name=" + helmRelease
)

// imageBinaries are the executables of devicehost's image, as /proc/<pid>/exe names
// them for a process in one of the release's containers.
var imageBinaries = []string{
	"/usr/local/bin/devicehost",
	"/usr/local/bin/devicehost-dra-plugin",
	"/usr/local/bin/grpc_health_probe",
	"/opt/devicehost/plugins/nvidia-example",
	"/opt/devicehost/plugins/hostdev",
}

// helmImage is one image archive scripts/image wrote.
type helmImage struct{ tag, archive string }

// helmStack is the node with devicehost's images imported and the chart at hand; at
// most one release of it is installed at a time.
type helmStack struct {
	n      *nodeEnv
	helm   string
	chart  string
	images []helmImage // [0] is installed, [1] is the upgrade
	values string      // the values file of the node (no NVIDIA runtime, simulated GPUs)
	// The release's hostPaths, under the node's run directory.
	socketDir, stateDir, pluginDir string
	// s and d reach the agent through the socket's hostPath, with the host's CLI, and
	// make the suite's pods; d has no driver process of its own (the release runs it).
	s *stack
	d *draStack
}

// TestRealNodeHelm installs, upgrades, rolls back and uninstalls the chart on the real
// node, once per mode, with GPU pods running through the release.
func TestRealNodeHelm(t *testing.T) {
	h := startHelm(t)
	t.Run("DevicePlugin", h.caseDevicePlugin)
	t.Run("DRA", h.caseDRA)
	t.Run("Both", h.caseBoth)
	t.Run("HostDevices", h.caseHostDevices)
	t.Run("Adopt", h.caseAdopt)
	t.Run("Metrics", h.caseMetrics)
}

// waitImages waits for run.sh's build of the images, which runs beside the other cases:
// until it has written its exit status to $DEVICEHOST_E2E_IMAGES_DONE (unset: the images
// were built before the suite), and fails the test with its log if it failed.
func waitImages(t *testing.T) {
	t.Helper()
	done := os.Getenv("DEVICEHOST_E2E_IMAGES_DONE")
	if done == "" {
		return
	}
	var status string
	d := testwait.Until(t, 15*time.Minute, "run.sh's build of the images", func() (bool, string) {
		b, err := os.ReadFile(done)
		status = strings.TrimSpace(string(b))
		return err == nil, fmt.Sprint(err)
	})
	if status != "0" {
		tail, _ := os.ReadFile(os.Getenv("DEVICEHOST_E2E_IMAGES_LOG"))
		if len(tail) > 8192 {
			tail = tail[len(tail)-8192:]
		}
		t.Fatalf("building the images failed (exit %s):\n%s", status, tail)
	}
	t.Logf("images built (waited %v for them)", d.Round(time.Millisecond))
}

func startHelm(t *testing.T) *helmStack {
	t.Helper()
	n := requireNode(t)
	h := &helmStack{
		n:         n,
		helm:      os.Getenv("DEVICEHOST_E2E_HELM"),
		chart:     filepath.Join(n.root, "deploy", "helm", "devicehost"),
		socketDir: filepath.Join(n.run, "helm", "run"),
		stateDir:  filepath.Join(n.run, "helm", "state"),
		pluginDir: filepath.Join(n.run, "helm", "plugins"),
	}
	for _, f := range strings.Fields(os.Getenv("DEVICEHOST_E2E_IMAGES")) {
		tag, archive, ok := strings.Cut(f, "=")
		if !ok {
			t.Fatalf("DEVICEHOST_E2E_IMAGES: %q is not TAG=FILE", f)
		}
		h.images = append(h.images, helmImage{tag, archive})
	}
	if h.helm == "" || len(h.images) != 2 {
		t.Fatal("DEVICEHOST_E2E_HELM and DEVICEHOST_E2E_IMAGES (two TAG=FILE) are unset: run e2e/kubernetes/run.sh, which builds helm and the images")
	}
	waitImages(t)
	// The other cases applied deploy/kubernetes/dra.yaml by hand: the release makes the
	// same cluster objects, which helm would refuse to take over.
	if _, err := n.kubectl(nil, "delete", "-f", filepath.Join(n.root, "deploy", "kubernetes", "dra.yaml"), "--ignore-not-found", "--wait=true"); err != nil {
		t.Fatal(err)
	}
	for _, img := range h.images {
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		out, err := exec.CommandContext(ctx, n.vars["DEVICEHOST_E2E_CTR"], "--address", n.vars["DEVICEHOST_E2E_CONTAINERD_SOCK"],
			"-n", "k8s.io", "images", "import", img.archive).CombinedOutput()
		cancel()
		if err != nil {
			t.Fatalf("ctr images import %s: %v\n%s", img.archive, err, out)
		}
		fi, _ := os.Stat(img.archive)
		t.Logf("image %s:%s (%d MB archive) imported in %v", helmImageRepo, img.tag, fi.Size()>>20, time.Since(start).Round(time.Millisecond))
	}
	h.values = filepath.Join(n.run, "helm", "values.yaml")
	if err := os.MkdirAll(filepath.Dir(h.values), 0o755); err != nil {
		t.Fatal(err)
	}
	// What a node without NVIDIA's runtime needs besides --set runtimeClassName="": the
	// simulated GPUs, the CDI directory this node's containerd reads, hostPaths the
	// node's down removes; and probes and a release grace short enough for the cases.
	values := fmt.Sprintf(`cdiDir: %s
hostPaths:
  socket: %s
  state: %s
  plugins: %s
livenessProbe:
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
kubeletPlugin:
  config: |
    kubernetes {
      release_grace = "5s"
      resource "nvidia.com/gpu" {
        vendor = "nvidia"
        type   = "gpu"
      }
    }
agent:
  config: |
    log_json = true

    plugin "nvidia-example" {
      config {
        simulate     = "dgxh100"
        cdi_spec_dir = "/var/run/cdi"
      }
    }
`, n.cdiDir, h.socketDir, h.stateDir, h.pluginDir)
	if err := os.WriteFile(h.values, []byte(values), 0o644); err != nil {
		t.Fatal(err)
	}
	h.s = &stack{n: n, ds: &daemonSet{agentSocket: filepath.Join(h.socketDir, "devicehost.sock")}}
	h.d = &draStack{stack: h.s}
	t.Cleanup(func() {
		h.s.deleteAllPods(t)
		if _, err := n.kubectl(nil, "-n", podNamespace, "delete", "resourceclaimtemplate", "-l", "app="+podLabel, "--ignore-not-found"); err != nil {
			t.Errorf("delete the suite's claim templates: %v", err)
		}
		if _, err := h.run("uninstall", helmRelease, "-n", helmNamespace, "--ignore-not-found", "--wait"); err != nil {
			t.Errorf("helm uninstall: %v", err)
		}
	})
	return h
}

// run runs helm with args, bounded to 3 minutes.
func (h *helmStack) run(args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, h.helm, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+h.n.kubeconfig, "HELM_CACHE_HOME="+filepath.Join(h.n.run, "helm", "home"),
		"HELM_CONFIG_HOME="+filepath.Join(h.n.run, "helm", "home"), "HELM_DATA_HOME="+filepath.Join(h.n.run, "helm", "home"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("helm %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return out, nil
}

// installArgs are the arguments of `helm install` and `helm upgrade` as docs/kubernetes.md
// gives them, for mode and the image's tag, with the node's values file.
func (h *helmStack) installArgs(verb, mode, tag string) []string {
	args := []string{verb, helmRelease, h.chart, "-n", helmNamespace}
	// --set-string: a tag of digits only (a short commit hash such as 4104447) would be a
	// number to --set, which the chart's schema refuses.
	return append(args, "--set", "mode="+mode, "--set", "image.repository="+helmImageRepo, "--set-string", "image.tag="+tag,
		"--set", "image.pullPolicy=Never", "--set", "runtimeClassName=", "-f", h.values)
}

// releasePod is the part of a release pod the cases read.
type releasePod struct {
	Metadata struct {
		Name              string    `json:"name"`
		CreationTimestamp time.Time `json:"creationTimestamp"`
		DeletionTimestamp *string   `json:"deletionTimestamp"`
	} `json:"metadata"`
	Spec struct {
		ServiceAccountName string `json:"serviceAccountName"`
		Containers         []struct {
			Name  string `json:"name"`
			Image string `json:"image"`
		} `json:"containers"`
	} `json:"spec"`
	Status struct {
		Phase             string `json:"phase"`
		ContainerStatuses []struct {
			Name         string `json:"name"`
			Ready        bool   `json:"ready"`
			RestartCount int    `json:"restartCount"`
			Image        string `json:"image"`
		} `json:"containerStatuses"`
	} `json:"status"`
}

// ready says whether every container of the pod is ready, with what it runs.
func (p releasePod) ready(image string) (bool, string) {
	if p.Metadata.DeletionTimestamp != nil {
		return false, p.Metadata.Name + " terminating"
	}
	var st []string
	ok := p.Status.Phase == "Running" && len(p.Status.ContainerStatuses) == len(p.Spec.Containers)
	for _, c := range p.Spec.Containers {
		ok = ok && c.Image == image
	}
	for _, c := range p.Status.ContainerStatuses {
		ok = ok && c.Ready
		st = append(st, fmt.Sprintf("%s ready=%v restarts=%d", c.Name, c.Ready, c.RestartCount))
	}
	return ok, fmt.Sprintf("%s %s %v", p.Metadata.Name, p.Status.Phase, st)
}

func (p releasePod) restarts(container string) int {
	for _, c := range p.Status.ContainerStatuses {
		if c.Name == container {
			return c.RestartCount
		}
	}
	return -1
}

// pods are the release's pods on the node.
func (h *helmStack) pods() ([]releasePod, error) {
	var list struct {
		Items []releasePod `json:"items"`
	}
	err := h.n.kubectlJSON(&list, "-n", helmNamespace, "get", "pods", "-l", helmPodLabel)
	return list.Items, err
}

// waitReady waits until the release has exactly one pod, running image, every
// container of it ready, and returns it.
func (h *helmStack) waitReady(t *testing.T, image string, limit time.Duration, during ...func()) (releasePod, time.Duration) {
	t.Helper()
	var pod releasePod
	d := testwait.Until(t, limit, "the release's pod ready with "+image, func() (bool, string) {
		for _, f := range during {
			f()
		}
		pods, err := h.pods()
		if err != nil {
			return false, err.Error()
		}
		if len(pods) != 1 {
			var st []string
			for _, p := range pods {
				_, s := p.ready(image)
				st = append(st, s)
			}
			return false, fmt.Sprintf("%d pods: %v", len(pods), st)
		}
		pod = pods[0]
		return pod.ready(image)
	})
	return pod, d
}

func (h *helmStack) image(i int) string { return helmImageRepo + ":" + h.images[i].tag }

// install installs the chart in mode with image i and waits until its pod is ready and
// the agent serves the 8 simulated GPUs through the socket's hostPath.
func (h *helmStack) install(t *testing.T, mode string, i int) releasePod {
	t.Helper()
	start := time.Now()
	if _, err := h.run(h.installArgs("install", mode, h.images[i].tag)...); err != nil {
		t.Fatal(err)
	}
	pod, d := h.waitReady(t, h.image(i), 3*time.Minute)
	h.checkVersion(t, pod.Metadata.Name, i)
	h.s.waitAgentHealthy(t, 60*time.Second)
	t.Logf("helm install (mode %s, %s): pod %s ready %v after the install; the agent serves 8 healthy GPUs on its hostPath socket %v after it",
		mode, h.image(i), pod.Metadata.Name, d.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	return pod
}

// checkVersion fails t unless the agent of the release's pod says at start that it is
// the version of image i (scripts/image builds each tag as that version).
func (h *helmStack) checkVersion(t *testing.T, pod string, i int) {
	t.Helper()
	var got []string
	testwait.Until(t, 30*time.Second, "the agent's version in its log", func() (bool, string) {
		out, err := h.n.kubectl(nil, "-n", helmNamespace, "logs", pod, "-c", "agent")
		if err != nil {
			return false, err.Error()
		}
		got = nil
		for _, l := range strings.Split(string(out), "\n") {
			var line struct {
				Message string `json:"@message"`
				Version string `json:"version"`
			}
			if json.Unmarshal([]byte(l), &line) == nil && line.Message == "listening" {
				got = append(got, line.Version)
			}
		}
		return len(got) > 0, "no \"listening\" line yet"
	})
	if want := h.images[i].tag; got[len(got)-1] != want {
		t.Errorf("the agent of %s says it is version %v, want %s", pod, got, want)
	}
}

// checkProbes fails t if the kubelet saw a probe of the pod fail or restarted one of its
// containers other than those named (which a case made fail).
func (h *helmStack) checkProbes(t *testing.T, pod string, failed ...string) {
	t.Helper()
	var p releasePod
	if err := h.n.kubectlJSON(&p, "-n", helmNamespace, "get", "pod", pod); err != nil {
		t.Fatal(err)
	}
	for _, c := range p.Status.ContainerStatuses {
		if c.RestartCount != 0 && !slices.Contains(failed, c.Name) {
			t.Errorf("container %s of %s restarted %d times", c.Name, pod, c.RestartCount)
		}
	}
	var events struct {
		Items []struct {
			InvolvedObject struct {
				FieldPath string `json:"fieldPath"` // spec.containers{NAME}
			} `json:"involvedObject"`
			Message string `json:"message"`
			Count   int    `json:"count"`
		} `json:"items"`
	}
	if err := h.n.kubectlJSON(&events, "-n", helmNamespace, "get", "events", "--field-selector", "involvedObject.name="+pod+",reason=Unhealthy"); err != nil {
		t.Fatal(err)
	}
	for _, e := range events.Items {
		if !slices.ContainsFunc(failed, func(c string) bool { return e.InvolvedObject.FieldPath == "spec.containers{"+c+"}" }) {
			t.Errorf("pod %s, %s: probe failed %d times: %s", pod, e.InvolvedObject.FieldPath, e.Count, e.Message)
		}
	}
	t.Logf("pod %s: %d containers, no probe failure but in %v, %v since it was created", pod, len(p.Status.ContainerStatuses), failed,
		time.Since(p.Metadata.CreationTimestamp).Round(time.Second))
}

// releaseProcess is the process of the release's container running args[1] (agent,
// kubelet-plugin) of devicehost, or devicehost-dra-plugin when sub is "dra".
func releaseProcess(t *testing.T, sub string) proc.Process {
	t.Helper()
	all, err := proc.List()
	if err != nil {
		t.Fatal(err)
	}
	var found []proc.Process
	for _, p := range all {
		switch {
		case p.Zombie():
		case sub == "dra" && p.Exe == "/usr/local/bin/devicehost-dra-plugin":
			found = append(found, p)
		case p.Exe == "/usr/local/bin/devicehost" && len(p.Argv) > 1 && p.Argv[1] == sub:
			found = append(found, p)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%d processes of the release's %s: %v", len(found), sub, found)
	}
	return found[0]
}

// probeRestart stops the process of container (SIGSTOP: it hangs, its socket still
// accepts) and waits until the kubelet's liveness probe has it restarted and ready again.
func (h *helmStack) probeRestart(t *testing.T, pod, container, sub string) {
	t.Helper()
	p := releaseProcess(t, sub)
	if err := syscall.Kill(p.PID, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	var rp releasePod
	d := testwait.Until(t, 2*time.Minute, "container "+container+" restarted by its liveness probe", func() (bool, string) {
		if err := h.n.kubectlJSON(&rp, "-n", helmNamespace, "get", "pod", pod); err != nil {
			return false, err.Error()
		}
		ok, st := rp.ready(rp.Spec.Containers[0].Image)
		return ok && rp.restarts(container) == 1, st
	})
	t.Logf("%s (pid %d) stopped: restarted by the kubelet and ready again %v later", container, p.PID, d.Round(time.Millisecond))
}

// leftovers is what of devicehost is on the node: processes of the image, sockets of
// the release, CDI specs, ResourceSlices.
func (h *helmStack) leftovers() []string {
	var left []string
	all, err := proc.List()
	if err != nil {
		return []string{err.Error()}
	}
	for _, p := range all {
		if slices.Contains(imageBinaries, strings.TrimSuffix(p.Exe, " (deleted)")) && !p.Zombie() {
			left = append(left, fmt.Sprintf("process %d: %s", p.PID, p.Cmdline()))
		}
	}
	sockets := func(dir string, match func(string) bool) {
		_ = filepath.WalkDir(dir, func(path string, e fs.DirEntry, err error) error {
			if err == nil && e.Type()&fs.ModeSocket != 0 && match(path) {
				left = append(left, "socket "+path)
			}
			return nil
		})
	}
	sockets(h.socketDir, func(string) bool { return true })
	sockets(h.n.kubeletRoot, func(p string) bool { return strings.Contains(p, "devicehost") })
	if specs, _ := filepath.Glob(filepath.Join(h.n.cdiDir, "devicehost*")); len(specs) > 0 {
		left = append(left, fmt.Sprintf("CDI specs %v", specs))
	}
	out, err := h.n.kubectl(nil, "get", "resourceslices", "--field-selector", "spec.driver="+draDriver, "-o", "name")
	if err != nil {
		left = append(left, err.Error())
	} else if s := strings.Fields(string(out)); len(s) > 0 {
		left = append(left, fmt.Sprintf("ResourceSlices %v", s))
	}
	return left
}

// uninstall runs helm uninstall and waits until nothing of devicehost is left on the
// node but its ledger, which stays on the state hostPath.
func (h *helmStack) uninstall(t *testing.T) {
	t.Helper()
	start := time.Now()
	if _, err := h.run("uninstall", helmRelease, "-n", helmNamespace, "--wait"); err != nil {
		t.Fatal(err)
	}
	dHelm := time.Since(start)
	// The kubelet wipes a DRA driver's ResourceSlices some time after the driver has
	// unregistered (30 s in 1.37), unless it comes back.
	d := testwait.Until(t, 90*time.Second, "nothing of devicehost left on the node", func() (bool, string) {
		pods, err := h.pods()
		if err != nil {
			return false, err.Error()
		}
		left := h.leftovers()
		return len(pods) == 0 && len(left) == 0, fmt.Sprintf("%d pods; %v", len(pods), left)
	})
	ledger, err := filepath.Glob(filepath.Join(h.stateDir, "*"))
	if err != nil || len(ledger) == 0 {
		t.Errorf("the state hostPath %s is empty after the uninstall: the ledger must stay (%v)", h.stateDir, err)
	}
	t.Logf("helm uninstall returned in %v; no process, socket, CDI spec or ResourceSlice %v after it; the state hostPath keeps %v",
		dHelm.Round(time.Millisecond), (dHelm + d).Round(time.Millisecond), ledger)
}

// deletePodReleased deletes a device-plugin pod and waits until the release's bridge has
// released its reservation (after the release grace of the node's values).
func (h *helmStack) deletePodReleased(t *testing.T, name string) {
	t.Helper()
	h.s.deletePod(t, name)
	testwait.Until(t, 90*time.Second, "pod "+name+"'s reservation released", func() (bool, string) {
		rs, err := h.s.reservations("-owner", podOwner(name), "-state", "active")
		if err != nil {
			return false, err.Error()
		}
		return len(rs) == 0, fmt.Sprintf("%d active", len(rs))
	})
}

// activeByID is the agent's active reservations by ID.
func (h *helmStack) activeByID(t *testing.T) map[string]*pb.Reservation {
	t.Helper()
	rs, err := h.s.reservations("-state", "active")
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]*pb.Reservation{}
	for _, r := range rs {
		m[r.GetReservationId()] = r
	}
	return m
}

// sameReservations fails t unless the ledger's active reservations are want's: the same
// IDs, owners and devices.
func (h *helmStack) sameReservations(t *testing.T, when string, want map[string]*pb.Reservation) {
	t.Helper()
	got := h.activeByID(t)
	for id, w := range want {
		g, ok := got[id]
		if !ok {
			t.Errorf("%s: reservation %s of %s is gone", when, id, w.GetOwnerId())
			continue
		}
		if g.GetOwnerId() != w.GetOwnerId() || !slices.Equal(g.GetDeviceIds(), w.GetDeviceIds()) {
			t.Errorf("%s: reservation %s is %s %v, was %s %v", when, id, g.GetOwnerId(), g.GetDeviceIds(), w.GetOwnerId(), w.GetDeviceIds())
		}
	}
	for id, g := range got {
		if _, ok := want[id]; !ok {
			t.Errorf("%s: a new reservation %s of %s %v", when, id, g.GetOwnerId(), g.GetDeviceIds())
		}
	}
}

// gpuPodsRunning fails t unless each pod runs with its container never restarted.
func (h *helmStack) gpuPodsRunning(t *testing.T, when string, pods ...string) {
	t.Helper()
	for _, name := range pods {
		p, err := h.s.getPod(name)
		if err != nil {
			t.Fatal(err)
		}
		restarts := 0
		for _, c := range p.Status.ContainerStatuses {
			restarts += c.RestartCount
		}
		if p.Status.Phase != "Running" || restarts != 0 {
			t.Errorf("%s: GPU pod %s is %s with %d restarts, want Running with none", when, name, p.Status.Phase, restarts)
		}
	}
}

// The device-plugin mode: a pod of 2 GPUs through the release; a hung bridge restarted
// by its probe under it; uninstall with the pod running, and a reinstall that finds its
// holder in the ledger.
func (h *helmStack) caseDevicePlugin(t *testing.T) {
	pod := h.install(t, "devicePlugin", 0)
	h.s.waitAllocatable(t, 8, 60*time.Second)
	h.checkNodeStatus(t)
	name := h.s.createPod(t, "helm-dp", 2)
	defer h.s.deletePod(t, name)
	out, dRun := h.s.waitPodReady(t, name, 90*time.Second)
	res, _ := h.s.waitPodReservation(t, name, 30*time.Second)
	env, _ := containerView(out)
	if got, want := strings.Split(env, ","), res.GetDeviceIds(); !sameSet(got, want) {
		t.Errorf("NVIDIA_VISIBLE_DEVICES=%s in the pod, its reservation holds %v", env, want)
	}
	t.Logf("pod %s running %v after its create, holding %v as %s", name, dRun.Round(time.Millisecond), res.GetDeviceIds(), res.GetOwnerId())
	before := h.activeByID(t)

	h.probeRestart(t, pod.Metadata.Name, "kubelet-plugin", "kubelet-plugin")
	h.gpuPodsRunning(t, "after the bridge's restart", name)
	h.checkProbes(t, pod.Metadata.Name, "kubelet-plugin")

	h.uninstall(t)
	h.checkNodeStatusRemoved(t)
	h.gpuPodsRunning(t, "after the uninstall", name)
	start := time.Now()
	pod = h.install(t, "devicePlugin", 0)
	h.sameReservations(t, "after the reinstall", before)
	t.Logf("reinstalled: the ledger names %s as the holder of %v again, %v after the install", res.GetOwnerId(), res.GetDeviceIds(), time.Since(start).Round(time.Millisecond))
	h.gpuPodsRunning(t, "after the reinstall", name)

	h.deletePodReleased(t, name)
	h.checkProbes(t, pod.Metadata.Name)
	h.uninstall(t)
}

// The DRA mode: the driver in the release publishes the pool with its in-cluster
// service account and the chart's RBAC; a claim of 2 GPUs; the agent killed under it
// comes back on the same ledger.
func (h *helmStack) caseDRA(t *testing.T) {
	pod := h.install(t, "dra", 0)
	if pod.Spec.ServiceAccountName != helmRelease+"-dra" {
		t.Errorf("the release's pod runs as service account %q, want %s-dra", pod.Spec.ServiceAccountName, helmRelease)
	}
	d := h.d.waitPool(t, 60*time.Second, "8 untainted GPUs", func(p pool) (bool, string) {
		gpus := p.ofType("gpu")
		return len(gpus) == 8 && len(p.tainted(gpus)) == 0, p.String()
	})
	t.Logf("the release's driver published 8 GPUs with its in-cluster account, %v after the pod was ready", d.Round(time.Millisecond))
	h.checkRBAC(t)
	h.extendedResourcePod(t)

	tmpl := h.d.createTemplate(t, "helm-dra", gpuClass, 2, "")
	name, c, res, _ := h.d.runClaimPod(t, "helm-dra", tmpl)
	// The chart's RBAC lets the driver write the claim's device status: its pod's
	// token names the node (associated-node:patch on resourceclaims/driver).
	h.d.waitClaimStatus(t, c, slices.Sorted(slices.Values(res.GetDeviceIds())))
	before := h.activeByID(t)

	agent := releaseProcess(t, "agent")
	if err := syscall.Kill(agent.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var rp releasePod
	testwait.Until(t, 2*time.Minute, "the agent container back after SIGKILL", func() (bool, string) {
		if err := h.n.kubectlJSON(&rp, "-n", helmNamespace, "get", "pod", pod.Metadata.Name); err != nil {
			return false, err.Error()
		}
		ok, st := rp.ready(h.image(0))
		return ok && rp.restarts("agent") == 1, st
	})
	h.s.waitAgentHealthy(t, 60*time.Second)
	h.sameReservations(t, "after the agent's SIGKILL", before)
	t.Logf("agent (pid %d) SIGKILLed: its container ready again %v later, on the same ledger (holder %s of %v)",
		agent.PID, time.Since(start).Round(time.Millisecond), res.GetOwnerId(), res.GetDeviceIds())
	h.gpuPodsRunning(t, "after the agent's SIGKILL", name)

	h.probeRestart(t, pod.Metadata.Name, "dra-plugin", "dra")
	h.gpuPodsRunning(t, "after the driver's restart", name)

	h.d.deleteReleased(t, name, c, res)
	h.checkProbes(t, pod.Metadata.Name, "agent", "dra-plugin")
	h.uninstall(t)
}

// checkRBAC checks what the driver's service account may do: what the driver needs,
// nothing more.
func (h *helmStack) checkRBAC(t *testing.T) {
	t.Helper()
	as := "system:serviceaccount:" + helmNamespace + ":" + helmRelease + "-dra"
	for _, c := range []struct {
		verb, resource string
		want           bool
	}{
		{"create", "resourceslices.resource.k8s.io", true},
		{"delete", "resourceslices.resource.k8s.io", true},
		{"watch", "resourceclaims.resource.k8s.io", true},
		{"get", "nodes", true},
		{"update", "resourceclaims.resource.k8s.io", false},
		{"list", "secrets", false},
		{"delete", "pods", false},
		{"create", "deviceclasses.resource.k8s.io", false},
		{"update", "nodes", false},
	} {
		out, _ := h.n.kubectl(nil, "auth", "can-i", c.verb, c.resource, "--as", as)
		if got := strings.TrimSpace(string(out)) == "yes"; got != c.want {
			t.Errorf("%s may %s %s: %v, want %v", as, c.verb, c.resource, got, c.want)
		}
	}
}

// The two modes at once, and a helm upgrade to another image under a device-plugin pod
// and a claim pod, then a helm rollback: the DaemonSet rolls, the GPU pods keep running
// with their devices, no reservation is lost or handed to another pod, and a new GPU
// pod runs right after each roll.
func (h *helmStack) caseBoth(t *testing.T) {
	h.install(t, "both", 0)
	h.s.waitAllocatable(t, 8, 60*time.Second)
	h.d.waitPool(t, 60*time.Second, "8 GPUs", func(p pool) (bool, string) { return len(p.ofType("gpu")) == 8, p.String() })
	dp := h.s.createPod(t, "helm-both-dp", 2)
	defer h.s.deletePod(t, dp)
	h.s.waitPodReady(t, dp, 90*time.Second)
	dpRes, _ := h.s.waitPodReservation(t, dp, 30*time.Second)
	tmpl := h.d.createTemplate(t, "helm-both", gpuClass, 2, "")
	dra, c, draRes, _ := h.d.runClaimPod(t, "helm-both-dra", tmpl)
	if shared := intersect(dpRes.GetDeviceIds(), draRes.GetDeviceIds()); len(shared) > 0 {
		t.Fatalf("the device-plugin pod and the claim pod share %v", shared)
	}
	t.Logf("device-plugin pod %s holds %v, claim pod %s holds %v", dp, dpRes.GetDeviceIds(), dra, draRes.GetDeviceIds())
	before := h.activeByID(t)

	roll := func(what string, args []string, image int) {
		t.Helper()
		if _, err := h.run(args...); err != nil {
			t.Fatal(err)
		}
		// While it rolls, whenever the agent answers, its ledger holds the running pods'
		// reservations and no other.
		seen := map[string]string{}
		answered := 0
		pod, d := h.waitReady(t, h.image(image), 3*time.Minute, func() {
			rs, err := h.s.reservations("-state", "active")
			if err != nil {
				return // the agent is between pods
			}
			answered++
			for _, r := range rs {
				if _, ok := before[r.GetReservationId()]; !ok {
					seen[r.GetReservationId()] = fmt.Sprintf("%s %v", r.GetOwnerId(), r.GetDeviceIds())
				}
			}
		})
		if len(seen) > 0 {
			t.Errorf("%s: reservations made during the roll: %v", what, seen)
		}
		h.checkVersion(t, pod.Metadata.Name, image)
		t.Logf("%s: the ledger read %d times during the roll, holding only the running pods' reservations", what, answered)
		h.s.waitAgentHealthy(t, 60*time.Second)
		h.sameReservations(t, "after the "+what, before)
		h.gpuPodsRunning(t, "after the "+what, dp, dra)
		t.Logf("%s to %s: the new pod %s ready %v after the command; GPU pods not restarted; %d reservations before and after",
			what, h.image(image), pod.Metadata.Name, d.Round(time.Millisecond), len(before))
		// A new GPU pod schedules and runs at once on the new release.
		ready := time.Now()
		name := h.s.createPod(t, "helm-after-"+strings.Fields(what)[1], 2)
		_, dRun := h.s.waitPodReady(t, name, 90*time.Second)
		res, _ := h.s.waitPodReservation(t, name, 30*time.Second)
		if shared := intersect(res.GetDeviceIds(), append(dpRes.GetDeviceIds(), draRes.GetDeviceIds()...)); len(shared) > 0 {
			t.Errorf("the pod made after the %s got %v, held by the running pods", what, shared)
		}
		t.Logf("a new pod of 2 GPUs ran %v after its create, %v after the roll's pod was ready", dRun.Round(time.Millisecond), time.Since(ready).Round(time.Millisecond))
		h.deletePodReleased(t, name)
		// And a new claim, through the restarted driver.
		ready = time.Now()
		name2, c2, res2, _ := h.d.runClaimPod(t, "helm-after-"+strings.Fields(what)[1]+"-dra", tmpl)
		if shared := intersect(res2.GetDeviceIds(), append(dpRes.GetDeviceIds(), draRes.GetDeviceIds()...)); len(shared) > 0 {
			t.Errorf("the claim made after the %s got %v, held by the running pods", what, shared)
		}
		t.Logf("a new claim pod of 2 GPUs ran %v after the roll's pod was ready", time.Since(ready).Round(time.Millisecond))
		h.d.deleteReleased(t, name2, c2, res2)
		h.checkProbes(t, pod.Metadata.Name)
	}
	roll("helm upgrade", h.installArgs("upgrade", "both", h.images[1].tag), 1)
	roll("helm rollback", []string{"rollback", helmRelease, "1", "-n", helmNamespace}, 0)

	h.d.deleteReleased(t, dra, c, draRes)
	h.s.deletePod(t, dp)
	testwait.Until(t, 90*time.Second, "the device-plugin pod's reservation released", func() (bool, string) {
		rs, err := h.s.reservations("-state", "active")
		if err != nil {
			return false, err.Error()
		}
		return len(rs) == 0, fmt.Sprintf("%d active: %v", len(rs), rs)
	})
	h.uninstall(t)
}

func sameSet(a, b []string) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

func intersect(a, b []string) []string {
	var out []string
	for _, x := range a {
		if slices.Contains(b, x) {
			out = append(out, x)
		}
	}
	return out
}

// extendedResourcePod: in dra mode the chart's whole-GPU DeviceClass serves
// nvidia.com/gpu (DRAExtendedResource), so an unchanged pod asking limits
// nvidia.com/gpu: 2, as for the device plugin, is scheduled through DRA: the scheduler
// makes a claim for it, the driver prepares it (owner k8s-claim/...), the container sees
// its 2 GPUs, and deleting the pod frees them at once.
func (h *helmStack) extendedResourcePod(t *testing.T) {
	t.Helper()
	start := time.Now()
	name := h.d.createPod(t, "helm-dra-ext", 2)
	out, dRun := h.d.waitPodReady(t, name, 90*time.Second)
	prefix := claimOwner + podNamespace + "/" + name + "-extended-resources-"
	var res *pb.Reservation
	testwait.Until(t, 60*time.Second, "a reservation of the pod's extended-resource claim", func() (bool, string) {
		rs, err := h.s.reservations("-state", "active")
		if err != nil {
			return false, err.Error()
		}
		for _, r := range rs {
			if strings.HasPrefix(r.GetOwnerId(), prefix) {
				res = r
				return true, ""
			}
		}
		return false, fmt.Sprintf("no owner under %s among %d active", prefix, len(rs))
	})
	ids := slices.Sorted(slices.Values(res.GetDeviceIds()))
	if got := parsePodView(out).gpus(); len(ids) != 2 || !slices.Equal(got, ids) {
		t.Errorf("pod %s asking nvidia.com/gpu: 2: its claim's reservation holds %v, its container sees %v", name, ids, got)
	}
	t.Logf("pod %s (limits nvidia.com/gpu: 2, no claim of its own) running %v after its create, through DRA: reservation %s, owner %s, devices %v",
		name, dRun.Round(time.Millisecond), res.GetReservationId(), res.GetOwnerId(), ids)
	deleted := time.Now()
	h.s.deletePod(t, name)
	testwait.Until(t, releaseAtOnce+10*time.Second, "the extended-resource claim released", func() (bool, string) {
		rs, err := h.s.reservations("-state", "active")
		if err != nil {
			return false, err.Error()
		}
		for _, r := range rs {
			if r.GetReservationId() == res.GetReservationId() {
				return false, "still active"
			}
		}
		return true, ""
	})
	t.Logf("deleted: its GPUs free %v after the delete (%v in all)", time.Since(deleted).Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// caseHostDevices: the chart's default hostdev.devices, enabled by one --set, in mode
// both: the release's agent serves the node's /dev/fuse and /dev/net/tun (8 holders
// each) and /dev/kvm (4) beside the GPUs; a claim of fuse.devicehost.io opens /dev/fuse
// in its container and a pod asking devicehost.io/tun makes a TUN interface.
func (h *helmStack) caseHostDevices(t *testing.T) {
	for _, p := range []string{"/dev/fuse", "/dev/net/tun"} {
		if !charDevice(p) {
			t.Skipf("%s is not a character device on this node", p)
		}
	}
	start := time.Now()
	if _, err := h.run(append(h.installArgs("install", "both", h.images[0].tag), "--set", "hostdev.enabled=true")...); err != nil {
		t.Fatal(err)
	}
	pod, dReady := h.waitReady(t, h.image(0), 3*time.Minute)
	h.s.waitAgentHealthy(t, 60*time.Second)
	want := map[string]int{"fuse": 8, "tun": 8, "kvm": 0}
	if charDevice("/dev/kvm") {
		want["kvm"] = 4
	}
	testwait.Until(t, 60*time.Second, fmt.Sprintf("hostdev devices %v healthy", want), func() (bool, string) {
		fp, err := h.s.devices()
		if err != nil {
			return false, err.Error()
		}
		got := map[string]int{"fuse": 0, "tun": 0, "kvm": 0}
		for _, g := range fp.GetGroups() {
			for _, d := range g.GetDevices() {
				if g.GetVendor() == "hostdev" && d.GetHealth() == pb.Health_HEALTH_HEALTHY {
					got[g.GetType()]++
				}
			}
		}
		return maps.Equal(got, want), fmt.Sprint(got)
	})
	h.d.waitPool(t, 60*time.Second, "a fuse and a tun device of 8 holders each in the pool", func(p pool) (bool, string) {
		return holdersDevice(p, "fuse") == "8" && holdersDevice(p, "tun") == "8", p.String()
	})
	testwait.Until(t, 60*time.Second, "node allocatable devicehost.io/tun=8", func() (bool, string) {
		n, err := h.s.allocatableOf(tunResource)
		return err == nil && n == 8, fmt.Sprintf("%d (%v)", n, err)
	})
	t.Logf("helm install --set hostdev.enabled=true (mode both): pod %s ready %v after it; host devices %v served %v after it",
		pod.Metadata.Name, dReady.Round(time.Millisecond), want, time.Since(start).Round(time.Millisecond))

	fuseTmpl := h.d.createTemplate(t, "helm-fuse", fuseClass, 1, "")
	draPod := h.s.hostdevPod(t, "helm-hostdev-dra", func(spec, container map[string]any) {
		spec["resourceClaims"] = []any{map[string]any{"name": "fuse", "resourceClaimTemplateName": fuseTmpl}}
		container["resources"] = map[string]any{"claims": []any{map[string]any{"name": "fuse"}}}
	})
	dpPod := h.s.hostdevPod(t, "helm-hostdev-dp", func(spec, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{tunResource: "1"}}
	})
	out, _ := h.s.waitPodReady(t, draPod, 90*time.Second)
	if v := parseHostdevView(out); v.fuse != "rw" {
		t.Errorf("claim pod %s: FUSE=%s, want /dev/fuse opened read-write:\n%s", draPod, v.fuse, out)
	}
	out, _ = h.s.waitPodReady(t, dpPod, 90*time.Second)
	if v := parseHostdevView(out); !strings.HasPrefix(v.tun, "dhtun") {
		t.Errorf("device-plugin pod %s: TUN=%s, want a TUN interface made:\n%s", dpPod, v.tun, out)
	}
	dpRes, _ := h.s.waitPodReservation(t, dpPod, 60*time.Second)
	t.Logf("through the release: claim pod %s opened /dev/fuse, device-plugin pod %s made a TUN interface on %v",
		draPod, dpPod, dpRes.GetDeviceIds())

	h.s.deletePod(t, draPod)
	h.s.deletePod(t, dpPod)
	testwait.Until(t, 90*time.Second, "the pods' reservations released", func() (bool, string) {
		rs, err := h.s.reservations("-state", "active")
		if err != nil {
			return false, err.Error()
		}
		return len(rs) == 0, fmt.Sprintf("%d active: %v", len(rs), rs)
	})
	h.uninstall(t)
}
