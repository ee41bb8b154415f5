package kubernetes

import (
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// The node's real /dev/fuse and /dev/net/tun through the hostdev plugin, beside the
// simulated GPUs on one ledger: to pods through a DRA claim and through the kubelet
// bridge's resources, count honoured across both.

// hostdevAgentBlock is the agent's hostdev plugin block in the case (the chart's
// hostdev.devices, with tun offered twice), its CDI spec where the container's
// /var/run/cdi is (the node's CDI directory; mapConfig maps it).
const hostdevAgentBlock = `plugin "hostdev" {
  config {
    cdi_spec_dir = "/var/run/cdi"
    device "fuse" {
      paths = ["/dev/fuse"]
      count = 8
    }
    device "tun" {
      paths = ["/dev/net/tun"]
      count = 2
    }
  }
}

`

const (
	fuseResource = "devicehost.io/fuse"
	tunResource  = "devicehost.io/tun"
	fuseClass    = "fuse.devicehost.io"
	tunClass     = "tun.devicehost.io"
)

// hostdevScript is what the case's pods run: does the container lack /dev/fuse
// (FUSE=absent), is it a character device it can open for reading and writing
// (FUSE=rw), or not (FUSE=not-a-device, FUSE=denied: the device cgroup refuses it); can
// it make a TUN interface (TUN=<name>, or TUN_FAILED=<why>, by the static tuntap
// mounted at /opt/tuntap); then READY. (The shell's <> creates a missing file: the node
// is tested first.)
const hostdevScript = `if [ ! -e /dev/fuse ]; then echo FUSE=absent; elif [ ! -c /dev/fuse ]; then echo FUSE=not-a-device; ` +
	`elif (exec 3<>/dev/fuse) 2>/dev/null; then echo FUSE=rw; else echo FUSE=denied; fi; ` +
	`/opt/tuntap/tuntap; echo READY; trap 'exit 0' TERM; sleep 86400 & wait`

// hostdevPod creates a pod running hostdevScript with NET_ADMIN (a TUN interface needs
// it, and the device); shape adds what it asks for.
func (s *stack) hostdevPod(t *testing.T, prefix string, shape func(spec, container map[string]any)) string {
	t.Helper()
	return s.submitPod(t, prefix, func(spec, container map[string]any) {
		container["command"] = []string{"/bin/sh", "-c", hostdevScript}
		container["securityContext"] = map[string]any{"capabilities": map[string]any{"add": []string{"NET_ADMIN"}}}
		container["volumeMounts"] = []any{map[string]any{"name": "tuntap", "mountPath": "/opt/tuntap", "readOnly": true}}
		spec["volumes"] = []any{map[string]any{"name": "tuntap", "hostPath": map[string]any{"path": filepath.Dir(s.n.tuntap), "type": "Directory"}}}
		shape(spec, container)
	})
}

// hostdevView is what a hostdevScript pod printed.
type hostdevView struct{ fuse, tun string }

func parseHostdevView(out string) hostdevView {
	var v hostdevView
	for _, l := range strings.Split(out, "\n") {
		if f, ok := strings.CutPrefix(l, "FUSE="); ok {
			v.fuse = f
		}
		if n, ok := strings.CutPrefix(l, "TUN="); ok {
			v.tun = n
		}
		if e, ok := strings.CutPrefix(l, "TUN_FAILED="); ok {
			v.tun = "failed: " + e
		}
	}
	return v
}

// charDevice says whether path is a character device on this node.
func charDevice(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode()&fs.ModeCharDevice != 0
}

// hostdevIDs are the IDs of the reservations' devices of type typ (by the ID's prefix).
func hostdevIDs(rs []*pb.Reservation, typ string) []string {
	var ids []string
	for _, r := range rs {
		for _, id := range r.GetDeviceIds() {
			if strings.HasPrefix(id, typ+"-") {
				ids = append(ids, id)
			}
		}
	}
	slices.Sort(ids)
	return ids
}

func (d *draStack) caseHostDev(t *testing.T) {
	for _, p := range []string{"/dev/fuse", "/dev/net/tun"} {
		if !charDevice(p) {
			t.Skipf("%s is not a character device on this node", p)
		}
	}
	start := time.Now()
	block := d.agent.c.mapConfig(hostdevAgentBlock)
	d.withAgentConfig(t, configVariant(t, d.agent.c, "hostdev", `plugin "nvidia-example" {`, block+`plugin "nvidia-example" {`))
	d.withHostdevResources(t)
	d.applyHostdevClasses(t)
	t.Cleanup(func() { d.releaseHostdevPods(t) }) // before the agent goes back to GPUs alone
	testwait.Until(t, 60*time.Second, "8 fuse and 2 tun devices healthy at the agent", func() (bool, string) {
		fp, err := d.devices()
		if err != nil {
			return false, err.Error()
		}
		n := map[string]int{}
		for _, g := range fp.GetGroups() {
			for _, dv := range g.GetDevices() {
				if g.GetVendor() == "hostdev" && dv.GetHealth() == pb.Health_HEALTH_HEALTHY {
					n[g.GetType()]++
				}
			}
		}
		return n["fuse"] == 8 && n["tun"] == 2, fmt.Sprint(n)
	})
	dPool := d.waitPool(t, 60*time.Second, "one fuse device of 8 holders and one tun device of 2 in the pool", func(p pool) (bool, string) {
		return holdersDevice(p, "fuse") == "8" && holdersDevice(p, "tun") == "2", p.String()
	})
	testwait.Until(t, 60*time.Second, "node allocatable devicehost.io/fuse=8, tun=2", func() (bool, string) {
		f, err1 := d.allocatableOf(fuseResource)
		n, err2 := d.allocatableOf(tunResource)
		return err1 == nil && err2 == nil && f == 8 && n == 2, fmt.Sprintf("fuse %d, tun %d (%v %v)", f, n, err1, err2)
	})
	t.Logf("hostdev served: DRA pool and node allocatable %v after the agent's restart (pool %v)", time.Since(start).Round(time.Millisecond), dPool.Round(time.Millisecond))

	// Through DRA: a claim of each class; the container opens /dev/fuse and makes a TUN
	// interface; the ledger names the claims.
	draPod := d.hostdevClaimPod(t, "hostdev-dra", fuseClass, tunClass)
	out, dRun := d.waitPodReady(t, draPod, 90*time.Second)
	v := parseHostdevView(out)
	draRes := d.waitClaimsHolding(t, draPod, map[string]int{"fuse": 1, "tun": 1})
	t.Logf("DRA pod %s running %v after its create: FUSE=%s TUN=%s; reservations hold %v %v", draPod, dRun.Round(time.Millisecond),
		v.fuse, v.tun, hostdevIDs(draRes, "fuse"), hostdevIDs(draRes, "tun"))
	if v.fuse != "rw" || !strings.HasPrefix(v.tun, "dhtun") {
		t.Errorf("DRA pod %s: FUSE=%s TUN=%s, want /dev/fuse opened read-write and a TUN interface made:\n%s", draPod, v.fuse, v.tun, out)
	}

	// The tun device's second holder goes to a second claim; a third waits until one
	// of them is gone (consumable capacity: the scheduler counts the holders).
	second := d.hostdevClaimPod(t, "hostdev-dra-tun2", tunClass)
	d.waitPodReady(t, second, 90*time.Second)
	d.waitClaimsHolding(t, second, map[string]int{"tun": 1})
	third := d.hostdevClaimPod(t, "hostdev-dra-tun3", tunClass)
	msg, _ := d.waitUnschedulable(t, third, 60*time.Second)
	d.deletePod(t, second)
	out, dFreed := d.waitPodReady(t, third, 90*time.Second)
	if v := parseHostdevView(out); !strings.HasPrefix(v.tun, "dhtun") {
		t.Errorf("third tun claim pod %s: TUN=%s once a holder was free", third, v.tun)
	}
	t.Logf("tun's 2 holders through DRA: a third claim pod unschedulable (%s), running %v after the second was deleted", msg, dFreed.Round(time.Millisecond))
	d.deletePod(t, third)

	// A pod without them: the nodes are absent, the TUN interface cannot be made.
	bare := d.hostdevPod(t, "hostdev-none", func(map[string]any, map[string]any) {})
	out, _ = d.waitPodReady(t, bare, 90*time.Second)
	if v := parseHostdevView(out); v.fuse != "absent" || !strings.HasPrefix(v.tun, "failed: open /dev/net/tun") {
		t.Errorf("pod %s without devices: FUSE=%s TUN=%s, want both absent:\n%s", bare, v.fuse, v.tun, out)
	}
	d.deletePod(t, bare)

	// Through the kubelet bridge: devicehost.io/fuse and devicehost.io/tun in limits.
	dpPod := d.hostdevPod(t, "hostdev-dp", func(spec, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{fuseResource: "1", tunResource: "1"}}
	})
	out, dRun = d.waitPodReady(t, dpPod, 90*time.Second)
	// One reservation per resource the container asks for.
	var dpRes []*pb.Reservation
	testwait.Until(t, 60*time.Second, "the device-plugin pod's fuse and tun reserved", func() (bool, string) {
		rs, err := d.reservations("-owner", podOwner(dpPod), "-state", "active")
		dpRes = rs
		return err == nil && len(hostdevIDs(rs, "fuse")) == 1 && len(hostdevIDs(rs, "tun")) == 1, fmt.Sprintf("%v %v", rs, err)
	})
	v = parseHostdevView(out)
	dpIDs := append(hostdevIDs(dpRes, "fuse"), hostdevIDs(dpRes, "tun")...)
	t.Logf("device-plugin pod %s running %v after its create: FUSE=%s TUN=%s; its reservations hold %v", dpPod, dRun.Round(time.Millisecond),
		v.fuse, v.tun, dpIDs)
	if v.fuse != "rw" || !strings.HasPrefix(v.tun, "dhtun") {
		t.Errorf("device-plugin pod %s: FUSE=%s TUN=%s, want /dev/fuse opened read-write and a TUN interface made:\n%s", dpPod, v.fuse, v.tun, out)
	}
	if shared := intersect(dpIDs, append(hostdevIDs(draRes, "fuse"), hostdevIDs(draRes, "tun")...)); len(shared) > 0 {
		t.Errorf("the device-plugin pod and the DRA pod share %v", shared)
	}

	// count: both tun copies are held, through one path each; a third pod waits.
	third = d.hostdevPod(t, "hostdev-third-tun", func(spec, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{tunResource: "1"}}
	})
	msg, dVerdict := d.waitUnschedulable(t, third, 60*time.Second)
	if !strings.Contains(msg, "Insufficient "+tunResource) {
		t.Errorf("third tun pod %s: %q, want Insufficient %s", third, msg, tunResource)
	}
	// And the ninth of 8 fuse: 2 held, 6 more in one pod, then one more waits.
	six := d.hostdevPod(t, "hostdev-six-fuse", func(spec, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{fuseResource: "6"}}
	})
	d.waitPodReady(t, six, 90*time.Second)
	ninth := d.hostdevPod(t, "hostdev-ninth-fuse", func(spec, container map[string]any) {
		container["resources"] = map[string]any{"limits": map[string]any{fuseResource: "1"}}
	})
	msg9, _ := d.waitUnschedulable(t, ninth, 60*time.Second)
	if !strings.Contains(msg9, "Insufficient "+fuseResource) {
		t.Errorf("ninth fuse pod %s: %q, want Insufficient %s", ninth, msg9, fuseResource)
	}
	t.Logf("count honoured: third tun pod unschedulable %v after its create (%s); ninth fuse pod: %s", dVerdict.Round(time.Millisecond), msg, msg9)
	// A holder goes: the waiting pod runs on the copy it frees.
	d.deletePod(t, six)
	out, dFreed = d.waitPodReady(t, ninth, 2*time.Minute)
	if v := parseHostdevView(out); v.fuse != "rw" {
		t.Errorf("ninth fuse pod %s: FUSE=%s once a copy was free, want rw", ninth, v.fuse)
	}
	t.Logf("the ninth fuse pod ran %v after the pod of 6 was deleted", dFreed.Round(time.Millisecond))
}

// holdersDevice is the holders capacity of the pool's one device of type typ, if it
// is one consumable device (allowMultipleAllocations); "" otherwise.
func holdersDevice(p pool, typ string) string {
	devs := p.ofType(typ)
	if len(devs) != 1 || devs[0].AllowMultipleAllocations == nil || !*devs[0].AllowMultipleAllocations {
		return ""
	}
	return devs[0].Capacity["holders"].Value
}

// hostdevClaimPod creates a hostdevScript pod with one claim of each class, each made
// from a template of one device.
func (d *draStack) hostdevClaimPod(t *testing.T, prefix string, classes ...string) string {
	t.Helper()
	var claims, uses []any
	for _, class := range classes {
		typ, _, _ := strings.Cut(class, ".")
		tmpl := d.createTemplate(t, typ, class, 1, "")
		claims = append(claims, map[string]any{"name": typ, "resourceClaimTemplateName": tmpl})
		uses = append(uses, map[string]any{"name": typ})
	}
	return d.hostdevPod(t, prefix, func(spec, container map[string]any) {
		spec["resourceClaims"] = claims
		container["resources"] = map[string]any{"claims": uses}
	})
}

// waitClaimsHolding waits until the pod's claims (named after it) hold, at the agent,
// as many hostdev devices of each type as want says, and returns their reservations.
func (d *draStack) waitClaimsHolding(t *testing.T, podName string, want map[string]int) []*pb.Reservation {
	t.Helper()
	var held []*pb.Reservation
	testwait.Until(t, 30*time.Second, fmt.Sprintf("pod %s's claims holding %v", podName, want), func() (bool, string) {
		rs, err := d.reservations("-owner", claimOwner, "-state", "active")
		if err != nil {
			return false, err.Error()
		}
		// The pod's claims are named after it: <pod>-<claim>-<suffix>.
		held = slices.DeleteFunc(rs, func(r *pb.Reservation) bool {
			return !strings.HasPrefix(r.GetOwnerId(), claimOwner+podNamespace+"/"+podName+"-")
		})
		for typ, n := range want {
			if len(hostdevIDs(held, typ)) != n {
				return false, fmt.Sprint(held)
			}
		}
		return true, ""
	})
	return held
}

// withHostdevResources restarts the bridge with resource blocks for the hostdev types
// (as the chart's hostdev.enabled adds them), and its own config back when t ends.
func (d *draStack) withHostdevResources(t *testing.T) {
	t.Helper()
	d.withBridgeResources(t, "hostdev", bridgeResource{fuseResource, "hostdev", "fuse"}, bridgeResource{tunResource, "hostdev", "tun"})
}

// bridgeResource is a resource block of the bridge's config.
type bridgeResource struct{ name, vendor, typ string }

// withBridgeResources restarts the bridge with a copy of its config that also has the
// resource blocks rs (its file named with suffix), and its own config back, with the 8 GPUs allocatable, when t ends.
func (d *draStack) withBridgeResources(t *testing.T, suffix string, rs ...bridgeResource) {
	t.Helper()
	plain := d.bridge.c
	const anchor = "kubernetes {"
	block := anchor
	for _, r := range rs {
		block += fmt.Sprintf("\n  resource %q {\n    vendor = %q\n    type   = %q\n  }\n", r.name, r.vendor, r.typ)
	}
	c := configVariant(t, plain, suffix, anchor, block)
	restart := func(c hostContainer) {
		d.bridge.stop(t, syscall.SIGTERM)
		d.bridge.c = c
		d.bridge.start(t)
	}
	restart(c)
	t.Cleanup(func() {
		restart(plain)
		d.waitAllocatable(t, 8, 60*time.Second)
	})
}

// applyHostdevClasses applies the chart's DeviceClasses of its hostdev types (helm
// template with hostdev.enabled), and deletes them when t ends.
func (d *draStack) applyHostdevClasses(t *testing.T) {
	t.Helper()
	helm := os.Getenv("DEVICEHOST_E2E_HELM")
	if helm == "" {
		t.Fatal("DEVICEHOST_E2E_HELM is unset: run e2e/kubernetes/run.sh, which builds helm")
	}
	out, err := exec.Command(helm, "template", "devicehost", filepath.Join(d.n.root, "deploy", "helm", "devicehost"),
		"--set", "mode=dra", "--set", "hostdev.enabled=true", "--show-only", "templates/deviceclasses.yaml").Output()
	if err != nil {
		t.Fatalf("helm template: %v", err)
	}
	var classes []byte
	for _, doc := range strings.Split(string(out), "\n---") {
		if strings.Contains(doc, fuseClass) || strings.Contains(doc, tunClass) {
			classes = append(classes, []byte(doc+"\n---\n")...)
		}
	}
	if applied, err := d.n.kubectl(classes, "apply", "-f", "-"); err != nil {
		t.Fatalf("apply the hostdev DeviceClasses: %v\n%s", err, classes)
	} else {
		t.Logf("%s", strings.TrimSpace(string(applied)))
	}
	t.Cleanup(func() {
		if _, err := d.n.kubectl(nil, "delete", "deviceclass", fuseClass, tunClass, "--ignore-not-found"); err != nil {
			t.Errorf("delete the hostdev DeviceClasses: %v", err)
		}
	})
}

// releaseHostdevPods deletes the case's pods and waits until no reservation of a
// hostdev device is left (the bridge's release grace, the claims' unprepare).
func (d *draStack) releaseHostdevPods(t *testing.T) {
	t.Helper()
	d.deleteAllPods(t)
	testwait.Until(t, d.releaseGrace+60*time.Second, "no hostdev device held", func() (bool, string) {
		rs, err := d.reservations("-state", "active")
		if err != nil {
			return false, err.Error()
		}
		held := append(hostdevIDs(rs, "fuse"), hostdevIDs(rs, "tun")...)
		return len(held) == 0, fmt.Sprintf("held: %v", held)
	})
}
