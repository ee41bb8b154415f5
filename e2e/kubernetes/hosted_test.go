package kubernetes

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// squat/generic-device-plugin, unmodified (built from the Go module proxy by build.sh),
// hosted under devicehost: it registers with the agent's kubernetes_device_plugins
// directory instead of the kubelet's, and its devices reach pods through DRA and the
// kubelet bridge, on the agent's ledger; it is killed and restarted, and the agent is
// restarted under it, while pods hold its devices.

const (
	gdpResource = "devic.es/fuse" // its default domain, and the device's name
	gdpClass    = "gdp-fuse.devicehost.io"
	gdpCount    = 4
)

// gdpDevice is the --device flag: /dev/fuse offered 4 times.
var gdpDevice = fmt.Sprintf(`{"name":"fuse","groups":[{"count":%d,"paths":[{"path":"/dev/fuse"}]}]}`, gdpCount)

// gdpDevices are the agent's devices of the plugin's resource, with their health.
func (s *stack) gdpDevices() (map[string]*pb.Device, error) {
	fp, err := s.devices()
	if err != nil {
		return nil, err
	}
	out := map[string]*pb.Device{}
	for _, g := range fp.GetGroups() {
		if g.GetVendor()+"/"+g.GetType() == gdpResource {
			for _, d := range g.GetDevices() {
				out[d.GetId()] = d
			}
		}
	}
	return out, nil
}

// waitGDP waits until the agent lists the plugin's gdpCount devices and ok accepts
// them.
func (s *stack) waitGDP(t *testing.T, what string, ok func(map[string]*pb.Device) bool) time.Duration {
	t.Helper()
	return testwait.Until(t, 60*time.Second, what, func() (bool, string) {
		devs, err := s.gdpDevices()
		if err != nil {
			return false, err.Error()
		}
		var st []string
		for id, d := range devs {
			st = append(st, fmt.Sprintf("%.8s %s %s", id, d.GetHealth(), d.GetHealthReason()))
		}
		return len(devs) == gdpCount && ok(devs), strings.Join(st, "; ")
	})
}

func allHealth(h pb.Health) func(map[string]*pb.Device) bool {
	return func(devs map[string]*pb.Device) bool {
		for _, d := range devs {
			if d.GetHealth() != h {
				return false
			}
		}
		return true
	}
}

// activeIDs are the IDs of the agent's active reservations, sorted.
func (s *stack) activeIDs(t *testing.T) []string {
	t.Helper()
	rs, err := s.reservations("-state", "active")
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, r := range rs {
		ids = append(ids, r.GetReservationId()+" "+r.GetOwnerId()+" "+strings.Join(r.GetDeviceIds(), ","))
	}
	slices.Sort(ids)
	return ids
}

func (d *draStack) caseHostedPlugin(t *testing.T) {
	if !charDevice("/dev/fuse") {
		t.Skip("/dev/fuse is not a character device on this node")
	}
	bin := d.n.vars["DEVICEHOST_E2E_GENERIC_DEVICE_PLUGIN"]
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("generic-device-plugin: %v (e2e/kubernetes/build.sh builds it)", err)
	}
	dir := filepath.Join(d.n.run, "ds", "kubelet-device-plugins")
	block := fmt.Sprintf("kubernetes_device_plugins {\n  dir = %q\n}\n\n", dir)
	d.withAgentConfig(t, configVariant(t, d.agent.c, "hosted", `plugin "nvidia-example" {`, block+`plugin "nvidia-example" {`))
	d.waitAgentHealthy(t, 60*time.Second)
	d.withBridgeResources(t, "hosted", bridgeResource{gdpResource, "devic.es", "fuse"})
	class := fmt.Sprintf(`{"apiVersion":"resource.k8s.io/v1","kind":"DeviceClass","metadata":{"name":%q},"spec":{"selectors":[{"cel":{"expression":%q}}]}}`,
		gdpClass, fmt.Sprintf(`device.driver == %q && device.attributes[%q].resource == %q`, draDriver, draDriver, gdpResource))
	if out, err := d.n.kubectl([]byte(class), "apply", "-f", "-"); err != nil {
		t.Fatalf("apply DeviceClass %s: %v %s", gdpClass, err, out)
	}
	plugin := &hostProc{name: "generic-device-plugin", bin: bin, log: filepath.Join(d.n.logs, "generic-device-plugin.log"),
		c: hostContainer{name: "generic-device-plugin", args: []string{"--plugin-directory", dir, "--listen", "127.0.0.1:18082", "--device", gdpDevice}}}
	t.Cleanup(func() { plugin.stop(t, syscall.SIGTERM) }) // after the pods are gone
	t.Cleanup(func() {
		d.releaseClaimsAndPods(t)
		if _, err := d.n.kubectl(nil, "delete", "deviceclass", gdpClass, "--ignore-not-found"); err != nil {
			t.Errorf("delete DeviceClass %s: %v", gdpClass, err)
		}
	})
	started := time.Now()
	plugin.start(t)
	dList := d.waitGDP(t, "the plugin's 4 devices healthy at the agent", allHealth(pb.Health_HEALTH_HEALTHY))
	dSlice := d.waitPool(t, 60*time.Second, "the plugin's 4 devices in the DRA pool", func(p pool) (bool, string) {
		n := 0
		for _, dv := range p.devices {
			if dv.attr("resource") == gdpResource {
				n++
			}
		}
		return n == gdpCount, p.String()
	})
	dAlloc := testwait.Until(t, 60*time.Second, "node allocatable devic.es/fuse=4 through the bridge", func() (bool, string) {
		n, err := d.allocatableOf(gdpResource)
		return err == nil && n == gdpCount, fmt.Sprintf("%d (%v)", n, err)
	})
	t.Logf("generic-device-plugin %s started: devices at the agent %v later, in the DRA pool %v later, node allocatable through the bridge %v later",
		d.n.vars["GENERIC_DEVICE_PLUGIN_VERSION"], dList.Round(time.Millisecond), (dList + dSlice).Round(time.Millisecond), (dList + dAlloc).Round(time.Millisecond))

	// The contract: reserve by ID answers the plugin's Allocate.
	devs, err := d.gdpDevices()
	if err != nil {
		t.Fatal(err)
	}
	ids := slices.Sorted(func(yield func(string) bool) {
		for id := range devs {
			if !yield(id) {
				return
			}
		}
	})
	out, err := d.cli("reserve", "-json", "-owner", "e2e-contract", "-device", ids[0])
	if err != nil || !strings.Contains(string(out), `"hostPath": "/dev/fuse"`) {
		t.Errorf("devicehost reserve of %s: %v\n%s\nwant the plugin's Allocate answer, /dev/fuse", ids[0], err, out)
	}
	var resp pb.ReserveResponse
	if err := protojson.Unmarshal(out, &resp); err != nil {
		t.Fatalf("reserve -json: %v\n%s", err, out)
	}
	if _, err := d.cli("release", "-reservation", resp.GetReservationId()); err != nil {
		t.Errorf("release %s: %v", resp.GetReservationId(), err)
	}

	// Through DRA and through the bridge: each pod opens /dev/fuse.
	draPod := d.hostdevClaimPod(t, "gdp-dra", gdpClass)
	out2, dRun := d.waitPodReady(t, draPod, 90*time.Second)
	if v := parseHostdevView(out2); v.fuse != "rw" {
		t.Errorf("DRA pod %s: FUSE=%s, want /dev/fuse opened read-write:\n%s", draPod, v.fuse, out2)
	}
	dpPod := d.hostdevPod(t, "gdp-dp", func(spec, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{gdpResource: "1"}}
	})
	out3, _ := d.waitPodReady(t, dpPod, 90*time.Second)
	if v := parseHostdevView(out3); v.fuse != "rw" {
		t.Errorf("device-plugin pod %s: FUSE=%s, want /dev/fuse opened read-write:\n%s", dpPod, v.fuse, out3)
	}
	d.waitPodReservation(t, dpPod, 60*time.Second)
	held := d.activeIDs(t)
	t.Logf("DRA pod %s running %v after its create (%v after the plugin started); device-plugin pod %s running; held: %v",
		draPod, dRun.Round(time.Millisecond), time.Since(started).Round(time.Millisecond), dpPod, held)

	// The plugin killed: its devices unhealthy, the holders kept; restarted, healthy.
	killed := time.Now()
	plugin.stop(t, syscall.SIGKILL)
	dDown := d.waitGDP(t, "the plugin's devices unhealthy", allHealth(pb.Health_HEALTH_UNHEALTHY))
	plugin.start(t)
	dBack := d.waitGDP(t, "the plugin's devices healthy again", allHealth(pb.Health_HEALTH_HEALTHY))
	if now := d.activeIDs(t); !slices.Equal(now, held) {
		t.Errorf("reservations after the plugin's restart:\n%v\nwant those before:\n%v", now, held)
	}
	d.stillRunning(t, draPod)
	d.stillRunning(t, dpPod)
	t.Logf("plugin SIGKILLed: its devices unhealthy %v later; restarted, healthy %v after its start (%v in all); holders kept",
		dDown.Round(time.Millisecond), dBack.Round(time.Millisecond), time.Since(killed).Round(time.Millisecond))

	// The agent restarted under it: the plugin registers again, nothing held is lost.
	d.agent.stop(t, syscall.SIGTERM)
	d.agent.start(t)
	dAgain := d.waitGDP(t, "the plugin's devices healthy after the agent's restart", allHealth(pb.Health_HEALTH_HEALTHY))
	if now := d.activeIDs(t); !slices.Equal(now, held) {
		t.Errorf("reservations after the agent's restart:\n%v\nwant those before:\n%v", now, held)
	}
	d.stillRunning(t, draPod)
	d.stillRunning(t, dpPod)
	t.Logf("agent restarted under the plugin: it registered again, its devices healthy %v after the agent's stop; holders kept", dAgain.Round(time.Millisecond))
}

// releaseClaimsAndPods deletes the suite's pods and waits until no reservation but the
// GPUs' of other cases is left of them (the bridge's grace, the claims' unprepare).
func (d *draStack) releaseClaimsAndPods(t *testing.T) {
	t.Helper()
	d.deleteAllPods(t)
	testwait.Until(t, d.releaseGrace+60*time.Second, "no reservation of the case left", func() (bool, string) {
		rs, err := d.reservations("-state", "active")
		if err != nil {
			return false, err.Error()
		}
		return len(rs) == 0, fmt.Sprintf("%d active: %v", len(rs), rs)
	})
}
