package kubernetes

import (
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Prioritized alternatives (DRAPrioritizedList) on a node that mixes MIG-enabled and
// whole GPUs (on-demand MIG; the simulated operator leaves MIG mode off on GPUs 4 to 7):
// the example claim of deploy/kubernetes/examples/mig-or-gpu.yaml gets a 1g.10gb MIG
// instance while a MIG-enabled GPU has room, and a whole GPU once a claim holds every
// MIG-enabled GPU whole.
func (d *draStack) casePrioritized(t *testing.T) {
	d.withAgentConfig(t, d.agentConfigVariant(t, "mixed", `mig            = "on-demand"
        sim_state_file = "`+filepath.Join(d.n.run, "ds", "nvidia-sim-mixed.json")+`"
        sim_mig_mode_off = [4, 5, 6, 7]`))
	var migGPUs []string // the agent's GPUs with MIG mode on: one counter set each
	dPool := d.waitPool(t, 60*time.Second, "8 GPUs, MIG partitions of 4 of them with their counter sets", func(p pool) (bool, string) {
		fp, err := d.devices()
		if err != nil {
			return false, err.Error()
		}
		migGPUs = migGPUs[:0]
		for _, cs := range fp.GetCounterSets() {
			migGPUs = append(migGPUs, cs.GetName())
		}
		slices.Sort(migGPUs)
		return len(p.ofType("gpu")) == 8 && len(p.ofType("mig")) > 0 && p.counters == 4 && len(migGPUs) == 4,
			fmt.Sprintf("%s; agent's counter sets %v", p, migGPUs)
	})
	t.Logf("agent restarted with on-demand MIG on 4 of 8 GPUs (%v): pool ready %v after", migGPUs, dPool.Round(time.Millisecond))

	tmpl := d.manifestTemplate(t, "examples/mig-or-gpu.yaml", "mig-or-gpu")
	check := func(c *claim, wantRequest string) {
		t.Helper()
		rs := c.Status.Allocation.Devices.Results
		if len(rs) != 1 || rs[0].Request != wantRequest {
			t.Errorf("claim %s allocated %+v, want one device for request %s", c.Metadata.Name, rs, wantRequest)
		}
	}

	// Room for MIG: the first alternative.
	name, c, res, v := d.runClaimPod(t, "dra-first-mig", tmpl)
	check(c, "gpu/mig")
	if ids := res.GetDeviceIds(); res.GetType() != "mig" || len(ids) != 1 || !strings.Contains(ids[0], "-mig-1g.10gb-") {
		t.Errorf("reservation %s: %s %v, want one 1g.10gb MIG instance", res.GetReservationId(), res.GetType(), ids)
	}
	if !strings.HasPrefix(v.env, "MIG-") {
		t.Errorf("NVIDIA_VISIBLE_DEVICES=%s in the container, want a MIG-<uuid>", v.env)
	}
	t.Logf("MIG with room: claim %s got %s (request %s), container sees %s",
		c.Metadata.Name, res.GetDeviceIds(), c.Status.Allocation.Devices.Results[0].Request, v.env)
	d.deleteReleased(t, name, c, res)

	// No room: every MIG-enabled GPU held whole by another claim.
	quoted := make([]string, len(migGPUs))
	for i, id := range migGPUs {
		quoted[i] = strconv.Quote(id)
	}
	hold := d.createTemplate(t, "mig-gpus", gpuClass, len(migGPUs),
		`device.attributes["`+draDriver+`"].id in [`+strings.Join(quoted, ", ")+`]`)
	holder, _, hres, _ := d.runClaimPod(t, "dra-hold-mig-gpus", hold)
	defer d.deletePod(t, holder)
	if got := slices.Sorted(slices.Values(hres.GetDeviceIds())); !slices.Equal(got, migGPUs) {
		t.Fatalf("the holder's reservation holds %v, want the MIG-enabled GPUs %v", got, migGPUs)
	}
	name, c, res, v = d.runClaimPod(t, "dra-first-whole", tmpl)
	check(c, "gpu/whole")
	if ids := res.GetDeviceIds(); res.GetType() != "gpu" || len(ids) != 1 || slices.Contains(migGPUs, ids[0]) {
		t.Errorf("reservation %s: %s %v, want one whole GPU with MIG mode off", res.GetReservationId(), res.GetType(), ids)
	}
	if !strings.HasPrefix(v.env, "GPU-") {
		t.Errorf("NVIDIA_VISIBLE_DEVICES=%s in the container, want a GPU-<uuid>", v.env)
	}
	t.Logf("MIG without room (%d MIG-enabled GPUs held whole): claim %s got %s (request %s), container sees %s",
		len(migGPUs), c.Metadata.Name, res.GetDeviceIds(), c.Status.Allocation.Devices.Results[0].Request, v.env)
	d.deleteReleased(t, name, c, res)
}
