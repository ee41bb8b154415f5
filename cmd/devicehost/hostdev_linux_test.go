package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// The hostdev plugin in a real agent, on a scratch tree of mknod'ed nodes and a fake
// sysfs: the contract's config, `devices -json`, `reserve -json`, a node that goes and
// comes back, and a USB device re-plugged under another number keeping its holder.

// hostdevTree is a scratch /dev and /sys.
type hostdevTree struct{ dev, sys string }

func newHostdevTree(t *testing.T) hostdevTree {
	t.Helper()
	root := tempDir(t, "dhhostdev")
	tr := hostdevTree{dev: filepath.Join(root, "dev"), sys: filepath.Join(root, "sys")}
	if err := os.MkdirAll(filepath.Join(tr.sys, "bus/usb/devices"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(filepath.Join(root, "probe"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Skipf("cannot make device nodes here (mknod: %v); this test needs root", err)
	}
	return tr
}

func (tr hostdevTree) mknod(t *testing.T, rel string, major, minor uint32) {
	t.Helper()
	p := filepath.Join(tr.dev, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(major, minor))); err != nil {
		t.Fatal(err)
	}
}

// plug adds a CP210x stick of serial 0001 as sysfs device name, bus 1 number devnum,
// with the tty tty: sysfs first, then its nodes, as the kernel and udev do.
func (tr hostdevTree) plug(t *testing.T, name string, devnum int, tty string) {
	t.Helper()
	dir := filepath.Join(tr.sys, "bus/usb/devices", name)
	files := map[string]string{
		"idVendor": "10c4\n", "idProduct": "ea60\n", "serial": "0001\n",
		"uevent": fmt.Sprintf("DEVNAME=bus/usb/001/%03d\n", devnum),
		filepath.Join(name+":1.0", tty, "uevent"): "DEVNAME=" + tty + "\n",
	}
	for f, data := range files {
		p := filepath.Join(dir, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tr.mknod(t, tty, 188, uint32(devnum))
	tr.mknod(t, fmt.Sprintf("bus/usb/001/%03d", devnum), 189, uint32(devnum-1))
}

func (tr hostdevTree) unplug(t *testing.T, name string, devnum int, tty string) {
	t.Helper()
	for _, p := range []string{filepath.Join(tr.dev, fmt.Sprintf("bus/usb/001/%03d", devnum)), filepath.Join(tr.dev, tty), filepath.Join(tr.sys, "bus/usb/devices", name)} {
		if err := os.RemoveAll(p); err != nil {
			t.Fatal(err)
		}
	}
}

func TestAgentServesHostDevices(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	tr := newHostdevTree(t)
	tr.mknod(t, "fuse", 10, 229)
	tr.plug(t, "1-1", 4, "ttyUSB0")
	dir := tempDir(t, "dhhd")
	config := fmt.Sprintf(`plugin "hostdev" {
  config {
    dev_root = %q
    sys_root = %q
    device "fuse" {
      paths = ["/dev/fuse"]
      count = 8
    }
    device "kvm" {
      paths = ["/dev/kvm"]
      count = 4
    }
    device "zigbee" {
      usb {
        vendor  = "10c4"
        product = "ea60"
        serial  = "0001"
      }
    }
  }
}
`, tr.dev, tr.sys)
	path := filepath.Join(dir, "agent.hcl")
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	addr := filepath.Join(dir, "dh.sock")
	agent := startAgentProcess(t, endpoint.Address{Network: "unix", Path: addr}, "agent", "-dev", "-config", path, "-listen", "unix://"+addr, "-log-json")
	c := agent.client(t, ctx)

	// devices -json: each block a group of vendor hostdev; count devices where set;
	// a block matching nothing has none.
	var fp pb.FingerprintResponse
	if err := protojson.Unmarshal([]byte(mustRunCLI(t, "devices", "-json", "-address", "unix://"+addr)), &fp); err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"fuse": 8, "kvm": 0, "zigbee": 1}
	for _, g := range fp.GetGroups() {
		if g.GetVendor() != "hostdev" {
			continue
		}
		if n, ok := want[g.GetType()]; !ok || len(g.GetDevices()) != n {
			t.Errorf("group hostdev/%s has %d devices, want %d", g.GetType(), len(g.GetDevices()), n)
		}
		delete(want, g.GetType())
	}
	if len(want) > 0 {
		t.Errorf("devices -json lacks the hostdev groups %v", want)
	}
	agent.waitLog(t, ctx, "device block serves less than configured", func(e logEntry) bool {
		return e["device"] == "kvm" && strings.Contains(fmt.Sprint(e["why"]), "/dev/kvm: no such device node")
	})

	// reserve -json answers the node's host path.
	out := mustRunCLI(t, "reserve", "-json", "-address", "unix://"+addr, "-owner", "job-fuse", "-device", "fuse-3")
	if want := `"hostPath": "` + filepath.Join(tr.dev, "fuse") + `"`; !strings.Contains(out, want) || !strings.Contains(out, `"containerPath": "/dev/fuse"`) {
		t.Errorf("reserve -json:\n%s\nwant it to carry %s and the container path /dev/fuse", out, want)
	}
	mustRunCLI(t, "reserve", "-address", "unix://"+addr, "-owner", "job-zigbee", "-device", "zigbee-0001")

	stream, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	waitFingerprint(t, "fuse-3 and zigbee-0001 healthy", stream, func(fp *pb.FingerprintResponse) bool {
		return healthIs(fp, "fuse-3", pb.Health_HEALTH_HEALTHY) && healthIs(fp, "zigbee-0001", pb.Health_HEALTH_HEALTHY)
	})

	// The node goes: its devices turn unhealthy with the reason; it comes back.
	removed := time.Now()
	if err := os.Remove(filepath.Join(tr.dev, "fuse")); err != nil {
		t.Fatal(err)
	}
	fpGone := waitFingerprint(t, "fuse-3 unhealthy", stream, func(fp *pb.FingerprintResponse) bool {
		return healthIs(fp, "fuse-3", pb.Health_HEALTH_UNHEALTHY)
	})
	t.Logf("node removed -> its devices unhealthy at the agent's API in %v", time.Since(removed))
	if reason := deviceOf(fpGone, "fuse-3").GetHealthReason(); reason != "/dev/fuse: no such device node" {
		t.Errorf("fuse-3 reason %q, want it to name the missing node", reason)
	}
	tr.mknod(t, "fuse", 10, 229)
	waitFingerprint(t, "fuse-3 healthy again", stream, func(fp *pb.FingerprintResponse) bool {
		return healthIs(fp, "fuse-3", pb.Health_HEALTH_HEALTHY)
	})

	// The stick is re-plugged on another port: new sysfs name, bus number and tty.
	tr.unplug(t, "1-1", 4, "ttyUSB0")
	waitFingerprint(t, "zigbee-0001 unhealthy", stream, func(fp *pb.FingerprintResponse) bool {
		return healthIs(fp, "zigbee-0001", pb.Health_HEALTH_UNHEALTHY)
	})
	plugged := time.Now()
	tr.plug(t, "1-3", 7, "ttyUSB2")
	waitFingerprint(t, "zigbee-0001 healthy again", stream, func(fp *pb.FingerprintResponse) bool {
		return healthIs(fp, "zigbee-0001", pb.Health_HEALTH_HEALTHY)
	})
	t.Logf("USB device re-plugged under another number -> healthy under its ID in %v", time.Since(plugged))
	held := mustRunCLI(t, "reservations", "-address", "unix://"+addr, "-device", "zigbee-0001")
	if !strings.Contains(held, "job-zigbee") {
		t.Errorf("after the re-plug, reservations of zigbee-0001:\n%s\nwant job-zigbee still holding it", held)
	}
	// A new reservation of the device gets its new nodes.
	mustRunCLI(t, "release", "-address", "unix://"+addr, "-owner", "job-zigbee")
	out = mustRunCLI(t, "reserve", "-json", "-address", "unix://"+addr, "-owner", "job-zigbee-2", "-device", "zigbee-0001")
	for _, node := range []string{"/dev/bus/usb/001/007", "/dev/ttyUSB2"} {
		if !strings.Contains(out, `"containerPath": "`+node+`"`) {
			t.Errorf("reserve -json after the re-plug:\n%s\nwant %s", out, node)
		}
	}
}

// healthIs reports whether device id is in fp with health h.
func healthIs(fp *pb.FingerprintResponse, id string, h pb.Health) bool {
	d := deviceOf(fp, id)
	return d != nil && d.GetHealth() == h
}

// deviceOf finds device id in fp; nil when absent.
func deviceOf(fp *pb.FingerprintResponse, id string) *pb.Device {
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetId() == id {
				return d
			}
		}
	}
	return nil
}

// A typo in a hostdev block stops the agent at start with the block's file and line
// and the key the plugin knows.
func TestAgentExitsOnAHostdevConfigTypo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	path, addr := writeTypoConfig(t, `log_level = "info"

plugin "hostdev" {
  config {
    device "fuse" {
      pahts = ["/dev/fuse"]
    }
  }
}
`)
	agent := startAgentProcess(t, addr, "agent", "-dev", "-config", path, "-listen", addr.String())
	err := agent.Wait(ctx)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("agent with a hostdev config typo: %v, want exit status 1", err)
	}
	stderr := strings.Join(agent.Stderr.Lines(), "\n")
	want := path + `:3,1: Plugin config rejected; plugin "hostdev": config: json: unknown field "pahts" (did you mean "paths"?)`
	if !strings.Contains(stderr, want) {
		t.Errorf("stderr does not say %q:\n%s", want, stderr)
	}
}
