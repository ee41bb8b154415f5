package kubernetes

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/devicehost/devicehost/tools/proc"
	"github.com/devicehost/devicehost/tools/testwait"
)

// TestRealNode runs devicehost's agent and kubelet bridge, as the DaemonSet runs them,
// on the real node, and checks what pods asking for nvidia.com/gpu get. Each case leaves
// no pod behind; reservations of deleted pods are left to the bridge's release, as on a
// real node.
func TestRealNode(t *testing.T) {
	s := startStack(t)
	t.Run("TwoGPUs", s.caseTwoGPUs)
	t.Run("InsufficientStaysPending", s.caseInsufficient)
	t.Run("KubeletRestart", s.caseKubeletRestart)
	t.Run("PluginSIGKILL", s.casePluginKill)
	t.Run("AgentRestartUnderPod", s.caseAgentRestart)
	t.Run("PodDeletedReleased", s.casePodDeleted)
	t.Run("BridgeRestartNoDuplicates", s.caseBridgeRestart)
	t.Run("CordonedGPUOfferedToNoNewPod", s.caseCordon)
}

// A pod asking for 2 GPUs runs, sees its two GPUs, and the ledger names its container.
func (s *stack) caseTwoGPUs(t *testing.T) {
	name := s.createPod(t, "two-gpus", 2)
	defer s.deletePod(t, name)
	out, dRun := s.waitPodReady(t, name, 90*time.Second)
	res, dRes := s.waitPodReservation(t, name, 60*time.Second)
	t.Logf("pod running in %v, its reservation %s named %s %v later", dRun.Round(time.Millisecond),
		res.GetReservationId(), res.GetOwnerId(), dRes.Round(time.Millisecond))
	ids := res.GetDeviceIds()
	if len(ids) != 2 {
		t.Fatalf("reservation %s holds %v, want 2 GPUs", res.GetReservationId(), ids)
	}
	env, devs := containerView(out)
	t.Logf("container sees NVIDIA_VISIBLE_DEVICES=%s, device nodes %v; its reservation holds %v", env, devs, ids)

	spec := s.cdiSpec(t)
	checkDeviceNodes(t, spec, devs, ids)
	// The env: the README promises the GPUs' UUIDs in NVIDIA_VISIBLE_DEVICES.
	got := strings.Split(env, ",")
	slices.Sort(got)
	want := slices.Clone(ids)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("NVIDIA_VISIBLE_DEVICES=%s in the container, want its GPUs %v (the plugin's CDI spec sets %v for every container)",
			env, want, spec.commonEnv)
	}
}

// containerView reads what the pod's script printed.
func containerView(out string) (env string, devs []string) {
	for _, l := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(l, "NVIDIA_VISIBLE_DEVICES="); ok {
			env = v
		}
		if v, ok := strings.CutPrefix(l, "DEVICE="); ok {
			devs = append(devs, v)
		}
	}
	return env, devs
}

// checkDeviceNodes checks the device nodes a container sees against the plugin's CDI
// spec: every node of its devices, no node of another device (but those its devices
// share, as a MIG device shares its GPU's).
func checkDeviceNodes(t *testing.T, spec cdiView, devs, devices []string) {
	t.Helper()
	want := map[string]bool{}
	for _, id := range devices {
		for _, dn := range spec.perDevice[id] {
			want[dn] = true
		}
	}
	for id, nodes := range spec.perDevice {
		for _, dn := range nodes {
			if has := slices.Contains(devs, dn); has != want[dn] {
				t.Errorf("device node %s of %s in the container: %v, want %v", dn, id, has, want[dn])
			}
		}
	}
}

type cdiView struct {
	perDevice map[string][]string // device name (the GPU's UUID) -> its device node paths
	commonEnv []string
}

// cdiSpec is the plugin's CDI spec, which must name the 8 GPUs and nothing else.
func (s *stack) cdiSpec(t *testing.T) cdiView {
	t.Helper()
	v := s.pluginCDI(t)
	if len(v.perDevice) != 8 {
		t.Fatalf("the plugin's CDI spec names %d GPUs, want 8", len(v.perDevice))
	}
	return v
}

// pluginCDI reads the plugin's CDI spec.
func (s *stack) pluginCDI(t *testing.T) cdiView {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(s.n.cdiDir, "devicehost-nvidia-example.yaml"))
	if err != nil {
		t.Fatalf("the plugin's CDI spec: %v", err)
	}
	var spec struct {
		Devices []struct {
			Name           string `yaml:"name"`
			ContainerEdits struct {
				DeviceNodes []struct {
					Path string `yaml:"path"`
				} `yaml:"deviceNodes"`
			} `yaml:"containerEdits"`
		} `yaml:"devices"`
		ContainerEdits struct {
			Env []string `yaml:"env"`
		} `yaml:"containerEdits"`
	}
	if err := yaml.Unmarshal(data, &spec); err != nil {
		t.Fatalf("the plugin's CDI spec: %v", err)
	}
	v := cdiView{perDevice: map[string][]string{}, commonEnv: spec.ContainerEdits.Env}
	for _, d := range spec.Devices {
		for _, dn := range d.ContainerEdits.DeviceNodes {
			v.perDevice[d.Name] = append(v.perDevice[d.Name], dn.Path)
		}
	}
	return v
}

// A pod asking for more GPUs than are free stays Pending, and the scheduler says why.
func (s *stack) caseInsufficient(t *testing.T) {
	holder := s.createPod(t, "holder", 2)
	defer s.deletePod(t, holder)
	s.waitPodReady(t, holder, 90*time.Second)
	big := s.createPod(t, "too-many", 7)
	defer s.deletePod(t, big)
	var msg string
	d := testwait.Until(t, 60*time.Second, "pod "+big+" unschedulable", func() (bool, string) {
		p, err := s.getPod(big)
		if err != nil {
			return false, err.Error()
		}
		for _, c := range p.Status.Conditions {
			if c.Type == "PodScheduled" && c.Status == "False" {
				msg = c.Message
				return strings.Contains(c.Message, "Insufficient "+gpuResource), c.Message
			}
		}
		return false, fmt.Sprintf("phase %s, conditions %+v", p.Status.Phase, p.Status.Conditions)
	})
	t.Logf("7 GPUs with 6 free: unschedulable after %v: %s", d.Round(time.Millisecond), msg)
	if p, err := s.getPod(big); err != nil || p.Status.Phase != "Pending" {
		t.Errorf("pod %s: phase %v (err %v), want Pending", big, p.Status.Phase, err)
	}
}

// registrationErrors are the lines of the bridge's log (from bOff) and the kubelet's (from
// kOff) that say a registration failed, split at the time after: before it (while the
// kubelet restarts) and from it on.
func (s *stack) registrationErrors(bOff, kOff int64, after time.Time) (before, since []string) {
	add := func(at time.Time, line string) {
		if at.Before(after) {
			before = append(before, line)
		} else {
			since = append(since, line)
		}
	}
	for _, l := range linesSince(s.bridge.log, bOff) {
		if (l.Level == "warn" || l.Level == "error") && strings.Contains(l.Message, "regist") {
			add(l.Time, "bridge: "+l.Raw)
		}
	}
	kubeletErr := regexp.MustCompile(`already connected|Failed to connect to new client|Failed to register|registration failed`)
	for _, l := range linesSince(filepath.Join(s.n.logs, "kubelet.log"), kOff) {
		if kubeletErr.MatchString(l.Raw) {
			add(klogTime(l.Raw), "kubelet: "+l.Raw)
		}
	}
	return before, since
}

// klogTime reads the time of a klog line ("E1201 13:01:34.519922 ..."), this year, local
// time; zero when the line has none.
func klogTime(line string) time.Time {
	f := strings.Fields(line)
	if len(f) < 2 || len(f[0]) != 5 {
		return time.Time{}
	}
	t, err := time.ParseInLocation("0102 15:04:05.000000", f[0][1:]+" "+f[1], time.Local)
	if err != nil {
		return time.Time{}
	}
	return t.AddDate(time.Now().Year(), 0, 0)
}

// kubeletSocketMade says when the kubelet's registration socket was made; zero when there
// is none. (Not its inode: a new socket often gets the old one's.)
func (s *stack) kubeletSocketMade() time.Time {
	fi, err := os.Stat(filepath.Join(s.n.kubeletRoot, "device-plugins", "kubelet.sock"))
	if err != nil {
		return time.Time{}
	}
	return fi.ModTime()
}

// After a kubelet restart the bridge registers again within 5 s, and no registration
// fails in the next 30 s. Whether a bridge registers twice with one kubelet depends on
// how its own socket's removal and the new kubelet.sock interleave, so the kubelet
// restarts three times; registration errors show within milliseconds of the
// registration, so 5 s after each and 30 s after the last are watched.
func (s *stack) caseKubeletRestart(t *testing.T) {
	const restarts = 3
	for i := 1; i <= restarts; i++ {
		quiet := 5 * time.Second
		if i == restarts {
			quiet = 30 * time.Second
		}
		s.restartKubelet(t, i, quiet)
		if t.Failed() {
			return
		}
	}
	s.waitAllocatable(t, 8, 60*time.Second)
}

// restartKubelet stops and starts the kubelet, checks that the bridge registers again
// within 5 s of the new kubelet.sock, and that no registration fails for quiet after that.
func (s *stack) restartKubelet(t *testing.T, i int, quiet time.Duration) {
	t.Helper()
	stopped := time.Now()
	bOff, kOff := s.bridge.logOffset(), fileSize(filepath.Join(s.n.logs, "kubelet.log"))
	s.n.nodeScript(t, "stop", "kubelet")
	start := exec.Command("bash", filepath.Join(s.n.root, "e2e", "kubernetes", "node.sh"), "start", "kubelet")
	startOut := &strings.Builder{}
	start.Stdout, start.Stderr = startOut, startOut
	if err := start.Start(); err != nil {
		t.Fatal(err)
	}
	startDone := make(chan error, 1)
	go func() { startDone <- start.Wait() }()
	defer func() {
		if err := <-startDone; err != nil {
			t.Errorf("node.sh start kubelet: %v\n%s", err, startOut)
		}
	}()
	// The new kubelet.sock; then the bridge's "registered" line after it.
	var sockAt time.Time
	testwait.Until(t, 90*time.Second, "a new kubelet.sock", func() (bool, string) {
		if made := s.kubeletSocketMade(); made.After(stopped) {
			sockAt = made
			return true, ""
		}
		return false, "the socket from before the restart, or none"
	})
	var regAt time.Time
	d, err := testwait.Poll(30*time.Second, func() (bool, string) {
		for _, l := range linesSince(s.bridge.log, bOff) {
			if l.Message == "registered with the kubelet" && !l.Time.Before(sockAt) {
				regAt = l.Time
				return true, ""
			}
		}
		return false, "no registration in the bridge's log"
	})
	if err != nil {
		t.Fatalf("restart %d: bridge registration after the kubelet restart: %v", i, err)
	}
	lag := regAt.Sub(sockAt)
	t.Logf("restart %d: kubelet.sock back; bridge registered %v after it (seen %v after)", i, lag.Round(time.Millisecond), d.Round(time.Millisecond))
	// No failed registration after it; stop at the first one. A failed try while the
	// kubelet was starting is logged, not counted.
	var early, errs []string
	_, _ = testwait.Poll(quiet, func() (bool, string) {
		early, errs = s.registrationErrors(bOff, kOff, regAt)
		return len(errs) > 0, ""
	})
	if len(early) > 0 {
		t.Logf("restart %d: %d failed registration tries before the bridge registered:\n%s", i, len(early), strings.Join(early, "\n"))
	}
	if len(errs) > 0 {
		t.Errorf("restart %d: %d registration errors within %v of the bridge's registration:\n%s", i, len(errs),
			time.Since(regAt).Round(time.Millisecond), strings.Join(errs[:min(len(errs), 6)], "\n"))
	} else {
		t.Logf("restart %d: no registration error for %v after the registration", i, quiet)
	}
}

// pluginPID is the PID of the agent's nvidia-example plugin process, 0 when none runs.
func (s *stack) pluginPID() int {
	if s.agent.cmd == nil {
		return 0
	}
	exe := filepath.Join(s.ds.pluginDir, "nvidia-example")
	kids, _ := proc.Children(s.agent.cmd.Process.Pid)
	for _, p := range kids {
		if p.Exe == exe {
			return p.PID
		}
	}
	return 0
}

// SIGKILL the plugin: the node's allocatable GPUs drop, then come back. The kubelet
// posts node status every second here and the agent restarts a plugin within 200 ms, so
// the plugin is killed again each time it comes back, as a crash loop would, until the
// drop shows.
func (s *stack) casePluginKill(t *testing.T) {
	killed := map[int]bool{}
	start := time.Now()
	dDrop := testwait.Until(t, 60*time.Second, "allocatable down to 0", func() (bool, string) {
		if pid := s.pluginPID(); pid != 0 && !killed[pid] {
			if err := syscall.Kill(pid, syscall.SIGKILL); err == nil {
				killed[pid] = true
			}
		}
		n, err := s.allocatable()
		if err != nil {
			return false, err.Error()
		}
		return n == 0, fmt.Sprintf("allocatable %d after %d kills", n, len(killed))
	})
	dBack := s.waitAllocatable(t, 8, 120*time.Second)
	t.Logf("plugin SIGKILLed %d times: allocatable 0 after %v, back to 8 after %v more (%v in all)",
		len(killed), dDrop.Round(time.Millisecond), dBack.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	s.waitAgentHealthy(t, 60*time.Second)
}

// The agent restarts under a running pod: the pod's reservation survives it, by ID,
// owner and devices.
func (s *stack) caseAgentRestart(t *testing.T) {
	name := s.createPod(t, "agent-restart", 2)
	defer s.deletePod(t, name)
	s.waitPodReady(t, name, 90*time.Second)
	before, _ := s.waitPodReservation(t, name, 60*time.Second)
	start := time.Now()
	s.agent.stop(t, syscall.SIGTERM)
	s.agent.start(t)
	s.waitAgentHealthy(t, 60*time.Second)
	dAgent := time.Since(start)
	after, _ := s.waitPodReservation(t, name, 30*time.Second)
	if after.GetReservationId() != before.GetReservationId() || !slices.Equal(after.GetDeviceIds(), before.GetDeviceIds()) {
		t.Errorf("after the agent restart: reservation %s %v, before %s %v", after.GetReservationId(), after.GetDeviceIds(),
			before.GetReservationId(), before.GetDeviceIds())
	}
	dAlloc := s.waitAllocatable(t, 8, 60*time.Second)
	if p, err := s.getPod(name); err != nil || p.Status.Phase != "Running" {
		t.Errorf("pod %s after the agent restart: phase %v (err %v), want Running", name, p.Status.Phase, err)
	}
	t.Logf("agent back with 8 healthy GPUs %v after SIGTERM, reservation %s kept; allocatable 8 again %v later",
		dAgent.Round(time.Millisecond), after.GetReservationId(), dAlloc.Round(time.Millisecond))
}

// A deleted pod's GPUs are free at the agent after the bridge's grace period, not before.
func (s *stack) casePodDeleted(t *testing.T) {
	name := s.createPod(t, "deleted", 2)
	s.waitPodReady(t, name, 90*time.Second)
	res, _ := s.waitPodReservation(t, name, 60*time.Second)
	deleted := time.Now()
	dGone := s.deletePod(t, name)
	limit := 3*s.releaseGrace + 30*time.Second
	testwait.Until(t, limit, "reservation "+res.GetReservationId()+" released", func() (bool, string) {
		rs, err := s.reservations("-owner", res.GetOwnerId())
		if err != nil {
			return false, err.Error()
		}
		for _, r := range rs {
			if r.GetReservationId() == res.GetReservationId() {
				return r.GetReleasedAt() != nil, r.GetState().String()
			}
		}
		return false, "not in the ledger"
	})
	total := time.Since(deleted)
	t.Logf("pod gone %v after delete; reservation released %v after delete (release_grace %v)",
		dGone.Round(time.Millisecond), total.Round(time.Millisecond), s.releaseGrace)
	if total < s.releaseGrace-time.Second {
		t.Errorf("released %v after the delete, before the %v grace period", total, s.releaseGrace)
	}
	for _, id := range res.GetDeviceIds() {
		rs, err := s.reservations("-device", id, "-state", "active")
		if err != nil {
			t.Fatal(err)
		}
		if len(rs) != 0 {
			t.Errorf("GPU %s still held after the release: %v", id, rs)
		}
	}
}

// The bridge restarts under a running pod: it registers again, and the ledger keeps one
// reservation for the pod, the same; a new pod then gets a reservation of its own.
func (s *stack) caseBridgeRestart(t *testing.T) {
	name := s.createPod(t, "bridge-restart", 2)
	defer s.deletePod(t, name)
	s.waitPodReady(t, name, 90*time.Second)
	before, _ := s.waitPodReservation(t, name, 60*time.Second)
	off := s.bridge.logOffset()
	s.bridge.stop(t, syscall.SIGTERM)
	s.bridge.start(t)
	dReg := testwait.Until(t, 30*time.Second, "bridge registered again", func() (bool, string) {
		for _, l := range linesSince(s.bridge.log, off) {
			if l.Message == "registered with the kubelet" {
				return true, ""
			}
		}
		return false, "no registration in its log"
	})
	// Three PodResources passes of the new bridge: the pod's devices in exactly one active
	// reservation, the one from before.
	window := 15 * time.Second
	var dup []string
	_, _ = testwait.Poll(window, func() (bool, string) {
		for _, id := range before.GetDeviceIds() {
			rs, err := s.reservations("-device", id, "-state", "active")
			if err != nil {
				continue
			}
			if len(rs) != 1 || rs[0].GetReservationId() != before.GetReservationId() {
				dup = append(dup, fmt.Sprintf("%s: %v", id, rs))
			}
		}
		return len(dup) > 0, ""
	})
	if len(dup) > 0 {
		t.Errorf("after the bridge restart, the pod's GPUs are held by other or several reservations: %v", dup)
	}
	second := s.createPod(t, "after-bridge-restart", 2)
	defer s.deletePod(t, second)
	s.waitPodReady(t, second, 90*time.Second)
	res2, _ := s.waitPodReservation(t, second, 60*time.Second)
	if slices.ContainsFunc(res2.GetDeviceIds(), func(id string) bool { return slices.Contains(before.GetDeviceIds(), id) }) {
		t.Errorf("new pod's reservation %v shares GPUs with the running pod's %v", res2.GetDeviceIds(), before.GetDeviceIds())
	}
	active, err := s.reservations("-state", "active", "-owner", podOwner(name))
	if err != nil || len(active) != 1 {
		t.Errorf("the first pod's active reservations: %v (err %v), want 1", active, err)
	}
	t.Logf("bridge registered again %v after SIGTERM; one reservation for the pod over %v; a new pod got %v",
		dReg.Round(time.Millisecond), window, res2.GetDeviceIds())
}
