package hostdev

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/devicehost/devicehost/deviceplugin/deviceplugintest"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// tree is a scratch dev root and sys root, with device nodes made by mknod.
type tree struct {
	t   testing.TB
	dev string
	sys string
}

// newTree makes an empty scratch tree; it skips the test where mknod is not allowed
// (not root).
func newTree(t testing.TB) *tree {
	t.Helper()
	root := t.TempDir()
	tr := &tree{t: t, dev: filepath.Join(root, "dev"), sys: filepath.Join(root, "sys")}
	for _, d := range []string{tr.dev, filepath.Join(tr.sys, usbDevicesDir)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	probe := filepath.Join(root, "probe")
	if err := unix.Mknod(probe, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Skipf("cannot make device nodes here (mknod: %v); these tests need root", err)
	}
	return tr
}

// mknod makes character device p ("/dev/...") with the given numbers, and its
// directories.
func (tr *tree) mknod(p string, major, minor uint32) {
	tr.t.Helper()
	tr.mknodHost(hostPath(tr.dev, p), major, minor)
}

// mknodHost makes character device host (a path on disk) and its directories.
func (tr *tree) mknodHost(host string, major, minor uint32) {
	tr.t.Helper()
	if err := os.MkdirAll(filepath.Dir(host), 0o755); err != nil {
		tr.t.Fatal(err)
	}
	if err := unix.Mknod(host, unix.S_IFCHR|0o666, int(unix.Mkdev(major, minor))); err != nil {
		tr.t.Fatal(err)
	}
}

// rm removes p ("/dev/...").
func (tr *tree) rm(p string) {
	tr.t.Helper()
	if err := os.Remove(hostPath(tr.dev, p)); err != nil {
		tr.t.Fatal(err)
	}
}

// write writes a file of the tree (sysfs attributes, regular files under /dev).
func (tr *tree) write(path, data string) {
	tr.t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		tr.t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		tr.t.Fatal(err)
	}
}

// usbDevice is a USB device in the fake sysfs: name is its sysfs name ("1-1"),
// devnum its number on bus 1, tty the node its interface has ("" for none).
type usbDevice struct {
	name, vendor, product, serial string
	devnum                        int
	tty                           string
}

// plug adds d to sysfs and its nodes to /dev, as the kernel and udev would: the
// sysfs entries first, then the nodes.
func (tr *tree) plug(d usbDevice) {
	tr.t.Helper()
	dir := filepath.Join(tr.sys, usbDevicesDir, d.name)
	tr.write(filepath.Join(dir, "idVendor"), d.vendor+"\n")
	tr.write(filepath.Join(dir, "idProduct"), d.product+"\n")
	if d.serial != "" {
		tr.write(filepath.Join(dir, "serial"), d.serial+"\n")
	}
	busNode := fmt.Sprintf("bus/usb/001/%03d", d.devnum)
	tr.write(filepath.Join(dir, "uevent"), fmt.Sprintf("MAJOR=189\nMINOR=%d\nDEVNAME=%s\nDEVTYPE=usb_device\n", d.devnum-1, busNode))
	if d.tty != "" {
		tr.write(filepath.Join(dir, d.name+":1.0", d.tty, "uevent"), "MAJOR=188\nMINOR=0\nDEVNAME="+d.tty+"\n")
		tr.mknod("/dev/"+d.tty, 188, uint32(d.devnum))
	}
	tr.mknod("/dev/"+busNode, 189, uint32(d.devnum-1))
}

// unplug removes d's nodes and its sysfs entries.
func (tr *tree) unplug(d usbDevice) {
	tr.t.Helper()
	tr.rm(fmt.Sprintf("/dev/bus/usb/001/%03d", d.devnum))
	if d.tty != "" {
		tr.rm("/dev/" + d.tty)
	}
	if err := os.RemoveAll(filepath.Join(tr.sys, usbDevicesDir, d.name)); err != nil {
		tr.t.Fatal(err)
	}
}

// config is a config JSON for the tree with the given device blocks.
func (tr *tree) config(devices map[string]DeviceConfig) []byte {
	tr.t.Helper()
	none := ""
	data, err := json.Marshal(Config{Devices: devices, DevRoot: tr.dev, SysRoot: tr.sys, CDISpecDir: &none})
	if err != nil {
		tr.t.Fatal(err)
	}
	return data
}

// started is a configured plugin with a Fingerprint stream running.
type started struct {
	p *Plugin
	*deviceplugintest.Inventories
}

// start configures a plugin and runs its Fingerprint stream until the test ends.
func start(t testing.TB, configJSON []byte) *started {
	t.Helper()
	p := New(nil)
	if err := p.SetConfig(context.Background(), configJSON); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	return &started{p: p, Inventories: deviceplugintest.WatchFingerprint(t, p)}
}

// device finds device id in r; nil when absent.
func device(r *pb.FingerprintResponse, id string) *pb.Device {
	for _, g := range r.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetId() == id {
				return d
			}
		}
	}
	return nil
}

// group finds the group of type typ in r; nil when absent.
func group(r *pb.FingerprintResponse, typ string) *pb.DeviceGroup {
	for _, g := range r.GetGroups() {
		if g.GetType() == typ {
			return g
		}
	}
	return nil
}

// ids lists a group's device IDs, in order.
func ids(g *pb.DeviceGroup) []string {
	var out []string
	for _, d := range g.GetDevices() {
		out = append(out, d.GetId())
	}
	return out
}

func healthy(d *pb.Device) bool { return d != nil && d.GetHealth() == pb.Health_HEALTH_HEALTHY }

// note is what the plugin last logged for block typ.
func (p *Plugin) note(typ string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.notes[typ]
}
