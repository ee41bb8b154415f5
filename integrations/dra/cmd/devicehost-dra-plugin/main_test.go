package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
)

// The contract's flags exist, with the kubelet's directories and devicehost.io as
// defaults, and a missing node name is one clear error.
func TestFlags(t *testing.T) {
	t.Setenv("NODE_NAME", "")
	err := run([]string{"-address", "unix:///nonexistent/dh.sock", "-kubeconfig", "/nonexistent"})
	if err == nil || !strings.Contains(err.Error(), "-node-name") {
		t.Errorf("run without a node name: %v; want an error naming -node-name", err)
	}
	err = run([]string{"-node-name", "n", "-kubeconfig", "/nonexistent/kubeconfig"})
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/kubeconfig") {
		t.Errorf("run with a missing kubeconfig: %v; want an error naming it", err)
	}
	if err := run([]string{"-no-such-flag"}); err == nil {
		t.Error("run with an unknown flag: no error")
	}
}

func TestFlagDefaults(t *testing.T) {
	t.Setenv("NODE_NAME", "node-from-env")
	var s settings
	if err := newFlags(&s).Parse(nil); err != nil {
		t.Fatal(err)
	}
	want := settings{address: "unix:///run/devicehost/devicehost.sock", nodeName: "node-from-env", driverName: "devicehost.io",
		registryDir: "/var/lib/kubelet/plugins_registry", cdiDir: "/var/run/cdi", staleGrace: s.staleGrace, staleInterval: s.staleInterval, logLevel: "info",
		healthStall: time.Minute, healthAgent: 3 * time.Minute, kubeQPS: 5, kubeBurst: 10}
	if s != want {
		t.Errorf("defaults %+v; want %+v", s, want)
	}
	// The health socket lies beside the DRA socket, in the plugin dir.
	if err := s.finish(map[string]bool{}); err != nil {
		t.Fatal(err)
	}
	if want := "/var/lib/kubelet/plugins/devicehost.io/health.sock"; s.healthSocket != want {
		t.Errorf("health socket %q, want %q", s.healthSocket, want)
	}
}

// Health flags that cannot work are refused, all at once, each named.
func TestHealthFlagErrors(t *testing.T) {
	err := run([]string{"-node-name", "n", "-health-stall-timeout", "10ms", "-health-agent-timeout", "0s", "-health-socket", "h.sock"})
	for _, want := range []string{"-health-stall-timeout 10ms is below the minimum of 1s", "-health-agent-timeout 0s is below the minimum of 1s", `-health-socket "h.sock": want an absolute path`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("run: %v; want %q in it", err, want)
		}
	}
	var s settings
	fs := newFlags(&s)
	if err := fs.Parse([]string{"-node-name", "n", "-health-socket", ""}); err != nil {
		t.Fatal(err)
	}
	if err := s.finish(map[string]bool{"health-socket": true}); err != nil || s.healthSocket != "" {
		t.Errorf(`-health-socket "": %q, %v; want none`, s.healthSocket, err)
	}
}

// The driver's requests to the API server, from every client it makes, go at the pace
// of -kube-api-qps and -kube-api-burst together: a burst of 3 at 0.001 a second takes
// three requests, of the typed and the metadata client alike, and holds the fourth back
// (it fails at its deadline, not sent).
func TestKubeAPIRateBoundsEveryClient(t *testing.T) {
	var sent atomic.Int32
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sent.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}`)
	}))
	defer api.Close()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	body := fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: %s\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\nusers:\n- name: u\n  user: {}\ncurrent-context: c\n", api.URL)
	if err := os.WriteFile(kubeconfig, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	var s settings
	if err := newFlags(&s).Parse([]string{"-node-name", "n", "-kubeconfig", kubeconfig, "-kube-api-qps", "0.001", "-kube-api-burst", "3"}); err != nil {
		t.Fatal(err)
	}
	if err := s.finish(map[string]bool{}); err != nil {
		t.Fatal(err)
	}
	cfg, err := s.restConfig()
	if err != nil {
		t.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	meta, err := metadata.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	slices := schema.GroupVersionResource{Group: "resource.k8s.io", Version: "v1", Resource: "resourceslices"}
	get := []func(context.Context) error{
		func(ctx context.Context) error {
			_, err := kube.CoreV1().Nodes().Get(ctx, "n", metav1.GetOptions{})
			return err
		},
		func(ctx context.Context) error {
			_, err := meta.Resource(slices).Get(ctx, "s", metav1.GetOptions{})
			return err
		},
		func(ctx context.Context) error {
			_, err := kube.ResourceV1().ResourceSlices().Get(ctx, "s", metav1.GetOptions{})
			return err
		},
	}
	for i, g := range get {
		if err := g(context.Background()); !apierrors.IsNotFound(err) {
			t.Fatalf("request %d within the burst: %v; want the server's NotFound", i+1, err)
		}
	}
	for i, g := range get {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		err := g(ctx)
		cancel()
		if err == nil || apierrors.IsNotFound(err) {
			t.Errorf("request %d past the burst: %v; want it held back by the limit", i+4, err)
		}
	}
	if n := sent.Load(); n != 3 {
		t.Errorf("the API server got %d requests; want the burst of 3", n)
	}
}

// Rates that cannot pace anything are refused, each named.
func TestKubeAPIRateFlagErrors(t *testing.T) {
	for _, tt := range []struct{ args, want string }{
		{"-kube-api-qps 0", "-kube-api-qps 0: want a number of requests a second above 0"},
		{"-kube-api-qps -1", "-kube-api-qps -1: want"},
		{"-kube-api-qps NaN", "-kube-api-qps NaN: want"},
		{"-kube-api-qps 1e300", "-kube-api-qps 1e+300: want"},
		{"-kube-api-burst 0", "-kube-api-burst 0: want 1 or more"},
	} {
		err := run(append([]string{"-node-name", "n"}, strings.Fields(tt.args)...))
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v; want %q in it", tt.args, err, tt.want)
		}
	}
}
