package nvidia

import (
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxb200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// wantAttr is an attribute every simulated GPU group must carry.
type wantAttr struct {
	unit string
	kind string // "int" or "string"
}

var wantAttrs = map[string]wantAttr{
	"memory":             {"MiB", "int"},
	"power_limit":        {"W", "int"},
	"bar1":               {"MiB", "int"},
	"sm_clock":           {"MHz", "int"},
	"memory_clock":       {"MHz", "int"},
	"pci_bandwidth":      {"MB/s", "int"},
	"driver_version":     {"", "string"},
	"cuda_version":       {"", "string"},
	"compute_capability": {"", "string"},
}

var busIDPattern = regexp.MustCompile(`^0000:[0-9a-f]{2}:00\.0$`)

func TestFingerprintSimulatedMachines(t *testing.T) {
	tests := []struct {
		machine    string
		mock       func() *server.Server
		memoryMiB  int64
		capability string
		powerW     int64
	}{
		{"dgxa100", dgxa100.New, 40960, "8.0", 400},
		{"dgxh100", dgxh100.New, 81920, "9.0", 700},
		{"dgxh200", dgxh200.New, 144384, "9.0", 700},
		{"dgxb200", dgxb200.New, 184320, "10.0", 1000},
	}
	for _, tt := range tests {
		t.Run(tt.machine, func(t *testing.T) {
			wantName, _ := tt.mock().Devices[0].GetName()

			first := fingerprintOnce(t, Config{Simulate: tt.machine})
			if got := len(first.GetGroups()); got != 1 {
				t.Fatalf("got %d groups, want 1 (eight identical GPUs)", got)
			}
			g := first.GetGroups()[0]
			if g.GetVendor() != "nvidia" || g.GetType() != "gpu" || g.GetName() != wantName {
				t.Errorf("group = %s/%s/%q, want nvidia/gpu/%q", g.GetVendor(), g.GetType(), g.GetName(), wantName)
			}
			if got := len(g.GetDevices()); got != 8 {
				t.Fatalf("got %d devices, want 8", got)
			}

			for name, want := range wantAttrs {
				v, ok := g.GetAttributes()[name]
				if !ok {
					t.Errorf("attribute %q missing", name)
					continue
				}
				if v.GetUnit() != want.unit {
					t.Errorf("attribute %q unit = %q, want %q", name, v.GetUnit(), want.unit)
				}
				_, isInt := v.GetKind().(*pb.Value_IntValue)
				_, isString := v.GetKind().(*pb.Value_StringValue)
				if (want.kind == "int" && (!isInt || v.GetIntValue() <= 0)) || (want.kind == "string" && (!isString || v.GetStringValue() == "")) {
					t.Errorf("attribute %q = %v, want a non-empty %s", name, v, want.kind)
				}
			}
			if got := g.GetAttributes()["memory"].GetIntValue(); got != tt.memoryMiB {
				t.Errorf("memory = %d MiB, want %d", got, tt.memoryMiB)
			}
			if got := g.GetAttributes()["compute_capability"].GetStringValue(); got != tt.capability {
				t.Errorf("compute_capability = %q, want %q", got, tt.capability)
			}
			cuda, _ := tt.mock().SystemGetCudaDriverVersion() // 12040 is CUDA 12.4
			if got, want := g.GetAttributes()["cuda_version"].GetStringValue(), fmt.Sprintf("%d.%d", cuda/1000, cuda%1000/10); got != want {
				t.Errorf("cuda_version = %q, want %q (the mock's %d)", got, want, cuda)
			}
			if v, ok := g.GetAttributes()["mig_capable"].GetKind().(*pb.Value_BoolValue); !ok || !v.BoolValue {
				t.Errorf("mig_capable = %v, want true (every simulated DGX GPU can run MIG)", g.GetAttributes()["mig_capable"])
			}
			if got := g.GetAttributes()["power_limit"].GetIntValue(); got != tt.powerW {
				t.Errorf("power_limit = %d W, want %d", got, tt.powerW)
			}

			buses := make(map[string]bool)
			for i, d := range g.GetDevices() {
				if want := simulatedUUID(tt.machine, i); d.GetId() != want {
					t.Errorf("device %d ID = %q, want %q", i, d.GetId(), want)
				}
				if d.GetHealth() != pb.Health_HEALTH_HEALTHY || d.GetHealthReason() != "" {
					t.Errorf("device %d health = %v %q, want healthy", i, d.GetHealth(), d.GetHealthReason())
				}
				bus := d.GetLocality().GetPciBusId()
				if !busIDPattern.MatchString(bus) || buses[bus] {
					t.Errorf("device %d PCI bus ID %q: want a unique one like 0000:1b:00.0", i, bus)
				}
				buses[bus] = true
				if got, want := d.GetLocality().GetNumaNode(), int32(i/4); got != want {
					t.Errorf("device %d NUMA node = %d, want %d", i, got, want)
				}
			}

			// A second plugin instance (a restart) reports the very same inventory.
			second := fingerprintOnce(t, Config{Simulate: tt.machine})
			if !protoEqual(first, second) {
				t.Errorf("fingerprint changed across plugin instances:\n first %v\nsecond %v", first, second)
			}
		})
	}
}

// fingerprintOnce runs a fresh plugin with cfg and returns its first fingerprint.
func fingerprintOnce(t *testing.T, cfg Config) *pb.FingerprintResponse {
	t.Helper()
	p, _ := newTestPlugin(t, cfg)
	s := startFingerprint(t, p)
	resp := s.next(t)
	if err := s.stop(t); err != nil {
		t.Errorf("Fingerprint returned %v after cancel, want nil", err)
	}
	return resp
}

func TestSimulatedUUIDsAreDistinctAcrossMachines(t *testing.T) {
	seen := make(map[string]string)
	uuidPattern := regexp.MustCompile(`^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	for _, m := range machineNames() {
		for i := range 8 {
			id := simulatedUUID(m, i)
			if !uuidPattern.MatchString(id) {
				t.Errorf("%s GPU %d: ID %q is not GPU-<uuid>", m, i, id)
			}
			if other, dup := seen[id]; dup {
				t.Errorf("%s GPU %d has the ID of %s", m, i, other)
			}
			seen[id] = m
		}
	}
}

func TestFingerprintIgnoresGPUs(t *testing.T) {
	ignored := []string{simulatedUUID("dgxh100", 2), simulatedUUID("dgxh100", 5)}
	resp := fingerprintOnce(t, Config{Simulate: "dgxh100", IgnoredGPUIDs: ignored})
	got := devices(resp)
	if len(got) != 6 {
		t.Errorf("got %d devices, want 6", len(got))
	}
	for _, id := range ignored {
		if _, ok := got[id]; ok {
			t.Errorf("ignored GPU %s was fingerprinted", id)
		}
	}
}

// A re-read that finds nothing new sends nothing; one that finds a change sends it.
func TestFingerprintSendsOnlyOnChange(t *testing.T) {
	p, clk := newTestPlugin(t, Config{Simulate: "dgxh100", FingerprintPeriod: "1m"})
	s := startFingerprint(t, p)
	if got := len(s.next(t).GetGroups()); got != 1 {
		t.Fatalf("first fingerprint has %d groups, want 1", got)
	}

	clk.Advance(time.Minute) // re-read: nothing changed
	clk.waitForTimerAt(t, t0.Add(2*time.Minute))

	// The stream is parked until t0+2m; change GPU 7's product name under it.
	p.rt.lib.(*simLib).devices[7].mock.Config.Name = "NVIDIA H100 80GB HBM3 (renamed)"
	clk.Advance(time.Minute)

	resp := s.next(t) // had the unchanged re-read been sent, this would be it
	if got := len(resp.GetGroups()); got != 2 {
		t.Fatalf("after the rename got %d groups, want 2: %v", got, resp)
	}
	if a, b := resp.GetGroups()[0], resp.GetGroups()[1]; a.GetName() != "NVIDIA H100 80GB HBM3" || len(a.GetDevices()) != 7 ||
		b.GetName() != "NVIDIA H100 80GB HBM3 (renamed)" || len(b.GetDevices()) != 1 {
		t.Errorf("groups = %q (%d GPUs), %q (%d GPUs); want the 7 unchanged first, then the renamed one",
			a.GetName(), len(a.GetDevices()), b.GetName(), len(b.GetDevices()))
	}
}

func TestNormalizeBusID(t *testing.T) {
	tests := []struct{ in, want string }{
		{"00000000:1B:00.0", "0000:1b:00.0"},
		{"0000:07:00.0", "0000:07:00.0"},
		{"00000001:C3:01.1", "0001:c3:01.1"},
		{"garbage-ID", "garbage-id"},
		{"", ""},
	}
	for _, tt := range tests {
		if got := normalizeBusID(tt.in); got != tt.want {
			t.Errorf("normalizeBusID(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}
