package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/server/servertest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	cleanupE2E()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

var (
	h100 = device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3"}
	a100 = device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA A100"}
	t0   = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
)

// twoGroups is a snapshot of an H100 group (one device held, one unhealthy) and an A100.
func twoGroups() device.Snapshot {
	return device.Snapshot{
		Time: t0,
		Inventory: device.Inventory{Groups: []device.Group{
			{GroupKey: a100, Plugin: "nvidia", Devices: []device.DeviceInfo{{ID: "GPU-a0"}}},
			{GroupKey: h100, Plugin: "nvidia", Devices: []device.DeviceInfo{{ID: "GPU-0"}, {ID: "GPU-1"}, {ID: "GPU-2"}}},
		}},
		State: device.State{Devices: map[string]device.DeviceState{
			"GPU-a0": {Health: device.HealthHealthy},
			"GPU-0":  {Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "r1", OwnerID: "alloc-1"}},
			"GPU-1":  {Health: device.HealthUnhealthy, Reason: "XID 79: fell off the bus"},
			"GPU-2":  {Health: device.HealthHealthy},
		}},
	}
}

// watchOnce is a Manager.Watch that delivers snap and nothing more.
func watchOnce(snap device.Snapshot) func(context.Context) <-chan device.Snapshot {
	return func(context.Context) <-chan device.Snapshot {
		ch := make(chan device.Snapshot, 1)
		ch <- snap
		return ch
	}
}

// startAgent serves mgr in-process on a socket in a fresh directory and returns its
// address. Cleanup stops the server.
func startAgent(t *testing.T, mgr device.Manager) string {
	return servertest.Serve(t, servertest.SocketPath(t), server.Config{Manager: mgr}).Addr.String()
}

// cliResult is what one in-process run of the command line produced.
type cliResult struct {
	stdout, stderr string
	code           int
}

// runCLI runs devicehost with args in-process, with an empty environment.
func runCLI(t *testing.T, args ...string) cliResult {
	t.Helper()
	return runCLIEnv(t, nil, args...)
}

// runCLIEnv is runCLI with the environment variables env.
func runCLIEnv(t *testing.T, env map[string]string, args ...string) cliResult {
	t.Helper()
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	code := run(ctx, &cmdEnv{stdout: &stdout, stderr: &stderr, getenv: func(k string) string { return env[k] }}, args)
	return cliResult{stdout: stdout.String(), stderr: stderr.String(), code: code}
}

// mustRunCLI runs devicehost with args and fails the test unless it exits 0.
func mustRunCLI(t *testing.T, args ...string) string {
	t.Helper()
	r := runCLI(t, args...)
	if r.code != 0 {
		t.Fatalf("devicehost %s: exit %d, stderr:\n%s", strings.Join(args, " "), r.code, r.stderr)
	}
	return r.stdout
}

func TestDevicesTable(t *testing.T) {
	snap := twoGroups()
	snap.State.Devices = maps.Clone(snap.State.Devices)
	for id, c := range map[string]device.Cordon{"GPU-0": {Reason: "ECC storm", By: "admin"}, "GPU-2": {Reason: "firmware update", Drain: true}} {
		st := snap.State.Devices[id]
		st.Cordon = &c
		snap.State.Devices[id] = st
	}
	addr := startAgent(t, &devicetest.Fake{WatchFunc: watchOnce(snap)})
	got := mustRunCLI(t, "devices", "-address", addr)
	want := strings.Join([]string{
		"GROUP                             DEVICE  HEALTH     REASON                    HOLDER        CORDONED",
		"nvidia/gpu/NVIDIA A100            GPU-a0  healthy    -                         -             -",
		"nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-0   healthy    -                         alloc-1 (r1)  ECC storm",
		"nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-1   unhealthy  XID 79: fell off the bus  -             -",
		"nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-2   healthy    -                         -             drain: firmware update",
		"",
	}, "\n")
	if got != want {
		t.Errorf("devices:\ngot\n%s\nwant\n%s", got, want)
	}
}

// Admin accesses (monitoring or debugging workloads that see a device without holding
// it) have a column of their own, apart from the holder, shown only when there is one.
func TestDevicesTableAdminAccess(t *testing.T) {
	snap := twoGroups()
	snap.State.Devices = maps.Clone(snap.State.Devices)
	for id, acc := range map[string][]device.Holder{
		"GPU-0": {{ReservationID: "acc-1", OwnerID: "k8s-claim/mon/dcgm/u1"}, {ReservationID: "acc-2", OwnerID: "k8s-claim/mon/dbg/u2"}},
		"GPU-2": {{ReservationID: "acc-1", OwnerID: "k8s-claim/mon/dcgm/u1"}},
	} {
		st := snap.State.Devices[id]
		st.AdminAccess = acc
		snap.State.Devices[id] = st
	}
	addr := startAgent(t, &devicetest.Fake{WatchFunc: watchOnce(snap)})
	got := mustRunCLI(t, "devices", "-address", addr)
	want := strings.Join([]string{
		"GROUP                             DEVICE  HEALTH     REASON                    HOLDER        CORDONED  ADMIN ACCESS",
		"nvidia/gpu/NVIDIA A100            GPU-a0  healthy    -                         -             -         -",
		"nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-0   healthy    -                         alloc-1 (r1)  -         k8s-claim/mon/dcgm/u1 (acc-1), k8s-claim/mon/dbg/u2 (acc-2)",
		"nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-1   unhealthy  XID 79: fell off the bus  -             -         -",
		"nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-2   healthy    -                         -             -         k8s-claim/mon/dcgm/u1 (acc-1)",
		"",
	}, "\n")
	if got != want {
		t.Errorf("devices:\ngot\n%s\nwant\n%s", got, want)
	}
}

// Partitions show the counter set they share (their GPU), and a free one that cannot be
// reserved now shows who blocks it.
func TestDevicesTableShared(t *testing.T) {
	gpu0 := device.CounterSetKey{Plugin: "nvidia", Name: "GPU-0"}
	use := func(n int64) []device.Consumption {
		return []device.Consumption{{Set: gpu0, Counters: map[string]int64{"compute-slices": n}}}
	}
	snap := device.Snapshot{
		Inventory: device.Inventory{
			Groups: []device.Group{
				{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "H100"}, Plugin: "nvidia",
					Devices: []device.DeviceInfo{{ID: "GPU-0", Consumes: use(7)}, {ID: "GPU-1"}}},
				{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "mig", Name: "1g.10gb"}, Plugin: "nvidia",
					Devices: []device.DeviceInfo{{ID: "MIG-0-0", Consumes: use(1)}, {ID: "MIG-0-1", Consumes: use(1)}}},
			},
			CounterSets: []device.CounterSet{{Key: gpu0, Capacity: map[string]int64{"compute-slices": 7}}},
		},
		State: device.State{Devices: map[string]device.DeviceState{
			"GPU-0":   {Health: device.HealthHealthy, BlockedBy: []device.Holder{{ReservationID: "r1", OwnerID: "job-1"}, {ReservationID: "r2", OwnerID: "job-2"}}},
			"GPU-1":   {Health: device.HealthHealthy},
			"MIG-0-0": {Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "r1", OwnerID: "job-1"}},
			"MIG-0-1": {Health: device.HealthHealthy},
		}},
	}
	addr := startAgent(t, &devicetest.Fake{WatchFunc: watchOnce(snap)})
	got := mustRunCLI(t, "devices", "-address", addr)
	want := strings.Join([]string{
		"GROUP               DEVICE   HEALTH   REASON  HOLDER                            CORDONED  SHARES",
		"nvidia/gpu/H100     GPU-0    healthy  -       blocked by job-1 (r1) and 1 more  -         GPU-0",
		"nvidia/gpu/H100     GPU-1    healthy  -       -                                 -         -",
		"nvidia/mig/1g.10gb  MIG-0-0  healthy  -       job-1 (r1)                        -         GPU-0",
		"nvidia/mig/1g.10gb  MIG-0-1  healthy  -       -                                 -         GPU-0",
		"",
	}, "\n")
	if got != want {
		t.Errorf("devices:\ngot\n%s\nwant\n%s", got, want)
	}
}

func TestDevicesJSON(t *testing.T) {
	addr := startAgent(t, &devicetest.Fake{WatchFunc: watchOnce(twoGroups())})
	out := mustRunCLI(t, "devices", "-json", "-address", addr)
	var fp pb.FingerprintResponse
	if err := protojson.Unmarshal([]byte(out), &fp); err != nil {
		t.Fatalf("devices -json output is not a FingerprintResponse: %v\n%s", err, out)
	}
	if got := len(fp.GetGroups()); got != 2 {
		t.Fatalf("%d groups, want 2", got)
	}
	if h := fp.GetGroups()[1].GetDevices()[0].GetHolder(); h.GetOwnerId() != "alloc-1" {
		t.Errorf("GPU-0 holder = %v, want owner alloc-1", h)
	}
}

// -json prints conventional JSON (two-space indent, one space after a colon), the same
// bytes every time, though protojson randomizes its spacing from build to build; the
// one-line form of stats -json is compact JSON.
func TestJSONOutputIsStable(t *testing.T) {
	mgr := &devicetest.Fake{
		ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
			return device.Reservation{ID: "res-1", Container: device.ContainerReservation{
				Envs:       map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-0", "A": "1"},
				CDIDevices: []string{"nvidia.com/gpu=GPU-0"},
			}}, nil
		},
		WatchStatsFunc: func(context.Context, time.Duration) <-chan device.StatsSnapshot {
			ch := make(chan device.StatsSnapshot, 1)
			ch <- device.StatsSnapshot{Time: t0, Groups: []device.GroupStats{{GroupKey: h100, Plugin: "nvidia",
				Devices: []device.DeviceStats{{ID: "GPU-0", Time: t0, Values: map[string]device.Value{
					"power": {Kind: device.KindFloat, Float: 301.5, Unit: "W"},
				}}}}}}
			return ch
		},
	}
	addr := startAgent(t, mgr)
	out := mustRunCLI(t, "reserve", "-json", "-address", addr, "-owner", "o", "-device", "GPU-0",
		"-vendor", h100.Vendor, "-type", h100.Type, "-name", h100.Name)
	want := `{
  "reservationId": "res-1",
  "reservation": {
    "envs": {
      "A": "1",
      "NVIDIA_VISIBLE_DEVICES": "GPU-0"
    },
    "cdiDevices": [
      "nvidia.com/gpu=GPU-0"
    ]
  }
}
`
	if out != want {
		t.Errorf("reserve -json:\n%s\nwant\n%s", out, want)
	}
	var resp pb.ReserveResponse
	if err := protojson.Unmarshal([]byte(out), &resp); err != nil || resp.GetReservationId() != "res-1" {
		t.Errorf("reserve -json does not parse back: %v (%v)", err, &resp)
	}

	line := mustRunCLI(t, "stats", "-once", "-json", "-address", addr)
	var compact bytes.Buffer
	if err := json.Compact(&compact, []byte(line)); err != nil {
		t.Fatalf("stats -json: %v\n%s", err, line)
	}
	if got := compact.String() + "\n"; line != got {
		t.Errorf("stats -json:\n%s\nwant compact JSON\n%s", line, got)
	}
}

// protojson's random spaces (after a colon or a comma, from build to build) never reach
// the output.
func TestLayoutJSONDropsRandomSpaces(t *testing.T) {
	spaced := []byte(`{"reservationId":  "res-1", "deviceIds":["a",  "b"],"envs":{ "A": "x  y"}}`)
	tests := []struct {
		indent bool
		want   string
	}{
		{false, `{"reservationId":"res-1","deviceIds":["a","b"],"envs":{"A":"x  y"}}` + "\n"},
		{true, "{\n  \"reservationId\": \"res-1\",\n  \"deviceIds\": [\n    \"a\",\n    \"b\"\n  ],\n  \"envs\": {\n    \"A\": \"x  y\"\n  }\n}\n"},
	}
	for _, tt := range tests {
		got, err := layoutJSON(spaced, tt.indent)
		if err != nil || string(got) != tt.want {
			t.Errorf("layoutJSON(indent %v) = %q, %v; want %q", tt.indent, got, err, tt.want)
		}
	}
}

// -option passes plugin options to the Reserve, and a listing shows the options of the
// reservations that have some in an OPTIONS column (none: no column).
func TestReservePluginOptions(t *testing.T) {
	got := make(chan device.ReserveRequest, 1)
	mgr := &devicetest.Fake{
		ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
			got <- req
			return device.Reservation{ID: "r2", PluginOptions: req.PluginOptions}, nil
		},
		ReservationsFunc: func(context.Context, device.ReservationFilter) ([]device.Reservation, error) {
			return []device.Reservation{
				{ID: "r1", OwnerID: "a", Group: h100, DeviceIDs: []string{"GPU-0::mps::0"}, State: device.ReservationActive},
				{ID: "r2", OwnerID: "b", Group: h100, DeviceIDs: []string{"GPU-0::mps::1"}, State: device.ReservationActive,
					PluginOptions: map[string]string{"mps_isolation": "per-holder", "note": "x=y"}},
			}, nil
		},
	}
	addr := startAgent(t, mgr)
	mustRunCLI(t, "reserve", "-address", addr, "-owner", "b", "-device", "GPU-0::mps::1", "-vendor", h100.Vendor, "-type", h100.Type, "-name", h100.Name,
		"-option", "mps_isolation=per-holder", "-option", "note=x=y")
	if req, want := <-got, map[string]string{"mps_isolation": "per-holder", "note": "x=y"}; !maps.Equal(req.PluginOptions, want) {
		t.Errorf("Reserve's plugin options %v, want %v", req.PluginOptions, want)
	}
	for _, bad := range []string{"mps_isolation", "=shared"} {
		if r := runCLI(t, "reserve", "-address", addr, "-owner", "b", "-device", "GPU-0", "-option", bad); r.code != 2 || !strings.Contains(r.stderr, "want key=value") {
			t.Errorf("reserve -option %q: exit %d, stderr %q; want a usage error", bad, r.code, r.stderr)
		}
	}
	list := mustRunCLI(t, "reservations", "-address", addr)
	want := strings.Join([]string{
		"RESERVATION  OWNER  GROUP                             DEVICES        STATE   CREATED  RELEASED  OPTIONS",
		"r1           a      nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-0::mps::0  active  -        -         -",
		"r2           b      nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-0::mps::1  active  -        -         mps_isolation=per-holder,note=x=y",
		"",
	}, "\n")
	if list != want {
		t.Errorf("reservations:\ngot\n%s\nwant\n%s", list, want)
	}
}

func TestReserveInfersGroup(t *testing.T) {
	got := make(chan device.ReserveRequest, 1)
	mgr := &devicetest.Fake{
		WatchFunc: watchOnce(twoGroups()),
		ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
			got <- req
			return device.Reservation{ID: "r2", Container: device.ContainerReservation{
				Envs:       map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(req.DeviceIDs, ",")},
				CDIDevices: []string{"nvidia.com/gpu=GPU-2", "nvidia.com/gpu=GPU-1"},
				Devices:    []device.DeviceSpec{{HostPath: "/dev/nvidia2", ContainerPath: "/dev/nvidia2", Permissions: "rw"}},
				Mounts:     []device.Mount{{HostPath: "/usr/lib/nv", ContainerPath: "/usr/lib/nv", ReadOnly: true}},
			}}, nil
		},
	}
	addr := startAgent(t, mgr)
	out := mustRunCLI(t, "reserve", "-address", addr, "-owner", "alloc-2", "-device", "GPU-2", "-device", "GPU-1")
	req := <-got
	want := device.ReserveRequest{OwnerID: "alloc-2", Group: h100, DeviceIDs: []string{"GPU-2", "GPU-1"}}
	if fmt.Sprint(req) != fmt.Sprint(want) {
		t.Errorf("Reserve request = %+v, want %+v", req, want)
	}
	wantOut := strings.Join([]string{
		"RESERVATION  r2",
		"env          NVIDIA_VISIBLE_DEVICES=GPU-2,GPU-1",
		"cdi          nvidia.com/gpu=GPU-2",
		"cdi          nvidia.com/gpu=GPU-1",
		"mount        /usr/lib/nv -> /usr/lib/nv (ro)",
		"device       /dev/nvidia2 -> /dev/nvidia2 (rw)",
		"",
	}, "\n")
	if out != wantOut {
		t.Errorf("reserve output:\ngot\n%s\nwant\n%s", out, wantOut)
	}
}

func TestReserveGroupChoice(t *testing.T) {
	dup := twoGroups()
	dup.Inventory.Groups[0].Devices = append(dup.Inventory.Groups[0].Devices, device.DeviceInfo{ID: "GPU-2"})
	tests := []struct {
		name      string
		snap      device.Snapshot
		args      []string
		wantGroup device.GroupKey
		wantErr   string
	}{
		{"unknown device", twoGroups(), []string{"-device", "GPU-9"}, device.GroupKey{},
			"devicehost: reserve: device GPU-9 is not in any group of the agent's: unknown device (NotFound)\n"},
		{"unknown devices", twoGroups(), []string{"-device", "GPU-9,GPU-0,GPU-8"}, device.GroupKey{},
			"devicehost: reserve: devices GPU-9, GPU-8 are not in any group of the agent's: unknown device (NotFound)\n"},
		{"unknown device in the groups asked for", twoGroups(), []string{"-device", "GPU-0", "-name", "NVIDIA A100"}, device.GroupKey{},
			`devicehost: reserve: device GPU-0 is not in any group matching vendor="" type="" name="NVIDIA A100": unknown device (NotFound)` + "\n"},
		{"devices of two groups", twoGroups(), []string{"-device", "GPU-a0", "-device", "GPU-0"}, device.GroupKey{},
			"devicehost: reserve: devices GPU-a0, GPU-0 are not all in one group; a reservation takes devices of one group\n"},
		{"ambiguous ID", dup, []string{"-device", "GPU-2"}, device.GroupKey{},
			"devicehost: reserve: device GPU-2 is in more than one group (nvidia/gpu/NVIDIA A100, nvidia/gpu/NVIDIA H100 80GB HBM3); choose with -vendor, -type and -name\n"},
		{"ambiguity resolved by -name", dup, []string{"-device", "GPU-2", "-name", "NVIDIA A100"}, a100, ""},
		{"comma-separated devices", twoGroups(), []string{"-device", "GPU-0,GPU-2"}, h100, ""},
		{"group forced: no look-up", device.Snapshot{}, []string{"-device", "X", "-vendor", "v", "-type", "t", "-name", "n"},
			device.GroupKey{Vendor: "v", Type: "t", Name: "n"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := make(chan device.ReserveRequest, 1)
			mgr := &devicetest.Fake{
				ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
					got <- req
					return device.Reservation{ID: "r"}, nil
				},
			}
			if tt.snap.Inventory.Groups != nil {
				mgr.WatchFunc = watchOnce(tt.snap)
			} // else Watch's stream ends at once: a look-up would fail
			addr := startAgent(t, mgr)
			r := runCLI(t, append([]string{"reserve", "-address", addr, "-owner", "o"}, tt.args...)...)
			if tt.wantErr != "" {
				if r.code != 1 || r.stderr != tt.wantErr {
					t.Errorf("exit %d stderr %q, want exit 1 and %q", r.code, r.stderr, tt.wantErr)
				}
				if len(got) != 0 {
					t.Errorf("Reserve was called: %+v", <-got)
				}
				return
			}
			if r.code != 0 {
				t.Fatalf("exit %d: %s", r.code, r.stderr)
			}
			if req := <-got; req.Group != tt.wantGroup {
				t.Errorf("group = %v, want %v", req.Group, tt.wantGroup)
			}
		})
	}
}

func TestCallErrorsAreOneLineAndExit1(t *testing.T) {
	mgr := &devicetest.Fake{
		WatchFunc: watchOnce(twoGroups()),
		ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
			return device.Reservation{}, fmt.Errorf("GPU-0 held by reservation r1 of owner alloc-1: %w", device.ErrDeviceHeld)
		},
	}
	addr := startAgent(t, mgr)
	r := runCLI(t, "reserve", "-address", addr, "-owner", "alloc-2", "-device", "GPU-0")
	want := "devicehost: reserve: GPU-0 held by reservation r1 of owner alloc-1: device held (FailedPrecondition)\n"
	if r.code != 1 || r.stderr != want {
		t.Errorf("exit %d stderr %q, want exit 1 and %q", r.code, r.stderr, want)
	}
}

func TestUnreachableAgent(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "nobody.sock")
	// A socket left behind by an agent that is gone: there, but nothing accepts on it.
	stale := filepath.Join(dir, "stale.sock")
	lis, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	lis.SetUnlinkOnClose(false)
	lis.Close()
	notSocket := filepath.Join(dir, "file")
	if err := os.WriteFile(notSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}

	const flagHint = "If it listens elsewhere, give its address with -address or $DEVICEHOST_ADDRESS"
	tests := []struct {
		name string
		args []string
		env  map[string]string
		why  string // what the error says went wrong
		hint string
	}{
		{"no socket", []string{"devices", "-address", "unix://" + missing}, nil,
			"no socket at " + missing + " (no such file or directory)", flagHint},
		{"stale socket", []string{"plugins", "-address", "unix://" + stale}, nil,
			"the socket " + stale + " exists but no agent accepts on it (connection refused)", flagHint},
		{"not a socket", []string{"reservations", "-address", "unix://" + notSocket}, nil,
			notSocket + " is not a socket", flagHint},
		{"address from the environment", []string{"stats"}, map[string]string{addressEnv: "unix://" + missing},
			"no socket at " + missing, "The address is from $DEVICEHOST_ADDRESS; -address overrides it"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := runCLIEnv(t, tt.env, tt.args...)
			if r.code != 1 || strings.Count(r.stderr, "\n") != 1 {
				t.Errorf("exit %d stderr %q, want exit 1 and one line", r.code, r.stderr)
			}
			for _, want := range []string{"devicehost: cannot reach agent at unix://", tt.why, "is the agent running ('devicehost agent')?", tt.hint} {
				if !strings.Contains(r.stderr, want) {
					t.Errorf("stderr %q does not say %q", r.stderr, want)
				}
			}
			if strings.Contains(r.stderr, "transport:") {
				t.Errorf("stderr %q has gRPC's transport error in it", r.stderr)
			}
		})
	}
}

// -address's help names its default once: the built-in one, or $DEVICEHOST_ADDRESS's.
func TestAddressHelpNamesOneDefault(t *testing.T) {
	tests := []struct {
		env  map[string]string
		want string
	}{
		{nil, `(default "unix:///run/devicehost/devicehost.sock"; $DEVICEHOST_ADDRESS overrides it)`},
		{map[string]string{addressEnv: "tcp://127.0.0.1:7070"}, `(default "tcp://127.0.0.1:7070", from $DEVICEHOST_ADDRESS)`},
	}
	for _, tt := range tests {
		for _, cmd := range []string{"devices", "stats", "kubelet-plugin"} {
			r := runCLIEnv(t, tt.env, cmd, "-h")
			_, help, _ := strings.Cut(r.stdout, "-address address\n")
			help, _, _ = strings.Cut(help, "\n")
			if r.code != 0 || strings.Count(help, "(default") != 1 || !strings.Contains(help, tt.want) {
				t.Errorf("%s -h (env %v): exit %d, -address help %q, want one default: %s", cmd, tt.env, r.code, help, tt.want)
			}
		}
	}
}

func TestPluginsTable(t *testing.T) {
	mgr := &devicetest.Fake{StateFunc: func() device.State {
		return device.State{Plugins: []device.PluginState{
			{Name: "acme", Version: "1.2.0", Status: device.PluginFailed, Restarts: 5, LastError: "exit status 2\nbad config"},
			{Name: "nvidia-example", Version: "0.1.0", Status: device.PluginRunning, DeviceCount: 8},
		}}
	}}
	addr := startAgent(t, mgr)
	got := mustRunCLI(t, "plugins", "-address", addr)
	want := strings.Join([]string{
		"PLUGIN          VERSION  STATUS   DEVICES  RESTARTS  NEXT RETRY  LAST ERROR",
		"acme            1.2.0    failed   0        5         -           exit status 2 bad config",
		"nvidia-example  0.1.0    running  8        0         -           -",
		"",
	}, "\n")
	if got != want {
		t.Errorf("plugins:\ngot\n%s\nwant\n%s", got, want)
	}
}

func TestReleaseAndReservations(t *testing.T) {
	var mu sync.Mutex
	var releases []device.ReleaseRequest
	var filters []device.ReservationFilter
	mgr := &devicetest.Fake{
		ReleaseFunc: func(_ context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
			mu.Lock()
			defer mu.Unlock()
			releases = append(releases, req)
			if req.ReservationID == "gone" {
				return device.ReleaseResult{}, fmt.Errorf("reservation gone: %w", device.ErrNotFound)
			}
			return device.ReleaseResult{Released: []string{"r2"}, AlreadyReleased: []string{"r1"}}, nil
		},
		ReservationsFunc: func(_ context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
			mu.Lock()
			defer mu.Unlock()
			filters = append(filters, f)
			return []device.Reservation{{ID: "r1", OwnerID: "alloc-1", Group: h100, DeviceIDs: []string{"GPU-0", "GPU-2"},
				State: device.ReservationReleased, CleanupPending: true},
				{ID: "r3", OwnerID: "k8s-claim/ml/c/u", Group: h100, DeviceIDs: []string{"GPU-2"}, State: device.ReservationReleased,
					OwnerLabels: device.OwnerLabels{Pod: "p-0,p-1", Namespace: "ml"}}}, nil
		},
	}
	addr := startAgent(t, mgr)

	if got, want := mustRunCLI(t, "release", "-address", addr, "-owner", "alloc-1"), "released r2\nalready released r1 (nothing done)\n"; got != want {
		t.Errorf("release output %q, want %q", got, want)
	}
	r := runCLI(t, "release", "-address", addr, "-reservation", "gone")
	if r.code != 1 || !strings.Contains(r.stderr, "(NotFound)") {
		t.Errorf("release of an unknown reservation: exit %d stderr %q, want exit 1 and NotFound", r.code, r.stderr)
	}
	got := mustRunCLI(t, "reservations", "-address", addr, "-device", "GPU-2", "-state", "released")
	want := strings.Join([]string{
		"RESERVATION  OWNER                            GROUP                             DEVICES      STATE                       CREATED  RELEASED",
		"r1           alloc-1                          nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-0,GPU-2  released (cleanup pending)  -        -",
		"r3           k8s-claim/ml/c/u (pods p-0,p-1)  nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-2        released                    -        -",
		"",
	}, "\n")
	if got != want {
		t.Errorf("reservations:\ngot\n%s\nwant\n%s", got, want)
	}
	mu.Lock()
	defer mu.Unlock()
	wantReleases := []device.ReleaseRequest{{OwnerID: "alloc-1"}, {ReservationID: "gone"}}
	if fmt.Sprint(releases) != fmt.Sprint(wantReleases) {
		t.Errorf("releases = %+v, want %+v", releases, wantReleases)
	}
	wantFilters := []device.ReservationFilter{{DeviceID: "GPU-2", State: device.ReservationReleased}}
	if fmt.Sprint(filters) != fmt.Sprint(wantFilters) {
		t.Errorf("filters = %+v, want %+v", filters, wantFilters)
	}
}

func TestUsageErrorsExit2(t *testing.T) {
	tests := [][]string{
		{"reserve", "-device", "GPU-0"},
		{"reserve", "-owner", "o"},
		{"release"},
		{"release", "-owner", "o", "-reservation", "r"},
		{"reservations", "-state", "pending"},
		{"stats", "-interval", "-1s"},
		{"devices", "-address", "localhost:80"},
		{"devices", "-address", "tcp://127.0.0.1:1"},                        // tcp without TLS flags
		{"plugins", "-address", "tcp://10.0.0.1:1", "-insecure"},            // plaintext off loopback
		{"reservations", "-address", "unix:///x.sock", "-tls-ca", "ca.pem"}, // TLS on a socket
		{"stats", "-timeout", "-1s"},
		{"devices", "extra"},
		{"frobnicate"},
		{},
	}
	for _, args := range tests {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			if r := runCLI(t, args...); r.code != 2 {
				t.Errorf("exit %d (stderr %q), want 2", r.code, r.stderr)
			}
		})
	}
}

func TestStatsOnce(t *testing.T) {
	snap := device.StatsSnapshot{Time: t0, Groups: []device.GroupStats{{
		GroupKey: h100, Plugin: "nvidia",
		Devices: []device.DeviceStats{
			{ID: "GPU-0", Values: map[string]device.Value{
				"gpu_utilization": {Kind: device.KindInt, Int: 42, Unit: "%"},
				"power":           {Kind: device.KindFloat, Float: 301.256, Unit: "W"},
			}},
			{ID: "GPU-2", Values: map[string]device.Value{
				"gpu_utilization":      {Kind: device.KindInt, Int: 7, Unit: "%"},
				"ecc_errors_corrected": {Kind: device.KindInt, Int: 3, Unit: "count"},
			}},
		},
	}}}
	intervals := make(chan time.Duration, 2)
	mgr := &devicetest.Fake{WatchStatsFunc: func(_ context.Context, interval time.Duration) <-chan device.StatsSnapshot {
		intervals <- interval
		ch := make(chan device.StatsSnapshot, 1)
		ch <- snap
		return ch
	}}
	addr := startAgent(t, mgr)

	out := mustRunCLI(t, "stats", "-once", "-interval", "2s", "-address", addr)
	if got := <-intervals; got != 2*time.Second {
		t.Errorf("interval asked = %v, want 2s", got)
	}
	wantTable := strings.Join([]string{
		"",
		"nvidia/gpu/NVIDIA H100 80GB HBM3 (plugin nvidia)",
		"DEVICE  ecc_errors_corrected  gpu_utilization  power",
		"GPU-0   -                     42 %             301.26 W",
		"GPU-2   3                     7 %              -",
		"",
	}, "\n")
	if _, table, ok := strings.Cut(out, "\n"); !ok || table != wantTable {
		t.Errorf("stats -once:\ngot\n%s\nwant (after the time line)\n%s", out, wantTable)
	}

	out = mustRunCLI(t, "stats", "-once", "-json", "-address", addr)
	<-intervals
	if strings.Count(out, "\n") != 1 {
		t.Errorf("stats -once -json printed %d lines, want 1:\n%s", strings.Count(out, "\n"), out)
	}
	var resp pb.StatsResponse
	if err := protojson.Unmarshal([]byte(out), &resp); err != nil {
		t.Fatalf("not a StatsResponse: %v", err)
	}
	if got := resp.GetGroups()[0].GetDevices()[0].GetValues()["gpu_utilization"].GetIntValue(); got != 42 {
		t.Errorf("GPU-0 gpu_utilization = %d, want 42", got)
	}
}

func TestStatsEndsWhenTheAgentGoesAway(t *testing.T) {
	mgr := &devicetest.Fake{WatchStatsFunc: func(context.Context, time.Duration) <-chan device.StatsSnapshot {
		ch := make(chan device.StatsSnapshot)
		close(ch) // the manager shut down
		return ch
	}}
	addr := startAgent(t, mgr)
	r := runCLI(t, "stats", "-address", addr)
	if r.code != 1 || !strings.Contains(r.stderr, "(Unavailable)") {
		t.Errorf("exit %d stderr %q, want exit 1 and Unavailable", r.code, r.stderr)
	}
}

func TestTablesEscapeCellsThatCouldFakeColumnsOrRows(t *testing.T) {
	spoof := "job-7  GPU-37c4  healthy  spoof"
	snap := device.Snapshot{
		Time: t0,
		Inventory: device.Inventory{Groups: []device.Group{
			{GroupKey: h100, Plugin: "nvidia", Devices: []device.DeviceInfo{{ID: "GPU-0"}, {ID: "GPU-1"}, {ID: "GPU-2"}}},
		}},
		State: device.State{Devices: map[string]device.DeviceState{
			"GPU-0": {Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "r1", OwnerID: spoof}},
			"GPU-1": {Health: device.HealthUnhealthy, Reason: "XID 79\nnvidia/gpu/x  GPU-99  healthy  -  -"},
			"GPU-2": {Health: device.HealthUnhealthy, Reason: "\x1b[2Jcleared", Cordon: &device.Cordon{Reason: "ECC  x\x1b[2J"}},
		}},
	}
	mgr := &devicetest.Fake{
		WatchFunc: watchOnce(snap),
		ReservationsFunc: func(context.Context, device.ReservationFilter) ([]device.Reservation, error) {
			return []device.Reservation{
				{ID: "r1", OwnerID: spoof, Group: h100, DeviceIDs: []string{"GPU-0"}, State: device.ReservationActive},
				{ID: "r2", OwnerID: "-", Group: h100, DeviceIDs: []string{"GPU-1"}, State: device.ReservationActive},
			}, nil
		},
		StateFunc: func() device.State {
			return device.State{Plugins: []device.PluginState{{Name: "acme", Version: "1.0", Status: device.PluginFailed,
				LastError: "boom \x1b]0;owned\x07 done"}}}
		},
	}
	addr := startAgent(t, mgr)
	tests := []struct {
		args []string
		want []string
	}{
		{[]string{"devices"}, []string{
			`GROUP                             DEVICE  HEALTH     REASON                                         HOLDER                                  CORDONED`,
			`nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-0   healthy    -                                              "job-7  GPU-37c4  healthy  spoof" (r1)  -`,
			`nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-1   unhealthy  "XID 79\nnvidia/gpu/x  GPU-99  healthy  -  -"  -                                       -`,
			`nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-2   unhealthy  "\x1b[2Jcleared"                               -                                       "ECC  x\x1b[2J"`,
		}},
		{[]string{"reservations"}, []string{
			`RESERVATION  OWNER                              GROUP                             DEVICES  STATE   CREATED  RELEASED`,
			`r1           "job-7  GPU-37c4  healthy  spoof"  nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-0    active  -        -`,
			`r2           "-"                                nvidia/gpu/NVIDIA H100 80GB HBM3  GPU-1    active  -        -`,
		}},
		{[]string{"plugins"}, []string{
			`PLUGIN  VERSION  STATUS  DEVICES  RESTARTS  NEXT RETRY  LAST ERROR`,
			`acme    1.0      failed  0        0         -           "boom \x1b]0;owned\a done"`,
		}},
	}
	for _, tt := range tests {
		t.Run(tt.args[0], func(t *testing.T) {
			got := mustRunCLI(t, append(tt.args, "-address", addr)...)
			want := strings.Join(tt.want, "\n") + "\n"
			if got != want {
				t.Errorf("%s:\ngot\n%s\nwant\n%s", tt.args[0], got, want)
			}
		})
	}
}

func TestCellQuotesOnlyWhatCouldBeMisread(t *testing.T) {
	tests := []struct{ in, want string }{
		{"", "-"},
		{"NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"},
		{"k8s/ns/pod/c", "k8s/ns/pod/c"},
		{"job-é", "job-é"},
		{"-", `"-"`},
		{"a  b", `"a  b"`},
		{" lead", `" lead"`},
		{"trail ", `"trail "`},
		{"tab\there", `"tab\there"`},
		{"new\nline", `"new\nline"`},
		{"\u00a0nbsp", `"\u00a0nbsp"`},
		{"bidi\u202eevil", `"bidi\u202eevil"`},
		{"bad\xffutf8", `"bad\xffutf8"`},
		{`"quoted"`, `"\"quoted\""`},
	}
	for _, tt := range tests {
		if got := cell(tt.in); got != tt.want {
			t.Errorf("cell(%q) = %s, want %s", tt.in, got, tt.want)
		}
	}
}

func TestCallErrorsDoNotStutter(t *testing.T) {
	mgr := &devicetest.Fake{
		ReleaseFunc: func(_ context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
			// The ledger's own wording for an unknown ID.
			return device.ReleaseResult{}, fmt.Errorf("release: reservation %q: %w", req.ReservationID, device.ErrNotFound)
		},
	}
	addr := startAgent(t, mgr)
	r := runCLI(t, "release", "-address", addr, "-reservation", "gone")
	want := "devicehost: release: reservation \"gone\": not found (NotFound)\n"
	if r.code != 1 || r.stderr != want {
		t.Errorf("exit %d stderr %q, want exit 1 and %q", r.code, r.stderr, want)
	}
}

func TestStatsFilterMatchingNoGroup(t *testing.T) {
	// The server filters the agent's stats: a filter that matches nothing gets samples
	// with no groups at all.
	mgr := &devicetest.Fake{
		WatchFunc: watchOnce(twoGroups()),
		WatchStatsFunc: func(context.Context, time.Duration) <-chan device.StatsSnapshot {
			ch := make(chan device.StatsSnapshot, 1)
			ch <- device.StatsSnapshot{Time: t0, Groups: []device.GroupStats{{GroupKey: h100, Plugin: "nvidia"}}}
			return ch
		},
	}
	addr := startAgent(t, mgr)
	r := runCLI(t, "stats", "-once", "-vendor", "nope", "-address", addr)
	if want := "devicehost: stats: no device group matches -vendor \"nope\"; the agent's groups: nvidia/gpu/NVIDIA A100, nvidia/gpu/NVIDIA H100 80GB HBM3\n"; r.stderr != want {
		t.Errorf("stderr %q, want %q", r.stderr, want)
	}
	for _, args := range [][]string{
		{"stats", "-once", "-vendor", "nope"},
		{"stats", "-once", "-json", "-vendor", "nope"},
		{"stats", "-vendor", "nvidia", "-type", "fpga"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			r := runCLI(t, append(args, "-address", addr)...)
			if r.code != 1 || !strings.HasPrefix(r.stderr, "devicehost: stats: no device group matches -") ||
				!strings.Contains(r.stderr, "the agent's groups: nvidia/gpu/NVIDIA A100, nvidia/gpu/NVIDIA H100 80GB HBM3") {
				t.Errorf("exit %d stderr %q stdout %q, want exit 1 saying no group matched and which there are", r.code, r.stderr, r.stdout)
			}
		})
	}
}

func TestStatsOnceWaitsForAGroupNotSampledYet(t *testing.T) {
	// The H100 group is in the inventory but its plugin has not been sampled in the first
	// stats snapshot: -once waits for the next instead of printing an empty table.
	mgr := &devicetest.Fake{
		WatchFunc: watchOnce(twoGroups()),
		WatchStatsFunc: func(context.Context, time.Duration) <-chan device.StatsSnapshot {
			ch := make(chan device.StatsSnapshot, 2)
			ch <- device.StatsSnapshot{Time: t0}
			ch <- device.StatsSnapshot{Time: t0, Groups: []device.GroupStats{{GroupKey: h100, Plugin: "nvidia",
				Devices: []device.DeviceStats{{ID: "GPU-0", Values: map[string]device.Value{"power": {Kind: device.KindInt, Int: 300, Unit: "W"}}}}}}}
			return ch
		},
	}
	addr := startAgent(t, mgr)
	out := mustRunCLI(t, "stats", "-once", "-json", "-name", h100.Name, "-address", addr)
	var resp pb.StatsResponse
	if err := protojson.Unmarshal([]byte(out), &resp); err != nil || len(resp.GetGroups()) != 1 {
		t.Errorf("stats -once -name H100 = %q (%v), want the second sample, with the H100 group", out, err)
	}
}

func TestStatsTimeoutEndsTheLiveStream(t *testing.T) {
	// A sample every 20ms, for as long as the stream is open.
	mgr := &devicetest.Fake{WatchStatsFunc: func(ctx context.Context, _ time.Duration) <-chan device.StatsSnapshot {
		ch := make(chan device.StatsSnapshot)
		go func() {
			defer close(ch)
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				select {
				case ch <- device.StatsSnapshot{Time: t0, Groups: []device.GroupStats{{GroupKey: h100, Plugin: "nvidia"}}}:
				case <-ctx.Done():
					return
				}
			}
		}()
		return ch
	}}
	addr := startAgent(t, mgr)
	// runCLI's own deadline is 30s: without -timeout honoured, this would run into it
	// and fail (exit 1, DeadlineExceeded).
	r := runCLI(t, "stats", "-json", "-timeout", "300ms", "-address", addr)
	if r.code != 0 || strings.Count(r.stdout, "\n") < 1 {
		t.Errorf("stats -timeout 300ms: exit %d, %d lines, stderr %q; want exit 0 after some samples", r.code, strings.Count(r.stdout, "\n"), r.stderr)
	}

	silent := startAgent(t, &devicetest.Fake{WatchStatsFunc: func(context.Context, time.Duration) <-chan device.StatsSnapshot {
		return make(chan device.StatsSnapshot) // never a sample
	}})
	r = runCLI(t, "stats", "-timeout", "200ms", "-address", silent)
	if r.code != 1 || !strings.Contains(r.stderr, "no sample within -timeout 200ms") {
		t.Errorf("stats -timeout with no sample: exit %d stderr %q, want exit 1 saying so", r.code, r.stderr)
	}
}
