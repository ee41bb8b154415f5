package adapter

import (
	"fmt"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/device"
	nproto "github.com/hashicorp/nomad/plugins/device/proto"
	"github.com/hashicorp/nomad/plugins/shared/structs"
	"google.golang.org/protobuf/proto"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

func ptr[T any](v T) *T { return &v }

func intV(n int64, unit string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_IntValue{IntValue: n}, Unit: unit}
}

func floatV(f float64, unit string) *pb.Value {
	return &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: f}, Unit: unit}
}

func strV(s string) *pb.Value { return &pb.Value{Kind: &pb.Value_StringValue{StringValue: s}} }

// A Nomad fingerprint becomes one the host accepts: attributes in devicehost's units,
// health with reason, PCI bus IDs, NUMA node unknown.
func TestFingerprintFromNomad(t *testing.T) {
	groups := []*device.DeviceGroup{{
		Vendor: "nvidia", Type: "gpu", Name: "Tesla T4",
		Attributes: map[string]*structs.Attribute{
			"memory":        structs.NewIntAttribute(15360, "MiB"),
			"pci_bandwidth": structs.NewIntAttribute(15760, "MB/s"),
			"big":           structs.NewIntAttribute(2, "PiB"),
			"rate":          structs.NewFloatAttribute(1.5, "kB/s"),
			"power":         structs.NewIntAttribute(2, "kW"),
			"weird":         structs.NewIntAttribute(12, "furlong"),
			"cores":         structs.NewIntAttribute(2560, ""),
			"driver":        structs.NewStringAttribute("535.54"),
			"mig":           structs.NewBoolAttribute(false),
			"empty":         {},
		},
		Devices: []*device.Device{
			{ID: "GPU-1", Healthy: true, HwLocality: &device.DeviceLocality{PciBusID: "00000000:3B:00.0"}},
			{ID: "GPU-2", Healthy: false, HealthDesc: "XID 79"},
			nil,
		},
	}, nil}
	got := fingerprintFromNomad(groups)
	want := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{{
		Vendor: "nvidia", Type: "gpu", Name: "Tesla T4",
		Attributes: map[string]*pb.Value{
			"memory":        intV(15360, "MiB"),
			"pci_bandwidth": intV(15760, "MB/s"),
			"big":           intV(2048, "TiB"),
			"rate":          floatV(1.5e-3, "MB/s"),
			"power":         intV(2000, "W"),
			"weird":         strV("12 furlong"),
			"cores":         intV(2560, ""),
			"driver":        strV("535.54"),
			"mig":           {Kind: &pb.Value_BoolValue{}},
		},
		Devices: []*pb.Device{
			{Id: "GPU-1", Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{PciBusId: "00000000:3B:00.0", NumaNode: -1}},
			{Id: "GPU-2", Health: pb.Health_HEALTH_UNHEALTHY, HealthReason: "XID 79", Locality: &pb.Locality{NumaNode: -1}},
		},
	}}}
	if !proto.Equal(got, want) {
		t.Errorf("got  %v\nwant %v", got, want)
	}
	if err := validate.Fingerprint(got); err != nil {
		t.Errorf("the host refuses the translation: %v", err)
	}
}

// Nomad stats become devicehost stats: nested objects flattened, fractions as two
// values, the summary as "summary", free-text units as devicehost spells them, only
// for fingerprinted devices, at most MaxStatsValues per device; the host accepts them.
func TestStatsFromNomad(t *testing.T) {
	ts := time.Unix(1700000000, 0)
	now := ts.Add(time.Minute)
	groups := []*device.DeviceGroupStats{{
		Vendor: "nvidia", Type: "gpu", Name: "Tesla T4",
		InstanceStats: map[string]*device.DeviceStats{
			"GPU-1": {
				Summary: &structs.StatValue{IntNumeratorVal: ptr[int64](40), Unit: "%", Desc: "GPU utilization"},
				Stats: &structs.StatObject{
					Attributes: map[string]*structs.StatValue{
						"Memory utilization": {IntNumeratorVal: ptr[int64](1024), IntDenominatorVal: ptr[int64](15360), Unit: "MiB"},
						"Temperature":        {IntNumeratorVal: ptr[int64](45), Unit: "°C"},
						"size":               {IntNumeratorVal: ptr[int64](10), Unit: "bytes"},
						"power":              {FloatNumeratorVal: ptr(70.5), Unit: "W"},
						"nan":                {FloatNumeratorVal: ptr(math.NaN())},
						"odd":                {FloatNumeratorVal: ptr(2.5), Unit: "parsecs"},
						"mode":               {StringVal: ptr("-rw-r--r--")},
						"throttled":          {BoolVal: ptr(true)},
						"nothing":            {},
					},
					Nested: map[string]*structs.StatObject{
						"ecc": {Attributes: map[string]*structs.StatValue{"l2": {IntNumeratorVal: ptr[int64](0)}}},
					},
				},
				Timestamp: ts,
			},
			"GPU-2":       {Stats: &structs.StatObject{Attributes: map[string]*structs.StatValue{"x": {IntNumeratorVal: ptr[int64](1)}}}},
			"not-printed": {Stats: &structs.StatObject{Attributes: map[string]*structs.StatValue{"x": {IntNumeratorVal: ptr[int64](1)}}}},
			"nil":         nil,
		},
	}}
	known := map[string]bool{"GPU-1": true, "GPU-2": true, "nil": true}
	got := statsFromNomad(groups, func(id string) bool { return known[id] }, now)
	if len(got.Devices) != 2 || got.Devices[0].DeviceId != "GPU-1" || got.Devices[1].DeviceId != "GPU-2" {
		t.Fatalf("devices %v; want GPU-1, GPU-2 (not the unknown one, not the nil one)", got.Devices)
	}
	wantValues := map[string]*pb.Value{
		"summary":                  intV(40, "%"),
		"Memory utilization":       intV(1024, "MiB"),
		"Memory utilization_total": intV(15360, "MiB"),
		"Temperature":              intV(45, "C"),
		"size":                     intV(10, "B"),
		"power":                    floatV(70.5, "W"),
		"odd":                      strV("2.5 parsecs"),
		"mode":                     strV("-rw-r--r--"),
		"throttled":                {Kind: &pb.Value_BoolValue{BoolValue: true}},
		"ecc.l2":                   intV(0, ""),
	}
	g1 := got.Devices[0]
	if !proto.Equal(&pb.DeviceStats{DeviceId: "GPU-1", Values: wantValues, Timestamp: g1.Timestamp}, g1) {
		t.Errorf("GPU-1 values\n got %v\nwant %v", g1.Values, wantValues)
	}
	if !g1.Timestamp.AsTime().Equal(ts) || !got.Devices[1].Timestamp.AsTime().Equal(now) {
		t.Errorf("timestamps %v, %v; want the plugin's, then now", g1.Timestamp.AsTime(), got.Devices[1].Timestamp.AsTime())
	}
	if err := validate.Stats(got, func(id string) bool { return known[id] }); err != nil {
		t.Errorf("the host refuses the translation: %v", err)
	}
}

// A Nomad plugin's flood of statistics is cut to what the host accepts.
func TestStatsFromNomadBounded(t *testing.T) {
	attrs := map[string]*structs.StatValue{}
	for i := range 3 * validate.MaxStatsValues {
		attrs[fmt.Sprintf("m%04d", i)] = &structs.StatValue{IntNumeratorVal: ptr(int64(i))}
	}
	deep := &structs.StatObject{Attributes: map[string]*structs.StatValue{"leaf": {IntNumeratorVal: ptr[int64](1)}}}
	for range 50 {
		deep = &structs.StatObject{Nested: map[string]*structs.StatObject{"n": deep}}
	}
	groups := []*device.DeviceGroupStats{{InstanceStats: map[string]*device.DeviceStats{
		"a": {Stats: &structs.StatObject{Attributes: attrs}},
		"b": {Stats: deep},
	}}}
	got := statsFromNomad(groups, func(string) bool { return true }, time.Now())
	if n := len(got.Devices[0].Values); n != validate.MaxStatsValues {
		t.Errorf("%d values, want %d", n, validate.MaxStatsValues)
	}
	if _, ok := got.Devices[0].Values["m0000"]; !ok {
		t.Error("the first values by name were dropped")
	}
	if n := len(got.Devices[1].Values); n != 0 {
		t.Errorf("a value %d objects deep came through: %v", 50, got.Devices[1].Values)
	}
}

// A Nomad reservation keeps its envs; task paths become container paths.
func TestReservationFromNomad(t *testing.T) {
	got := reservationFromNomad(&nproto.ContainerReservation{
		Envs:    map[string]string{"A": "1"},
		Mounts:  []*nproto.Mount{{TaskPath: "/t/m", HostPath: "/h/m", ReadOnly: true}, nil},
		Devices: []*nproto.DeviceSpec{{TaskPath: "/dev/x", HostPath: "/dev/y", Permissions: "rw"}},
	})
	want := &pb.ContainerReservation{
		Envs:    map[string]string{"A": "1"},
		Mounts:  []*pb.Mount{{HostPath: "/h/m", ContainerPath: "/t/m", ReadOnly: true}},
		Devices: []*pb.DeviceSpec{{HostPath: "/dev/y", ContainerPath: "/dev/x", Permissions: "rw"}},
	}
	if !proto.Equal(got, want) {
		t.Errorf("got %v\nwant %v", got, want)
	}
	if got := reservationFromNomad(nil); len(got.GetEnvs())+len(got.GetMounts())+len(got.GetDevices()) != 0 {
		t.Errorf("nil reservation: %v", got)
	}
}

// The adapter's config names what is wrong.
func TestParseConfig(t *testing.T) {
	bin := t.TempDir() + "/plugin"
	writeExec(t, bin)
	open := t.TempDir() + "/open"
	writeExec(t, open)
	if err := os.Chmod(open, 0o757); err != nil {
		t.Fatal(err)
	}
	openDir := t.TempDir()
	inOpenDir := openDir + "/plugin"
	writeExec(t, inOpenDir)
	if err := os.Chmod(openDir, 0o777); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, config, want string }{
		{"empty", ``, "nomad_plugin is required"},
		{"no plugin", `{}`, "nomad_plugin: required"},
		{"relative", `{"nomad_plugin": "plugin"}`, "not an absolute path"},
		{"missing", `{"nomad_plugin": "/nonexistent/p"}`, "no such file"},
		{"not executable", `{"nomad_plugin": "` + t.TempDir() + `"}`, "not an executable file"},
		{"world-writable", `{"nomad_plugin": "` + open + `"}`, "is world-writable (mode -rwxr-xrwx)"},
		{"world-writable dir", `{"nomad_plugin": "` + inOpenDir + `"}`, "its directory " + openDir + " is world-writable"},
		{"unknown key", `{"nomad_plugin": "` + bin + `", "nomad_cfg": {}}`, `unknown field "nomad_cfg"`},
		{"config not object", `{"nomad_plugin": "` + bin + `", "nomad_config": [1]}`, "nomad_config: must be an object"},
		{"bad wait", `{"nomad_plugin": "` + bin + `", "empty_inventory_after": "later"}`, `empty_inventory_after: "later"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := parseConfig([]byte(tc.config))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v; want one containing %q", err, tc.want)
			}
		})
	}
	cfg, wait, err := parseConfig([]byte(`{"nomad_plugin": "` + bin + `", "nomad_args": ["-x"], "nomad_config": {"a": 1}}`))
	if err != nil || cfg.NomadPlugin != bin || wait != DefaultEmptyInventoryAfter || cfg.NomadArgs[0] != "-x" {
		t.Fatalf("parseConfig = %+v, %v, %v", cfg, wait, err)
	}
}

// The Nomad plugin does not see what go-plugin told the adapter (its AutoMTLS
// certificate, ports, socket dir, devicehost's handshake cookie): it would serve by
// those instead of the adapter's own client's.
func TestPluginEnv(t *testing.T) {
	got := pluginEnv([]string{
		"PATH=/usr/bin", "PLUGIN_CLIENT_CERT=pem", "PLUGIN_MIN_PORT=1", "PLUGIN_UNIX_SOCKET_DIR=/var/lib/devicehost/sockets",
		"DEVICEHOST_PLUGIN=cookie", "NVIDIA_DRIVER_CAPABILITIES=all", "PLUGINS=kept",
	})
	want := []string{"PATH=/usr/bin", "NVIDIA_DRIVER_CAPABILITIES=all", "PLUGINS=kept"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("pluginEnv = %q, want %q", got, want)
	}
}
