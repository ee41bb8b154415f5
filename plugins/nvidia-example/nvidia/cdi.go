package nvidia

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/deviceplugin/cdi"
)

// cdiKind is the CDI kind of the plugin's GPUs: Reserve names each GPU
// nvidia.com/gpu=<UUID>, the name the NVIDIA Container Toolkit gives it with
// --device-name-strategy=uuid.
const cdiKind = "nvidia.com/gpu"

// cdiSpecName is the spec's file name in the spec dir (plus ".yaml"), apart from the
// NVIDIA Container Toolkit's nvidia.yaml.
const cdiSpecName = "devicehost-" + Name

// The NVIDIA kernel driver registers character major 195 for /dev/nvidiaN (minor N,
// NVML's minor number) and /dev/nvidiactl (minor 255). They are fixed in the driver,
// so the spec carries them and injection works whether or not the node exists on this
// host, as with simulated GPUs. nvidia-uvm's major is assigned when its module loads:
// it is listed only when the node exists, without numbers, and a runtime reads them
// from the node when it injects.
const (
	nvidiaMajor    = 195
	nvidiaCtlMinor = 255
)

// uvmNodes are the nodes CUDA needs besides the GPU's own and nvidiactl.
var uvmNodes = []string{"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}

// cdiPublisher keeps the plugin's CDI spec in step with the GPUs it reports. Safe for
// concurrent use (two Fingerprint streams may publish); it starts no goroutines.
type cdiPublisher struct {
	w      *cdi.Writer
	logger hclog.Logger
	// charDevice says whether path is a character device on this host.
	charDevice func(path string) bool
	// migMinors is the driver's table of MIG capability minors (migMinorsPath).
	migMinors string

	mu      sync.Mutex
	lastErr string // the failure last logged: a lasting one is logged once
}

func newCDIPublisher(dir string, logger hclog.Logger, charDevice func(string) bool, migMinors string) (*cdiPublisher, error) {
	w, err := cdi.NewWriter(dir, cdiSpecName)
	if err != nil {
		return nil, fmt.Errorf("config: cdi_spec_dir: %w", err)
	}
	return &cdiPublisher{w: w, logger: logger, charDevice: charDevice, migMinors: migMinors}, nil
}

// migMinorsPath is where the NVIDIA driver lists the minors of the MIG capability
// nodes (/dev/nvidia-caps/nvidia-cap<minor>), e.g. "gpu0/gi1/access 12" and
// "gpu0/gi1/ci0/access 13"; "gpu<N>" is the GPU's device minor.
const migMinorsPath = "/proc/driver/nvidia-caps/mig-minors"

// cdiAlias is a device the spec lists besides the GPUs, on its parent GPU: a
// time-sliced replica or a MIG device, named by its device ID.
type cdiAlias struct {
	name   string
	parent gpu
	mig    bool // a MIG device, in GPU instance gi and compute instance ci
	gi, ci int
}

// readMIGMinors parses the driver's MIG capability table; nil when there is none
// (no MIG-capable driver, or a simulated machine).
func readMIGMinors(path string) map[string]int {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	out := make(map[string]int)
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		if n, err := strconv.Atoi(f[1]); err == nil {
			out[f[0]] = n
		}
	}
	return out
}

// publish writes the spec for gpus and more (removes it for no GPUs). A failure is logged, once
// while it lasts, and retried on the next call; the plugin goes on serving.
func (c *cdiPublisher) publish(gpus []gpu, more []cdiAlias) {
	spec := c.spec(gpus, more)
	changed, err := c.w.Write(spec)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		if msg := err.Error(); msg != c.lastErr {
			c.lastErr = msg
			c.logger.Error("CDI spec not written: container runtimes cannot resolve this plugin's CDI names ("+
				cdiKind+"=<UUID>) until it is; the plugin goes on serving and retries on each fingerprint re-read",
				"path", c.w.Path(), "error", err)
		}
		return
	}
	if changed || c.lastErr != "" {
		if len(spec.Devices) == 0 {
			c.logger.Info("CDI spec removed: no GPUs", "path", c.w.Path())
		} else {
			c.logger.Info("CDI spec written", "path", c.w.Path(), "gpus", len(spec.Devices))
		}
	}
	c.lastErr = ""
}

// spec describes gpus for CDI: each GPU brings its /dev/nvidiaN; any of them brings
// /dev/nvidiactl and the UVM nodes this host has. It sets no NVIDIA_VISIBLE_DEVICES:
// Reserve's answer does, with the reserved GPUs' UUIDs, and a spec edit would override
// it in the container (a runtime applies CDI edits after the container's own env), so
// the workload would see a list other than the devices it got. A GPU whose minor
// number NVML cannot give is left out, with a warning. A replica or MIG device
// brings its parent GPU's node.
func (c *cdiPublisher) spec(gpus []gpu, more []cdiAlias) cdi.Spec {
	const ctl = "/dev/nvidiactl"
	s := cdi.Spec{
		Kind:    cdiKind,
		Devices: make(map[string]cdi.Edits, len(gpus)),
		Common:  cdi.Edits{DeviceNodes: []cdi.DeviceNode{node(ctl)}},
		Nodes:   map[string]cdi.Node{ctl: {Type: "c", Major: nvidiaMajor, Minor: nvidiaCtlMinor}},
	}
	for _, path := range uvmNodes {
		if c.charDevice(path) {
			s.Common.DeviceNodes = append(s.Common.DeviceNodes, node(path))
		}
	}
	for _, g := range gpus {
		minor, ret := g.dev.GetMinorNumber()
		if ret != nvml.SUCCESS || minor < 0 || minor >= nvidiaCtlMinor {
			c.logger.Warn("GPU left out of the CDI spec: no device minor number", "gpu", g.uuid, "minor", minor, "error", ret)
			continue
		}
		path := fmt.Sprintf("/dev/nvidia%d", minor)
		s.Devices[g.uuid] = cdi.Edits{DeviceNodes: []cdi.DeviceNode{node(path)}}
		s.Nodes[path] = cdi.Node{Type: "c", Major: nvidiaMajor, Minor: int64(minor)}
	}
	var caps map[string]int
	for _, m := range more {
		parent, ok := s.Devices[m.parent.uuid]
		if !ok {
			continue
		}
		dev := cdi.Edits{DeviceNodes: slices.Clone(parent.DeviceNodes)}
		if m.mig {
			// The GPU and compute instance's capability nodes, where the driver has
			// them: by path, their major being assigned at module load (as nvidia-uvm's).
			if caps == nil {
				caps = readMIGMinors(c.migMinors)
			}
			minor, _ := m.parent.dev.GetMinorNumber()
			for _, k := range []string{fmt.Sprintf("gpu%d/gi%d/access", minor, m.gi), fmt.Sprintf("gpu%d/gi%d/ci%d/access", minor, m.gi, m.ci)} {
				if n, ok := caps[k]; ok {
					if path := fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", n); c.charDevice(path) {
						dev.DeviceNodes = append(dev.DeviceNodes, node(path))
					}
				}
			}
		}
		s.Devices[m.name] = dev
	}
	return s
}

// node is a device node at the same path in the container, read-write (no mknod).
func node(path string) cdi.DeviceNode {
	return cdi.DeviceNode{HostPath: path, ContainerPath: path, Permissions: "rw"}
}

// isCharDevice says whether path is a character device on this host.
func isCharDevice(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
