package nvidia

import (
	"maps"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// wantStats are the values every GPU's stats must carry, with their units and bounds.
var wantStats = map[string]struct {
	unit     string
	min, max float64
}{
	"gpu_utilization":        {"%", 0, 100},
	"memory_utilization":     {"%", 0, 100},
	"memory_used":            {"MiB", 1, 81920},
	"memory_free":            {"MiB", 1, 81920},
	"memory_total":           {"MiB", 81920, 81920},
	"sm_clock":               {"MHz", 345, 1980},
	"memory_clock":           {"MHz", 2619, 2619},
	"last_xid":               {"", 0, 0},
	"temperature":            {"C", 20, 90},
	"power":                  {"W", 50, 700},
	"ecc_errors_corrected":   {"count", 0, 0},
	"ecc_errors_uncorrected": {"count", 0, 0},
}

func number(v *pb.Value) float64 {
	if f, ok := v.GetKind().(*pb.Value_FloatValue); ok {
		return f.FloatValue
	}
	return float64(v.GetIntValue())
}

func TestStatsMoveOverTime(t *testing.T) {
	p, clk := newTestPlugin(t, Config{Simulate: "dgxh100"})
	s := startStats(t, p, time.Second)

	first := s.next(t)
	clk.Advance(7 * time.Second)
	second := s.next(t)

	for i, resp := range []*pb.StatsResponse{first, second} {
		wantTime := t0.Add(time.Duration(i) * 7 * time.Second)
		if got := len(resp.GetDevices()); got != 8 {
			t.Fatalf("sample %d has %d devices, want 8", i, got)
		}
		for j, d := range resp.GetDevices() {
			if want := simulatedUUID("dgxh100", j); d.GetDeviceId() != want {
				t.Errorf("sample %d device %d ID = %q, want %q", i, j, d.GetDeviceId(), want)
			}
			if got := d.GetTimestamp().AsTime(); !got.Equal(wantTime) {
				t.Errorf("sample %d timestamp = %v, want %v", i, got, wantTime)
			}
			if got := d.GetValues()["index"]; got.GetIntValue() != int64(j) || got.GetUnit() != "" {
				t.Errorf("sample %d device %d index = %v, want %d without a unit", i, j, got, j)
			}
			v := d.GetValues()
			// Each is rounded down to whole MiB, so the sum may be one short.
			if used, free, total := number(v["memory_used"]), number(v["memory_free"]), number(v["memory_total"]); used+free > total || used+free < total-1 {
				t.Errorf("sample %d device %d: memory used %v + free %v = %v, want the total %v", i, j, used, free, used+free, total)
			}
			for name, want := range wantStats {
				v, ok := d.GetValues()[name]
				if !ok {
					t.Errorf("sample %d device %d lacks %q", i, j, name)
					continue
				}
				if v.GetUnit() != want.unit || number(v) < want.min || number(v) > want.max {
					t.Errorf("sample %d device %d %s = %v %q, want %q within [%v, %v]",
						i, j, name, number(v), v.GetUnit(), want.unit, want.min, want.max)
				}
			}
		}
	}

	// Seven seconds later every GPU's load, memory, temperature and power have moved.
	for j := range first.GetDevices() {
		a, b := first.GetDevices()[j].GetValues(), second.GetDevices()[j].GetValues()
		for _, name := range []string{"gpu_utilization", "memory_used", "power", "sm_clock"} {
			if number(a[name]) == number(b[name]) {
				t.Errorf("device %d %s stayed at %v over 7 s", j, name, number(a[name]))
			}
		}
	}
	// And the GPUs do not all move in step.
	if a, b := first.GetDevices()[0].GetValues(), first.GetDevices()[1].GetValues(); number(a["power"]) == number(b["power"]) {
		t.Errorf("GPUs 0 and 1 draw the same power %v", number(a["power"]))
	}

	if err := s.stop(t); err != nil {
		t.Errorf("Stats returned %v after cancel, want nil", err)
	}
}

// A second plugin instance at the same time reports the same samples: the simulation
// is a function of time, not of the process.
func TestStatsAreDeterministic(t *testing.T) {
	sample := func() *pb.StatsResponse {
		p, _ := newTestPlugin(t, Config{Simulate: "dgxb200"})
		s := startStats(t, p, time.Second)
		resp := s.next(t)
		s.stop(t)
		for _, d := range resp.GetDevices() {
			d.Processes = nil // what runs on this machine (simprocs.go), which may change between them
		}
		return resp
	}
	if a, b := sample(), sample(); !protoEqual(a, b) {
		t.Errorf("two plugins at the same time disagree:\n%v\n%v", a, b)
	}
}

// Falling behind skips the missed ticks instead of sending a burst.
func TestStatsTicksAfterLongPause(t *testing.T) {
	p, clk := newTestPlugin(t, Config{Simulate: "dgxa100"})
	s := startStats(t, p, time.Second)
	s.next(t)
	clk.Advance(time.Hour)
	if got, want := s.next(t).GetDevices()[0].GetTimestamp().AsTime(), t0.Add(time.Hour); !got.Equal(want) {
		t.Errorf("sample after the pause stamped %v, want %v", got, want)
	}
	// The next tick is one interval after the late one, not a backlog of 3600.
	clk.waitForTimerAt(t, t0.Add(time.Hour+time.Second))
}

func TestStatsLeaveOutIgnoredGPUs(t *testing.T) {
	ignored := simulatedUUID("dgxh200", 0)
	p, _ := newTestPlugin(t, Config{Simulate: "dgxh200", IgnoredGPUIDs: []string{ignored}})
	resp := startStats(t, p, time.Second).next(t)
	if got := len(resp.GetDevices()); got != 7 {
		t.Errorf("got %d devices, want 7", got)
	}
	for _, d := range resp.GetDevices() {
		if d.GetDeviceId() == ignored {
			t.Errorf("stats for ignored GPU %s", ignored)
		}
	}
}

// Each GPU's stats carry the last XID it raised, critical or not (DCGM's XID_ERRORS),
// and 0 for a GPU that raised none.
func TestStatsCarryTheLastXID(t *testing.T) {
	const m = "dgxh100"
	p, clk := newTestPlugin(t, Config{
		Simulate:          m,
		FingerprintPeriod: "1h",
		InjectFaults: []FaultConfig{
			{GPUIndex: ptr(0), XID: 48, After: "2s"},
			{GPUIndex: ptr(0), XID: 79, After: "10s"},
			{GPUIndex: ptr(1), XID: 13, After: "5s"}, // application error: GPU stays healthy
		},
	})
	fp := startFingerprint(t, p) // the XID watch runs while a Fingerprint stream does
	checkHealth(t, "start", fp.next(t), m, nil)
	clk.Advance(10 * time.Second)
	// Once GPU 0's reason names XID 79, every event so far has been handled.
	for {
		if reason := devices(fp.next(t))[simulatedUUID(m, 0)].GetHealthReason(); strings.Contains(reason, "XID 79") {
			break
		}
	}

	resp := startStats(t, p, time.Second).next(t)
	want := map[string]int64{simulatedUUID(m, 0): 79, simulatedUUID(m, 1): 13}
	for _, d := range resp.GetDevices() {
		got := d.GetValues()["last_xid"]
		if got == nil || got.GetIntValue() != want[d.GetDeviceId()] {
			t.Errorf("%s: last_xid = %v, want %d", d.GetDeviceId(), got, want[d.GetDeviceId()])
		}
	}
}

// A simulated device's processes are those on this machine whose environment names it
// in NVIDIA_VISIBLE_DEVICES, each using DEVICEHOST_SIM_FB_USED_MIB MiB: a process
// started naming GPU 2 and GPU 5 is reported on both with its memory, on no other; once
// it is gone the next sample leaves it out.
func TestStatsReportSimulatedProcesses(t *testing.T) {
	p, clk := newTestPlugin(t, Config{Simulate: "dgxh100"})
	gpu2, gpu5 := simulatedUUID("dgxh100", 2), simulatedUUID("dgxh100", 5)
	cmd := exec.Command("sleep", "60")
	cmd.Env = []string{"NVIDIA_VISIBLE_DEVICES=" + gpu2 + "," + gpu5, simFBUsedEnv + "=300", "PATH=" + os.Getenv("PATH")}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	pid := uint32(cmd.Process.Pid)
	mine := func(resp *pb.StatsResponse) map[string]int64 {
		out := map[string]int64{}
		for _, d := range resp.GetDevices() {
			for _, pr := range d.GetProcesses() {
				if pr.GetPid() == pid {
					out[d.GetDeviceId()] = pr.GetUsedBytes()
				}
			}
		}
		return out
	}
	s := startStats(t, p, time.Second)
	if got, want := mine(s.next(t)), map[string]int64{gpu2: 300 << 20, gpu5: 300 << 20}; !maps.Equal(got, want) {
		t.Errorf("the process on %v, want %v", got, want)
	}
	cmd.Process.Kill()
	cmd.Wait()
	clk.Advance(time.Second)
	if got := mine(s.next(t)); len(got) != 0 {
		t.Errorf("the process gone, still on %v", got)
	}
}

// A simulated process's DEVICEHOST_SIM_SM_UTIL is its NVML process utilization sample,
// reported as its sm_utilization (0 for a process of the device without it), and the
// device is as busy as its processes together: its gpu_utilization is their sum.
func TestStatsReportProcessUtilization(t *testing.T) {
	p, _ := newTestPlugin(t, Config{Simulate: "dgxh100"})
	gpu := simulatedUUID("dgxh100", 6)
	want := map[uint32]uint32{}
	for _, util := range []string{"30", "45", ""} {
		cmd := exec.Command("sleep", "60")
		cmd.Env = []string{"NVIDIA_VISIBLE_DEVICES=" + gpu, "PATH=" + os.Getenv("PATH")}
		if util != "" {
			cmd.Env = append(cmd.Env, simSMUtilEnv+"="+util)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { cmd.Process.Kill(); cmd.Wait() }()
		n, _ := strconv.Atoi(util)
		want[uint32(cmd.Process.Pid)] = uint32(n)
	}
	s := startStats(t, p, time.Second)
	resp := s.next(t)
	for _, d := range resp.GetDevices() {
		if d.GetDeviceId() != gpu {
			continue
		}
		got, sum := map[uint32]uint32{}, uint32(0)
		for _, pr := range d.GetProcesses() {
			if pr.SmUtilization == nil {
				t.Errorf("process %d on %s without sm_utilization", pr.GetPid(), gpu)
			}
			sum += pr.GetSmUtilization()
			if _, mine := want[pr.GetPid()]; mine {
				got[pr.GetPid()] = pr.GetSmUtilization()
			}
		}
		if !maps.Equal(got, want) {
			t.Errorf("sm_utilization by process %v, want %v", got, want)
		}
		if u := d.GetValues()["gpu_utilization"].GetIntValue(); u != int64(min(sum, 100)) {
			t.Errorf("gpu_utilization %d, want its processes' sum %d", u, min(sum, 100))
		}
		return
	}
	t.Fatalf("no stats of %s", gpu)
}
