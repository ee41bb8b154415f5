package kubernetes

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestValidateResourceName(t *testing.T) {
	for _, tc := range []struct {
		name string
		want string // "" for valid, else a part of the error
	}{
		{"nvidia.com/gpu", ""},
		{"example.com/fpga-Widget_9000.v2", ""},
		{"a/b", ""},
		{"nvidia.com/" + strings.Repeat("g", 63), ""},
		{"", "is empty"},
		{"gpu", "has no domain"},
		{"nvidia.com/gpu/extra", "more than one '/'"},
		{"kubernetes.io/gpu", "kubernetes.io namespace"},
		{"gpu.kubernetes.io/x", "kubernetes.io namespace"},
		{"requests.example.com/gpu", `starts with "requests."`},
		{"Nvidia.com/gpu", "not a DNS subdomain"},
		{"nvidia_corp.com/gpu", "not a DNS subdomain"},
		{"-nvidia.com/gpu", "not a DNS subdomain"},
		{"nvidia..com/gpu", "not a DNS subdomain"},
		{"/gpu", "not a DNS subdomain"},
		{"nvidia.com/", "must be letters, digits"},
		{"nvidia.com/-gpu", "must be letters, digits"},
		{"nvidia.com/gpu!", "must be letters, digits"},
		{"nvidia.com/gp u", "must be letters, digits"},
		{"nvidia.com/" + strings.Repeat("g", 64), "longer than 63"},
		{strings.Repeat("a", 200) + ".com/gpu", "more than 200"},
		{"nvidia.com/gpu\n", "must be letters, digits"},
	} {
		err := ValidateResourceName(tc.name)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("ValidateResourceName(%q) = %v, want nil", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("ValidateResourceName(%q) = %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

func TestDefaultResourceName(t *testing.T) {
	tests := []struct{ vendor, typ, name, want string }{
		{"nvidia", "gpu", "NVIDIA H100 80GB HBM3", "nvidia.com/gpu"},
		{"nvidia", PartitionType, "1g.10gb", "nvidia.com/mig-1g.10gb"},
		{HostDevVendor, "fuse", "fuse", "devicehost.io/fuse"},
		{HostDevVendor, "tun", "tun", "devicehost.io/tun"},
		{"devic.es", "fuse", "fuse", "devic.es/fuse"},
		{"intel.com", "qat", "qat", "intel.com/qat"},
	}
	for _, tt := range tests {
		got := DefaultResourceName(tt.vendor, tt.typ, tt.name)
		if got != tt.want {
			t.Errorf("DefaultResourceName(%q, %q, %q) = %q, want %q", tt.vendor, tt.typ, tt.name, got, tt.want)
		}
		if err := ValidateResourceName(got); err != nil {
			t.Errorf("default name %q is refused: %v", got, err)
		}
	}
}

func TestValidateResources(t *testing.T) {
	gpu := Resource{Name: "nvidia.com/gpu", Vendor: "nvidia", Type: "gpu"}
	h100 := Resource{Name: "nvidia.com/h100", Vendor: "nvidia", Type: "gpu", Model: "NVIDIA H100 80GB HBM3"}
	a100 := Resource{Name: "nvidia.com/a100", Vendor: "nvidia", Type: "gpu", Model: "NVIDIA A100"}
	fpga := Resource{Name: "acme.com/fpga", Vendor: "acme", Type: "fpga"}
	for _, tc := range []struct {
		name string
		rs   []Resource
		want string
	}{
		{"none", nil, ""},
		{"one per model", []Resource{h100, a100, fpga}, ""},
		{"any model and one model overlap", []Resource{gpu, h100}, `resources "nvidia.com/gpu" and "nvidia.com/h100" both match device groups of vendor "nvidia" type "gpu" name "NVIDIA H100 80GB HBM3"`},
		{"same model twice", []Resource{h100, {Name: "x.com/y", Vendor: "nvidia", Type: "gpu", Model: h100.Model}}, "both match"},
		{"a name twice", []Resource{gpu, {Name: gpu.Name, Vendor: "acme", Type: "fpga"}}, `resource "nvidia.com/gpu" is configured twice`},
		{"no vendor", []Resource{{Name: "x.com/y", Type: "gpu"}}, "vendor and type must be set"},
		{"bad name", []Resource{{Name: "gpu", Vendor: "nvidia", Type: "gpu"}}, "has no domain"},
	} {
		err := ValidateResources(tc.rs)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v, want nil", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

func TestOwnerID(t *testing.T) {
	a := ownerID("nvidia.com/gpu", []string{"GPU-1", "GPU-2"})
	if b := ownerID("nvidia.com/gpu", []string{"GPU-2", "GPU-1"}); a != b {
		t.Errorf("owner depends on the order of devices: %q vs %q", a, b)
	}
	for _, other := range []string{
		ownerID("nvidia.com/gpu", []string{"GPU-1"}),
		ownerID("nvidia.com/gpu", []string{"GPU-1", "GPU-3"}),
		ownerID("nvidia.com/gpu", []string{"GPU-1GPU-2"}),
		ownerID("nvidia.com/h100", []string{"GPU-1", "GPU-2"}),
	} {
		if other == a {
			t.Errorf("two different requests share the owner %q", a)
		}
	}
	if res, ok := resourceOfOwner(a); !ok || res != "nvidia.com/gpu" {
		t.Errorf("resourceOfOwner(%q) = %q, %v; want nvidia.com/gpu, true", a, res, ok)
	}
	long := ownerID("a.com/"+strings.Repeat("g", 63), []string{strings.Repeat("x", 1000)})
	if n := len(ownerPrefix + strings.Repeat("r", MaxResourceNameLen) + "/0123456789abcdef"); n > 256 {
		t.Errorf("the longest owner ID is %d bytes, more than the agent's 256", n)
	}
	if _, ok := resourceOfOwner(long); !ok {
		t.Errorf("resourceOfOwner(%q): not ours", long)
	}
	for _, owner := range []string{"job-42", "kubelet/nvidia.com/gpu", "kubelet/nvidia.com/gpu/xyz", "kubelet//0123456789abcdef",
		"kubelet/nvidia.com/gpu/0123456789abcdeg", "k8s/default/pod/ctr"} {
		if res, ok := resourceOfOwner(owner); ok {
			t.Errorf("resourceOfOwner(%q) = %q, true; want not the bridge's", owner, res)
		}
	}
}

func TestSocketName(t *testing.T) {
	if got, want := socketName("nvidia.com/gpu"), "devicehost-nvidia.com_gpu.sock"; got != want {
		t.Errorf("socketName = %q, want %q", got, want)
	}
}

// A socket a live process serves is never taken over; a stale one (nothing accepts
// on it) is replaced; a file that is not a socket is left alone.
func TestListenSocket(t *testing.T) {
	dir, err := os.MkdirTemp("", "lsk")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "p.sock")

	live, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := listenSocket(path); err == nil || !strings.Contains(err.Error(), "another process serves this socket") {
		t.Errorf("listen over a live socket: %v, want refused", err)
	}
	live.(*net.UnixListener).SetUnlinkOnClose(false)
	live.Close() // now stale: the file stays, nothing accepts

	lis, fi, err := listenSocket(path)
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	if got, err := os.Lstat(path); err != nil || !os.SameFile(got, fi) || got.Mode().Perm() != 0o600 {
		t.Errorf("socket after replacing a stale one: %v %v, want ours with mode 0600", got.Mode(), err)
	}
	lis.Close()
	if _, err := os.Lstat(path); err != nil {
		t.Errorf("closing the listener removed the socket (%v): it must be left to stop, which checks it is still ours", err)
	}

	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := listenSocket(plain); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("listen over a plain file: %v, want refused", err)
	}
	if _, err := os.Stat(plain); errors.Is(err, os.ErrNotExist) {
		t.Error("the plain file was removed")
	}
}

func TestSysfsPCIeRoot(t *testing.T) {
	sys := t.TempDir()
	// Two GPUs behind one switch on root port 17:01.0, one on root port 17:02.0, one
	// on the host bridge itself.
	devs := map[string]string{
		"0000:1b:00.0": "pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1b:00.0",
		"0000:1c:00.0": "pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:01.0/0000:1c:00.0",
		"0000:2a:00.0": "pci0000:17/0000:17:02.0/0000:2a:00.0",
		"0000:00:02.0": "pci0000:00/0000:00:02.0",
	}
	if err := os.MkdirAll(filepath.Join(sys, "bus", "pci", "devices"), 0o755); err != nil {
		t.Fatal(err)
	}
	for bus, path := range devs {
		full := filepath.Join(sys, "devices", path)
		if err := os.MkdirAll(full, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(filepath.Join("..", "..", "..", "devices", path), filepath.Join(sys, "bus", "pci", "devices", bus)); err != nil {
			t.Fatal(err)
		}
	}
	// A link that escapes the devices tree names no root.
	if err := os.Symlink("/etc", filepath.Join(sys, "bus", "pci", "devices", "0000:ff:00.0")); err != nil {
		t.Fatal(err)
	}
	root := SysfsPCIeRoot(sys)
	for _, tc := range []struct{ bus, want string }{
		{"0000:1b:00.0", "pci0000:17/0000:17:01.0"},
		{"0000:1c:00.0", "pci0000:17/0000:17:01.0"},
		{"0000:2a:00.0", "pci0000:17/0000:17:02.0"},
		{"0000:00:02.0", "pci0000:00/0000:00:02.0"},
		{"0000:99:00.0", ""},
		{"0000:ff:00.0", ""},
		{"", ""},
		{"../../../../etc", ""},
		{"..", ""},
	} {
		if got := root(tc.bus); got != tc.want {
			t.Errorf("root(%q) = %q, want %q", tc.bus, got, tc.want)
		}
	}
}
