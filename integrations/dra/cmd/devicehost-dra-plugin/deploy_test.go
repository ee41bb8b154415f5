package main

import (
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/integrations/dra/internal/manifests"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// readManifests decodes every object of a file in deploy/kubernetes, strictly.
func readManifests(t *testing.T, name string) []runtime.Object {
	t.Helper()
	objs, err := manifests.Read(filepath.Join("..", "..", "..", "..", "deploy", "kubernetes", name))
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// The DaemonSets with the DRA driver: its flags parse with the command's own parser,
// and every path they name (the agent's socket, the DRA and registration sockets'
// directories, the CDI directory, the health socket its liveness probe asks) lies on
// the volume it must; it runs as dra.yaml's ServiceAccount, which may do what the
// driver does.
func TestDeployDRADaemonSet(t *testing.T) {
	var sa string
	var role *rbacv1.ClusterRole
	var binding *rbacv1.ClusterRoleBinding
	for _, o := range readManifests(t, "dra.yaml") {
		switch o := o.(type) {
		case *corev1.ServiceAccount:
			sa = o.Namespace + "/" + o.Name
		case *rbacv1.ClusterRole:
			if strings.HasSuffix(o.Name, "-dra") { // not the node-status container's
				role = o
			}
		case *rbacv1.ClusterRoleBinding:
			if strings.HasSuffix(o.Name, "-dra") {
				binding = o
			}
		}
	}
	if sa == "" || role == nil || binding == nil {
		t.Fatalf("dra.yaml: ServiceAccount %q, ClusterRole %v, ClusterRoleBinding %v; want all three", sa, role, binding)
	}
	if binding.RoleRef.Name != role.Name || len(binding.Subjects) != 1 || binding.Subjects[0].Namespace+"/"+binding.Subjects[0].Name != sa {
		t.Errorf("binding %+v does not bind ClusterRole %s to %s", binding, role.Name, sa)
	}
	allowed := func(group, resource, verb string) bool {
		for _, r := range role.Rules {
			if slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, verb) {
				return true
			}
		}
		return false
	}
	for _, want := range [][3]string{
		{"resource.k8s.io", "resourceslices", "create"}, {"resource.k8s.io", "resourceslices", "delete"},
		{"resource.k8s.io", "resourceslices", "watch"}, {"resource.k8s.io", "resourceclaims", "get"},
		{"resource.k8s.io", "resourceclaims", "list"}, {"", "nodes", "get"},
	} {
		if !allowed(want[0], want[1], want[2]) {
			t.Errorf("ClusterRole %s does not allow %s on %s.%s", role.Name, want[2], want[1], want[0])
		}
	}

	for _, file := range []string{"devicehost-dra.yaml", "devicehost-both.yaml"} {
		t.Run(file, func(t *testing.T) {
			var cm *corev1.ConfigMap
			var ds *appsv1.DaemonSet
			for _, o := range readManifests(t, file) {
				switch o := o.(type) {
				case *corev1.ConfigMap:
					cm = o
				case *appsv1.DaemonSet:
					ds = o
				}
			}
			if cm == nil || ds == nil {
				t.Fatalf("want a ConfigMap and a DaemonSet")
			}
			spec := ds.Spec.Template.Spec
			if got := ds.Namespace + "/" + spec.ServiceAccountName; got != sa {
				t.Errorf("the pod runs as %s, want dra.yaml's %s", got, sa)
			}
			volumes := map[string]corev1.Volume{}
			for _, v := range spec.Volumes {
				volumes[v.Name] = v
			}
			var driver *corev1.Container
			for i, c := range spec.Containers {
				if c.Name == "dra-plugin" {
					driver = &spec.Containers[i]
				}
			}
			if driver == nil || !slices.Equal(driver.Command, []string{"devicehost-dra-plugin"}) {
				t.Fatalf("no container dra-plugin running devicehost-dra-plugin: %+v", driver)
			}
			var s settings
			fs := newFlags(&s)
			if err := fs.Parse(driver.Args); err != nil || fs.NArg() > 0 {
				t.Fatalf("dra-plugin args %v: %v (left %v)", driver.Args, err, fs.Args())
			}
			s.nodeName = "from-the-downward-api"
			if err := s.finish(map[string]bool{}); err != nil {
				t.Fatalf("dra-plugin args %v: %v", driver.Args, err)
			}
			if len(driver.Env) != 1 || driver.Env[0].Name != "NODE_NAME" || driver.Env[0].ValueFrom == nil ||
				driver.Env[0].ValueFrom.FieldRef == nil || driver.Env[0].ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
				t.Errorf("env %+v, want NODE_NAME from spec.nodeName", driver.Env)
			}
			// mountOf is the volume of driver's holding path.
			mountOf := func(path string) corev1.Volume {
				best := corev1.VolumeMount{}
				for _, m := range driver.VolumeMounts {
					if (path == m.MountPath || strings.HasPrefix(path, m.MountPath+"/")) && len(m.MountPath) > len(best.MountPath) {
						best = m
					}
				}
				return volumes[best.Name]
			}
			hostPath := func(path string) string {
				if v := mountOf(path); v.HostPath != nil {
					return v.HostPath.Path
				}
				return ""
			}
			// The driver dials a listener of its own, which lets it read and reserve
			// for claims, nothing more, and does not mount the agent's admin socket.
			listen := regexp.MustCompile(`(?m)^\s*listen\s*=\s*"unix://([^"]*)"`).FindStringSubmatch(cm.Data["devicehost.hcl"])
			if listen == nil || hostPath(listen[1]) != "" {
				t.Errorf("the driver mounts the agent's admin socket %v", listen)
			}
			own := regexp.MustCompile(`(?s)listener "dra-driver" \{\s*address = "unix://([^"]*)"\s*allow\s*= (\[[^]]*\])`).FindStringSubmatch(cm.Data["devicehost.hcl"])
			if own == nil || s.address != "unix://"+own[1] || own[2] != `["read", "reserve:k8s-claim/"]` {
				t.Errorf("the driver dials %s; the agent's dra-driver listener: %q, want it there allowing read and reserve:k8s-claim/", s.address, own)
			} else if got := hostPath(own[1]); got != "/run/devicehost/dra-plugin" {
				t.Errorf("the driver's socket %s is on hostPath %q in the driver, want the node's /run/devicehost/dra-plugin", own[1], got)
			}
			// The kubelet dials the driver's sockets at the paths it registers: the
			// same on the node as in the container.
			for _, dir := range []string{s.pluginDir, s.registryDir} {
				if got := hostPath(dir + "/x.sock"); got != dir {
					t.Errorf("%s is on hostPath %q, want the node's %s", dir, got, dir)
				}
			}
			if s.pluginDir != "/var/lib/kubelet/plugins/devicehost.io" || s.registryDir != "/var/lib/kubelet/plugins_registry" {
				t.Errorf("plugin dir %s, registry dir %s; want the kubelet's defaults for devicehost.io", s.pluginDir, s.registryDir)
			}
			if got := hostPath(s.cdiDir + "/x.yaml"); got != "/var/run/cdi" {
				t.Errorf("CDI dir %s is on hostPath %q, want /var/run/cdi", s.cdiDir, got)
			}
			p := driver.LivenessProbe
			want := []string{"grpc_health_probe", "-addr", "unix://" + s.healthSocket}
			if p == nil || p.Exec == nil || !slices.Equal(p.Exec.Command, want) {
				t.Errorf("liveness probe %+v, want exec %v", p, want)
			}
		})
	}
}
