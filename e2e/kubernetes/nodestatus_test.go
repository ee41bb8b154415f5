package kubernetes

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/proc"
	"github.com/devicehost/devicehost/tools/testwait"
)

// The condition the release's node-status container writes (integrations/dra/nodestatus).
const nodeCondition = "DevicehostDevicesHealthy"

// gfdLabels are the labels GPU Feature Discovery writes on a DGX H100 (driver 550.54.15,
// CUDA 12.4) in its documented names and formats, which the release must write the
// same.
var gfdLabels = map[string]string{
	"nvidia.com/gpu.product":               "NVIDIA-H100-80GB-HBM3",
	"nvidia.com/gpu.count":                 "8",
	"nvidia.com/gpu.memory":                "81920",
	"nvidia.com/gpu.family":                "hopper",
	"nvidia.com/gpu.compute.major":         "9",
	"nvidia.com/gpu.compute.minor":         "0",
	"nvidia.com/cuda.driver.major":         "550",
	"nvidia.com/cuda.driver.minor":         "54",
	"nvidia.com/cuda.driver.rev":           "15",
	"nvidia.com/cuda.driver-version.full":  "550.54.15",
	"nvidia.com/cuda.runtime.major":        "12",
	"nvidia.com/cuda.runtime.minor":        "4",
	"nvidia.com/cuda.runtime-version.full": "12.4",
	"nvidia.com/mig.capable":               "true",
	"nvidia.com/mig.strategy":              "none",
	"nvidia.com/gpu.replicas":              "1",
	"nvidia.com/gpu.sharing-strategy":      "none",
	"devicehost.io/nvidia.gpu.count":       "8",
}

// nodeView is the part of the node the checks read.
type nodeView struct {
	Metadata struct {
		Labels map[string]string `json:"labels"`
	} `json:"metadata"`
	Status struct {
		Conditions []struct {
			Type               string    `json:"type"`
			Status             string    `json:"status"`
			Reason             string    `json:"reason"`
			Message            string    `json:"message"`
			LastTransitionTime time.Time `json:"lastTransitionTime"`
		} `json:"conditions"`
	} `json:"status"`
}

// condition is the node's DevicehostDevicesHealthy condition: status, reason, message
// ("" when it has none).
func (v nodeView) condition() (status, reason, message string) {
	for _, c := range v.Status.Conditions {
		if c.Type == nodeCondition {
			return c.Status, c.Reason, c.Message
		}
	}
	return "", "", ""
}

// owned are the node's labels of nvidia.com/ and devicehost.io/ but the one the suite
// sets itself (nvidia.com/gpu.present, the chart's nodeSelector).
func (v nodeView) owned() map[string]string {
	out := map[string]string{}
	for k, val := range v.Metadata.Labels {
		if (strings.HasPrefix(k, "nvidia.com/") || strings.HasPrefix(k, "devicehost.io/")) && k != "nvidia.com/gpu.present" {
			out[k] = val
		}
	}
	return out
}

func (h *helmStack) node(t *testing.T) nodeView {
	t.Helper()
	var v nodeView
	if err := h.n.kubectlJSON(&v, "get", "node", h.n.nodeName); err != nil {
		t.Fatal(err)
	}
	return v
}

// checkNodeStatus checks what the release's node-status container tells the cluster:
// GFD's labels with GFD's values for the simulated DGX H100, a pod with GFD's
// nodeSelector scheduled by them, the condition True, False within the plugin's SIGKILL
// (naming its GPUs) and True again once it is back; and that its service account may
// write nothing but its own node's labels of its prefixes.
func (h *helmStack) checkNodeStatus(t *testing.T) {
	t.Helper()
	var v nodeView
	d := testwait.Until(t, 60*time.Second, "the node's GFD labels and condition True", func() (bool, string) {
		v = h.node(t)
		got := v.owned()
		for k, want := range gfdLabels {
			if got[k] != want {
				return false, fmt.Sprintf("%s=%q, want %q", k, got[k], want)
			}
		}
		st, _, msg := v.condition()
		return st == "True", "condition " + st + ": " + msg
	})
	got := v.owned()
	var list []string
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range got {
			if !yield(k) {
				return
			}
		}
	}) {
		list = append(list, k+"="+got[k])
	}
	_, _, msg := v.condition()
	t.Logf("%v after the pod was ready: %d labels (%s); %s True: %s", d.Round(time.Millisecond), len(got), strings.Join(list, " "), nodeCondition, msg)

	// A pod written for a node GFD labelled lands here.
	name := h.s.submitPod(t, "gfd-selector", func(spec, _ map[string]any) {
		spec["nodeSelector"] = map[string]any{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.family": "hopper", "nvidia.com/gpu.count": "8"}
	})
	_, dRun := h.s.waitPodReady(t, name, 90*time.Second)
	t.Logf("pod %s with GFD's nodeSelector (product, family, count) running %v after its create", name, dRun.Round(time.Millisecond))
	h.s.deletePod(t, name)

	// The plugin SIGKILLed: the condition turns False naming the GPUs, then True.
	watched, stop := h.watchCondition(t)
	agent := releaseProcess(t, "agent")
	kids, err := proc.Children(agent.PID)
	if err != nil {
		t.Fatal(err)
	}
	var plugin *proc.Process
	for i, k := range kids {
		if !k.Zombie() && filepath.Base(k.Exe) == "nvidia-example" {
			plugin = &kids[i]
		}
	}
	if plugin == nil {
		t.Fatalf("no nvidia-example among the agent's children %v", kids)
	}
	killed := time.Now()
	if err := syscall.Kill(plugin.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var falseAt, trueAt time.Time
	var falseMsg string
	timeout := time.After(2 * time.Minute)
	for trueAt.IsZero() {
		select {
		case c, ok := <-watched:
			if !ok {
				t.Fatal("the node watch ended")
			}
			switch {
			case c.status == "False" && falseAt.IsZero():
				falseAt, falseMsg = c.seen, c.message
			case c.status == "True" && !falseAt.IsZero():
				trueAt = c.seen
			}
		case <-timeout:
			t.Fatalf("the condition did not turn False and True again within 2 minutes of the plugin's SIGKILL (False at %v)", falseAt)
		}
	}
	stop()
	if !strings.Contains(falseMsg, "8 of ") || !strings.Contains(falseMsg, "plugin exited: signal: killed") {
		t.Errorf("the False condition's message %q does not name the 8 GPUs and the plugin's death", falseMsg)
	}
	t.Logf("plugin %d SIGKILLed: %s False %v later (%q), True again %v after the kill", plugin.PID, nodeCondition,
		falseAt.Sub(killed).Round(time.Millisecond), textTrim(falseMsg, 160), trueAt.Sub(killed).Round(time.Millisecond))

	h.checkNodeStatusAccess(t)
}

func textTrim(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// conditionSeen is one version of the node's condition a watch saw, and when.
type conditionSeen struct {
	status, message string
	seen            time.Time
}

// watchCondition watches the node (kubectl get --watch) and sends its condition at
// each version; stop ends the watch.
func (h *helmStack) watchCondition(t *testing.T) (<-chan conditionSeen, func()) {
	t.Helper()
	ch := make(chan conditionSeen, 64)
	stop := kubectlWatch(t, h.n, []string{"node", h.n.nodeName, "--output-watch-events=false"}, func(ctx context.Context, v nodeView) bool {
		st, _, msg := v.condition()
		select {
		case ch <- conditionSeen{st, msg, time.Now()}:
			return true
		case <-ctx.Done():
			return false
		}
	}, func() { close(ch) })
	return ch, stop
}

// checkNodeStatusAccess proves the ValidatingAdmissionPolicy: with a token of the
// release's service account bound to this node, a label of devicehost.io/ on this node
// is let through, and a label on another node, or one of another prefix on this node,
// is refused with the policy's message.
func (h *helmStack) checkNodeStatusAccess(t *testing.T) {
	t.Helper()
	var p releasePod
	pods, err := h.pods()
	if err != nil || len(pods) != 1 {
		t.Fatalf("the release's pods: %v, %v", pods, err)
	}
	p = pods[0]
	kc := filepath.Join(h.n.run, "helm", "node-status.kubeconfig")
	if err := h.n.serviceAccountKubeconfig(kc, helmNamespace, p.Spec.ServiceAccountName); err != nil {
		t.Fatal(err)
	}
	const other = "devicehost-e2e-other-node"
	if _, err := h.n.kubectl([]byte(`{"apiVersion":"v1","kind":"Node","metadata":{"name":"`+other+`"}}`), "create", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	defer h.n.kubectl(nil, "delete", "node", other, "--ignore-not-found")
	as := func(args ...string) ([]byte, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return exec.CommandContext(ctx, h.n.kubectlBin, append([]string{"--kubeconfig", kc}, args...)...).CombinedOutput()
	}
	if out, err := as("label", "node", h.n.nodeName, "devicehost.io/e2e-probe=yes"); err != nil {
		t.Errorf("the account may not label its own node devicehost.io/: %v: %s", err, out)
	}
	if out, err := as("label", "node", h.n.nodeName, "devicehost.io/e2e-probe-"); err != nil {
		t.Errorf("the account may not remove its own node's devicehost.io/ label: %v: %s", err, out)
	}
	for _, c := range []struct{ what, node, label, says string }{
		{"another node's label", other, "devicehost.io/e2e-probe=yes", "may write its own node only"},
		{"a label of another prefix", h.n.nodeName, "team.example.com/gpu=yes", "labels only"},
	} {
		out, err := as("label", "node", c.node, c.label)
		if err == nil || !strings.Contains(string(out), c.says) {
			t.Errorf("%s: kubectl label %s %s as the release's account: %v: %s; want refused, %q", c.what, c.node, c.label, err, out, c.says)
			continue
		}
		t.Logf("%s refused: %s", c.what, textTrim(strings.TrimSpace(string(out)), 240))
	}
	os.Remove(kc)
}

// checkNodeStatusRemoved fails t unless the uninstall took every label and the
// condition the release wrote off the node, and nothing else.
func (h *helmStack) checkNodeStatusRemoved(t *testing.T) {
	t.Helper()
	v := h.node(t)
	st, _, _ := v.condition()
	if got := v.owned(); len(got) > 0 || st != "" {
		t.Errorf("after the uninstall the node keeps labels %v and condition %q", got, st)
	}
	if v.Metadata.Labels["nvidia.com/gpu.present"] != "true" {
		t.Errorf("the uninstall removed nvidia.com/gpu.present, which the release did not write")
	}
	t.Logf("after the uninstall: no nvidia.com/ or devicehost.io/ label the release wrote, no %s condition; nvidia.com/gpu.present kept", nodeCondition)
}
