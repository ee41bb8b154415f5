package validate_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

var requested = []string{"GPU-0", "GPU-1"}

// goodReservation returns a fresh reservation that breaks no rule for requested.
func goodReservation() *pb.ContainerReservation {
	return &pb.ContainerReservation{
		Envs: map[string]string{
			"NVIDIA_VISIBLE_DEVICES": "GPU-0,GPU-1",
			"CUDA_VISIBLE_DEVICES":   "0,1",
			"_PRIVATE":               "",
			"LDX":                    "not the loader's", // LD without the underscore
			"ld_preload":             "glibc reads only upper case",
			"PATHS":                  "not PATH",
		},
		Mounts: []*pb.Mount{
			{HostPath: "/usr/lib/x86_64-linux-gnu/libcuda.so.1", ContainerPath: "/usr/lib/libcuda.so.1", ReadOnly: true},
			{HostPath: "/", ContainerPath: "/host"},
		},
		Devices: []*pb.DeviceSpec{
			{HostPath: "/dev/nvidia0", ContainerPath: "/dev/nvidia0", Permissions: "rw"},
			{HostPath: "/dev/nvidiactl", ContainerPath: "/dev/nvidiactl", Permissions: "mwr"},
			{HostPath: "/dev/nvidia-uvm", ContainerPath: "/dev/nvidia-uvm", Permissions: "r"},
		},
		CdiDevices: []string{"nvidia.com/gpu=GPU-0", "nvidia.com/gpu=GPU-1"},
	}
}

func TestReservation(t *testing.T) {
	env := func(name, value string) func(*pb.ContainerReservation) {
		return func(r *pb.ContainerReservation) { r.Envs[name] = value }
	}
	mountHost := func(p string) func(*pb.ContainerReservation) {
		return func(r *pb.ContainerReservation) { r.Mounts[0].HostPath = p }
	}
	devContainer := func(p string) func(*pb.ContainerReservation) {
		return func(r *pb.ContainerReservation) { r.Devices[1].ContainerPath = p }
	}
	perms := func(p string) func(*pb.ContainerReservation) {
		return func(r *pb.ContainerReservation) { r.Devices[0].Permissions = p }
	}
	cdi := func(name string) func(*pb.ContainerReservation) {
		return func(r *pb.ContainerReservation) { r.CdiDevices[1] = name }
	}
	one := func(item string, rule validate.Rule) []found { return []found{{item, rule}} }
	tests := []struct {
		name   string
		mutate func(*pb.ContainerReservation)
		want   []found
	}{
		{name: "good", mutate: func(*pb.ContainerReservation) {}},
		{name: "empty", mutate: func(r *pb.ContainerReservation) { *r = pb.ContainerReservation{} }},
		{name: "CDI name with dots and colons", mutate: cdi("example.co.uk/fpga_x=GPU-1")},

		{name: "env LD_PRELOAD", mutate: env("LD_PRELOAD", "/x.so"), want: one(`env "LD_PRELOAD"`, validate.RuleEnvDenied)},
		{name: "env LD_LIBRARY_PATH", mutate: env("LD_LIBRARY_PATH", "/x"), want: one(`env "LD_LIBRARY_PATH"`, validate.RuleEnvDenied)},
		{name: "env LD_AUDIT", mutate: env("LD_AUDIT", "/x.so"), want: one(`env "LD_AUDIT"`, validate.RuleEnvDenied)},
		{name: "env LD_ prefix", mutate: env("LD_SOMETHING_NEW", ""), want: one(`env "LD_SOMETHING_NEW"`, validate.RuleEnvDenied)},
		{name: "env DYLD_ prefix", mutate: env("DYLD_INSERT_LIBRARIES", "/x"), want: one(`env "DYLD_INSERT_LIBRARIES"`, validate.RuleEnvDenied)},
		{name: "env GLIBC_TUNABLES", mutate: env("GLIBC_TUNABLES", "x"), want: one(`env "GLIBC_TUNABLES"`, validate.RuleEnvDenied)},
		{name: "env GCONV_PATH", mutate: env("GCONV_PATH", "/tmp"), want: one(`env "GCONV_PATH"`, validate.RuleEnvDenied)},
		{name: "env PATH", mutate: env("PATH", "/evil"), want: one(`env "PATH"`, validate.RuleEnvDenied)},
		{name: "env BASH_ENV", mutate: env("BASH_ENV", "/x.sh"), want: one(`env "BASH_ENV"`, validate.RuleEnvDenied)},
		{name: "env PYTHONPATH", mutate: env("PYTHONPATH", "/x"), want: one(`env "PYTHONPATH"`, validate.RuleEnvDenied)},
		{name: "env NODE_OPTIONS", mutate: env("NODE_OPTIONS", "-r x"), want: one(`env "NODE_OPTIONS"`, validate.RuleEnvDenied)},
		{name: "env name empty", mutate: env("", "x"), want: one(`env ""`, validate.RuleEmpty)},
		{name: "env name starts with digit", mutate: env("1GPU", "x"), want: one(`env "1GPU"`, validate.RuleEnvName)},
		{name: "env name with dash", mutate: env("A-B", "x"), want: one(`env "A-B"`, validate.RuleEnvName)},
		{name: "env name with equals", mutate: env("A=B", "x"), want: one(`env "A=B"`, validate.RuleEnvName)},
		{name: "env name with space", mutate: env("A B", "x"), want: one(`env "A B"`, validate.RuleEnvName)},
		{name: "env name not ASCII", mutate: env("GPUÉ", "x"), want: one(`env "GPUÉ"`, validate.RuleEnvName)},
		{
			name:   "env name too long",
			mutate: env(strings.Repeat("A", validate.MaxNameLen+1), "x"),
			want:   one(`env "`+strings.Repeat("A", 64)+`"...`, validate.RuleTooLong),
		},
		{name: "env value with NUL", mutate: env("A", "x\x00y"), want: one(`env "A": value`, validate.RuleNUL)},
		{name: "env value not UTF-8", mutate: env("A", "\xff"), want: one(`env "A": value`, validate.RuleInvalidUTF8)},
		{
			name:   "env value too long",
			mutate: env("A", strings.Repeat("v", validate.MaxEnvValueLen+1)),
			want:   one(`env "A": value`, validate.RuleTooLong),
		},
		{name: "env value at the limit", mutate: env("A", strings.Repeat("v", validate.MaxEnvValueLen))},

		{name: "nil mount", mutate: func(r *pb.ContainerReservation) { r.Mounts[1] = nil }, want: one("mount[1]", validate.RuleMissing)},
		{name: "mount host path empty", mutate: mountHost(""), want: one("mount[0]: host_path", validate.RuleEmpty)},
		{name: "mount host path relative", mutate: mountHost("usr/lib"), want: one(`mount[0]: host_path "usr/lib"`, validate.RuleNotAbsolute)},
		{
			name:   "mount host path relative with dotdot",
			mutate: mountHost("../etc"),
			want: []found{
				{`mount[0]: host_path "../etc"`, validate.RuleNotAbsolute},
				{`mount[0]: host_path "../etc"`, validate.RuleDotDot},
			},
		},
		{name: "mount host path dotdot", mutate: mountHost("/usr/../etc"), want: one(`mount[0]: host_path "/usr/../etc"`, validate.RuleDotDot)},
		{name: "mount host path trailing dotdot", mutate: mountHost("/usr/.."), want: one(`mount[0]: host_path "/usr/.."`, validate.RuleDotDot)},
		{name: "mount host path double slash", mutate: mountHost("/usr//lib"), want: one(`mount[0]: host_path "/usr//lib"`, validate.RuleNotClean)},
		{name: "mount host path dot", mutate: mountHost("/usr/./lib"), want: one(`mount[0]: host_path "/usr/./lib"`, validate.RuleNotClean)},
		{name: "mount host path trailing slash", mutate: mountHost("/usr/"), want: one(`mount[0]: host_path "/usr/"`, validate.RuleNotClean)},
		{name: "mount host path with NUL", mutate: mountHost("/usr\x00"), want: one(`mount[0]: host_path "/usr\x00"`, validate.RuleNUL)},
		{name: "mount host path not UTF-8", mutate: mountHost("/usr\xff"), want: one(`mount[0]: host_path "/usr\xff"`, validate.RuleInvalidUTF8)},
		{
			name:   "mount host path too long",
			mutate: mountHost("/" + strings.Repeat("a", validate.MaxPathLen)),
			want:   one(`mount[0]: host_path "/`+strings.Repeat("a", 63)+`"...`, validate.RuleTooLong),
		},
		{name: "a name with dots is not dotdot", mutate: mountHost("/usr/..lib")},
		{
			name:   "mount container path relative",
			mutate: func(r *pb.ContainerReservation) { r.Mounts[1].ContainerPath = "host" },
			want:   one(`mount[1]: container_path "host"`, validate.RuleNotAbsolute),
		},

		{name: "nil device node", mutate: func(r *pb.ContainerReservation) { r.Devices[2] = nil }, want: one("device[2]", validate.RuleMissing)},
		{name: "device container path empty", mutate: devContainer(""), want: one("device[1]: container_path", validate.RuleEmpty)},
		{name: "device container path dotdot", mutate: devContainer("/dev/../etc/shadow"), want: one(`device[1]: container_path "/dev/../etc/shadow"`, validate.RuleDotDot)},
		{
			name:   "device host path relative",
			mutate: func(r *pb.ContainerReservation) { r.Devices[2].HostPath = "dev/nvidia-uvm" },
			want:   one(`device[2]: host_path "dev/nvidia-uvm"`, validate.RuleNotAbsolute),
		},
		{name: "permissions empty", mutate: perms(""), want: one("device[0]: permissions", validate.RuleEmpty)},
		{name: "permissions x", mutate: perms("rwx"), want: one("device[0]: permissions", validate.RulePermissions)},
		{name: "permissions repeated", mutate: perms("rr"), want: one("device[0]: permissions", validate.RulePermissions)},
		{name: "permissions too many", mutate: perms("rwmr"), want: one("device[0]: permissions", validate.RulePermissions)},
		{name: "permissions upper case", mutate: perms("R"), want: one("device[0]: permissions", validate.RulePermissions)},

		{name: "CDI name empty", mutate: cdi(""), want: one(`cdi_device[1] ""`, validate.RuleEmpty)},
		{name: "CDI without name", mutate: cdi("nvidia.com/gpu"), want: one(`cdi_device[1] "nvidia.com/gpu"`, validate.RuleCDIName)},
		{name: "CDI without class", mutate: cdi("nvidia.com=GPU-1"), want: one(`cdi_device[1] "nvidia.com=GPU-1"`, validate.RuleCDIName)},
		{name: "CDI vendor not a domain", mutate: cdi("nvidia/gpu=GPU-1"), want: one(`cdi_device[1] "nvidia/gpu=GPU-1"`, validate.RuleCDIName)},
		{name: "CDI vendor starts with dot", mutate: cdi(".nvidia.com/gpu=GPU-1"), want: one(`cdi_device[1] ".nvidia.com/gpu=GPU-1"`, validate.RuleCDIName)},
		{name: "CDI vendor ends with dot", mutate: cdi("nvidia.com./gpu=GPU-1"), want: one(`cdi_device[1] "nvidia.com./gpu=GPU-1"`, validate.RuleCDIName)},
		{name: "CDI class with dot", mutate: cdi("nvidia.com/g.pu=GPU-1"), want: one(`cdi_device[1] "nvidia.com/g.pu=GPU-1"`, validate.RuleCDIName)},
		{name: "CDI class starts with digit", mutate: cdi("nvidia.com/1gpu=GPU-1"), want: one(`cdi_device[1] "nvidia.com/1gpu=GPU-1"`, validate.RuleCDIName)},
		{name: "CDI two slashes", mutate: cdi("nvidia.com/gpu/x=GPU-1"), want: one(`cdi_device[1] "nvidia.com/gpu/x=GPU-1"`, validate.RuleCDIName)},
		{name: "CDI name empty part", mutate: cdi("nvidia.com/gpu="), want: one(`cdi_device[1] "nvidia.com/gpu="`, validate.RuleCDIName)},
		{name: "CDI name starts with dash", mutate: cdi("nvidia.com/gpu=-1"), want: one(`cdi_device[1] "nvidia.com/gpu=-1"`, validate.RuleCDIName)},
		{name: "CDI name with space", mutate: cdi("nvidia.com/gpu=GPU 1"), want: one(`cdi_device[1] "nvidia.com/gpu=GPU 1"`, validate.RuleCDIName)},
		{name: "CDI name with equals", mutate: cdi("nvidia.com/gpu=GPU=1"), want: one(`cdi_device[1] "nvidia.com/gpu=GPU=1"`, validate.RuleCDIName)},
		{
			name:   "CDI name too long",
			mutate: cdi("nvidia.com/gpu=" + strings.Repeat("a", validate.MaxNameLen)),
			want:   one(`cdi_device[1] "nvidia.com/gpu=`+strings.Repeat("a", 49)+`"...`, validate.RuleTooLong),
		},
		{name: "CDI device not requested", mutate: cdi("nvidia.com/gpu=GPU-2"), want: one(`cdi_device[1] "nvidia.com/gpu=GPU-2"`, validate.RuleNotRequested)},
		{name: "CDI all is not a requested device", mutate: cdi("nvidia.com/gpu=all"), want: one(`cdi_device[1] "nvidia.com/gpu=all"`, validate.RuleNotRequested)},

		{
			name: "too many envs",
			mutate: func(r *pb.ContainerReservation) {
				for i := range validate.MaxEnvs {
					r.Envs[fmt.Sprintf("E%03d", i)] = ""
				}
			},
			want: one("envs", validate.RuleTooMany),
		},
		{
			name: "too many mounts",
			mutate: func(r *pb.ContainerReservation) {
				for range validate.MaxMounts {
					r.Mounts = append(r.Mounts, &pb.Mount{HostPath: "/a", ContainerPath: "/a"})
				}
			},
			want: one("mounts", validate.RuleTooMany),
		},
		{
			name: "too many device nodes",
			mutate: func(r *pb.ContainerReservation) {
				for range validate.MaxDeviceNodes {
					r.Devices = append(r.Devices, &pb.DeviceSpec{HostPath: "/a", ContainerPath: "/a", Permissions: "r"})
				}
			},
			want: one("devices", validate.RuleTooMany),
		},
		{
			name: "too many CDI devices",
			mutate: func(r *pb.ContainerReservation) {
				for range validate.MaxCDIDevices {
					r.CdiDevices = append(r.CdiDevices, "nvidia.com/gpu=GPU-0")
				}
			},
			want: one("cdi_devices", validate.RuleTooMany),
		},
		{
			name: "every violation is reported",
			mutate: func(r *pb.ContainerReservation) {
				r.Envs["LD_PRELOAD"] = "/evil.so"
				r.Envs["9"] = ""
				r.Mounts[0].ContainerPath = "/usr/../../etc"
				r.Devices[2].Permissions = "rwx"
				r.CdiDevices[0] = "nvidia.com/gpu=GPU-3"
			},
			want: []found{
				{`env "9"`, validate.RuleEnvName},
				{`env "LD_PRELOAD"`, validate.RuleEnvDenied},
				{`mount[0]: container_path "/usr/../../etc"`, validate.RuleDotDot},
				{"device[2]: permissions", validate.RulePermissions},
				{`cdi_device[0] "nvidia.com/gpu=GPU-3"`, validate.RuleNotRequested},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := goodReservation()
			tt.mutate(res)
			checkViolations(t, validate.Reservation(res, requested), tt.want)
		})
	}
}

func TestReservationNil(t *testing.T) {
	checkViolations(t, validate.Reservation(nil, requested), []found{{"reservation", validate.RuleMissing}})
}

func TestReservationNothingRequested(t *testing.T) {
	err := validate.Reservation(goodReservation(), nil)
	checkViolations(t, err, []found{
		{`cdi_device[0] "nvidia.com/gpu=GPU-0"`, validate.RuleNotRequested},
		{`cdi_device[1] "nvidia.com/gpu=GPU-1"`, validate.RuleNotRequested},
	})
}

// TestEnvDeniedLists checks that every exported deny-list entry is denied, that the
// lists hold what EnvDenied and their doc comments promise, and that they are copies.
func TestEnvDeniedLists(t *testing.T) {
	names := validate.DeniedEnvNames()
	if !slices.IsSorted(names) {
		t.Errorf("DeniedEnvNames() not sorted: %q", names)
	}
	for _, want := range []string{"PATH", "GCONV_PATH", "BASH_ENV", "PYTHONPATH"} {
		if !slices.Contains(names, want) {
			t.Errorf("DeniedEnvNames() lacks %q", want)
		}
	}
	for _, n := range names {
		if !validate.EnvDenied(n) {
			t.Errorf("EnvDenied(%q) = false for a name of DeniedEnvNames", n)
		}
	}
	prefixes := validate.DeniedEnvPrefixes()
	if want := []string{"LD_", "DYLD_", "GLIBC_"}; !slices.Equal(prefixes, want) {
		t.Errorf("DeniedEnvPrefixes() = %q, want %q", prefixes, want)
	}
	for _, p := range prefixes {
		if !validate.EnvDenied(p + "X") {
			t.Errorf("EnvDenied(%q) = false for a prefix of DeniedEnvPrefixes", p+"X")
		}
	}
	names[0], prefixes[0] = "CHANGED", "CHANGED"
	if validate.DeniedEnvNames()[0] == "CHANGED" || validate.DeniedEnvPrefixes()[0] == "CHANGED" {
		t.Error("changing a returned deny list changed the package's")
	}
	for _, allowed := range []string{"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "LD", "ld_preload", "XPATH"} {
		if validate.EnvDenied(allowed) {
			t.Errorf("EnvDenied(%q) = true, want false", allowed)
		}
	}
}
