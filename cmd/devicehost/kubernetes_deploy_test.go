package main

import (
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/tools/k8smanifest"
)

// The Kubernetes manifests in deploy/kubernetes are checked here, with the binary's own
// flag and config parsing: what a node would run must parse.

// readManifests decodes every YAML document of file, refusing unknown fields nowhere
// (Kubernetes objects have many the checks do not read) but any YAML error.
func readManifests(t *testing.T, file string) []k8smanifest.Object {
	t.Helper()
	objs, err := k8smanifest.Read(filepath.Join("..", "..", "deploy", "kubernetes", file))
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if o.APIVersion == "" || o.Kind == "" || o.Metadata.Name == "" {
			t.Errorf("%s: a document without apiVersion, kind or metadata.name: %+v", file, o)
		}
	}
	return objs
}

// The DaemonSets with the kubelet bridge: the device-plugin install and the one with
// both Kubernetes paths.
func TestDeployDaemonSet(t *testing.T) {
	for _, file := range []string{"devicehost.yaml", "devicehost-both.yaml"} {
		t.Run(file, func(t *testing.T) { checkBridgeDaemonSet(t, file) })
	}
}

func checkBridgeDaemonSet(t *testing.T, file string) {
	objs := readManifests(t, file)
	var config, ds *k8smanifest.Object
	for i := range objs {
		switch objs[i].Kind {
		case "ConfigMap":
			config = &objs[i]
		case "DaemonSet":
			ds = &objs[i]
		}
	}
	if config == nil || ds == nil {
		t.Fatalf("want a ConfigMap and a DaemonSet, have %d objects", len(objs))
	}
	spec := ds.Spec.Template.Spec
	volumes := map[string]string{} // name -> "emptyDir", "configMap" or the host path
	for _, v := range spec.Volumes {
		switch {
		case v.EmptyDir != nil:
			volumes[v.Name] = "emptyDir"
		case v.ConfigMap != nil:
			volumes[v.Name] = "configMap"
			if v.ConfigMap.Name != config.Metadata.Name {
				t.Errorf("volume %s uses ConfigMap %q, want %q", v.Name, v.ConfigMap.Name, config.Metadata.Name)
			}
		case v.HostPath != nil:
			volumes[v.Name] = v.HostPath.Path
		}
	}
	for _, p := range []string{"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources", "/opt/devicehost/plugins", "/var/lib/devicehost", "/var/run/cdi", "/run/devicehost"} {
		if !slices.Contains(slices.Collect(maps.Values(volumes)), p) {
			t.Errorf("no hostPath volume for %s", p)
		}
	}

	// Each container's command line parses, with the ConfigMap's files where they are
	// mounted.
	dir := t.TempDir()
	for name, content := range config.Data {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	env := &cmdEnv{stdout: io.Discard, stderr: io.Discard, getenv: func(string) string { return "" }}
	containers := map[string]k8smanifest.Container{}
	for _, c := range append(spec.InitContainers, spec.Containers...) {
		containers[c.Name] = c
		for _, m := range c.VolumeMounts {
			if _, ok := volumes[m.Name]; !ok {
				t.Errorf("container %s mounts volume %q, which is not declared", c.Name, m.Name)
			}
		}
	}
	agent, bridge := containers["agent"], containers["kubelet-plugin"]
	if len(agent.Args) == 0 || len(bridge.Args) == 0 {
		t.Fatalf("want containers agent and kubelet-plugin with args, have %v", slices.Collect(maps.Keys(containers)))
	}
	args := func(c k8smanifest.Container) []string {
		out := slices.Clone(c.Args[1:])
		for i, a := range out {
			if strings.HasPrefix(a, "/etc/devicehost/") {
				out[i] = filepath.Join(dir, strings.TrimPrefix(a, "/etc/devicehost/"))
			}
		}
		return out
	}
	a, err := parseAgentArgs(env, args(agent))
	if err != nil {
		t.Fatalf("agent args %v: %v", agent.Args, err)
	}
	k, err := parseKubeletPluginArgs(env, args(bridge))
	if err != nil {
		t.Fatalf("kubelet-plugin args %v: %v", bridge.Args, err)
	}
	if agent.Args[0] != "agent" || bridge.Args[0] != "kubelet-plugin" {
		t.Errorf("subcommands %q and %q, want agent and kubelet-plugin", agent.Args[0], bridge.Args[0])
	}
	// The bridge dials a listener of its own, which lets it read and reserve for the
	// owners it makes, nothing more.
	var bridgeListener listenerSettings
	for _, l := range a.cfg.Listeners {
		if l.Address == k.Address {
			bridgeListener = l
		}
	}
	if want := []string{"read", "reserve:kubelet/", "reserve:k8s/"}; !slices.Equal(bridgeListener.Allow, want) {
		t.Errorf("the bridge dials %s, a listener allowing %q among %+v; want one allowing %q", k.Address, bridgeListener.Allow, a.cfg.Listeners, want)
	}
	if len(k.Resources) != 1 || k.Resources[0].Name != "nvidia.com/gpu" {
		t.Errorf("resources %+v, want nvidia.com/gpu", k.Resources)
	}
	// The socket's directory is the node's /run/devicehost (the host's CLI reads the
	// ledger there), which both containers mount at the same place; the kubelet's
	// directories are where the bridge's flags say.
	mountOf := func(c k8smanifest.Container, path string) string {
		for _, m := range c.VolumeMounts {
			if strings.HasPrefix(path, m.MountPath+"/") {
				return m.Name
			}
		}
		return ""
	}
	sock := strings.TrimPrefix(a.cfg.Listen, "unix://")
	if v := mountOf(agent, sock); v == "" || volumes[v] != "/run/devicehost" {
		t.Errorf("admin socket %s: agent's volume %q, want the hostPath /run/devicehost", sock, v)
	}
	if v := mountOf(bridge, sock); v != "" {
		t.Errorf("the bridge mounts the admin socket %s (volume %q)", sock, v)
	}
	// The bridge's own socket: the same path on the node, in the agent and in the bridge.
	bsock := strings.TrimPrefix(k.Address, "unix://")
	if va, vb := mountOf(agent, bsock), mountOf(bridge, bsock); volumes[va] != "/run/devicehost" || volumes[vb] != "/run/devicehost/kubelet-plugin" ||
		!strings.HasPrefix(bsock, "/run/devicehost/kubelet-plugin/") {
		t.Errorf("bridge socket %s: agent's volume %q (%s), bridge's %q (%s); want the node's /run/devicehost/kubelet-plugin in both", bsock, va, volumes[va], vb, volumes[vb])
	}
	if v := mountOf(bridge, k.DevicePluginDir+"/x"); volumes[v] != "/var/lib/kubelet/device-plugins" {
		t.Errorf("-device-plugin-dir %s is not the kubelet's device-plugins hostPath", k.DevicePluginDir)
	}
	if v := mountOf(bridge, k.PodResourcesSocket); volumes[v] != "/var/lib/kubelet/pod-resources" {
		t.Errorf("-pod-resources-socket %s is not in the kubelet's pod-resources hostPath", k.PodResourcesSocket)
	}
	if v := mountOf(agent, a.cfg.StateDir+"/x"); volumes[v] != "/var/lib/devicehost" {
		t.Errorf("state dir %s is not on the state hostPath", a.cfg.StateDir)
	}
	if v := mountOf(agent, a.cfg.PluginDir+"/x"); volumes[v] != "/opt/devicehost/plugins" {
		t.Errorf("plugin dir %s is not on the plugins hostPath", a.cfg.PluginDir)
	}
	// The plugin's CDI spec lands where the node's container runtime reads it.
	if v := mountOf(agent, "/var/run/cdi/devicehost-nvidia-example.yaml"); volumes[v] != "/var/run/cdi" {
		t.Errorf("the agent's /var/run/cdi is not the node's (volume %q)", v)
	}
	// Liveness: grpc_health_probe on the agent's socket and service.
	if agent.LivenessProbe == nil {
		t.Fatal("the agent has no liveness probe")
	}
	want := []string{"grpc_health_probe", "-addr", a.cfg.Listen, "-service", "devicehost.v1.DeviceHost"}
	if got := agent.LivenessProbe.Exec.Command; !slices.Equal(got, want) {
		t.Errorf("agent liveness probe %v, want %v", got, want)
	}
	// The bridge's: grpc_health_probe on the health socket it serves, in a volume of
	// its own container (the shared socket directory).
	if bridge.LivenessProbe == nil {
		t.Fatal("the kubelet-plugin has no liveness probe")
	}
	want = []string{"grpc_health_probe", "-addr", "unix://" + k.HealthSocket}
	if got := bridge.LivenessProbe.Exec.Command; k.HealthSocket == "" || !slices.Equal(got, want) {
		t.Errorf("kubelet-plugin liveness probe %v, want %v", got, want)
	}
	if v := mountOf(bridge, k.HealthSocket); volumes[v] != "/run/devicehost/kubelet-plugin" {
		t.Errorf("the bridge's health socket %s is on volume %q, want its socket directory", k.HealthSocket, v)
	}
}

// Every container of every DaemonSet in deploy/kubernetes has a liveness probe that
// asks grpc.health.v1 over a unix socket (a container that is stuck is restarted).
func TestDeployEveryContainerProbed(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("..", "..", "deploy", "kubernetes", "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	daemonSets := 0
	for _, f := range files {
		for _, o := range readManifests(t, filepath.Base(f)) {
			if o.Kind != "DaemonSet" {
				continue
			}
			daemonSets++
			for _, c := range o.Spec.Template.Spec.Containers {
				p := c.LivenessProbe
				if p == nil || len(p.Exec.Command) < 3 || p.Exec.Command[0] != "grpc_health_probe" || p.Exec.Command[1] != "-addr" || !strings.HasPrefix(p.Exec.Command[2], "unix:///") {
					t.Errorf("%s: container %s: liveness probe %+v, want grpc_health_probe -addr unix:///...", filepath.Base(f), c.Name, p)
				}
			}
		}
	}
	if daemonSets < 3 {
		t.Errorf("%d DaemonSets in deploy/kubernetes, want one per mode (device plugin, DRA, both)", daemonSets)
	}
}

func TestDeployExamplePod(t *testing.T) {
	objs := readManifests(t, "example-pod.yaml")
	if len(objs) != 1 || objs[0].Kind != "Pod" || len(objs[0].Spec.Containers) != 1 {
		t.Fatalf("want one Pod with one container, have %+v", objs)
	}
	if got := objs[0].Spec.Containers[0].Resources.Limits["nvidia.com/gpu"]; got != "2" {
		t.Errorf("nvidia.com/gpu limit %q, want 2", got)
	}
}
