package hostdev

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/devicehost/devicehost/deviceplugin/cdi"
	"github.com/devicehost/devicehost/internal/suggest"
)

// Config is the plugin's config block, as the host hands it over in SetConfig (the HCL
// block converted to JSON; `device "fuse" { ... }` is the key "fuse" of the object
// "device"). Unknown keys are rejected, so a typo does not pass silently.
//
//	plugin "hostdev" {
//	  config {
//	    device "fuse" {
//	      paths = ["/dev/fuse"]
//	      count = 8                  # held by up to 8 workloads at once
//	    }
//	    device "serial" { paths = ["/dev/ttyUSB*"] }    # one device per node matched
//	    device "audio" {                                 # two nodes, one device
//	      paths = ["/dev/snd/pcmC0D0p", "/dev/snd/controlC0"]
//	    }
//	    device "zigbee" {
//	      usb {
//	        vendor  = "10c4"
//	        product = "ea60"
//	        serial  = "0001"
//	      }
//	    }
//	  }
//	}
//
// (HCL takes a one-line block of one attribute only: a block of two is written on
// several lines.)
type Config struct {
	// Devices are the device types by name (the group's type, e.g. "fuse").
	Devices map[string]DeviceConfig `json:"device,omitempty"`
	// DevRoot is the directory that stands for /dev: a path "/dev/x" is looked up as
	// DevRoot/x. Empty: "/dev". Tests point it at a scratch tree of mknod'ed nodes.
	DevRoot string `json:"dev_root,omitempty"`
	// SysRoot is the directory that stands for /sys, where USB devices are found
	// (SysRoot/bus/usb/devices). Empty: "/sys".
	SysRoot string `json:"sys_root,omitempty"`
	// CDISpecDir is the absolute directory the plugin keeps its CDI spec in, so the
	// CDI names Reserve answers resolve in container runtimes; "" writes none. Unset:
	// cdi.DefaultDir when DevRoot is /dev, none otherwise (a scratch tree's nodes
	// must not enter the host's CDI registry).
	CDISpecDir *string `json:"cdi_spec_dir,omitempty"`
}

// DeviceConfig is one `device "name" { ... }` block: one device type.
type DeviceConfig struct {
	// Paths are the device nodes, each an absolute path under /dev. Without a glob,
	// all of them together are one device (an audio card's pcm and control nodes,
	// mounted together). A single path may be a glob in its last element
	// ("/dev/ttyUSB*"): one device per node it matches.
	Paths []string `json:"paths,omitempty"`
	// USB finds USB devices by identity instead of Paths: one device per USB device
	// that matches, with every device node it has (its /dev/bus/usb node and its
	// interfaces' nodes, such as a ttyUSB), whatever numbers they get.
	USB *USBConfig `json:"usb,omitempty"`
	// Count offers each device this many times, to as many holders at once (1 to
	// MaxCount); each copy is a device of its own, "<id>-<i>". Unset (0): once, as "<id>".
	Count int `json:"count,omitempty"`
	// Permissions are the cgroup permissions the container gets on the nodes, some of
	// "rwm". Empty: "rw".
	Permissions string `json:"permissions,omitempty"`
}

// USBConfig selects USB devices by their sysfs identity: idVendor and idProduct (4
// hex digits each) and, when set, serial.
type USBConfig struct {
	Vendor  string `json:"vendor"`
	Product string `json:"product"`
	Serial  string `json:"serial,omitempty"`
}

// Bounds on a config and on what a scan takes from the file system. A glob or a bus
// with more is served up to the bound, and the rest is reported, not served.
const (
	// MaxTypes is the most device blocks a config may have.
	MaxTypes = 64
	// MaxPaths is the most paths one block may list.
	MaxPaths = 16
	// MaxCount is the largest count.
	MaxCount = 1024
	// MaxMatches is the most devices one block serves: glob matches or USB devices,
	// times count.
	MaxMatches = 1024
	// MaxUSBNodes is the most device nodes one USB device may bring.
	MaxUSBNodes = 16
	// maxNameLen bounds a block name: it becomes a Kubernetes resource name's and a
	// DeviceClass's last element.
	maxNameLen = 40
)

// Vendor is the vendor of every group the plugin reports.
const Vendor = "hostdev"

// CDIKind is the CDI kind of the plugin's devices ("<kind>=<device ID>").
const CDIKind = "devicehost.io/hostdev"

var (
	typeName = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	hex4     = regexp.MustCompile(`^[0-9a-f]{4}$`)
)

// settings is a checked config.
type settings struct {
	devRoot, sysRoot string
	cdiDir           string // "" writes none
	types            []typeSettings
}

// typeSettings is one checked device block.
type typeSettings struct {
	name  string
	paths []string // clean, absolute, under /dev
	glob  bool     // paths is one glob
	usb   *USBConfig
	count int // 0: once, without a suffix
	perms string
}

// copies is how many devices the block makes of each thing it finds.
func (t typeSettings) copies() int { return max(t.count, 1) }

// parseConfig decodes and checks a config block. Every problem is reported, each
// naming its block and key, joined with errors.Join.
func parseConfig(configJSON []byte) (settings, error) {
	var c Config
	if trimmed := bytes.TrimSpace(configJSON); len(trimmed) > 0 && !bytes.Equal(trimmed, []byte("null")) {
		dec := json.NewDecoder(bytes.NewReader(trimmed))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&c); err != nil {
			known := slices.Concat(suggest.JSONKeys(Config{}), suggest.JSONKeys(DeviceConfig{}), suggest.JSONKeys(USBConfig{}))
			return settings{}, fmt.Errorf("config: %w", suggest.UnknownField(err, known))
		}
		if dec.More() {
			return settings{}, errors.New("config: trailing data after the JSON object")
		}
	}
	s := settings{devRoot: "/dev", sysRoot: "/sys"}
	var errs []error
	for _, r := range []struct {
		key      string
		val      string
		out      *string
		fallback string
	}{{"dev_root", c.DevRoot, &s.devRoot, "/dev"}, {"sys_root", c.SysRoot, &s.sysRoot, "/sys"}} {
		switch {
		case r.val == "":
		case !filepath.IsAbs(r.val):
			errs = append(errs, fmt.Errorf("config: %s = %q: want an absolute path", r.key, r.val))
		default:
			*r.out = filepath.Clean(r.val)
		}
	}
	switch {
	case c.CDISpecDir == nil:
		if s.devRoot == "/dev" {
			s.cdiDir = cdi.DefaultDir
		}
	case *c.CDISpecDir == "":
	case !filepath.IsAbs(*c.CDISpecDir):
		errs = append(errs, fmt.Errorf("config: cdi_spec_dir = %q: want an absolute path", *c.CDISpecDir))
	default:
		s.cdiDir = filepath.Clean(*c.CDISpecDir)
	}
	if len(c.Devices) > MaxTypes {
		errs = append(errs, fmt.Errorf("config: %d device blocks, more than %d", len(c.Devices), MaxTypes))
	}
	for _, name := range slices.Sorted(maps.Keys(c.Devices)) {
		t, err := parseType(name, c.Devices[name])
		if err != nil {
			errs = append(errs, err)
			continue
		}
		s.types = append(s.types, t)
	}
	return s, errors.Join(errs...)
}

// parseType checks one device block.
func parseType(name string, d DeviceConfig) (typeSettings, error) {
	where := fmt.Sprintf("config: device %q", name)
	var errs []error
	if len(name) > maxNameLen || !typeName.MatchString(name) {
		errs = append(errs, fmt.Errorf("%s: the name must be 1 to %d lower-case letters, digits and '-', starting and ending with a letter or digit", where, maxNameLen))
	}
	t := typeSettings{name: name, usb: d.USB, count: d.Count, perms: d.Permissions}
	switch {
	case len(d.Paths) == 0 && d.USB == nil:
		errs = append(errs, fmt.Errorf("%s: give paths or a usb block", where))
	case len(d.Paths) > 0 && d.USB != nil:
		errs = append(errs, fmt.Errorf("%s: give paths or a usb block, not both", where))
	case len(d.Paths) > MaxPaths:
		errs = append(errs, fmt.Errorf("%s: paths: %d paths, more than %d", where, len(d.Paths), MaxPaths))
	}
	for i, p := range d.Paths {
		clean, glob, err := checkPath(p)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: paths[%d] = %q: %w", where, i, p, err))
			continue
		}
		if glob && len(d.Paths) > 1 {
			errs = append(errs, fmt.Errorf("%s: paths[%d] = %q: a glob must be the block's only path (one device per node it matches)", where, i, p))
		}
		if slices.Contains(t.paths, clean) {
			errs = append(errs, fmt.Errorf("%s: paths[%d] = %q: given twice", where, i, p))
		}
		t.glob = glob
		t.paths = append(t.paths, clean)
	}
	if u := d.USB; u != nil {
		if !hex4.MatchString(u.Vendor) {
			errs = append(errs, fmt.Errorf("%s: usb: vendor = %q: want 4 lower-case hex digits, as sysfs idVendor shows them (e.g. \"10c4\")", where, u.Vendor))
		}
		if !hex4.MatchString(u.Product) {
			errs = append(errs, fmt.Errorf("%s: usb: product = %q: want 4 lower-case hex digits, as sysfs idProduct shows them (e.g. \"ea60\")", where, u.Product))
		}
		if u.Serial != "" && !printableSerial(u.Serial) {
			errs = append(errs, fmt.Errorf("%s: usb: serial = %q: want 1 to %d printable ASCII characters", where, u.Serial, maxSerialLen))
		}
	}
	if d.Count < 0 || d.Count > MaxCount {
		errs = append(errs, fmt.Errorf("%s: count = %d: want 1 to %d (unset: once)", where, d.Count, MaxCount))
	}
	switch {
	case t.perms == "":
		t.perms = "rw"
	case !validPerms(t.perms):
		errs = append(errs, fmt.Errorf("%s: permissions = %q: want some of \"rwm\", each once", where, t.perms))
	}
	return t, errors.Join(errs...)
}

// checkPath checks a configured device path: absolute, clean, under /dev, with glob
// characters (checked by path.Match's syntax) only in its last element.
func checkPath(p string) (clean string, glob bool, err error) {
	if !path.IsAbs(p) {
		return "", false, errors.New("want an absolute path under /dev")
	}
	clean = path.Clean(p)
	if clean != p {
		return "", false, fmt.Errorf("not a clean path (want %q)", clean)
	}
	rel, ok := strings.CutPrefix(clean, "/dev/")
	if !ok || rel == "" {
		return "", false, errors.New("want a path under /dev")
	}
	dir, last := path.Split(rel)
	if strings.ContainsAny(dir, `*?[\`) {
		return "", false, errors.New("a glob may only be in the last element")
	}
	if _, err := path.Match(last, ""); err != nil {
		return "", false, fmt.Errorf("bad glob: %w", err)
	}
	return clean, strings.ContainsAny(last, `*?[\`), nil
}

func validPerms(p string) bool {
	if len(p) > 3 {
		return false
	}
	for i, c := range p {
		if !strings.ContainsRune("rwm", c) || strings.ContainsRune(p[i+1:], c) {
			return false
		}
	}
	return true
}

// maxSerialLen bounds a USB serial: sysfs shows at most 126 UTF-16 units' worth.
const maxSerialLen = 128

// printableSerial reports whether s is a USB serial the plugin takes as an identity:
// 1 to maxSerialLen printable ASCII characters.
func printableSerial(s string) bool {
	if s == "" || len(s) > maxSerialLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
