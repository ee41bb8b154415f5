// Package cdi lets a device plugin publish its devices as a CDI (Container Device
// Interface) spec, so that the CDI names its Reserve hands out ("vendor.com/class=ID")
// resolve in containerd, CRI-O and podman. Writer builds the spec from each device's
// Edits (env vars, device nodes, mounts), validates it with the CDI library and writes it
// atomically into a spec directory (default DefaultDir) whenever the devices change. Its
// users are the nvidia-example plugin and the DRA driver's claim specs; it imports no
// devicehost protocol. See docs/plugins.md#cdi-specs.
package cdi

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"go.yaml.in/yaml/v3"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

// DefaultDir is where container runtimes look for generated (not hand-written) CDI
// specs, after /etc/cdi; a spec there wins over one in /etc/cdi for the same name.
const DefaultDir = cdiapi.DefaultDynamicDir

// specFileMode lets every runtime read the spec, rootless podman included; a spec
// holds nothing secret.
const specFileMode = 0o644

// Name returns the CDI name of device id of kind ("vendor.com/class"), as Reserve
// puts it in ContainerReservation.CdiDevices: "vendor.com/class=id".
func Name(kind, id string) string { return kind + "=" + id }

// Spec is what a set of devices gives a container.
type Spec struct {
	// Kind is the CDI kind of every device, "vendor.com/class", e.g. "nvidia.com/gpu".
	Kind string
	// Devices maps each device ID (the part of the CDI name after "=") to what a
	// container with that device gets. An empty map means no devices: Write removes
	// the file.
	Devices map[string]Edits
	// Common is what a container with any of these devices gets once, however many
	// it has (control device nodes, shared env vars); the zero value for nothing.
	Common Edits
	// Nodes gives the type and numbers of device nodes, by host path. Without an
	// entry, a runtime stats the host's node when it injects the device and fails if
	// there is none; with one, it needs no node on the host (a device node the
	// runtime creates in the container by its numbers), which is how simulated devices
	// resolve on a machine that lacks them.
	Nodes map[string]Node
}

// Edits is what a container gets, a CDI spec's containerEdits: env vars, device nodes
// and bind mounts. The zero value gives nothing.
type Edits struct {
	Env         map[string]string // name -> value
	DeviceNodes []DeviceNode
	Mounts      []Mount
}

// DeviceNode is a device node a container gets; its type and numbers, when the host
// may lack it, are in Spec.Nodes under HostPath.
type DeviceNode struct {
	HostPath      string // required
	ContainerPath string // empty: HostPath
	Permissions   string // cgroup access, some of "rwm"; empty: the runtime's default
}

// Mount is a bind mount of HostPath at ContainerPath (rbind, rprivate, nosuid, nodev).
type Mount struct {
	HostPath      string
	ContainerPath string
	ReadOnly      bool
}

// Node is a device node's type and numbers.
type Node struct {
	Type  string // "c" (character device) or "b" (block device)
	Major int64
	Minor int64
}

// Writer keeps one CDI spec file up to date: Write replaces it, atomically (a
// temporary file renamed over it, so a runtime never reads half a spec), whenever what
// it would hold changes. Make one with NewWriter. Safe for concurrent use; it starts no
// goroutines and has nothing to close, unless Ahead is used (then Discard). The file
// outlives the process on purpose:
// containers started with its names and those still to start keep resolving them while
// a plugin restarts; Remove takes it away.
type Writer struct {
	dir   string
	name  string // file name without extension
	ext   string // ".yaml" or ".json"
	cache *cdiapi.Cache
	ahead *ahead // the directory's file made ahead (Writer.Ahead); shared with siblings

	mu   sync.Mutex
	last []byte // the spec last written, JSON; nil when none (or removed)
}

// NewWriter returns a writer of the spec file dir/name.yaml. dir must be an absolute
// path; it is created (0755) on the first write if missing. name is a plain file name
// (letters, digits, '.', '_', '-'), e.g. "devicehost-" + the plugin's name; pick one
// that no other tool writes in dir (the NVIDIA Container Toolkit writes nvidia.yaml).
func NewWriter(dir, name string) (*Writer, error) { return newWriter(dir, name, ".yaml") }

// NewJSONWriter is NewWriter for a spec file dir/name.json. Runtimes read both
// encodings alike; the CDI library writes JSON in half of YAML's time, with a tenth of
// the garbage, which counts where a spec is written while a caller waits (the DRA
// driver writes one per claim in NodePrepareResources).
func NewJSONWriter(dir, name string) (*Writer, error) { return newWriter(dir, name, ".json") }

func newWriter(dir, name, ext string) (*Writer, error) {
	if dir == "" {
		return nil, errors.New("cdi: spec directory: empty")
	}
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("cdi: spec directory %q: must be an absolute path", dir)
	}
	if !validFileName(name) {
		return nil, fmt.Errorf("cdi: spec file name %q: want letters, digits, '.', '_' or '-' only", name)
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return nil, fmt.Errorf("cdi: %w", err)
	}
	dir = filepath.Clean(dir)
	return &Writer{dir: dir, name: name, ext: ext, cache: cache, ahead: &ahead{dir: dir}}, nil
}

// Sibling returns a writer of another spec file, dir/name.yaml (.json for a JSON
// writer), in w's directory. It
// shares w's CDI library cache, so making one reads nothing from disk: NewWriter reads
// and parses every spec in the directory (the library's cache), which a writer per
// claim or per instance would otherwise pay each time. name is checked as NewWriter
// checks it.
func (w *Writer) Sibling(name string) (*Writer, error) {
	if !validFileName(name) {
		return nil, fmt.Errorf("cdi: spec file name %q: want letters, digits, '.', '_' or '-' only", name)
	}
	return &Writer{dir: w.dir, name: name, ext: w.ext, cache: w.cache, ahead: w.ahead}, nil
}

func validFileName(name string) bool {
	if name == "" || name == "." || name == ".." || len(name) > 200 {
		return false
	}
	for _, c := range name {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// Path is the spec file's path.
func (w *Writer) Path() string { return filepath.Join(w.dir, w.name+w.ext) }

// Write makes the spec file describe s: it replaces the file when its content would
// change (devices that left s leave the file) or the file is gone, and removes it when
// s has no devices. changed says whether the file was written or removed. A spec that
// CDI would reject is refused with the rule it broke, before anything is written. On
// error the file is as it was, and the next Write tries again.
func (w *Writer) Write(s Spec) (changed bool, err error) {
	raw, err := s.toCDI()
	if err != nil {
		return false, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(raw.Devices) == 0 {
		return w.removeLocked()
	}
	data, err := json.Marshal(raw)
	if err != nil {
		return false, fmt.Errorf("cdi: encode spec %s: %w", w.Path(), err)
	}
	if w.last != nil && slices.Equal(data, w.last) {
		if _, err := os.Stat(w.Path()); err == nil {
			return false, nil
		}
		// Someone removed it (a cleaned /var/run/cdi): write it again.
	}
	// The CDI library's rules for the edits (env, nodes, mounts, hooks), then a
	// temporary file in dir renamed over the old one. Not the library's WriteSpec: it
	// makes twice the system calls (a stat, the directory opened for the rename, a chmod
	// by path), which cost 0.2 ms a claim spec on a VM where the DRA driver writes one
	// while the kubelet waits.
	if err := validateSpec(raw); err != nil {
		return false, fmt.Errorf("cdi: write spec %s: %w", w.Path(), err)
	}
	out := data
	if w.ext == ".yaml" {
		y, err := yaml.Marshal(raw)
		if err != nil {
			return false, fmt.Errorf("cdi: encode spec %s: %w", w.Path(), err)
		}
		out = append([]byte("---\n"), y...)
	}
	if err := w.ahead.writeAtomic(w.Path(), out); err != nil {
		return false, fmt.Errorf("cdi: write spec %s: %w", w.Path(), err)
	}
	w.last = data
	return true, nil
}

// validateSpec applies the CDI library's rules to a spec toCDI made (its kind, device
// names and version are toCDI's): the common edits and each device's, which must not be
// empty.
func validateSpec(raw *cdispec.Spec) error {
	if err := (&cdiapi.ContainerEdits{ContainerEdits: &raw.ContainerEdits}).Validate(); err != nil {
		return fmt.Errorf("invalid spec: common edits: %w", err)
	}
	for i := range raw.Devices {
		d := &raw.Devices[i]
		e := &cdiapi.ContainerEdits{ContainerEdits: &d.ContainerEdits}
		if len(d.ContainerEdits.Env)+len(d.ContainerEdits.DeviceNodes)+len(d.ContainerEdits.Mounts)+len(d.ContainerEdits.Hooks)+
			len(d.ContainerEdits.AdditionalGIDs)+len(d.ContainerEdits.NetDevices) == 0 && d.ContainerEdits.IntelRdt == nil {
			return fmt.Errorf("invalid device %q: empty device edits", d.Name)
		}
		if err := e.Validate(); err != nil {
			return fmt.Errorf("invalid device %q: %w", d.Name, err)
		}
	}
	return nil
}

// Remove deletes the spec file; a missing one is not an error.
func (w *Writer) Remove() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, err := w.removeLocked()
	return err
}

// removeLocked deletes the file; removed says whether there was one.
func (w *Writer) removeLocked() (removed bool, err error) {
	if _, err := os.Lstat(w.Path()); errors.Is(err, fs.ErrNotExist) {
		w.last = nil
		return false, nil
	}
	if err := w.cache.RemoveSpec(w.name + w.ext); err != nil {
		return false, fmt.Errorf("cdi: remove spec %s: %w", w.Path(), err)
	}
	w.last = nil
	return true, nil
}

// toCDI converts s to a CDI spec at the lowest CDI version that can express it, so
// runtimes with older CDI libraries read it too. Devices are sorted by ID.
func (s Spec) toCDI() (*cdispec.Spec, error) {
	vendor, class := parser.ParseQualifier(s.Kind)
	if err := parser.ValidateVendorName(vendor); err != nil {
		return nil, fmt.Errorf("cdi: kind %q: %w", s.Kind, err)
	}
	if err := parser.ValidateClassName(class); err != nil {
		return nil, fmt.Errorf("cdi: kind %q: %w", s.Kind, err)
	}
	raw := &cdispec.Spec{Kind: s.Kind}
	var errs []error
	common, err := s.edits("common edits", s.Common)
	if err != nil {
		errs = append(errs, err)
	}
	raw.ContainerEdits = common
	ids := make([]string, 0, len(s.Devices))
	for id := range s.Devices {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		if err := parser.ValidateDeviceName(id); err != nil {
			errs = append(errs, fmt.Errorf("cdi: device %q: %w", id, err))
			continue
		}
		edits, err := s.edits(fmt.Sprintf("device %q", id), s.Devices[id])
		if err != nil {
			errs = append(errs, err)
			continue
		}
		raw.Devices = append(raw.Devices, cdispec.Device{Name: id, ContainerEdits: edits})
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if raw.Version, err = cdispec.MinimumRequiredVersion(raw); err != nil {
		return nil, fmt.Errorf("cdi: spec version: %w", err)
	}
	return raw, nil
}

// edits converts one Edits; what names the item in errors.
func (s Spec) edits(what string, r Edits) (cdispec.ContainerEdits, error) {
	var e cdispec.ContainerEdits
	var errs []error
	for _, k := range slices.Sorted(maps.Keys(r.Env)) {
		e.Env = append(e.Env, k+"="+r.Env[k])
	}
	for i, d := range r.DeviceNodes {
		if d.HostPath == "" {
			errs = append(errs, fmt.Errorf("cdi: %s: device node %d: empty host path", what, i))
			continue
		}
		n := &cdispec.DeviceNode{Path: d.ContainerPath, Permissions: d.Permissions}
		if n.Path == "" {
			n.Path = d.HostPath
		}
		if n.Path != d.HostPath {
			n.HostPath = d.HostPath
		}
		if num, ok := s.Nodes[d.HostPath]; ok {
			n.Type, n.Major, n.Minor = num.Type, num.Major, num.Minor
		}
		e.DeviceNodes = append(e.DeviceNodes, n)
	}
	for _, m := range r.Mounts {
		opts := []string{"rbind", "rprivate", "nosuid", "nodev"}
		if m.ReadOnly {
			opts = append(opts, "ro")
		}
		e.Mounts = append(e.Mounts, &cdispec.Mount{HostPath: m.HostPath, ContainerPath: m.ContainerPath,
			Type: "bind", Options: opts})
	}
	return e, errors.Join(errs...)
}
