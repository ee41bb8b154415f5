package kubernetes

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/testwait"
)

// waitUnschedulable waits until the scheduler says why pod name cannot be scheduled,
// and returns its message.
func (s *stack) waitUnschedulable(t *testing.T, name string, limit time.Duration) (string, time.Duration) {
	t.Helper()
	var msg string
	d := testwait.Until(t, limit, "pod "+name+" unschedulable", func() (bool, string) {
		p, err := s.getPod(name)
		if err != nil {
			return false, err.Error()
		}
		for _, c := range p.Status.Conditions {
			if c.Type == "PodScheduled" && c.Status == "False" && c.Message != "" {
				msg = c.Message
				return true, ""
			}
		}
		return false, fmt.Sprintf("phase %s, conditions %+v", p.Status.Phase, p.Status.Conditions)
	})
	return msg, d
}

// stillRunning fails t unless pod name runs, ready, its container never restarted.
func (s *stack) stillRunning(t *testing.T, name string) {
	t.Helper()
	p, err := s.getPod(name)
	if err != nil {
		t.Fatal(err)
	}
	if p.Status.Phase != "Running" || len(p.Status.ContainerStatuses) != 1 || !p.Status.ContainerStatuses[0].Ready ||
		p.Status.ContainerStatuses[0].RestartCount != 0 {
		t.Errorf("pod %s: phase %s, containers %+v; want it running, ready, never restarted", name, p.Status.Phase, p.Status.ContainerStatuses)
	}
}

// freeGPUs are the agent's GPUs no live reservation holds.
func (s *stack) freeGPUs(t *testing.T) []string {
	t.Helper()
	fp, err := s.devices()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, g := range fp.GetGroups() {
		if g.GetType() != "gpu" {
			continue
		}
		for _, d := range g.GetDevices() {
			if d.GetHolder() == nil {
				out = append(out, d.GetId())
			}
		}
	}
	slices.Sort(out)
	return out
}

// The device-plugin path: cordoning a GPU its pod holds and a free one takes both out
// of what the kubelet may allocate at once, the holder runs on, a pod that needs them
// stays Pending; uncordoning puts them back and the pod runs.
func (s *stack) caseCordon(t *testing.T) {
	holder := s.createPod(t, "cordon-holder", 2)
	defer s.deletePod(t, holder)
	s.waitPodReady(t, holder, 90*time.Second)
	res, _ := s.waitPodReservation(t, holder, 60*time.Second)
	s.waitAllocatable(t, 8, 30*time.Second)
	held, free := res.GetDeviceIds()[0], s.freeGPUs(t)[0]

	start := time.Now()
	for _, id := range []string{held, free} {
		if out, err := s.cli("cordon", "-device", id, "-reason", "e2e: ECC storm"); err != nil {
			t.Fatalf("cordon %s: %v %s", id, err, out)
		}
	}
	defer func() {
		for _, id := range []string{held, free} {
			s.cli("uncordon", "-device", id)
		}
	}()
	dCLI := time.Since(start)
	dGone := s.waitAllocatable(t, 6, 30*time.Second)
	t.Logf("cordoned %s (held by %s) and %s (free) with two devicehost cordon runs (%v): the kubelet allocates neither %v after they returned",
		held, holder, free, dCLI.Round(time.Millisecond), dGone.Round(time.Millisecond))

	// 8 GPUs: 2 the holder's, 2 cordoned (one of them the holder's), so 6 would take a
	// cordoned one.
	big := s.createPod(t, "cordon-big", 6)
	defer s.deletePod(t, big)
	msg, _ := s.waitUnschedulable(t, big, 60*time.Second)
	if !strings.Contains(msg, "Insufficient "+gpuResource) {
		t.Errorf("the scheduler's verdict on 6 GPUs with 2 cordoned: %q", msg)
	}
	s.stillRunning(t, holder)
	if rs, err := s.reservations("-owner", podOwner(holder), "-state", "active"); err != nil || len(rs) != 1 || rs[0].GetReservationId() != res.GetReservationId() {
		t.Errorf("the holder's reservation while cordoned: %v (%v), want %s kept", rs, err, res.GetReservationId())
	}

	start = time.Now()
	for _, id := range []string{held, free} {
		if out, err := s.cli("uncordon", "-device", id); err != nil {
			t.Fatalf("uncordon %s: %v %s", id, err, out)
		}
	}
	dBack := s.waitAllocatable(t, 8, 30*time.Second)
	s.waitPodReady(t, big, 90*time.Second)
	t.Logf("uncordoned: allocatable again %v after (%v for the cordon), the 6-GPU pod running %v after the uncordon",
		dBack.Round(time.Millisecond), dGone.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// The DRA path: cordoning taints the GPU NoSchedule in the pool, so a claim that needs
// it stays Pending while the claim that holds it runs on; uncordoning lets the pending
// claim run; drain taints the held GPU NoExecute, Kubernetes evicts its pod, the driver
// releases the claim and the drain returns with the GPU free.
func (d *draStack) caseCordonDrain(t *testing.T) {
	tmpl := d.createTemplate(t, "two", gpuClass, 2, "")
	holder, hc, hres, _ := d.runClaimPod(t, "dra-cordon-holder", tmpl)
	defer d.deletePod(t, holder)
	held, free := slices.Sorted(slices.Values(hres.GetDeviceIds()))[0], d.freeGPUs(t)[0]

	start := time.Now()
	for _, id := range []string{held, free} {
		if out, err := d.cli("cordon", "-device", id, "-reason", "e2e: ECC storm"); err != nil {
			t.Fatalf("cordon %s: %v %s", id, err, out)
		}
	}
	defer func() {
		for _, id := range []string{held, free} {
			d.cli("uncordon", "-device", id)
		}
	}()
	taintOf := func(p pool, id string) (string, bool) {
		for _, dv := range p.ofType("gpu") {
			if dv.attr("id") == id {
				_, eff, ok := dv.taint("cordoned")
				return eff, ok
			}
		}
		return "", false
	}
	dCLI := time.Since(start)
	dTaint := d.waitPool(t, 30*time.Second, "both cordoned GPUs tainted NoSchedule", func(p pool) (bool, string) {
		a, okA := taintOf(p, held)
		b, okB := taintOf(p, free)
		return okA && okB && a == "NoSchedule" && b == "NoSchedule", fmt.Sprintf("%s %v %s, %s %v %s", held, okA, a, free, okB, b)
	})
	t.Logf("cordoned %s (the claim's) and %s (free) with two devicehost cordon runs (%v): both tainted NoSchedule in the pool %v after they returned",
		held, free, dCLI.Round(time.Millisecond), dTaint.Round(time.Millisecond))

	// 8 GPUs: 2 the claim's, 1 more cordoned: a claim for 6 would need it.
	tmpl6 := d.createTemplate(t, "six", gpuClass, 6, "")
	six := d.createClaimPod(t, "dra-cordon-six", tmpl6)
	defer d.deletePod(t, six)
	msg, _ := d.waitUnschedulable(t, six, 60*time.Second)
	d.stillRunning(t, holder)
	t.Logf("claim for 6 GPUs with 1 free one cordoned: unschedulable: %s", msg)

	start = time.Now()
	if out, err := d.cli("uncordon", "-device", free); err != nil {
		t.Fatalf("uncordon %s: %v %s", free, err, out)
	}
	d.waitPodReady(t, six, 90*time.Second)
	t.Logf("uncordoned %s: the 6-GPU claim's pod running %v after", free, time.Since(start).Round(time.Millisecond))
	d.deletePod(t, six)

	// Drain: NoExecute, the pod is evicted, its claim released, the drain returns.
	start = time.Now()
	out, err := d.cliWithin(3*time.Minute, "drain", "-device", held, "-reason", "e2e: firmware update", "-timeout", "2m")
	dDrain := time.Since(start)
	if err != nil || !strings.Contains(string(out), held+" is free") {
		t.Fatalf("drain %s: %v\n%s", held, err, out)
	}
	if rs, err := d.reservations("-owner", hc.owner(), "-state", "active"); err != nil || len(rs) != 0 {
		t.Errorf("the drained claim's reservations: %v (%v), want none live", rs, err)
	}
	testwait.Until(t, 60*time.Second, "pod "+holder+" gone or failed after the drain", func() (bool, string) {
		p, err := d.getPod(holder)
		if err != nil {
			return strings.Contains(err.Error(), "NotFound") || strings.Contains(err.Error(), "not found"), err.Error()
		}
		return p.Status.Phase == "Failed" || p.Status.Phase == "Succeeded", "phase " + p.Status.Phase
	})
	t.Logf("drain of %s: its pod evicted and its claim released, drain returned %v after it began:\n%s", held, dDrain.Round(time.Millisecond), out)
}
