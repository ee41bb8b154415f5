package nodestatus

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server/servertest"
	"github.com/devicehost/devicehost/tools/agenttest"
	"github.com/devicehost/devicehost/tools/proc"
	"github.com/devicehost/devicehost/tools/testwait"
)

func TestMain(m *testing.M) {
	code := m.Run()
	agenttest.RemoveBinary()
	os.Exit(code)
}

// agent is a real `agent -dev` (eight simulated H100s) with extra arguments, and a
// client of it.
type agent struct {
	p *agenttest.Process
	c *client.Client
}

func startAgent(t *testing.T, args ...string) *agent {
	t.Helper()
	dir := servertest.ShortTempDir(t, "ns")
	sock := "unix://" + filepath.Join(dir, "dh.sock")
	p := agenttest.Start(t, agenttest.Command{
		Path:        agenttest.Binary(t),
		Args:        append([]string{"agent", "-dev", "-listen", sock, "-state-dir", filepath.Join(dir, "state")}, args...),
		TempDir:     dir,
		MergeOutput: true,
	})
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	c, err := client.Dial(ctx, sock, client.WithoutReachCheck(), client.WithBackoff(20*time.Millisecond, 200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.WaitServing(ctx); err != nil {
		t.Fatal(err)
	}
	return &agent{p: p, c: c}
}

func (a *agent) devices(t *testing.T) *pb.FingerprintResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	fp, err := a.c.Devices(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return fp
}

// The labels of the simulated DGX H100 are GFD's names with GFD's values for that
// machine (its driver 550.54.15, CUDA 12.4, 80 GB HBM3, compute capability 9.0), so a
// nodeSelector written for a node GFD labelled selects it.
func TestLabelsOfSimulatedDGXH100(t *testing.T) {
	a := startAgent(t)
	got := Labels(a.devices(t), "DGX H100")
	want := map[string]string{
		"nvidia.com/gpu.product":                  "NVIDIA-H100-80GB-HBM3",
		"nvidia.com/gpu.count":                    "8",
		"nvidia.com/gpu.memory":                   "81920",
		"nvidia.com/gpu.family":                   "hopper",
		"nvidia.com/gpu.compute.major":            "9",
		"nvidia.com/gpu.compute.minor":            "0",
		"nvidia.com/gpu.machine":                  "DGX-H100",
		"nvidia.com/cuda.driver.major":            "550",
		"nvidia.com/cuda.driver.minor":            "54",
		"nvidia.com/cuda.driver.rev":              "15",
		"nvidia.com/cuda.driver-version.major":    "550",
		"nvidia.com/cuda.driver-version.minor":    "54",
		"nvidia.com/cuda.driver-version.revision": "15",
		"nvidia.com/cuda.driver-version.full":     "550.54.15",
		"nvidia.com/cuda.runtime.major":           "12",
		"nvidia.com/cuda.runtime.minor":           "4",
		"nvidia.com/cuda.runtime-version.major":   "12",
		"nvidia.com/cuda.runtime-version.minor":   "4",
		"nvidia.com/cuda.runtime-version.full":    "12.4",
		"nvidia.com/mig.capable":                  "true",
		"nvidia.com/gpu.replicas":                 "1",
		"nvidia.com/mps.capable":                  "false",
		"nvidia.com/gpu.sharing-strategy":         "none",
		"devicehost.io/nvidia.gpu.count":          "8",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("label %s = %q, want %q", k, got[k], v)
		}
	}
	for k, v := range got {
		if errs := validation.IsQualifiedName(k); len(errs) > 0 {
			t.Errorf("label key %q: %v", k, errs)
		}
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			t.Errorf("label %s value %q: %v", k, v, errs)
		}
		if !strings.HasPrefix(k, NVIDIAPrefix) && !strings.HasPrefix(k, DevicehostPrefix) {
			t.Errorf("label %s is outside nvidia.com/ and devicehost.io/", k)
		}
	}
	t.Logf("%d labels:\n%s", len(got), labelList(got))
}

func labelList(l map[string]string) string {
	var b strings.Builder
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range l {
			if !yield(k) {
				return
			}
		}
	}) {
		fmt.Fprintf(&b, "  %s=%s\n", k, l[k])
	}
	return b.String()
}

// Labels a plugin cannot abuse: names that are no label value are cleaned, device types
// past MaxTypeLabels add no label, and a node offering both sharing modes has no GFD
// sharing strategy (it has none of GFD's single values) but both devicehost.io ones.
func TestLabelsBounded(t *testing.T) {
	fp := &pb.FingerprintResponse{}
	dev := []*pb.Device{{Id: "d", Health: pb.Health_HEALTH_HEALTHY}}
	fp.Groups = append(fp.Groups,
		&pb.DeviceGroup{Vendor: "nvidia", Type: "gpu", Name: "  Bad\x1b[31m Name/" + strings.Repeat("x", 80), Devices: dev},
		&pb.DeviceGroup{Vendor: "nvidia", Type: "gpu.shared", Name: "n", Devices: dev, Attributes: map[string]*pb.Value{"replicas": {Kind: &pb.Value_IntValue{IntValue: 4}}}},
		&pb.DeviceGroup{Vendor: "nvidia", Type: "gpu.mps", Name: "n", Devices: dev, Attributes: map[string]*pb.Value{"mps_shares": {Kind: &pb.Value_IntValue{IntValue: 2}}}},
		&pb.DeviceGroup{Vendor: "nvidia", Type: "mig", Name: "1g.10gb+me", Devices: dev, Attributes: map[string]*pb.Value{"memory": {Kind: &pb.Value_IntValue{IntValue: 9856}}}},
	)
	for i := range 3 * MaxTypeLabels {
		fp.Groups = append(fp.Groups, &pb.DeviceGroup{Vendor: "hostile", Type: fmt.Sprintf("t%03d", i), Devices: dev})
	}
	got := Labels(fp, "")
	if v := got["nvidia.com/gpu.product"]; v != "Bad-31m-Name-"+strings.Repeat("x", 50) {
		t.Errorf("gpu.product = %q, want the name cleaned and cut to 63 characters", v)
	}
	if _, ok := got["nvidia.com/gpu.sharing-strategy"]; ok || got["devicehost.io/gpu.sharing.time-slicing"] != "true" || got["devicehost.io/gpu.sharing.mps"] != "true" {
		t.Errorf("both modes offered: got sharing-strategy %q, time-slicing %q, mps %q; want none, true, true",
			got["nvidia.com/gpu.sharing-strategy"], got["devicehost.io/gpu.sharing.time-slicing"], got["devicehost.io/gpu.sharing.mps"])
	}
	if got["nvidia.com/gpu.replicas"] != "4" || got["nvidia.com/mps.capable"] != "true" {
		t.Errorf("replicas %q, mps.capable %q; want 4, true", got["nvidia.com/gpu.replicas"], got["nvidia.com/mps.capable"])
	}
	if got["nvidia.com/mig.strategy"] != "mixed" || got["nvidia.com/mig-1g.10gb.me.count"] != "1" || got["nvidia.com/mig-1g.10gb.me.memory"] != "9856" {
		t.Errorf("MIG labels: %s", labelList(got))
	}
	if _, ok := got["nvidia.com/gpu.machine"]; ok {
		t.Error("gpu.machine set with no machine type")
	}
	n := 0
	for k := range got {
		if strings.HasPrefix(k, "devicehost.io/") && strings.HasSuffix(k, ".count") {
			n++
		}
	}
	if n != MaxTypeLabels {
		t.Errorf("%d devicehost.io/<vendor>.<type>.count labels of %d types, want MaxTypeLabels (%d)", n, 3*MaxTypeLabels+4, MaxTypeLabels)
	}
	for k, v := range got {
		if errs := append(validation.IsQualifiedName(k), validation.IsValidLabelValue(v)...); len(errs) > 0 {
			t.Errorf("label %s=%q: %v", k, v, errs)
		}
	}
}

// The condition names the unhealthy devices, at most maxNamedDevices of them, in a
// bounded message.
func TestHealthOf(t *testing.T) {
	fp := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{{Vendor: "v", Type: "t"}}}
	g := fp.Groups[0]
	for i := range 40 {
		d := &pb.Device{Id: fmt.Sprintf("dev-%02d", i), Health: pb.Health_HEALTH_HEALTHY}
		if i%2 == 1 {
			d.Health, d.HealthReason = pb.Health_HEALTH_UNHEALTHY, "XID 79 "+strings.Repeat("\x1b[2J", 100)
		}
		g.Devices = append(g.Devices, d)
	}
	g.Devices = append(g.Devices, &pb.Device{Id: "dev-00", Health: pb.Health_HEALTH_HEALTHY}) // listed twice
	h := HealthOf(fp)
	if h.Status != "False" || h.Reason != ReasonUnhealthy || !strings.HasPrefix(h.Message, "20 of 40 devices unhealthy: dev-01 (XID 79") ||
		!strings.Contains(h.Message, "dev-31 (") || strings.Contains(h.Message, "dev-33") || !strings.HasSuffix(h.Message, ", and 4 more") || len(h.Message) > maxMessage || strings.Contains(h.Message, "\x1b") {
		t.Errorf("condition = %+v", h)
	}
	for _, d := range g.Devices {
		d.Health = pb.Health_HEALTH_HEALTHY
	}
	if h := HealthOf(fp); h != (Health{"True", ReasonHealthy, "40 devices healthy"}) {
		t.Errorf("all healthy: condition = %+v", h)
	}
}

func newNode(t *testing.T) *fake.Clientset {
	t.Helper()
	return fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1",
		Labels: map[string]string{"kubernetes.io/hostname": "node-1", "nvidia.com/gpu.present": "true"}}})
}

func getNode(t *testing.T, kube *fake.Clientset) *corev1.Node {
	t.Helper()
	n, err := kube.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func condition(n *corev1.Node) *corev1.NodeCondition {
	for i, c := range n.Status.Conditions {
		if c.Type == ConditionType {
			return &n.Status.Conditions[i]
		}
	}
	return nil
}

// Apply writes exactly its labels (one it stops saying goes, others' stay) and the
// condition; Remove takes off all it wrote and nothing else.
func TestPublisherApplyAndRemove(t *testing.T) {
	kube := newNode(t)
	ctx := context.Background()
	p := &Publisher{Kube: kube, Node: "node-1", Log: hclog.NewNullLogger()}
	if err := p.Apply(ctx, map[string]string{"nvidia.com/gpu.count": "8", "nvidia.com/mig-1g.10gb.count": "56"}, Health{"True", ReasonHealthy, "8 devices healthy"}); err != nil {
		t.Fatal(err)
	}
	n := getNode(t, kube)
	c := condition(n)
	if n.Labels["nvidia.com/gpu.count"] != "8" || n.Labels["nvidia.com/mig-1g.10gb.count"] != "56" || c == nil || c.Status != corev1.ConditionTrue {
		t.Fatalf("after Apply: labels %v, condition %+v", n.Labels, c)
	}
	since := c.LastTransitionTime
	// MIG reconfigured away: its label goes. The status is the same: the transition
	// time stays.
	if err := p.Apply(ctx, map[string]string{"nvidia.com/gpu.count": "8"}, Health{"True", ReasonHealthy, "8 devices healthy"}); err != nil {
		t.Fatal(err)
	}
	n = getNode(t, kube)
	if _, ok := n.Labels["nvidia.com/mig-1g.10gb.count"]; ok || n.Labels["kubernetes.io/hostname"] != "node-1" || n.Labels["nvidia.com/gpu.present"] != "true" {
		t.Fatalf("after the second Apply: labels %v; want the MIG label gone and the others' kept", n.Labels)
	}
	if c := condition(n); !c.LastTransitionTime.Equal(&since) {
		t.Errorf("lastTransitionTime moved from %v to %v with the status unchanged", since, c.LastTransitionTime)
	}
	if err := p.Apply(ctx, map[string]string{"nvidia.com/gpu.count": "8"}, Health{"False", ReasonUnhealthy, "1 of 8 devices unhealthy: GPU-1 (XID 79)"}); err != nil {
		t.Fatal(err)
	}
	if c := condition(getNode(t, kube)); c.Status != corev1.ConditionFalse || c.Reason != ReasonUnhealthy || c.Message != "1 of 8 devices unhealthy: GPU-1 (XID 79)" {
		t.Errorf("condition = %+v, want False naming GPU-1", c)
	}
	// A publisher started anew (the pod restarted) keeps the transition time of a
	// status that did not change.
	before := condition(getNode(t, kube)).LastTransitionTime
	p2 := &Publisher{Kube: kube, Node: "node-1", Log: hclog.NewNullLogger()}
	if err := p2.Apply(ctx, map[string]string{"nvidia.com/gpu.count": "8"}, Health{"False", ReasonUnhealthy, "1 of 8 devices unhealthy: GPU-1 (XID 79)"}); err != nil {
		t.Fatal(err)
	}
	if c := condition(getNode(t, kube)); !c.LastTransitionTime.Equal(&before) {
		t.Errorf("a new publisher moved lastTransitionTime from %v to %v", before, c.LastTransitionTime)
	}
	cleaned, err := RemoveAll(ctx, kube, hclog.NewNullLogger())
	if err != nil || !slices.Equal(cleaned, []string{"node-1"}) {
		t.Fatalf("RemoveAll = %v, %v; want [node-1]", cleaned, err)
	}
	n = getNode(t, kube)
	if len(n.Labels) != 2 || condition(n) != nil {
		t.Errorf("after RemoveAll: labels %v, condition %+v; want the two others' labels and no condition", n.Labels, condition(n))
	}
}

// A label removed by hand comes back at the next Apply after a Resync (not before: an
// unchanged set is not written), and a resync is not logged as a change; a real change
// after it is.
func TestPublisherResyncRewritesLabels(t *testing.T) {
	kube := newNode(t)
	ctx := context.Background()
	var logged bytes.Buffer
	p := &Publisher{Kube: kube, Node: "node-1", Log: hclog.New(&hclog.LoggerOptions{Output: &logged})}
	healthy := Health{"True", ReasonHealthy, "8 devices healthy"}
	labels := map[string]string{"nvidia.com/gpu.count": "8"}
	if err := p.Apply(ctx, labels, healthy); err != nil {
		t.Fatal(err)
	}
	removeByHand := func() {
		n := getNode(t, kube)
		delete(n.Labels, "nvidia.com/gpu.count")
		if _, err := kube.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	removeByHand()
	if err := p.Apply(ctx, labels, healthy); err != nil {
		t.Fatal(err)
	}
	if v, ok := getNode(t, kube).Labels["nvidia.com/gpu.count"]; ok {
		t.Fatalf("an unchanged Apply without Resync wrote the labels (gpu.count=%s): it must not write the node each pass", v)
	}
	p.Resync()
	if err := p.Apply(ctx, labels, healthy); err != nil {
		t.Fatal(err)
	}
	if v := getNode(t, kube).Labels["nvidia.com/gpu.count"]; v != "8" {
		t.Fatalf("after Resync and Apply: gpu.count = %q, want the removed label back (8)", v)
	}
	if strings.Contains(logged.String(), "node labels changed") {
		t.Errorf("a resync was logged as a change: %s", logged.String())
	}
	if err := p.Apply(ctx, map[string]string{"nvidia.com/gpu.count": "7"}, healthy); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logged.String(), "node labels changed") {
		t.Errorf("a change after a resync was not logged: %q", logged.String())
	}
}

// Run follows the agent: a plugin SIGKILLed turns the condition False naming its
// devices, and True again once the restarted plugin has fingerprinted; the labels stay.
func TestRunFollowsPluginCrash(t *testing.T) {
	a := startAgent(t)
	kube := newNode(t)
	ctx, cancel := context.WithCancel(context.Background())
	w, err := kube.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p := &Publisher{Kube: kube, Node: "node-1", Log: hclog.NewNullLogger()}
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, a.c, p, RunConfig{Resync: time.Hour, Unreachable: time.Hour, Retry: 10 * time.Millisecond})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	// next waits for the node's next update whose condition has status want.
	next := func(want corev1.ConditionStatus) *corev1.Node {
		t.Helper()
		timeout := time.After(testwait.Timeout)
		for {
			select {
			case ev := <-w.ResultChan():
				if ev.Type != watch.Modified {
					continue
				}
				n := ev.Object.(*corev1.Node)
				if c := condition(n); c != nil && c.Status == want {
					return n
				}
			case <-timeout:
				t.Fatalf("no node update with the condition %s within %v", want, testwait.Timeout)
			}
		}
	}
	n := next(corev1.ConditionTrue)
	if n.Labels["nvidia.com/gpu.product"] != "NVIDIA-H100-80GB-HBM3" {
		t.Fatalf("labels %v", n.Labels)
	}
	kids, err := proc.Children(a.p.Cmd.Process.Pid)
	if err != nil || len(kids) == 0 {
		t.Fatalf("the agent's plugins: %v, %v", kids, err)
	}
	for _, k := range kids {
		syscall.Kill(k.PID, syscall.SIGKILL)
	}
	n = next(corev1.ConditionFalse)
	c := condition(n)
	if c.Reason != ReasonUnhealthy || !strings.Contains(c.Message, "GPU-") || n.Labels["nvidia.com/gpu.count"] != "8" {
		t.Errorf("after the plugin's SIGKILL: condition %+v, gpu.count %q", c, n.Labels["nvidia.com/gpu.count"])
	}
	t.Logf("False: %s", c.Message)
	n = next(corev1.ConditionTrue)
	t.Logf("True again after %v: %s", condition(n).LastTransitionTime.Sub(c.LastTransitionTime.Time), condition(n).Message)
	w.Stop()
}
