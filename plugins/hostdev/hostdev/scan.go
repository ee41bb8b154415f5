package hostdev

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// node is one device node as a scan found it.
type node struct {
	path  string // in the container, e.g. "/dev/fuse"
	host  string // on the host: the node itself, symlinks resolved, under the dev root
	typ   byte   // 'c' (character device) or 'b' (block device)
	major uint32
	minor uint32
}

func (n node) String() string {
	return fmt.Sprintf("%s (%c %d:%d)", n.path, n.typ, n.major, n.minor)
}

// thing is one device a block found, before its count copies: a literal block's
// nodes, one glob match, or one USB device.
type thing struct {
	key     string // the device ID without a copy suffix
	nodes   []node
	problem string // why it cannot be served now ("" when it can)
}

// found is what one scan of one block found.
type found struct {
	things []thing
	// notes say why the block serves less than the config asks for: nothing matched,
	// a bound was met, a match was refused. The plugin logs them when they change.
	notes []string
}

// Bounds on what a scan reads.
const (
	// maxDirEntries is the most entries a scan reads from one directory (a glob's,
	// the USB bus's).
	maxDirEntries = 1 << 16
	// maxAttrBytes is the most bytes read from one sysfs attribute or uevent file.
	maxAttrBytes = 4096
	// maxUSBWalk is the most directory entries a scan visits under one USB device
	// looking for its interfaces' device nodes, and maxUSBDepth how deep it goes.
	maxUSBWalk  = 512
	maxUSBDepth = 4
)

// errNotFound says a configured node does not exist.
var errNotFound = errors.New("no such device node")

// scanType finds what block t serves now.
func scanType(s settings, t typeSettings) found {
	switch {
	case t.usb != nil:
		return scanUSB(s, t)
	case t.glob:
		return scanGlob(s, t)
	default:
		return scanLiteral(s, t)
	}
}

// scanLiteral finds a block of literal paths: one thing holding every node, or a
// thing with a problem when one of them is missing or wrong.
func scanLiteral(s settings, t typeSettings) found {
	th := thing{key: t.name}
	var problems []string
	for _, p := range t.paths {
		n, err := statNode(s.devRoot, p)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		th.nodes = append(th.nodes, n)
	}
	if len(problems) > 0 {
		th.problem = strings.Join(problems, "; ")
		th.nodes = nil
		return found{things: []thing{th}, notes: []string{th.problem}}
	}
	return found{things: []thing{th}}
}

// scanGlob finds a glob's matches, one thing each, in name order, up to the block's
// bound.
func scanGlob(s settings, t typeSettings) found {
	pattern := t.paths[0]
	dir, last := path.Split(pattern)
	names, truncated, err := readDirNames(hostPath(s.devRoot, path.Clean(dir)))
	var f found
	if err != nil {
		f.notes = append(f.notes, fmt.Sprintf("glob %s: %v", pattern, err))
		return f
	}
	if truncated {
		f.notes = append(f.notes, fmt.Sprintf("glob %s: directory has more than %d entries; only the first %d read", pattern, maxDirEntries, maxDirEntries))
	}
	limit := MaxMatches / t.copies()
	matched := 0
	for _, name := range names {
		if ok, _ := path.Match(last, name); !ok {
			continue
		}
		matched++
		if len(f.things) == limit {
			continue
		}
		p := path.Join(dir, name)
		th := thing{key: t.name + "-" + idPart(name)}
		n, err := statNode(s.devRoot, p)
		if err != nil {
			th.problem = err.Error()
			f.notes = append(f.notes, th.problem)
		} else {
			th.nodes = []node{n}
		}
		f.things = append(f.things, th)
	}
	if matched > limit {
		f.notes = append(f.notes, fmt.Sprintf("glob %s matched %d nodes; serving the first %d (at most %d devices per type, count %d each)",
			pattern, matched, limit, MaxMatches, t.copies()))
	}
	if matched == 0 {
		f.notes = append(f.notes, fmt.Sprintf("glob %s matched no node", pattern))
	}
	return f
}

// usbDevicesDir is where sysfs lists USB devices, under the sys root.
const usbDevicesDir = "bus/usb/devices"

// scanUSB finds the USB devices of the block's identity, one thing each, keyed by
// that identity (the serial, or the port when the device has none), with the nodes
// their uevents name.
func scanUSB(s settings, t typeSettings) found {
	u := t.usb
	want := fmt.Sprintf("USB %s:%s", u.Vendor, u.Product)
	if u.Serial != "" {
		want += fmt.Sprintf(" serial %q", u.Serial)
	}
	var f found
	dir := filepath.Join(s.sysRoot, usbDevicesDir)
	names, truncated, err := readDirNames(dir)
	if err != nil {
		f.notes = append(f.notes, fmt.Sprintf("%s: cannot list USB devices: %v", want, err))
		return f
	}
	if truncated {
		f.notes = append(f.notes, fmt.Sprintf("%s: %s has more than %d entries; only the first %d read", want, dir, maxDirEntries, maxDirEntries))
	}
	limit := MaxMatches / t.copies()
	matched := 0
	for _, name := range names {
		if strings.Contains(name, ":") { // an interface, not a device
			continue
		}
		devDir := filepath.Join(dir, name)
		if readAttr(devDir, "idVendor") != u.Vendor || readAttr(devDir, "idProduct") != u.Product {
			continue
		}
		serial, hasSerial := readAttrOK(devDir, "serial")
		if hasSerial && !printableSerial(serial) {
			f.notes = append(f.notes, fmt.Sprintf("%s: device %s has serial %q, not 1 to %d printable ASCII characters: not served",
				want, name, serial, maxSerialLen))
			continue
		}
		if u.Serial != "" && serial != u.Serial {
			continue
		}
		matched++
		if len(f.things) == limit {
			continue
		}
		ident := "port-" + name
		if hasSerial {
			ident = serial
		}
		th := thing{key: t.name + "-" + idPart(ident)}
		if th.nodes, th.problem = usbNodes(s.devRoot, devDir, name); th.problem != "" {
			f.notes = append(f.notes, th.problem)
		}
		f.things = append(f.things, th)
	}
	if matched > limit {
		f.notes = append(f.notes, fmt.Sprintf("%s matched %d devices; serving the first %d", want, matched, limit))
	}
	if matched == 0 {
		f.notes = append(f.notes, fmt.Sprintf("%s: no such device under %s", want, dir))
	}
	return f
}

// usbNodes finds the device nodes of the USB device in devDir (sysfs name name): its
// own (the uevent's DEVNAME, e.g. bus/usb/001/004) and those its interfaces have (a
// ttyUSB, a hidraw), by their uevents, without following symlinks, bounded.
func usbNodes(devRoot, devDir, name string) ([]node, string) {
	var names []string
	if dn, ok := ueventDevName(devDir); ok {
		names = append(names, dn)
	}
	visited := 0
	var walk func(dir string, depth int)
	walk = func(dir string, depth int) {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return
		}
		for _, e := range entries {
			if visited++; visited > maxUSBWalk || len(names) > MaxUSBNodes {
				return
			}
			// Only real directories (a sysfs symlink leads to a driver, a
			// subsystem or a parent, not a child), and at the top only the device's
			// own interfaces ("1-1:1.0"), not the devices behind a hub ("1-1.2").
			if !e.IsDir() || depth == 0 && !strings.HasPrefix(e.Name(), name+":") {
				continue
			}
			sub := filepath.Join(dir, e.Name())
			if dn, ok := ueventDevName(sub); ok {
				names = append(names, dn)
			}
			if depth+1 < maxUSBDepth {
				walk(sub, depth+1)
			}
		}
	}
	walk(devDir, 0)
	if len(names) > MaxUSBNodes {
		return nil, fmt.Sprintf("USB device %s has more than %d device nodes", name, MaxUSBNodes)
	}
	if len(names) == 0 {
		return nil, fmt.Sprintf("USB device %s has no device node", name)
	}
	var nodes []node
	var problems []string
	for _, dn := range names {
		n, err := statNode(devRoot, "/dev/"+dn)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		nodes = append(nodes, n)
	}
	if len(problems) > 0 {
		return nil, strings.Join(problems, "; ")
	}
	return nodes, ""
}

// ueventDevName is the DEVNAME of dir's uevent file: a node's path relative to /dev,
// taken only when it is clean, printable and stays under /dev.
func ueventDevName(dir string) (string, bool) {
	data, ok := readAttrOK(dir, "uevent")
	if !ok {
		return "", false
	}
	for line := range strings.SplitSeq(data, "\n") {
		v, ok := strings.CutPrefix(line, "DEVNAME=")
		if !ok {
			continue
		}
		if v == "" || len(v) > 255 || path.IsAbs(v) || path.Clean(v) != v || v == ".." || strings.HasPrefix(v, "../") || !printableSerial(v) {
			return "", false
		}
		return v, true
	}
	return "", false
}

// statNode finds the device node of configured path p ("/dev/...") under devRoot: its
// symlinks resolved (staying under devRoot), and a character or block device.
func statNode(devRoot, p string) (node, error) {
	host := hostPath(devRoot, p)
	resolved, err := filepath.EvalSymlinks(host)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return node{}, fmt.Errorf("%s: %w", p, errNotFound)
	case err != nil:
		if strings.Contains(err.Error(), "too many links") {
			return node{}, fmt.Errorf("%s: symlink loop", p)
		}
		return node{}, fmt.Errorf("%s: %w", p, err)
	}
	root, err := filepath.EvalSymlinks(devRoot)
	if err != nil {
		return node{}, fmt.Errorf("%s: dev root: %w", p, err)
	}
	if rel, err := filepath.Rel(root, resolved); err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return node{}, fmt.Errorf("%s: resolves to %s, outside %s", p, resolved, devRoot)
	}
	info, err := os.Lstat(resolved)
	switch {
	case errors.Is(err, fs.ErrNotExist): // removed since EvalSymlinks
		return node{}, fmt.Errorf("%s: %w", p, errNotFound)
	case err != nil:
		return node{}, fmt.Errorf("%s: %w", p, err)
	}
	if info.Mode()&fs.ModeDevice == 0 {
		return node{}, fmt.Errorf("%s: is a %s, not a device node", p, kindOf(info.Mode()))
	}
	major, minor, ok := deviceNumbers(info)
	if !ok {
		return node{}, fmt.Errorf("%s: cannot read its device numbers", p)
	}
	n := node{path: p, host: resolved, typ: 'b', major: major, minor: minor}
	if info.Mode()&fs.ModeCharDevice != 0 {
		n.typ = 'c'
	}
	return n, nil
}

// hostPath is where configured path p ("/dev/x") is under devRoot.
func hostPath(devRoot, p string) string {
	return filepath.Join(devRoot, filepath.FromSlash(strings.TrimPrefix(strings.TrimPrefix(p, "/dev"), "/")))
}

// kindOf names a file's type for a refusal.
func kindOf(m fs.FileMode) string {
	switch {
	case m.IsRegular():
		return "regular file"
	case m.IsDir():
		return "directory"
	case m&fs.ModeSocket != 0:
		return "socket"
	case m&fs.ModeNamedPipe != 0:
		return "named pipe"
	case m&fs.ModeSymlink != 0:
		return "symlink"
	}
	return "file of mode " + m.String()
}

// readDirNames lists dir's entries in name order, at most maxDirEntries of them.
func readDirNames(dir string) (names []string, truncated bool, err error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, false, err
	}
	defer f.Close()
	names, err = f.Readdirnames(maxDirEntries + 1)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, false, err
	}
	if len(names) > maxDirEntries {
		names, truncated = names[:maxDirEntries], true
	}
	slices.Sort(names)
	return names, truncated, nil
}

// readAttr reads a sysfs attribute, trimmed; "" when it cannot.
func readAttr(dir, name string) string {
	v, _ := readAttrOK(dir, name)
	return v
}

// readAttrOK reads at most maxAttrBytes of a sysfs attribute, trimmed of surrounding
// white space; ok is false when it cannot be read or is longer than that.
func readAttrOK(dir, name string) (string, bool) {
	f, err := os.Open(filepath.Join(dir, name))
	if err != nil {
		return "", false
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxAttrBytes+1))
	if err != nil || len(data) > maxAttrBytes {
		return "", false
	}
	return strings.TrimSpace(string(data)), true
}

// idPart turns s into a part of a device ID: kept as it is when it is 1 to 64 of
// letters, digits, '.', '_' and '-'; else a digest of it, so two different
// identities never share an ID.
func idPart(s string) string {
	t := s
	if len(t) > 0 && len(t) <= 64 && strings.Trim(t, "-.") != "" {
		ok := true
		for i := 0; i < len(t) && ok; i++ {
			c := t[i]
			ok = c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-'
		}
		if ok {
			return t
		}
	}
	sum := sha256.Sum256([]byte(s))
	return "h" + hex.EncodeToString(sum[:8])
}

// deviceID is the ID of copy i of a thing; a block without a count has one copy,
// named by its key alone.
func deviceID(key string, t typeSettings, i int) string {
	if t.count == 0 {
		return key
	}
	return key + "-" + strconv.Itoa(i)
}
