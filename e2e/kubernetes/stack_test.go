package kubernetes

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

const gpuResource = "nvidia.com/gpu"

// hostProc is one container of the DaemonSet run as a process of this host, its output
// appended to a log file that outlives it.
type hostProc struct {
	name   string
	bin    string
	c      hostContainer
	log    string
	cmd    *exec.Cmd
	exited chan struct{}
}

// start launches the process in a process group of its own, killed with the test binary.
func (p *hostProc) start(t *testing.T) {
	t.Helper()
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fmt.Fprintf(f, "\n==== %s start %s %s\n", time.Now().UTC().Format(time.RFC3339Nano), p.name, strings.Join(p.c.args, " "))
	cmd := exec.Command(p.bin, p.c.args...)
	cmd.Env = append(os.Environ(), p.c.env...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", p.name, err)
	}
	p.cmd = cmd
	p.exited = make(chan struct{})
	go func(done chan struct{}) {
		_ = cmd.Wait()
		close(done)
	}(p.exited)
}

// stop sends sig, waits up to 20 s for the process to exit, then kills it and whatever
// is left of its process group (the agent's plugins).
func (p *hostProc) stop(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if p.cmd == nil {
		return
	}
	pid := p.cmd.Process.Pid
	_ = syscall.Kill(pid, sig)
	select {
	case <-p.exited:
	case <-time.After(20 * time.Second):
		t.Errorf("%s (pid %d) did not exit within 20 s of %v: SIGKILL", p.name, pid, sig)
		_ = syscall.Kill(pid, syscall.SIGKILL)
		<-p.exited
	}
	_ = syscall.Kill(-pid, syscall.SIGKILL)
	p.cmd = nil
}

// logOffset is where the next line of the log will start.
func (p *hostProc) logOffset() int64 { return fileSize(p.log) }

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// logLine is one line of hclog's JSON output.
type logLine struct {
	Time    time.Time `json:"@timestamp"`
	Level   string    `json:"@level"`
	Message string    `json:"@message"`
	Raw     string    `json:"-"`
}

// linesSince reads the log from off on: JSON lines decoded, others kept raw.
func linesSince(path string, off int64) []logLine {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return nil
	}
	var out []logLine
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		l := logLine{Raw: sc.Text()}
		if strings.HasPrefix(l.Raw, "{") {
			_ = json.Unmarshal(sc.Bytes(), &l)
		}
		out = append(out, l)
	}
	return out
}

// stack is the DaemonSet's two containers on the node: the agent with the nvidia-example
// plugin on 8 simulated H100s, and the kubelet bridge.
type stack struct {
	n             *nodeEnv
	ds            *daemonSet
	agent, bridge *hostProc
	releaseGrace  time.Duration // from the bridge's config
	podSeq        int
}

// stacks counts the stacks started on this node.
var stacks int

func startStack(t *testing.T) *stack {
	t.Helper()
	n := requireNode(t)
	base := filepath.Join(n.run, "ds")
	if err := os.RemoveAll(base); err != nil {
		t.Fatal(err)
	}
	ds, err := renderDaemonSet(filepath.Join(n.root, "deploy", "kubernetes", "devicehost.yaml"), base, n.kubeletRoot, n.cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	// The DaemonSet would run on this node: its nodeSelector matches the node's labels.
	var nd struct {
		Metadata struct {
			Labels map[string]string `json:"labels"`
		} `json:"metadata"`
	}
	if err := n.kubectlJSON(&nd, "get", "node", n.nodeName); err != nil {
		t.Fatal(err)
	}
	if miss := unselected(ds.nodeSelector, nd.Metadata.Labels); len(miss) > 0 {
		t.Fatalf("node %s lacks %v of the DaemonSet's nodeSelector: the DaemonSet would not run on it (node.sh's NODE_LABELS)", n.nodeName, miss)
	}
	// The install-plugins init container: the image's plugins into the plugin directory.
	for name, bin := range map[string]string{"nvidia-example": n.nvidiaEx, "hostdev": n.hostdev} {
		plugin, err := os.ReadFile(bin)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(ds.pluginDir, name), plugin, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// The DaemonSet's config but for the bridge's release grace: 5 s instead of its 30 s,
	// so that a case's clean-up (and PodDeletedReleased's wait) waits 5 s for the pods'
	// releases, not 30. The cases check the grace is kept, whatever its length.
	ds.bridge = configVariant(t, ds.bridge, "grace", `release_grace = "30s"`, `release_grace = "5s"`)
	s := &stack{
		n:      n,
		ds:     ds,
		agent:  &hostProc{name: "agent", bin: n.devicehost, c: ds.agent, log: filepath.Join(n.logs, "devicehost-agent.log")},
		bridge: &hostProc{name: "kubelet-plugin", bin: n.devicehost, c: ds.bridge, log: filepath.Join(n.logs, "devicehost-kubelet-plugin.log")},
	}
	s.releaseGrace = s.bridgeReleaseGrace(t)
	t.Cleanup(func() {
		s.deleteAllPods(t)
		s.bridge.stop(t, syscall.SIGTERM)
		s.agent.stop(t, syscall.SIGTERM)
		if t.Failed() {
			t.Logf("logs of the node and of devicehost: %s", n.logs)
		}
	})
	// A second run on the node (-count) starts with a kubelet of its own, so that what the
	// first run left in the kubelet's device manager does not decide the second's cases.
	stacks++
	if stacks > 1 {
		n.nodeScript(t, "stop", "kubelet")
		n.nodeScript(t, "start", "kubelet")
	}
	start := time.Now()
	s.agent.start(t)
	s.waitAgentHealthy(t, 60*time.Second)
	t.Logf("agent: 8 healthy GPUs in %v", time.Since(start).Round(time.Millisecond))
	start = time.Now()
	s.bridge.start(t)
	s.waitAllocatable(t, 8, 60*time.Second)
	t.Logf("bridge: node allocatable %s=8 in %v", gpuResource, time.Since(start).Round(time.Millisecond))
	return s
}

// bridgeReleaseGrace reads release_grace from the bridge's rendered config.
func (s *stack) bridgeReleaseGrace(t *testing.T) time.Duration {
	t.Helper()
	args := s.ds.bridge.args
	for i, a := range args {
		if a == "-config" && i+1 < len(args) {
			data, err := os.ReadFile(args[i+1])
			if err != nil {
				t.Fatal(err)
			}
			if m := regexp.MustCompile(`release_grace\s*=\s*"([^"]+)"`).FindSubmatch(data); m != nil {
				d, err := time.ParseDuration(string(m[1]))
				if err != nil {
					t.Fatal(err)
				}
				return d
			}
		}
	}
	return 30 * time.Second // the bridge's default
}

// cli runs a devicehost client subcommand against the agent, bounded to 15 s.
func (s *stack) cli(args ...string) ([]byte, error) { return s.cliWithin(15*time.Second, args...) }

// cliWithin is cli for a command that may take up to limit.
func (s *stack) cliWithin(limit time.Duration, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.n.devicehost, append([]string{args[0], "-address", "unix://" + s.ds.agentSocket}, args[1:]...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("devicehost %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(stderr.Bytes()))
	}
	return out, nil
}

// devices is `devicehost devices -json`.
func (s *stack) devices() (*pb.FingerprintResponse, error) {
	out, err := s.cli("devices", "-json")
	if err != nil {
		return nil, err
	}
	fp := &pb.FingerprintResponse{}
	return fp, protojson.Unmarshal(out, fp)
}

// reservations is `devicehost reservations -json` with the filter flags given.
func (s *stack) reservations(flags ...string) ([]*pb.Reservation, error) {
	out, err := s.cli(append([]string{"reservations", "-json"}, flags...)...)
	if err != nil {
		return nil, err
	}
	rs := &pb.ListReservationsResponse{}
	if err := protojson.Unmarshal(out, rs); err != nil {
		return nil, err
	}
	return rs.GetReservations(), nil
}

func (s *stack) waitAgentHealthy(t *testing.T, limit time.Duration) {
	t.Helper()
	testwait.Until(t, limit, "agent serving 8 healthy GPUs", func() (bool, string) {
		fp, err := s.devices()
		if err != nil {
			return false, err.Error()
		}
		healthy := 0
		for _, g := range fp.GetGroups() {
			for _, d := range g.GetDevices() {
				// The GPUs: host devices (hostdev) may be served beside them.
				if g.GetVendor() == "nvidia" && d.GetHealth() == pb.Health_HEALTH_HEALTHY {
					healthy++
				}
			}
		}
		return healthy == 8, fmt.Sprintf("%d healthy", healthy)
	})
}

// allocatable is the node's allocatable count of the GPU resource (-1: not listed).
func (s *stack) allocatable() (int, error) { return s.allocatableOf(gpuResource) }

// allocatableOf is the node's allocatable count of resource (-1: not listed).
func (s *stack) allocatableOf(resource string) (int, error) {
	var nd struct {
		Status struct {
			Allocatable map[string]string `json:"allocatable"`
		} `json:"status"`
	}
	if err := s.n.kubectlJSON(&nd, "get", "node", s.n.nodeName); err != nil {
		return 0, err
	}
	v, ok := nd.Status.Allocatable[resource]
	if !ok {
		return -1, nil
	}
	return strconv.Atoi(v)
}

func (s *stack) waitAllocatable(t *testing.T, want int, limit time.Duration) time.Duration {
	t.Helper()
	return testwait.Until(t, limit, fmt.Sprintf("node allocatable %s=%d", gpuResource, want), func() (bool, string) {
		n, err := s.allocatable()
		if err != nil {
			return false, err.Error()
		}
		return n == want, fmt.Sprintf("allocatable %d", n)
	})
}

// pod is the part of a Pod object the cases read.
type pod struct {
	Metadata struct {
		Name string `json:"name"`
		UID  string `json:"uid"`
	} `json:"metadata"`
	Status struct {
		Phase      string `json:"phase"`
		Conditions []struct {
			Type    string `json:"type"`
			Status  string `json:"status"`
			Reason  string `json:"reason"`
			Message string `json:"message"`
		} `json:"conditions"`
		ContainerStatuses []struct {
			Ready        bool `json:"ready"`
			RestartCount int  `json:"restartCount"`
			// AllocatedResourcesStatus is the kubelet's view of the health of the
			// devices of the container's claims.
			AllocatedResourcesStatus []struct {
				Name      string `json:"name"`
				Resources []struct {
					ResourceID string `json:"resourceID"`
					Health     string `json:"health"`
				} `json:"resources"`
			} `json:"allocatedResourcesStatus"`
		} `json:"containerStatuses"`
		// ResourceClaimStatuses name the claims made for the pod from its templates.
		ResourceClaimStatuses []struct {
			Name              string `json:"name"`
			ResourceClaimName string `json:"resourceClaimName"`
		} `json:"resourceClaimStatuses"`
	} `json:"status"`
}

const (
	podNamespace = "default"
	podLabel     = "devicehost-e2e"
	podContainer = "cuda"
)

// createPod creates a pod whose one container asks for gpus GPUs and prints what it sees
// of them: NVIDIA_VISIBLE_DEVICES and the /dev/nvidia* nodes, then READY.
func (s *stack) createPod(t *testing.T, prefix string, gpus int) string {
	t.Helper()
	return s.submitPod(t, prefix, func(spec, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{gpuResource: strconv.Itoa(gpus)}}
	})
}

// submitPod creates a pod of the suite (its label, the node's image, one container that
// prints NVIDIA_VISIBLE_DEVICES, DEVICEHOST_CLAIM and the /dev/nvidia* nodes it sees,
// then READY, and sleeps); shape adds what the pod asks for to its spec and container.
// It returns the pod's name.
func (s *stack) submitPod(t *testing.T, prefix string, shape func(spec, container map[string]any)) string {
	t.Helper()
	s.podSeq++
	name := fmt.Sprintf("%s-%d-%d", prefix, time.Now().Unix()%100000, s.podSeq)
	script := `echo "NVIDIA_VISIBLE_DEVICES=${NVIDIA_VISIBLE_DEVICES-<unset>}"; ` +
		`echo "DEVICEHOST_CLAIM=${DEVICEHOST_CLAIM-<unset>}"; ` +
		`for d in /dev/nvidia*; do [ -e "$d" ] && echo "DEVICE=$d"; done; echo READY; ` +
		`trap 'exit 0' TERM; sleep 86400 & wait`
	container := map[string]any{
		"name":            podContainer,
		"image":           s.n.image,
		"imagePullPolicy": "Never",
		"command":         []string{"/bin/sh", "-c", script},
	}
	spec := map[string]any{
		"restartPolicy":                 "Never",
		"terminationGracePeriodSeconds": 2,
		"containers":                    []any{container},
	}
	shape(spec, container)
	s.n.createObject(t, "v1", "Pod", name, spec)
	return name
}

// createObject creates an object of the suite (namespace podNamespace, label
// app=podLabel, which the cleanups select by), failing t if the API server refuses it.
func (n *nodeEnv) createObject(t *testing.T, apiVersion, kind, name string, spec any) {
	t.Helper()
	obj := map[string]any{
		"apiVersion": apiVersion,
		"kind":       kind,
		"metadata":   map[string]any{"name": name, "namespace": podNamespace, "labels": map[string]string{"app": podLabel}},
		"spec":       spec,
	}
	data, err := json.Marshal(obj)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := n.kubectl(data, "create", "-f", "-"); err != nil {
		t.Fatalf("create %s %s: %v %s", kind, name, err, out)
	}
}

func (s *stack) getPod(name string) (*pod, error) {
	var p pod
	return &p, s.n.kubectlJSON(&p, "-n", podNamespace, "get", "pod", name)
}

// waitPodReady waits until the pod runs and its container printed READY; it returns the
// container's output.
func (s *stack) waitPodReady(t *testing.T, name string, limit time.Duration) (string, time.Duration) {
	t.Helper()
	var logs string
	d := testwait.Until(t, limit, "pod "+name+" running", func() (bool, string) {
		p, err := s.getPod(name)
		if err != nil {
			return false, err.Error()
		}
		if p.Status.Phase != "Running" {
			return false, fmt.Sprintf("phase %s, conditions %+v", p.Status.Phase, p.Status.Conditions)
		}
		out, err := s.n.kubectl(nil, "-n", podNamespace, "logs", name, "-c", podContainer)
		if err != nil {
			return false, err.Error()
		}
		logs = string(out)
		return strings.Contains(logs, "READY"), "no READY in its output: " + logs
	})
	return logs, d
}

// deletePod deletes the pod (if it is still there) and waits until the API server no
// longer has it.
func (s *stack) deletePod(t *testing.T, name string) time.Duration {
	t.Helper()
	if _, err := s.n.kubectl(nil, "-n", podNamespace, "delete", "pod", name, "--wait=false", "--ignore-not-found"); err != nil {
		t.Fatal(err)
	}
	return testwait.Until(t, 90*time.Second, "pod "+name+" gone", func() (bool, string) {
		out, err := s.n.kubectl(nil, "-n", podNamespace, "get", "pod", name, "--ignore-not-found", "-o", "name")
		if err != nil {
			return false, err.Error()
		}
		return len(bytes.TrimSpace(out)) == 0, "still there"
	})
}

func (s *stack) deleteAllPods(t *testing.T) {
	t.Helper()
	if _, err := s.n.kubectl(nil, "-n", podNamespace, "delete", "pod", "-l", "app="+podLabel, "--wait=true", "--timeout=90s"); err != nil {
		t.Errorf("delete the suite's pods: %v", err)
	}
}

// podOwner is the owner the bridge gives the reservation of a pod's container.
func podOwner(name string) string { return "k8s/" + podNamespace + "/" + name + "/" + podContainer }

// waitPodReservation waits until the agent's ledger names the pod's container as the
// owner of an active reservation, and returns it.
func (s *stack) waitPodReservation(t *testing.T, name string, limit time.Duration) (*pb.Reservation, time.Duration) {
	t.Helper()
	var res *pb.Reservation
	d := testwait.Until(t, limit, "a reservation owned by "+podOwner(name), func() (bool, string) {
		rs, err := s.reservations("-owner", podOwner(name), "-state", "active")
		if err != nil {
			return false, err.Error()
		}
		if len(rs) != 1 {
			all, _ := s.reservations("-state", "active")
			return false, fmt.Sprintf("%d reservations of the pod; all active: %v", len(rs), all)
		}
		res = rs[0]
		return true, ""
	})
	return res, d
}
