package dra

import "testing"

func TestDeviceName(t *testing.T) {
	for _, tc := range []struct{ id, want string }{
		{"gpu-0", "gpu-0"},
		{"GPU-8f3a4b2c-1d2e-3f40-5a6b-7c8d9e0f1a2b", "gpu-8f3a4b2c-1d2e-3f40-5a6b-7c8d9e0f1a2b-" + hash8("GPU-8f3a4b2c-1d2e-3f40-5a6b-7c8d9e0f1a2b")},
		{"MIG-GPU-1/1g.10gb@0", "mig-gpu-1-1g-10gb-0-" + hash8("MIG-GPU-1/1g.10gb@0")},
		{"///", "d-" + hash8("///")},
	} {
		got := DeviceName(tc.id)
		if got != tc.want {
			t.Errorf("DeviceName(%q) = %q, want %q", tc.id, got, tc.want)
		}
		if !isLabel(got) {
			t.Errorf("DeviceName(%q) = %q: not a DNS label", tc.id, got)
		}
	}
	if a, b := DeviceName("GPU-A"), DeviceName("gpu-a"); a == b {
		t.Errorf("GPU-A and gpu-a share the name %q", a)
	}
	long := "GPU-" + "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	if got := DeviceName(long); len(got) > 63 || !isLabel(got) {
		t.Errorf("DeviceName(long) = %q (%d chars): want a DNS label", got, len(got))
	}
}

func hash8(s string) string { n := label(s); return n[len(n)-8:] }

func TestLabelValue(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"k8s/default/pod/ctr", "k8s.default.pod.ctr"},
		{"XID 79: GPU fell off the bus", "XID.79..GPU.fell.off.the.bus"},
		{"", "def"},
		{"///", "def"},
		{"-x-", "x"},
	} {
		if got := labelValue(tc.in, "def"); got != tc.want {
			t.Errorf("labelValue(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
	long := labelValue("owner/"+string(make([]byte, 100)), "def")
	if len(long) > 63 {
		t.Errorf("labelValue(long) has %d characters", len(long))
	}
}

func TestAttributeName(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"driver_version", "driverVersion"},
		{"memory", "memory"},
		{"compute_capability", "computeCapability"},
		{"cuda-version", "cudaVersion"},
		{"9lives", ""},
		{"a/b", ""},
		{"this_attribute_name_is_much_too_long_for_dra", ""},
	} {
		if got := attributeName(tc.in); got != tc.want {
			t.Errorf("attributeName(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestVersion(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		ok       bool
	}{
		{"550.54.15", "550.54.15", true},
		{"535.104.05", "535.104.5", true},
		{"9.0", "9.0.0", true},
		{"12", "12.0.0", true},
		{"1.2.3.4", "", false},
		{"v1.2", "", false},
		{"", "", false},
	} {
		got, ok := version(tc.in)
		if got != tc.want || ok != tc.ok {
			t.Errorf("version(%q) = %q, %v; want %q, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}
