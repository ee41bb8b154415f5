package hostdev

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/deviceplugin/deviceplugintest"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

func TestConfigRejectsMistakesByName(t *testing.T) {
	tests := []struct {
		name   string
		config string
		want   []string // each in the error
	}{
		{"unknown key with a hint", `{"device":{"fuse":{"pahts":["/dev/fuse"]}}}`, []string{`unknown field "pahts"`, `did you mean "paths"?`}},
		{"unknown top key", `{"devices":{}}`, []string{`unknown field "devices"`, `did you mean "device"?`}},
		{"no paths nor usb", `{"device":{"fuse":{}}}`, []string{`device "fuse": give paths or a usb block`}},
		{"both", `{"device":{"x":{"paths":["/dev/x"],"usb":{"vendor":"10c4","product":"ea60"}}}}`, []string{"not both"}},
		{"relative path", `{"device":{"fuse":{"paths":["fuse"]}}}`, []string{`paths[0] = "fuse": want an absolute path under /dev`}},
		{"outside /dev", `{"device":{"pw":{"paths":["/etc/passwd"]}}}`, []string{`paths[0] = "/etc/passwd": want a path under /dev`}},
		{"unclean", `{"device":{"x":{"paths":["/dev/../etc/passwd"]}}}`, []string{"not a clean path"}},
		{"glob in a directory", `{"device":{"x":{"paths":["/dev/*/tun"]}}}`, []string{"a glob may only be in the last element"}},
		{"glob beside a path", `{"device":{"x":{"paths":["/dev/a","/dev/tty*"]}}}`, []string{"a glob must be the block's only path"}},
		{"bad glob", `{"device":{"x":{"paths":["/dev/tty["]}}}`, []string{"bad glob"}},
		{"bad name", `{"device":{"Fuse_1":{"paths":["/dev/fuse"]}}}`, []string{`device "Fuse_1": the name must be`}},
		{"count", `{"device":{"fuse":{"paths":["/dev/fuse"],"count":100000}}}`, []string{"count = 100000: want 1 to 1024"}},
		{"permissions", `{"device":{"fuse":{"paths":["/dev/fuse"],"permissions":"rwx"}}}`, []string{`permissions = "rwx"`}},
		{"usb ids", `{"device":{"z":{"usb":{"vendor":"10C4","product":"xyz"}}}}`, []string{`vendor = "10C4"`, `product = "xyz"`}},
		{"usb serial", `{"device":{"z":{"usb":{"vendor":"10c4","product":"ea60","serial":"a\u0007b"}}}}`, []string{`serial = "a\ab"`}},
		{"dev root", `{"dev_root":"dev","device":{}}`, []string{`dev_root = "dev": want an absolute path`}},
		{"trailing", `{} {}`, []string{"trailing data"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := New(nil)
			err := p.SetConfig(context.Background(), []byte(tt.config))
			if err == nil {
				t.Fatalf("SetConfig(%s) accepted it", tt.config)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("SetConfig(%s) = %v\nwant it to say %q", tt.config, err, w)
				}
			}
			if cerr := p.CheckConfig(context.Background(), []byte(tt.config)); cerr == nil || cerr.Error() != err.Error() {
				t.Errorf("CheckConfig = %v, want SetConfig's %v", cerr, err)
			}
		})
	}
}

func TestCountsGlobsAndGroups(t *testing.T) {
	tr := newTree(t)
	tr.mknod("/dev/fuse", 10, 229)
	tr.mknod("/dev/net/tun", 10, 200)
	for i := range 3 {
		tr.mknod(fmt.Sprintf("/dev/ttyUSB%d", i), 188, uint32(i))
	}
	tr.mknod("/dev/snd/pcmC0D0p", 116, 16)
	tr.mknod("/dev/snd/controlC0", 116, 0)
	s := start(t, tr.config(map[string]DeviceConfig{
		"fuse":   {Paths: []string{"/dev/fuse"}, Count: 8},
		"tun":    {Paths: []string{"/dev/net/tun"}, Count: 2},
		"serial": {Paths: []string{"/dev/ttyUSB*"}},
		"audio":  {Paths: []string{"/dev/snd/pcmC0D0p", "/dev/snd/controlC0"}},
		"kvm":    {Paths: []string{"/dev/kvm"}, Count: 4}, // absent here
	}))
	r := s.WaitFor(t, "the first inventory", func(*pb.FingerprintResponse) bool { return true })
	if err := validate.Fingerprint(r); err != nil {
		t.Fatalf("the host would refuse the inventory: %v", err)
	}
	want := map[string][]string{
		"fuse":   {"fuse-0", "fuse-1", "fuse-2", "fuse-3", "fuse-4", "fuse-5", "fuse-6", "fuse-7"},
		"tun":    {"tun-0", "tun-1"},
		"serial": {"serial-ttyUSB0", "serial-ttyUSB1", "serial-ttyUSB2"},
		"audio":  {"audio"},
		"kvm":    nil,
	}
	for typ, wantIDs := range want {
		g := group(r, typ)
		if g == nil {
			t.Errorf("no group of type %s:\n%s", typ, deviceplugintest.Describe(r))
			continue
		}
		if g.GetVendor() != Vendor {
			t.Errorf("group %s: vendor %q, want %q", typ, g.GetVendor(), Vendor)
		}
		if got := ids(g); !slices.Equal(got, wantIDs) {
			t.Errorf("group %s: devices %q, want %q", typ, got, wantIDs)
		}
		for _, d := range g.GetDevices() {
			if !healthy(d) {
				t.Errorf("device %s: %s (%s), want healthy", d.GetId(), d.GetHealth(), d.GetHealthReason())
			}
		}
	}

	// The copies of a device are its holders: a counter set of count, one each.
	sets := map[string]map[string]int64{}
	for _, cs := range r.GetCounterSets() {
		sets[cs.GetName()] = cs.GetCounters()
	}
	if want := map[string]map[string]int64{"fuse": {HoldersCounter: 8}, "tun": {HoldersCounter: 2}}; !reflect.DeepEqual(sets, want) {
		t.Errorf("counter sets %v, want %v (none for devices offered once)", sets, want)
	}
	if c := device(r, "fuse-3").GetConsumes(); len(c) != 1 || c[0].GetCounterSet() != "fuse" || c[0].GetCounters()[HoldersCounter] != 1 {
		t.Errorf("fuse-3 consumes %v, want one holder of fuse", c)
	}
	res, err := s.p.Reserve(context.Background(), []string{"fuse-3", "fuse-5", "audio"})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	wantNodes := []string{
		hostPath(tr.dev, "/dev/fuse") + " -> /dev/fuse rw",
		hostPath(tr.dev, "/dev/snd/pcmC0D0p") + " -> /dev/snd/pcmC0D0p rw",
		hostPath(tr.dev, "/dev/snd/controlC0") + " -> /dev/snd/controlC0 rw",
	}
	if got := specs(res); !slices.Equal(got, wantNodes) {
		t.Errorf("Reserve answered nodes\n%q\nwant (each node once)\n%q", got, wantNodes)
	}
	if _, err := s.p.Reserve(context.Background(), []string{"fuse-8"}); status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "fuse-8") {
		t.Errorf("Reserve(fuse-8) = %v, want NOT_FOUND naming it", err)
	}
}

// specs prints a reservation's device nodes, "host -> container perms".
func specs(r *pb.ContainerReservation) []string {
	var out []string
	for _, d := range r.GetDevices() {
		out = append(out, d.GetHostPath()+" -> "+d.GetContainerPath()+" "+d.GetPermissions())
	}
	return out
}

func TestRemovedNodeIsUnhealthyWithItsReasonAndComesBack(t *testing.T) {
	tr := newTree(t)
	tr.mknod("/dev/fuse", 10, 229)
	s := start(t, tr.config(map[string]DeviceConfig{"fuse": {Paths: []string{"/dev/fuse"}, Count: 2}}))
	s.WaitFor(t, "fuse-0 healthy", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "fuse-0")) })

	tr.rm("/dev/fuse")
	r := s.WaitFor(t, "fuse-0 unhealthy", func(r *pb.FingerprintResponse) bool {
		d := device(r, "fuse-0")
		return d != nil && d.GetHealth() == pb.Health_HEALTH_UNHEALTHY
	})
	for _, id := range []string{"fuse-0", "fuse-1"} {
		if reason := device(r, id).GetHealthReason(); reason != "/dev/fuse: no such device node" {
			t.Errorf("%s: reason %q, want it to name /dev/fuse and say it is missing", id, reason)
		}
	}
	if _, err := s.p.Reserve(context.Background(), []string{"fuse-0"}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("Reserve of a gone device = %v, want FAILED_PRECONDITION", err)
	}

	tr.mknod("/dev/fuse", 10, 229)
	s.WaitFor(t, "fuse-0 and fuse-1 healthy again", func(r *pb.FingerprintResponse) bool {
		return healthy(device(r, "fuse-0")) && healthy(device(r, "fuse-1"))
	})
	if _, err := s.p.Reserve(context.Background(), []string{"fuse-0"}); err != nil {
		t.Errorf("Reserve after the node came back: %v", err)
	}
}

func TestNodeAppearingLaterIsServed(t *testing.T) {
	tr := newTree(t)
	s := start(t, tr.config(map[string]DeviceConfig{"tun": {Paths: []string{"/dev/net/tun"}}}))
	r := s.WaitFor(t, "the first inventory", func(*pb.FingerprintResponse) bool { return true })
	if g := group(r, "tun"); g == nil || len(g.GetDevices()) != 0 {
		t.Fatalf("before /dev/net exists: %s, want an empty tun group", deviceplugintest.Describe(r))
	}
	// /dev/net does not exist yet: its parent is watched, then /dev/net itself.
	tr.mknod("/dev/net/tun", 10, 200)
	s.WaitFor(t, "tun healthy", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "tun")) })
}

func TestUSBDeviceRenumberedKeepsItsID(t *testing.T) {
	tr := newTree(t)
	stick := usbDevice{name: "1-1", vendor: "10c4", product: "ea60", serial: "0001", devnum: 4, tty: "ttyUSB0"}
	other := usbDevice{name: "1-2", vendor: "10c4", product: "ea60", serial: "0002", devnum: 5, tty: "ttyUSB1"}
	tr.plug(stick)
	tr.plug(other)
	tr.plug(usbDevice{name: "1-3", vendor: "046d", product: "c52b", devnum: 6}) // another product
	s := start(t, tr.config(map[string]DeviceConfig{
		"zigbee": {USB: &USBConfig{Vendor: "10c4", Product: "ea60", Serial: "0001"}},
		"cp210x": {USB: &USBConfig{Vendor: "10c4", Product: "ea60"}},
	}))
	r := s.WaitFor(t, "the zigbee stick", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "zigbee-0001")) })
	if got := ids(group(r, "zigbee")); !slices.Equal(got, []string{"zigbee-0001"}) {
		t.Errorf("zigbee devices %q, want only the stick of serial 0001", got)
	}
	if got := ids(group(r, "cp210x")); !slices.Equal(got, []string{"cp210x-0001", "cp210x-0002"}) {
		t.Errorf("cp210x devices %q, want both sticks by serial", got)
	}
	res, err := s.p.Reserve(context.Background(), []string{"zigbee-0001"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		hostPath(tr.dev, "/dev/bus/usb/001/004") + " -> /dev/bus/usb/001/004 rw",
		hostPath(tr.dev, "/dev/ttyUSB0") + " -> /dev/ttyUSB0 rw",
	}
	if got := specs(res); !slices.Equal(got, want) {
		t.Errorf("Reserve: %q, want %q", got, want)
	}

	tr.unplug(stick)
	// Its node may go before its sysfs entry: the first reason may be the node's.
	s.WaitFor(t, "the stick unhealthy as unplugged", func(r *pb.FingerprintResponse) bool {
		d := device(r, "zigbee-0001")
		return d != nil && !healthy(d) && strings.Contains(d.GetHealthReason(), "USB device 10c4:ea60 (zigbee-0001) is unplugged")
	})
	// Plugged in again on another port: another sysfs name, bus number and tty.
	stick.name, stick.devnum, stick.tty = "1-4", 9, "ttyUSB3"
	tr.plug(stick)
	s.WaitFor(t, "the stick back under its ID", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "zigbee-0001")) })
	res, err = s.p.Reserve(context.Background(), []string{"zigbee-0001"})
	if err != nil {
		t.Fatal(err)
	}
	want = []string{
		hostPath(tr.dev, "/dev/bus/usb/001/009") + " -> /dev/bus/usb/001/009 rw",
		hostPath(tr.dev, "/dev/ttyUSB3") + " -> /dev/ttyUSB3 rw",
	}
	if got := specs(res); !slices.Equal(got, want) {
		t.Errorf("Reserve after the re-plug: %q, want the new nodes %q", got, want)
	}
}

func TestHostileTrees(t *testing.T) {
	t.Run("glob over the bound", func(t *testing.T) {
		tr := newTree(t)
		for i := range MaxMatches/4 + 10 {
			tr.mknod(fmt.Sprintf("/dev/loop%04d", i), 7, uint32(i))
		}
		s := start(t, tr.config(map[string]DeviceConfig{"loop": {Paths: []string{"/dev/loop*"}, Count: 4}}))
		r := s.WaitFor(t, "the first inventory", func(*pb.FingerprintResponse) bool { return true })
		if n := len(group(r, "loop").GetDevices()); n != MaxMatches {
			t.Errorf("%d devices, want the bound %d", n, MaxMatches)
		}
		if err := validate.Fingerprint(r); err != nil {
			t.Errorf("the host would refuse the inventory: %v", err)
		}
		if note := s.p.note("loop"); !strings.Contains(note, fmt.Sprintf("matched %d nodes; serving the first %d", MaxMatches/4+10, MaxMatches/4)) {
			t.Errorf("note %q, want it to say how many matched and how many are served", note)
		}
	})
	t.Run("symlink loop and escape", func(t *testing.T) {
		tr := newTree(t)
		mustSymlink(t, "ttyB", hostPath(tr.dev, "/dev/ttyA"))
		mustSymlink(t, "ttyA", hostPath(tr.dev, "/dev/ttyB"))
		mustSymlink(t, "/etc/passwd", hostPath(tr.dev, "/dev/ttyC"))
		tr.mknod("/dev/ttyD", 4, 64)
		s := start(t, tr.config(map[string]DeviceConfig{"tty": {Paths: []string{"/dev/tty*"}}}))
		r := s.WaitFor(t, "the first inventory", func(*pb.FingerprintResponse) bool { return true })
		if got := ids(group(r, "tty")); !slices.Equal(got, []string{"tty-ttyD"}) {
			t.Errorf("devices %q, want only the real node ttyD", got)
		}
		note := s.p.note("tty")
		for _, w := range []string{"/dev/ttyA: symlink loop", "/dev/ttyC: resolves to /etc/passwd, outside"} {
			if !strings.Contains(note, w) {
				t.Errorf("note %q, want it to say %q", note, w)
			}
		}
	})
	t.Run("unprintable serial", func(t *testing.T) {
		tr := newTree(t)
		tr.plug(usbDevice{name: "1-1", vendor: "10c4", product: "ea60", serial: "ab\x1b[2Jcd", devnum: 4})
		s := start(t, tr.config(map[string]DeviceConfig{"z": {USB: &USBConfig{Vendor: "10c4", Product: "ea60"}}}))
		r := s.WaitFor(t, "the first inventory", func(*pb.FingerprintResponse) bool { return true })
		if n := len(group(r, "z").GetDevices()); n != 0 {
			t.Errorf("%d devices, want the device of the bad serial refused", n)
		}
		if note := s.p.note("z"); !strings.Contains(note, `serial "ab\x1b[2Jcd"`) || strings.Contains(note, "\x1b") {
			t.Errorf("note %q, want the serial quoted with its escape escaped", note)
		}
	})
	for _, replace := range []struct {
		name string
		with func(t *testing.T, path string)
		want string
	}{
		{"regular file", func(t *testing.T, p string) { mustWrite(t, p) }, "is a regular file, not a device node"},
		{"socket", func(t *testing.T, p string) { mustListen(t, p) }, "is a socket, not a device node"},
		{"other numbers", func(t *testing.T, p string) { mustMknod(t, p, 1, 3) }, "is now /dev/fuse (c 1:3)"},
	} {
		t.Run("node replaced by a "+replace.name+" before Reserve", func(t *testing.T) {
			tr := newTree(t)
			tr.mknod("/dev/fuse", 10, 229)
			// No stream: the plugin has not seen the change when Reserve comes.
			p := New(nil)
			if err := p.SetConfig(context.Background(), tr.config(map[string]DeviceConfig{"fuse": {Paths: []string{"/dev/fuse"}}})); err != nil {
				t.Fatal(err)
			}
			if _, _, err := p.scan(); err != nil {
				t.Fatal(err)
			}
			tr.rm("/dev/fuse")
			replace.with(t, hostPath(tr.dev, "/dev/fuse"))
			_, err := p.Reserve(context.Background(), []string{"fuse"})
			if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), replace.want) {
				t.Errorf("Reserve = %v, want FAILED_PRECONDITION saying %q", err, replace.want)
			}
		})
	}
}

func TestCDISpecNamesWhatReserveAnswers(t *testing.T) {
	tr := newTree(t)
	tr.mknod("/dev/kvm", 10, 232)
	cdiDir := t.TempDir()
	p := New(nil)
	cfg := fmt.Sprintf(`{"dev_root":%q,"sys_root":%q,"cdi_spec_dir":%q,"device":{"kvm":{"paths":["/dev/kvm"],"count":2}}}`, tr.dev, tr.sys, cdiDir)
	if err := p.SetConfig(context.Background(), []byte(cfg)); err != nil {
		t.Fatal(err)
	}
	r, _, err := p.scan()
	if err != nil {
		t.Fatal(err)
	}
	if got := device(r, "kvm-1").GetCdiDevices(); !slices.Equal(got, []string{CDIKind + "=kvm-1"}) {
		t.Errorf("kvm-1 CDI names %q", got)
	}
	res, err := p.Reserve(context.Background(), []string{"kvm-1"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.GetCdiDevices(), []string{CDIKind + "=kvm-1"}) {
		t.Errorf("Reserve CDI names %q", res.GetCdiDevices())
	}
	spec, err := os.ReadFile(filepath.Join(cdiDir, "devicehost-hostdev.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"kind: " + CDIKind, "name: kvm-1", "hostPath: " + hostPath(tr.dev, "/dev/kvm"), "major: 10", "minor: 232"} {
		if !strings.Contains(string(spec), w) {
			t.Errorf("CDI spec lacks %q:\n%s", w, spec)
		}
	}
	// Stopped by its host, the plugin takes its spec away.
	p.Shutdown()
	if _, err := os.Stat(filepath.Join(cdiDir, "devicehost-hostdev.yaml")); !os.IsNotExist(err) {
		t.Errorf("CDI spec after Shutdown: %v, want it removed", err)
	}
}

func mustSymlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

func mustWrite(t *testing.T, p string) {
	t.Helper()
	if err := os.WriteFile(p, []byte("not a device"), 0o666); err != nil {
		t.Fatal(err)
	}
}

func mustListen(t *testing.T, p string) {
	t.Helper()
	l, err := net.Listen("unix", p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}

func mustMknod(t *testing.T, p string, major, minor uint32) {
	t.Helper()
	(&tree{t: t}).mknodHost(p, major, minor)
}

// The machine's own nodes, where it has them: /dev/fuse, /dev/net/tun and /dev/kvm are
// found, healthy, and Reserve answers them as they are.
func TestRealDeviceNodes(t *testing.T) {
	blocks := map[string]DeviceConfig{}
	for typ, p := range map[string]string{"fuse": "/dev/fuse", "tun": "/dev/net/tun", "kvm": "/dev/kvm"} {
		if fi, err := os.Stat(p); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			blocks[typ] = DeviceConfig{Paths: []string{p}, Count: 2}
		}
	}
	if len(blocks) == 0 {
		t.Skip("none of /dev/fuse, /dev/net/tun, /dev/kvm here")
	}
	none := ""
	cfg, err := json.Marshal(Config{Devices: blocks, CDISpecDir: &none})
	if err != nil {
		t.Fatal(err)
	}
	s := start(t, cfg)
	r := s.WaitFor(t, "the first inventory", func(*pb.FingerprintResponse) bool { return true })
	for typ, b := range blocks {
		d := device(r, typ+"-1")
		if !healthy(d) {
			t.Errorf("%s-1: %v, want healthy", typ, d)
			continue
		}
		res, err := s.p.Reserve(context.Background(), []string{typ + "-1"})
		if err != nil {
			t.Errorf("Reserve %s-1: %v", typ, err)
			continue
		}
		want := b.Paths[0] + " -> " + b.Paths[0] + " rw"
		if got := specs(res); !slices.Equal(got, []string{want}) {
			t.Errorf("Reserve %s-1: %q, want %q", typ, got, want)
		}
	}
	t.Logf("served %d of the machine's nodes: %s", len(blocks), deviceplugintest.Describe(r))
}
