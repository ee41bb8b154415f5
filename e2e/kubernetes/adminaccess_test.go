package kubernetes

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/testwait"
)

// adminAccessLabel is the namespace label Kubernetes requires of a claim with admin
// access (DRAAdminAccess).
const adminAccessLabel = "resource.kubernetes.io/admin-access"

// Admin access (DRAAdminAccess, GA): a claim with adminAccess is refused by the API
// server in a namespace without the admin-access label; in one with it, its pod sees
// a GPU another claim holds and a free one, the ledger gains no holder, the agent lists
// the access apart from holders, and a new claim of the free GPU is not refused; the
// admin pod's delete ends the access.
func (d *draStack) caseAdminAccess(t *testing.T) {
	tmpl := d.createTemplate(t, "one", gpuClass, 1, "")
	holder, _, hres, _ := d.runClaimPod(t, "dra-admin-holder", tmpl)
	defer d.deletePod(t, holder)
	held, free := hres.GetDeviceIds()[0], d.freeGPUs(t)[0]
	spec := map[string]any{"devices": map[string]any{"requests": []any{map[string]any{"name": "gpus", "exactly": map[string]any{
		"deviceClassName": gpuClass, "count": 2, "adminAccess": true,
		"selectors": []any{map[string]any{"cel": map[string]any{"expression": `device.attributes["` + draDriver + `"].id in [` +
			strconv.Quote(held) + `, ` + strconv.Quote(free) + `]`}}},
	}}}}}

	// Refused where the namespace lacks the label.
	body, err := json.Marshal(map[string]any{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
		"metadata": map[string]any{"name": "admin-refused", "namespace": podNamespace, "labels": map[string]string{"app": podLabel}},
		"spec":     map[string]any{"spec": spec}})
	if err != nil {
		t.Fatal(err)
	}
	out, err := d.n.kubectl(body, "create", "-f", "-")
	if err == nil || !strings.Contains(err.Error(), adminAccessLabel) {
		t.Fatalf("an adminAccess claim template in namespace %s without %s: %v %s; want the API server to refuse it, naming the label", podNamespace, adminAccessLabel, err, out)
	}
	t.Logf("adminAccess outside an admin namespace refused by the API server: %v", err)

	if out, err := d.n.kubectl(nil, "label", "namespace", podNamespace, adminAccessLabel+"=true"); err != nil {
		t.Fatalf("label namespace %s: %v %s", podNamespace, err, out)
	}
	t.Cleanup(func() {
		if out, err := d.n.kubectl(nil, "label", "namespace", podNamespace, adminAccessLabel+"-"); err != nil {
			t.Errorf("unlabel namespace %s: %v %s", podNamespace, err, out)
		}
	})
	admin := d.submitTemplate(t, "admin", spec)
	name := d.createClaimPod(t, "dra-admin", admin)
	defer d.deletePod(t, name)
	podOut, dRun := d.waitPodReady(t, name, 90*time.Second)
	c := d.podClaim(t, name, 30*time.Second)
	v := parsePodView(podOut)
	checkDeviceNodes(t, d.pluginCDI(t), v.devs, []string{held, free})
	if rs, err := d.reservations("-owner", c.owner()); err != nil || len(rs) != 0 {
		t.Errorf("the admin claim's reservations: %v %v, want none", rs, err)
	}
	fp, err := d.devices()
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range fp.GetGroups() {
		for _, dv := range g.GetDevices() {
			accessed := len(dv.GetAdminAccess()) == 1 && dv.GetAdminAccess()[0].GetOwnerId() == c.owner()
			if want := dv.GetId() == held || dv.GetId() == free; accessed != want || !want && len(dv.GetAdminAccess()) > 0 {
				t.Errorf("%s admin access %v, want the claim's: %v", dv.GetId(), dv.GetAdminAccess(), want)
			}
			switch dv.GetId() {
			case held:
				if dv.GetHolder().GetReservationId() != hres.GetReservationId() {
					t.Errorf("%s holder %v under admin access, want %s still", held, dv.GetHolder(), hres.GetReservationId())
				}
			case free:
				if dv.GetHolder() != nil {
					t.Errorf("%s held by %v under admin access, want it free", free, dv.GetHolder())
				}
			}
		}
	}
	table, err := d.cli("devices")
	if err != nil || !strings.Contains(string(table), "ADMIN ACCESS") || strings.Count(string(table), c.owner()) != 2 {
		t.Errorf("devicehost devices: %v\n%s\nwant an ADMIN ACCESS column naming %s on 2 GPUs", err, table, c.owner())
	}
	t.Logf("admin claim %s: pod running %v after its create, sees the device nodes %v of %s (held by %s) and %s (free); no reservation; the agent lists the access on both",
		c.Metadata.Name, dRun.Round(time.Millisecond), v.devs, held, hres.GetOwnerId(), free)

	// The free GPU under admin access is not refused to a new claim.
	one := d.createTemplate(t, "free", gpuClass, 1, `device.attributes["`+draDriver+`"].id == `+strconv.Quote(free))
	taker, tc, tres, _ := d.runClaimPod(t, "dra-admin-taker", one)
	if ids := tres.GetDeviceIds(); !slices.Equal(ids, []string{free}) {
		t.Errorf("the new claim holds %v, want %s", ids, free)
	}
	d.deleteReleased(t, taker, tc, tres)

	d.deletePod(t, name)
	testwait.Until(t, 30*time.Second, "the admin access gone after its pod", func() (bool, string) {
		fp, err := d.devices()
		if err != nil {
			return false, err.Error()
		}
		var left []string
		for _, g := range fp.GetGroups() {
			for _, dv := range g.GetDevices() {
				if len(dv.GetAdminAccess()) > 0 {
					left = append(left, fmt.Sprintf("%s %v", dv.GetId(), dv.GetAdminAccess()))
				}
			}
		}
		return len(left) == 0, strings.Join(left, "; ")
	})
}
