package kubernetes

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/tools/k8smanifest"
)

// The DaemonSet of deploy/kubernetes/devicehost.yaml, rendered into host processes: each
// container's arguments, environment and config files, with every path inside the
// container mapped to where its volume lies on this node. hostPaths under the kubelet's
// root are the node's own; the CDI directory is the one the node's containerd reads;
// other hostPaths, emptyDirs and the ConfigMap lie under the node's run directory.

// hostContainer is one container of the DaemonSet as a process of this host.
type hostContainer struct {
	name string
	args []string // after the image's entrypoint (devicehost)
	env  []string
	// mounts maps each mount path in the container to its directory on the host.
	mounts map[string]string
}

// hostPath maps a path inside the container to the host, by the longest mount holding it.
func (c *hostContainer) hostPath(p string) (string, bool) {
	best := ""
	for mp := range c.mounts {
		if (p == mp || strings.HasPrefix(p, mp+"/")) && len(mp) > len(best) {
			best = mp
		}
	}
	if best == "" {
		return p, false
	}
	return c.mounts[best] + strings.TrimPrefix(p, best), true
}

// mapArg maps an argument that is a path, or a unix:// address of one.
func (c *hostContainer) mapArg(a string) string {
	scheme := ""
	if rest, ok := strings.CutPrefix(a, "unix://"); ok {
		scheme, a = "unix://", rest
	}
	if strings.HasPrefix(a, "/") {
		if hp, ok := c.hostPath(a); ok {
			return scheme + hp
		}
	}
	return scheme + a
}

var quotedPath = regexp.MustCompile(`"((?:unix://)?/[^"]*)"`)

// mapConfig maps every quoted absolute path (or unix:// address) in an HCL file.
func (c *hostContainer) mapConfig(text string) string {
	return quotedPath.ReplaceAllStringFunc(text, func(q string) string {
		return `"` + c.mapArg(strings.Trim(q, `"`)) + `"`
	})
}

// daemonSet is the rendered DaemonSet.
type daemonSet struct {
	agent, bridge hostContainer
	// dra is the DRA driver's container (devicehost-dra-plugin), nil while the
	// manifest has none; the DRA cases then start it with explicit arguments.
	dra         *hostContainer
	agentSocket string // the agent's socket on the host
	pluginDir   string // where the install-plugins init container puts the plugins
	stateDir    string
	// nodeSelector is the pod template's: the labels a node needs for the DaemonSet to
	// run on it.
	nodeSelector map[string]string
}

// templateSelector is the part of a DaemonSet that says where its pods run.
type templateSelector struct {
	Kind string `yaml:"kind"`
	Spec struct {
		Template struct {
			Spec struct {
				NodeSelector map[string]string `yaml:"nodeSelector"`
			} `yaml:"spec"`
		} `yaml:"template"`
	} `yaml:"spec"`
}

// unselected returns the nodeSelector's keys that labels lack or give another value,
// as key=value, sorted; none means a node with labels gets the DaemonSet's pod.
func unselected(selector, labels map[string]string) []string {
	var miss []string
	for k, v := range selector {
		if got, ok := labels[k]; !ok || got != v {
			miss = append(miss, k+"="+v)
		}
	}
	slices.Sort(miss)
	return miss
}

// pluginConfig is what the suite adds to the ConfigMap's plugin block: simulated GPUs, and
// their CDI spec where the node's containerd reads it (a path inside the agent container,
// mapped like the rest).
const pluginConfig = `
      config {
        simulate     = "dgxh100"
        cdi_spec_dir = "/var/run/cdi"
      }
`

// renderDaemonSet reads the manifest and lays out the volumes under base (emptyDirs,
// hostPaths outside the kubelet's root, config files). The CDI hostPath becomes cdiDir.
func renderDaemonSet(file, base, kubeletRoot, cdiDir string) (*daemonSet, error) {
	objs, err := k8smanifest.Read(file)
	if err != nil {
		return nil, err
	}
	var ds, cm *k8smanifest.Object
	for i := range objs {
		switch objs[i].Kind {
		case "DaemonSet":
			ds = &objs[i]
		case "ConfigMap":
			cm = &objs[i]
		}
	}
	if ds == nil || cm == nil {
		return nil, fmt.Errorf("%s: want a DaemonSet and a ConfigMap", file)
	}
	spec := ds.Spec.Template.Spec
	volumes := map[string]string{} // volume name -> host directory ("" for the ConfigMap)
	for _, v := range spec.Volumes {
		switch {
		case v.HostPath != nil:
			p := filepath.Clean(v.HostPath.Path)
			switch {
			case p == "/var/run/cdi" || p == "/run/cdi":
				volumes[v.Name] = cdiDir
			case p == "/var/lib/kubelet" || strings.HasPrefix(p, "/var/lib/kubelet/"):
				volumes[v.Name] = kubeletRoot + strings.TrimPrefix(p, "/var/lib/kubelet")
			default:
				volumes[v.Name] = filepath.Join(base, "hostpath", p)
			}
		case v.EmptyDir != nil:
			volumes[v.Name] = filepath.Join(base, "emptydir", v.Name)
		case v.ConfigMap != nil:
			if v.ConfigMap.Name != cm.Metadata.Name {
				return nil, fmt.Errorf("volume %s: ConfigMap %q, the manifest has %q", v.Name, v.ConfigMap.Name, cm.Metadata.Name)
			}
			volumes[v.Name] = ""
		default:
			return nil, fmt.Errorf("volume %s: a kind the suite does not map", v.Name)
		}
	}
	for _, dir := range volumes {
		if dir != "" {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return nil, err
			}
		}
	}
	render := func(c k8smanifest.Container) (hostContainer, error) {
		hc := hostContainer{name: c.Name, args: c.Args, mounts: map[string]string{}}
		configDirs := map[string]string{}
		for _, m := range c.VolumeMounts {
			dir, ok := volumes[m.Name]
			if !ok {
				return hc, fmt.Errorf("container %s mounts unknown volume %s", c.Name, m.Name)
			}
			if dir == "" {
				dir = filepath.Join(base, "config", c.Name, m.Name)
				configDirs[m.Name] = dir
			}
			hc.mounts[filepath.Clean(m.MountPath)] = dir
		}
		// Each container gets the ConfigMap's files with the paths of its own mounts.
		for _, dir := range configDirs {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return hc, err
			}
			for name, text := range cm.Data {
				text = strings.Replace(text, `plugin "nvidia-example" {`, `plugin "nvidia-example" {`+pluginConfig, 1)
				if err := os.WriteFile(filepath.Join(dir, name), []byte(hc.mapConfig(text)), 0o644); err != nil {
					return hc, err
				}
			}
		}
		hc.args = make([]string, len(c.Args))
		for i, a := range c.Args {
			hc.args[i] = hc.mapArg(a)
		}
		for _, e := range c.Env {
			hc.env = append(hc.env, e.Name+"="+e.Value)
		}
		return hc, nil
	}
	out := &daemonSet{}
	sels, err := k8smanifest.Docs[templateSelector](file)
	if err != nil {
		return nil, err
	}
	for _, d := range sels {
		if d.Kind == "DaemonSet" {
			out.nodeSelector = d.Spec.Template.Spec.NodeSelector
		}
	}
	for _, c := range spec.Containers {
		hc, err := render(c)
		if err != nil {
			return nil, err
		}
		switch {
		case slices.Contains(c.Args, "agent"):
			out.agent = hc
		case slices.Contains(c.Args, "kubelet-plugin"):
			out.bridge = hc
		case slices.ContainsFunc(append(slices.Clone(c.Command), c.Args...), isDRAPlugin):
			// The flags only: the binary is the one the suite builds.
			hc.args = slices.DeleteFunc(hc.args, isDRAPlugin)
			out.dra = &hc
		}
	}
	if out.agent.name == "" || out.bridge.name == "" {
		return nil, fmt.Errorf("%s: want an agent and a kubelet-plugin container", file)
	}
	// The agent's own config says where it listens, keeps state and finds plugins.
	cfg, err := os.ReadFile(out.agent.mapArg(out.agent.args[slices.Index(out.agent.args, "-config")+1]))
	if err != nil {
		return nil, fmt.Errorf("the agent's config: %w", err)
	}
	for key, dst := range map[string]*string{"listen": &out.agentSocket, "plugin_dir": &out.pluginDir, "state_dir": &out.stateDir} {
		m := regexp.MustCompile(`(?m)^\s*` + key + `\s*=\s*"([^"]*)"`).FindSubmatch(cfg)
		if m == nil {
			return nil, fmt.Errorf("the agent's config has no %s", key)
		}
		*dst = strings.TrimPrefix(string(m[1]), "unix://")
	}
	for _, p := range []string{out.agentSocket, out.pluginDir, out.stateDir} {
		if !strings.HasPrefix(p, base) && !strings.HasPrefix(p, kubeletRoot) {
			return nil, fmt.Errorf("the agent's config path %s maps to no volume", p)
		}
	}
	// The bridge must reach a listener of the agent's through its own mounts: one of
	// its own, which lets it reserve for pods (docs/configuration.md, "Access").
	addr := out.bridge.args[slices.Index(out.bridge.args, "-address")+1]
	var listens []string
	for _, m := range regexp.MustCompile(`(?s)listener "[^"]*" \{\s*address = "([^"]*)"\s*allow\s*= (\[[^]]*\])`).FindAllSubmatch(cfg, -1) {
		listens = append(listens, string(m[1]))
		if string(m[1]) == addr && !strings.Contains(string(m[2]), `"reserve:k8s/"`) {
			return nil, fmt.Errorf("the bridge dials %s, a listener allowing %s: not reserve:k8s/", addr, m[2])
		}
	}
	if !slices.Contains(listens, addr) {
		return nil, fmt.Errorf("the bridge dials %s, the agent listens on %s and %v", addr, out.agentSocket, listens)
	}
	if p := strings.TrimPrefix(addr, "unix://"); !strings.HasPrefix(p, base) {
		return nil, fmt.Errorf("the bridge's socket %s maps to no volume", p)
	}
	return out, nil
}

// isDRAPlugin says whether a container's command word is the DRA driver's binary.
func isDRAPlugin(word string) bool { return filepath.Base(word) == draBinary }

// The rendering runs without the node: every path the two containers use lands in a
// volume, and they meet at one agent socket.
func TestRenderDaemonSet(t *testing.T) {
	base := t.TempDir()
	kubeletRoot := filepath.Join(base, "kubelet")
	cdi := filepath.Join(base, "cdi")
	ds, err := renderDaemonSet(filepath.Join("..", "..", "deploy", "kubernetes", "devicehost.yaml"), filepath.Join(base, "ds"), kubeletRoot, cdi)
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(base, "ds", "hostpath", "run", "devicehost", "devicehost.sock"); ds.agentSocket != want {
		t.Errorf("agent socket %s, want %s", ds.agentSocket, want)
	}
	args := strings.Join(ds.bridge.args, " ")
	for _, want := range []string{
		"-device-plugin-dir " + filepath.Join(kubeletRoot, "device-plugins"),
		"-pod-resources-socket " + filepath.Join(kubeletRoot, "pod-resources", "kubelet.sock"),
	} {
		if !strings.Contains(args, want) {
			t.Errorf("bridge args %q, want %q in them", args, want)
		}
	}
	cfg, err := os.ReadFile(ds.agent.args[slices.Index(ds.agent.args, "-config")+1])
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`simulate     = "dgxh100"`, `cdi_spec_dir = "` + cdi + `"`, `state_dir  = "` + ds.stateDir + `"`} {
		if !strings.Contains(string(cfg), want) {
			t.Errorf("agent config:\n%s\nwant %s in it", cfg, want)
		}
	}
	// The node node.sh brings up has the labels the DaemonSet selects.
	script, err := os.ReadFile("node.sh")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^NODE_LABELS=(\S+)$`).FindSubmatch(script)
	if m == nil {
		t.Fatal("node.sh sets no NODE_LABELS")
	}
	labels := map[string]string{}
	for _, kv := range strings.Split(string(m[1]), ",") {
		k, v, _ := strings.Cut(kv, "=")
		labels[k] = v
	}
	if miss := unselected(ds.nodeSelector, labels); len(miss) > 0 {
		t.Errorf("the DaemonSet's nodeSelector %v needs %v, which node.sh's NODE_LABELS=%s lacks", ds.nodeSelector, miss, m[1])
	}
}
