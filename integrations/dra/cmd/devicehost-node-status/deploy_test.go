package main

import (
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"

	"github.com/devicehost/devicehost/integrations/dra/internal/manifests"
)

// The node-status container of every plain manifest: its flags parse with the command's
// own parser; it dials the agent's read-only listener (allow = ["read"]) on the volume
// that holds it, and its health socket is on a volume of its own that its liveness
// probe asks; its service account may patch nodes and their status, and the
// ValidatingAdmissionPolicy that keeps it to its own node matches that account.
func TestDeployNodeStatus(t *testing.T) {
	for _, files := range [][]string{{"devicehost.yaml"}, {"dra.yaml", "devicehost-dra.yaml"}, {"dra.yaml", "devicehost-both.yaml"}} {
		t.Run(files[len(files)-1], func(t *testing.T) {
			var cm *corev1.ConfigMap
			var ds *appsv1.DaemonSet
			roles := map[string]*rbacv1.ClusterRole{}
			var bindings []*rbacv1.ClusterRoleBinding
			var policy *admissionv1.ValidatingAdmissionPolicy
			var policyBinding *admissionv1.ValidatingAdmissionPolicyBinding
			for _, f := range files {
				objs, err := manifests.Read(filepath.Join("..", "..", "..", "..", "deploy", "kubernetes", f))
				if err != nil {
					t.Fatal(err)
				}
				for _, o := range objs {
					switch o := o.(type) {
					case *corev1.ConfigMap:
						cm = o
					case *appsv1.DaemonSet:
						ds = o
					case *rbacv1.ClusterRole:
						roles[o.Name] = o
					case *rbacv1.ClusterRoleBinding:
						bindings = append(bindings, o)
					case *admissionv1.ValidatingAdmissionPolicy:
						policy = o
					case *admissionv1.ValidatingAdmissionPolicyBinding:
						policyBinding = o
					}
				}
			}
			if cm == nil || ds == nil || policy == nil || policyBinding == nil {
				t.Fatalf("ConfigMap %v, DaemonSet %v, ValidatingAdmissionPolicy %v and binding %v: want all", cm != nil, ds != nil, policy != nil, policyBinding != nil)
			}
			spec := ds.Spec.Template.Spec
			i := slices.IndexFunc(spec.Containers, func(c corev1.Container) bool { return c.Name == "node-status" })
			if i < 0 || !slices.Equal(spec.Containers[i].Command, []string{"devicehost-node-status"}) {
				t.Fatal("no container node-status running devicehost-node-status")
			}
			c := spec.Containers[i]
			var s settings
			fs := newFlags(&s)
			if err := fs.Parse(c.Args); err != nil || fs.NArg() > 0 {
				t.Fatalf("node-status args %v: %v (left %v)", c.Args, err, fs.Args())
			}
			if len(c.Env) != 1 || c.Env[0].Name != "NODE_NAME" || c.Env[0].ValueFrom == nil || c.Env[0].ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
				t.Errorf("env %+v, want NODE_NAME from spec.nodeName", c.Env)
			}
			volumes := map[string]corev1.Volume{}
			for _, v := range spec.Volumes {
				volumes[v.Name] = v
			}
			mounted := func(path string) (corev1.Volume, bool) {
				for _, m := range c.VolumeMounts {
					if filepath.Dir(path) == m.MountPath {
						v, ok := volumes[m.Name]
						return v, ok
					}
				}
				return corev1.Volume{}, false
			}
			sock := strings.TrimPrefix(s.address, "unix://")
			v, ok := mounted(sock)
			if !ok || v.HostPath == nil || !strings.HasSuffix(v.HostPath.Path, "/read-only") {
				t.Errorf("the agent socket %s is not on the read-only listener's hostPath: %+v", sock, v)
			}
			listener := regexp.MustCompile(`(?s)listener "[^"]+" \{\s*address = "` + regexp.QuoteMeta(s.address) + `"\s*allow\s*=\s*\["read"\]`)
			if !listener.MatchString(cm.Data["devicehost.hcl"]) {
				t.Errorf("the agent config has no listener at %s allowing read only:\n%s", s.address, cm.Data["devicehost.hcl"])
			}
			if v, ok := mounted(s.healthSocket); !ok || v.EmptyDir == nil {
				t.Errorf("the health socket %q is not on an emptyDir of its own: %+v", s.healthSocket, v)
			}
			if p := c.LivenessProbe; p == nil || p.Exec == nil || !slices.Contains(p.Exec.Command, "unix://"+s.healthSocket) {
				t.Errorf("liveness probe %+v does not ask %s", p, s.healthSocket)
			}
			account := "system:serviceaccount:" + ds.Namespace + ":" + spec.ServiceAccountName
			var may []string
			for _, b := range bindings {
				if len(b.Subjects) == 1 && "system:serviceaccount:"+b.Subjects[0].Namespace+":"+b.Subjects[0].Name == account {
					for _, r := range roles[b.RoleRef.Name].Rules {
						for _, res := range r.Resources {
							for _, verb := range r.Verbs {
								may = append(may, res+":"+verb)
							}
						}
					}
				}
			}
			for _, want := range []string{"nodes:get", "nodes:patch", "nodes/status:patch"} {
				if !slices.Contains(may, want) {
					t.Errorf("%s may not %s (it may %v)", account, want, may)
				}
			}
			if len(policy.Spec.MatchConditions) != 1 || !strings.Contains(policy.Spec.MatchConditions[0].Expression, `"`+account+`"`) {
				t.Errorf("the policy does not match %s: %+v", account, policy.Spec.MatchConditions)
			}
			if policyBinding.Spec.PolicyName != policy.Name || !slices.Equal(policyBinding.Spec.ValidationActions, []admissionv1.ValidationAction{admissionv1.Deny}) {
				t.Errorf("policy binding %+v does not deny by policy %s", policyBinding.Spec, policy.Name)
			}
		})
	}
}
