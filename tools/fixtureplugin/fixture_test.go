package fixtureplugin_test

import (
	"bytes"
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/deviceplugin/deviceplugintest"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// start runs a fixture with cfg in-process and returns its client and the plugin.
func start(t *testing.T, cfg fixtureplugin.Config) (pb.DevicePluginClient, *fixtureplugin.Plugin) {
	t.Helper()
	p := fixtureplugin.New()
	p.Exit = func(int) { t.Error("fixture called Exit unexpectedly") }
	t.Cleanup(p.Stop)
	c := deviceplugintest.Connect(t, p)
	if _, err := c.SetConfig(testContext(t), &pb.SetConfigRequest{ConfigJson: cfg.JSON()}); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	return c, p
}

type device struct {
	id     string
	health pb.Health
}

func devices(m *pb.FingerprintResponse) []device {
	var out []device
	for _, g := range m.GetGroups() {
		for _, d := range g.GetDevices() {
			out = append(out, device{d.GetId(), d.GetHealth()})
		}
	}
	return out
}

func fingerprints(t *testing.T, c pb.DevicePluginClient) func() (*pb.FingerprintResponse, error) {
	t.Helper()
	ctx, cancel := context.WithCancel(testContext(t))
	t.Cleanup(cancel)
	stream, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	return stream.Recv
}

func TestFingerprintInventory(t *testing.T) {
	const ok, bad = pb.Health_HEALTH_HEALTHY, pb.Health_HEALTH_UNHEALTHY
	tests := []struct {
		name string
		cfg  fixtureplugin.Config
		want []device
	}{
		{name: "default", want: []device{{"w0", ok}, {"w1", ok}}},
		{name: "groups", cfg: fixtureplugin.Config{Groups: []fixtureplugin.Group{
			{Vendor: "a", Type: "t", Name: "A", IDs: []string{"a0", "a1"}, UnhealthyIDs: []string{"a1"}},
			{Vendor: "b", Type: "t", Name: "B", IDs: []string{"b0"}},
		}}, want: []device{{"a0", ok}, {"a1", bad}, {"b0", ok}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _ := start(t, tt.cfg)
			m, err := fingerprints(t, c)()
			if err != nil {
				t.Fatalf("Recv: %v", err)
			}
			if got := devices(m); !slices.Equal(got, tt.want) {
				t.Errorf("devices: got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestFingerprintReportEnv(t *testing.T) {
	t.Setenv("FIXTURE_TEST_SET", "42")
	c, _ := start(t, fixtureplugin.Config{ReportEnv: []string{"FIXTURE_TEST_SET", "FIXTURE_TEST_UNSET"}})
	m, err := fingerprints(t, c)()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	attrs := m.GetGroups()[0].GetAttributes()
	if got := attrs["env_FIXTURE_TEST_SET"].GetStringValue(); got != "42" {
		t.Errorf("env_FIXTURE_TEST_SET: got %q, want 42", got)
	}
	if v, ok := attrs["env_FIXTURE_TEST_UNSET"]; ok {
		t.Errorf("env_FIXTURE_TEST_UNSET: got %v, want no attribute", v)
	}
}

func TestFingerprintReportPID(t *testing.T) {
	for _, report := range []bool{false, true} {
		c, _ := start(t, fixtureplugin.Config{ReportPID: report})
		m, err := fingerprints(t, c)()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		v, ok := m.GetGroups()[0].GetAttributes()["pid"]
		switch {
		case report && v.GetIntValue() != int64(os.Getpid()):
			t.Errorf("report_pid: pid attribute = %v, want %d", v, os.Getpid())
		case !report && ok:
			t.Errorf("no report_pid: pid attribute = %v, want none", v)
		}
	}
}

func TestFingerprintBadAfter(t *testing.T) {
	c, _ := start(t, fixtureplugin.Config{FingerprintBadAfter: true})
	recv := fingerprints(t, c)
	first, err := recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	second, err := recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	if got := len(devices(first)); got != 2 {
		t.Errorf("first message: %d devices, want 2", got)
	}
	ids := []string{}
	for _, d := range devices(second) {
		ids = append(ids, d.id)
	}
	if !slices.Equal(ids, []string{"w0", "w1", "w0"}) {
		t.Errorf("second message IDs: got %q, want a duplicate w0", ids)
	}
}

func TestFingerprintChangeAndEnd(t *testing.T) {
	c, _ := start(t, fixtureplugin.Config{
		FingerprintChangeEvery: fixtureplugin.Duration(time.Millisecond),
		FingerprintEndAfter:    3,
	})
	recv := fingerprints(t, c)
	want := []pb.Health{pb.Health_HEALTH_HEALTHY, pb.Health_HEALTH_UNHEALTHY, pb.Health_HEALTH_HEALTHY}
	for i, w := range want {
		m, err := recv()
		if err != nil {
			t.Fatalf("Recv %d: %v", i, err)
		}
		if got := devices(m)[0].health; got != w {
			t.Errorf("message %d: w0 health %v, want %v", i, got, w)
		}
	}
	_, err := recv()
	if status.Code(err) != codes.Unknown || !strings.Contains(err.Error(), "ended after 3 messages") {
		t.Errorf("Recv after 3 messages: got %v, want the fixture's end-of-stream error", err)
	}
}

func TestFingerprintHang(t *testing.T) {
	c, _ := start(t, fixtureplugin.Config{FingerprintHang: true})
	ctx, cancel := context.WithCancel(testContext(t))
	stream, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	cancel()
	if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
		t.Errorf("Recv: got %v, want Canceled (nothing sent before the host gave up)", err)
	}
}

func TestStats(t *testing.T) {
	c, _ := start(t, fixtureplugin.Config{})
	open := func() func() (*pb.StatsResponse, error) {
		ctx, cancel := context.WithCancel(testContext(t))
		t.Cleanup(cancel)
		s, err := c.Stats(ctx, &pb.StatsRequest{Interval: durationpb.New(time.Millisecond)})
		if err != nil {
			t.Fatalf("Stats: %v", err)
		}
		return s.Recv
	}
	value := func(m *pb.StatsResponse, name string) int64 {
		return m.GetDevices()[0].GetValues()[name].GetIntValue()
	}

	first := open()
	for seq := int64(1); seq <= 3; seq++ {
		m, err := first()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		if got := value(m, "seq"); got != seq {
			t.Errorf("seq: got %d, want %d", got, seq)
		}
		if got := value(m, "stats_streams"); got != 1 {
			t.Errorf("stats_streams on the first stream: got %d, want 1", got)
		}
		if got := len(m.GetDevices()); got != 2 {
			t.Errorf("devices in a stats message: got %d, want 2", got)
		}
	}
	m, err := open()()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	if got := value(m, "stats_streams"); got != 2 {
		t.Errorf("stats_streams on the second stream: got %d, want 2", got)
	}
	// The first stream's later messages count the second stream too (those sent before
	// it opened may still be in flight, saying 1).
	for {
		if m, err = first(); err != nil {
			t.Fatalf("waiting for stats_streams 2 on the first stream: %v", err)
		}
		got := value(m, "stats_streams")
		if got == 2 {
			break
		}
		if got != 1 {
			t.Fatalf("stats_streams on the first stream: got %d, want 1 then 2", got)
		}
	}
}

func TestStatsKnobs(t *testing.T) {
	t.Run("error", func(t *testing.T) {
		c, _ := start(t, fixtureplugin.Config{StatsError: "sensor on fire"})
		s, err := c.Stats(testContext(t), &pb.StatsRequest{Interval: durationpb.New(time.Second)})
		if err == nil {
			_, err = s.Recv()
		}
		if status.Convert(err).Message() != "sensor on fire" {
			t.Errorf("Recv: got %v, want the stats_error message", err)
		}
	})
	t.Run("values", func(t *testing.T) {
		c, _ := start(t, fixtureplugin.Config{StatsValues: map[string]fixtureplugin.StatValue{
			"temp °C": {Value: 41.5, Unit: "C"},
			"a-b":     {Value: 2},
		}})
		s, err := c.Stats(testContext(t), &pb.StatsRequest{Interval: durationpb.New(time.Second)})
		if err != nil {
			t.Fatalf("Stats: %v", err)
		}
		m, err := s.Recv()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		for _, d := range m.GetDevices() {
			v := d.GetValues()
			if got := v["temp °C"]; got.GetFloatValue() != 41.5 || got.GetUnit() != "C" {
				t.Errorf("%s: \"temp °C\" = %v, want 41.5 C", d.GetDeviceId(), got)
			}
			if got := v["a-b"]; got.GetFloatValue() != 2 || got.GetUnit() != "" {
				t.Errorf("%s: \"a-b\" = %v, want 2 without a unit", d.GetDeviceId(), got)
			}
			if _, ok := v["seq"]; !ok {
				t.Errorf("%s: the usual values are gone: %v", d.GetDeviceId(), v)
			}
		}
	})
	t.Run("hang", func(t *testing.T) {
		c, _ := start(t, fixtureplugin.Config{StatsHang: true})
		ctx, cancel := context.WithCancel(testContext(t))
		s, err := c.Stats(ctx, &pb.StatsRequest{Interval: durationpb.New(time.Millisecond)})
		if err != nil {
			t.Fatalf("Stats: %v", err)
		}
		cancel()
		if _, err := s.Recv(); status.Code(err) != codes.Canceled {
			t.Errorf("Recv: got %v, want Canceled (nothing sent)", err)
		}
	})
}

func TestReserve(t *testing.T) {
	tests := []struct {
		name    string
		cfg     fixtureplugin.Config
		ids     []string
		wantErr string
		wantEnv map[string]string
	}{
		{name: "normal", ids: []string{"w1", "w0"}, wantEnv: map[string]string{"FIXTURE_DEVICES": "w1,w0"}},
		{name: "bad", cfg: fixtureplugin.Config{ReserveBad: true}, ids: []string{"w0"},
			wantEnv: map[string]string{"FIXTURE_DEVICES": "w0", "LD_PRELOAD": "/x"}},
		{name: "unknown IDs", ids: []string{"w0", "zz", "yy"}, wantErr: "unknown device IDs: zz, yy"},
		{name: "no IDs", ids: nil, wantErr: "no device IDs"},
		{name: "error", cfg: fixtureplugin.Config{ReserveError: "out of widgets"}, ids: []string{"w0"}, wantErr: "out of widgets"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _ := start(t, tt.cfg)
			resp, err := c.Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: tt.ids})
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Errorf("Reserve: got %v, want an error with %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Reserve: %v", err)
			}
			r := resp.GetReservation()
			if len(r.GetEnvs()) != len(tt.wantEnv) {
				t.Errorf("envs: got %v, want %v", r.GetEnvs(), tt.wantEnv)
			}
			for k, v := range tt.wantEnv {
				if r.GetEnvs()[k] != v {
					t.Errorf("env %s: got %q, want %q", k, r.GetEnvs()[k], v)
				}
			}
			d := r.GetDevices()
			if len(d) != 1 || d[0].GetHostPath() != "/dev/null" || d[0].GetContainerPath() != "/dev/fixture0" || d[0].GetPermissions() != "rw" {
				t.Errorf("device nodes: got %v, want /dev/null as /dev/fixture0 rw", d)
			}
			var wantCDI []string
			for _, id := range tt.ids {
				wantCDI = append(wantCDI, "fixture.example/widget="+id)
			}
			if !slices.Equal(r.GetCdiDevices(), wantCDI) {
				t.Errorf("CDI names: got %q, want %q", r.GetCdiDevices(), wantCDI)
			}
		})
	}
	t.Run("hang", func(t *testing.T) {
		c, _ := start(t, fixtureplugin.Config{ReserveHang: true})
		ctx, cancel := context.WithTimeout(testContext(t), 50*time.Millisecond)
		defer cancel()
		_, err := c.Reserve(ctx, &pb.ReserveRequest{DeviceIds: []string{"w0"}})
		if status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("Reserve: got %v, want DeadlineExceeded", err)
		}
	})
}

func TestRelease(t *testing.T) {
	c, _ := start(t, fixtureplugin.Config{})
	if _, err := c.Release(testContext(t), &pb.ReleaseRequest{ReservationId: "r", DeviceIds: []string{"w0"}}); err != nil {
		t.Errorf("Release: %v", err)
	}
	c, _ = start(t, fixtureplugin.Config{ReleaseError: "stuck"})
	_, err := c.Release(testContext(t), &pb.ReleaseRequest{ReservationId: "r", DeviceIds: []string{"w0"}})
	if status.Convert(err).Message() != "stuck" {
		t.Errorf("Release: got %v, want the release_error message", err)
	}
}

func TestReleaseLog(t *testing.T) {
	var buf bytes.Buffer // written by the plugin while it serves Release; read after the call returned
	p := fixtureplugin.New()
	p.Log = hclog.New(&hclog.LoggerOptions{Output: &buf, Level: hclog.Info})
	c := deviceplugintest.Connect(t, p)
	if _, err := c.SetConfig(testContext(t), &pb.SetConfigRequest{ConfigJson: fixtureplugin.Config{LogRelease: true}.JSON()}); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	if _, err := c.Release(testContext(t), &pb.ReleaseRequest{ReservationId: "res-1", DeviceIds: []string{"w0", "w1"}}); err != nil {
		t.Fatalf("Release: %v", err)
	}
	got := buf.String()
	for _, want := range []string{"fixture: release", "reservation_id=res-1", `device_ids="w0,w1"`, "failed=false"} {
		if !strings.Contains(got, want) {
			t.Errorf("log %q does not hold %q", got, want)
		}
	}
}

func TestSetConfigRejects(t *testing.T) {
	tests := []struct {
		name   string
		config string
		want   string
	}{
		{name: "reject_config", config: `{"reject_config":"no thanks"}`, want: "no thanks"},
		{name: "unknown knob", config: `{"groups":[],"bogus":true}`, want: "bogus"},
		{name: "bad duration", config: `{"exit_after":"soon"}`, want: "soon"},
		{name: "negative end_after", config: `{"fingerprint_end_after":-1}`, want: "fingerprint_end_after"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := deviceplugintest.Connect(t, fixtureplugin.New())
			_, err := c.SetConfig(testContext(t), &pb.SetConfigRequest{ConfigJson: []byte(tt.config)})
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("SetConfig(%s): got %v, want INVALID_ARGUMENT naming %q", tt.config, err, tt.want)
			}
			// CheckConfig refuses it alike, with the same message.
			_, cerr := c.CheckConfig(testContext(t), &pb.CheckConfigRequest{ConfigJson: []byte(tt.config)})
			if status.Code(cerr) != codes.InvalidArgument || status.Convert(cerr).Message() != status.Convert(err).Message() {
				t.Errorf("CheckConfig(%s): got %v, want SetConfig's %v", tt.config, cerr, err)
			}
		})
	}
}

// CheckConfig of a good config changes nothing: the running config stays.
func TestCheckConfigChangesNothing(t *testing.T) {
	p := fixtureplugin.New()
	t.Cleanup(p.Stop)
	running := fixtureplugin.Config{Groups: []fixtureplugin.Group{{Vendor: "fixture", Type: "widget", Name: "running", IDs: []string{"r0"}}}}
	if err := p.SetConfig(testContext(t), running.JSON()); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	other := fixtureplugin.Config{Groups: []fixtureplugin.Group{{Vendor: "fixture", Type: "widget", Name: "other", IDs: []string{"o0"}}}}
	if err := p.CheckConfig(testContext(t), other.JSON()); err != nil {
		t.Fatalf("CheckConfig: %v", err)
	}
	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	var got []*pb.DeviceGroup
	_ = p.Fingerprint(ctx, func(m *pb.FingerprintResponse) error {
		got = m.GetGroups()
		cancel()
		return nil
	})
	if len(got) != 1 || got[0].GetName() != "running" {
		t.Errorf("inventory after CheckConfig: %v, want the running config's group", got)
	}
}

func TestExitAfter(t *testing.T) {
	p := fixtureplugin.New()
	codes := make(chan int, 1)
	p.Exit = func(code int) { codes <- code }
	t.Cleanup(p.Stop)
	if err := p.SetConfig(testContext(t), fixtureplugin.Config{ExitAfter: fixtureplugin.Duration(time.Millisecond)}.JSON()); err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	select {
	case code := <-codes:
		if code != fixtureplugin.ExitCode {
			t.Errorf("exit code: got %d, want %d", code, fixtureplugin.ExitCode)
		}
	case <-testContext(t).Done():
		t.Fatal("exit_after never fired")
	}
}

func TestInfoProtocolVersionsOverride(t *testing.T) {
	p := fixtureplugin.New()
	p.InfoProtocolVersions = []string{"v7"}
	info, err := p.Server().GetPluginInfo(testContext(t), &pb.GetPluginInfoRequest{})
	if err != nil {
		t.Fatalf("GetPluginInfo: %v", err)
	}
	if !slices.Equal(info.GetProtocolVersions(), []string{"v7"}) || info.GetName() != fixtureplugin.Name {
		t.Errorf("GetPluginInfo: got %v, want name fixture, protocols [v7]", info)
	}
}

func TestConfigJSONRoundTrip(t *testing.T) {
	in := fixtureplugin.Config{ExitAfter: fixtureplugin.Duration(1500 * time.Millisecond), StatsHang: true}
	got := string(in.JSON())
	if want := `{"exit_after":"1.5s","stats_hang":true}`; got != want {
		t.Errorf("JSON: got %s, want %s", got, want)
	}
	p := fixtureplugin.New()
	p.Exit = func(int) {}
	t.Cleanup(p.Stop) // before exit_after fires
	if err := p.SetConfig(testContext(t), []byte(got)); err != nil {
		t.Errorf("SetConfig(%s): %v", got, err)
	}
}
