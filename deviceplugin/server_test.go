package deviceplugin_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/deviceplugin/deviceplugintest"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// funcPlugin is a function-field deviceplugin.Plugin; nil fields answer with zero values.
type funcPlugin struct {
	setConfig   func(ctx context.Context, cfg []byte) error
	fingerprint func(ctx context.Context, send func(*pb.FingerprintResponse) error) error
	stats       func(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error
	reserve     func(ctx context.Context, ids []string) (*pb.ContainerReservation, error)
}

func (p *funcPlugin) Info() deviceplugin.Info {
	return deviceplugin.Info{Name: "func", Version: "1.2.3"}
}

func (p *funcPlugin) SetConfig(ctx context.Context, cfg []byte) error {
	if p.setConfig == nil {
		return nil
	}
	return p.setConfig(ctx, cfg)
}

func (p *funcPlugin) Fingerprint(ctx context.Context, send func(*pb.FingerprintResponse) error) error {
	if p.fingerprint == nil {
		return nil
	}
	return p.fingerprint(ctx, send)
}

func (p *funcPlugin) Stats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
	if p.stats == nil {
		return nil
	}
	return p.stats(ctx, interval, send)
}

func (p *funcPlugin) Reserve(ctx context.Context, ids []string) (*pb.ContainerReservation, error) {
	if p.reserve == nil {
		return nil, nil
	}
	return p.reserve(ctx, ids)
}

// releasingPlugin adds Release to funcPlugin.
type releasingPlugin struct {
	funcPlugin
	release func(ctx context.Context, reservationID string, ids []string) error
}

func (p *releasingPlugin) Release(ctx context.Context, reservationID string, ids []string) error {
	return p.release(ctx, reservationID, ids)
}

// testContext is a context bounded by a deadline well inside the test's, so a hang
// fails the test instead of the whole binary.
func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// configured connects impl in-process and sends it an empty config, as a host would.
func configured(t *testing.T, impl deviceplugin.Plugin) pb.DevicePluginClient {
	t.Helper()
	c := deviceplugintest.Connect(t, impl)
	_, err := c.SetConfig(testContext(t), &pb.SetConfigRequest{ProtocolVersion: deviceplugin.ProtocolVersion})
	if err != nil {
		t.Fatalf("SetConfig: %v", err)
	}
	return c
}

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Errorf("%s: got code %v (err %v), want %v", what, got, err, want)
	}
}

func TestGetPluginInfo(t *testing.T) {
	c := deviceplugintest.Connect(t, &funcPlugin{})
	got, err := c.GetPluginInfo(testContext(t), &pb.GetPluginInfoRequest{})
	if err != nil {
		t.Fatalf("GetPluginInfo: %v", err)
	}
	want := &pb.GetPluginInfoResponse{Name: "func", PluginVersion: "1.2.3", ProtocolVersions: []string{"v1"}}
	if !proto.Equal(got, want) {
		t.Errorf("GetPluginInfo: got %v, want %v", got, want)
	}
}

func TestSetConfig(t *testing.T) {
	tests := []struct {
		name     string
		req      *pb.SetConfigRequest
		implErr  error
		wantCode codes.Code
		wantMsg  string
		wantSeen bool
	}{
		{name: "accepted", req: &pb.SetConfigRequest{ConfigJson: []byte(`{"a":1}`), ProtocolVersion: "v1"},
			wantCode: codes.OK, wantSeen: true},
		{name: "no protocol version is v1", req: &pb.SetConfigRequest{ConfigJson: []byte(`{"a":1}`)},
			wantCode: codes.OK, wantSeen: true},
		{name: "rejected", req: &pb.SetConfigRequest{ConfigJson: []byte(`{"a":1}`), ProtocolVersion: "v1"},
			implErr: errors.New("a: must be a string"), wantCode: codes.InvalidArgument, wantMsg: "a: must be a string", wantSeen: true},
		{name: "unknown protocol", req: &pb.SetConfigRequest{ConfigJson: []byte(`{"a":1}`), ProtocolVersion: "v9"},
			wantCode: codes.FailedPrecondition},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var seen []byte
			c := deviceplugintest.Connect(t, &funcPlugin{setConfig: func(_ context.Context, cfg []byte) error {
				seen = cfg
				return tt.implErr
			}})
			_, err := c.SetConfig(testContext(t), tt.req)
			wantCode(t, "SetConfig", err, tt.wantCode)
			if got := status.Convert(err).Message(); tt.wantMsg != "" && got != tt.wantMsg {
				t.Errorf("SetConfig message: got %q, want %q", got, tt.wantMsg)
			}
			if tt.wantSeen && string(seen) != string(tt.req.ConfigJson) {
				t.Errorf("config the plugin saw: got %q, want %q", seen, tt.req.ConfigJson)
			}
			if !tt.wantSeen && seen != nil {
				t.Errorf("config the plugin saw: got %q, want no call", seen)
			}
		})
	}
}

func TestCallsBeforeSetConfigAreRefused(t *testing.T) {
	called := make(chan string, 3)
	c := deviceplugintest.Connect(t, &funcPlugin{
		fingerprint: func(context.Context, func(*pb.FingerprintResponse) error) error { called <- "Fingerprint"; return nil },
		stats: func(context.Context, time.Duration, func(*pb.StatsResponse) error) error {
			called <- "Stats"
			return nil
		},
		reserve: func(context.Context, []string) (*pb.ContainerReservation, error) {
			called <- "Reserve"
			return nil, nil
		},
	})
	ctx := testContext(t)

	fs, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err == nil {
		_, err = fs.Recv()
	}
	wantCode(t, "Fingerprint", err, codes.FailedPrecondition)

	ss, err := c.Stats(ctx, &pb.StatsRequest{Interval: durationpb.New(time.Second)})
	if err == nil {
		_, err = ss.Recv()
	}
	wantCode(t, "Stats", err, codes.FailedPrecondition)

	_, err = c.Reserve(ctx, &pb.ReserveRequest{DeviceIds: []string{"w0"}})
	wantCode(t, "Reserve", err, codes.FailedPrecondition)

	close(called)
	for name := range called {
		t.Errorf("%s reached the plugin before SetConfig", name)
	}
}

func TestFingerprintStreamsAndStopsOnCancel(t *testing.T) {
	returned := make(chan error, 1)
	c := configured(t, &funcPlugin{fingerprint: func(ctx context.Context, send func(*pb.FingerprintResponse) error) error {
		for _, id := range []string{"a", "b"} {
			g := &pb.DeviceGroup{Vendor: "v", Type: "t", Name: "n", Devices: []*pb.Device{{Id: id}}}
			if err := send(&pb.FingerprintResponse{Groups: []*pb.DeviceGroup{g}}); err != nil {
				returned <- err
				return err
			}
		}
		<-ctx.Done()
		returned <- ctx.Err()
		return ctx.Err()
	}})

	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	stream, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	for _, want := range []string{"a", "b"} {
		m, err := stream.Recv()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		if got := m.GetGroups()[0].GetDevices()[0].GetId(); got != want {
			t.Errorf("device ID: got %q, want %q", got, want)
		}
	}
	cancel()
	if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
		t.Errorf("Recv after cancel: got %v, want code Canceled", err)
	}
	select {
	case err := <-returned:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("plugin's Fingerprint returned %v, want context.Canceled", err)
		}
	case <-testContext(t).Done():
		t.Fatal("plugin's Fingerprint did not return after the host cancelled the stream")
	}
}

func TestFingerprintErrorEndsStream(t *testing.T) {
	tests := []struct {
		name     string
		err      error
		wantCode codes.Code
		wantMsg  string
	}{
		{name: "plain error", err: errors.New("driver gone"), wantCode: codes.Unknown, wantMsg: "driver gone"},
		{name: "status kept", err: status.Error(codes.Unavailable, "busy"), wantCode: codes.Unavailable, wantMsg: "busy"},
		{name: "clean end", err: nil, wantCode: codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := configured(t, &funcPlugin{fingerprint: func(context.Context, func(*pb.FingerprintResponse) error) error {
				return tt.err
			}})
			stream, err := c.Fingerprint(testContext(t), &pb.FingerprintRequest{})
			if err != nil {
				t.Fatalf("Fingerprint: %v", err)
			}
			_, err = stream.Recv()
			if tt.err == nil {
				if err == nil || err.Error() != "EOF" {
					t.Errorf("Recv: got %v, want EOF", err)
				}
				return
			}
			wantCode(t, "Recv", err, tt.wantCode)
			if got := status.Convert(err).Message(); got != tt.wantMsg {
				t.Errorf("message: got %q, want %q", got, tt.wantMsg)
			}
		})
	}
}

func TestStats(t *testing.T) {
	intervals := make(chan time.Duration, 1)
	returned := make(chan error, 1)
	c := configured(t, &funcPlugin{stats: func(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
		intervals <- interval
		err := send(&pb.StatsResponse{Devices: []*pb.DeviceStats{{DeviceId: "w0"}}})
		if err == nil {
			<-ctx.Done()
			err = ctx.Err()
		}
		returned <- err
		return err
	}})

	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	stream, err := c.Stats(ctx, &pb.StatsRequest{Interval: durationpb.New(250 * time.Millisecond)})
	if err != nil {
		t.Fatalf("Stats: %v", err)
	}
	m, err := stream.Recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	if got := m.GetDevices()[0].GetDeviceId(); got != "w0" {
		t.Errorf("device ID: got %q, want w0", got)
	}
	if got := <-intervals; got != 250*time.Millisecond {
		t.Errorf("interval the plugin saw: got %s, want 250ms", got)
	}
	cancel()
	select {
	case err := <-returned:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("plugin's Stats returned %v, want context.Canceled", err)
		}
	case <-testContext(t).Done():
		t.Fatal("plugin's Stats did not return after the host cancelled the stream")
	}
}

func TestStatsRefusesBadInterval(t *testing.T) {
	tests := []struct {
		name     string
		interval *durationpb.Duration
	}{
		{name: "missing", interval: nil},
		{name: "zero", interval: durationpb.New(0)},
		{name: "negative", interval: durationpb.New(-time.Second)},
		{name: "invalid", interval: &durationpb.Duration{Seconds: 1, Nanos: -1}},
	}
	c := configured(t, &funcPlugin{stats: func(context.Context, time.Duration, func(*pb.StatsResponse) error) error {
		return errors.New("plugin's Stats must not be called")
	}})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stream, err := c.Stats(testContext(t), &pb.StatsRequest{Interval: tt.interval})
			if err == nil {
				_, err = stream.Recv()
			}
			wantCode(t, "Stats", err, codes.InvalidArgument)
		})
	}
}

func TestReserve(t *testing.T) {
	want := &pb.ContainerReservation{
		Envs:       map[string]string{"WIDGETS": "a,b"},
		Devices:    []*pb.DeviceSpec{{HostPath: "/dev/null", ContainerPath: "/dev/w", Permissions: "rw"}},
		Mounts:     []*pb.Mount{{HostPath: "/opt/w", ContainerPath: "/w", ReadOnly: true}},
		CdiDevices: []string{"acme.example/widget=a"},
	}
	tests := []struct {
		name     string
		ids      []string
		resp     *pb.ContainerReservation
		err      error
		wantCode codes.Code
		want     *pb.ContainerReservation
	}{
		{name: "reserved", ids: []string{"a", "b"}, resp: want, want: want},
		{name: "nil reservation is empty", ids: []string{"a"}, want: &pb.ContainerReservation{}},
		{name: "refused", ids: []string{"zz"}, err: errors.New(`unknown device "zz"`), wantCode: codes.Unknown},
		{name: "status kept", ids: []string{"zz"}, err: status.Error(codes.NotFound, "zz"), wantCode: codes.NotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var seen []string
			c := configured(t, &funcPlugin{reserve: func(_ context.Context, ids []string) (*pb.ContainerReservation, error) {
				seen = ids
				return tt.resp, tt.err
			}})
			got, err := c.Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: tt.ids})
			wantCode(t, "Reserve", err, tt.wantCode)
			if tt.err != nil {
				if got, want := status.Convert(err).Message(), status.Convert(tt.err).Message(); got != want {
					t.Errorf("message: got %q, want %q", got, want)
				}
				return
			}
			if !proto.Equal(got.GetReservation(), tt.want) {
				t.Errorf("reservation: got %v, want %v", got.GetReservation(), tt.want)
			}
			if len(seen) != len(tt.ids) || seen[0] != tt.ids[0] {
				t.Errorf("IDs the plugin saw: got %q, want %q", seen, tt.ids)
			}
		})
	}
}

// optionPlugin adds ReserveOptions to funcPlugin: it takes the option "mode".
type optionPlugin struct {
	funcPlugin
	got chan map[string]string
}

func (p *optionPlugin) ReserveOptions(_ context.Context, ids []string, options map[string]string) (*pb.ContainerReservation, error) {
	if err := deviceplugin.UnknownOptions("func", options, "mode"); err != nil {
		return nil, err
	}
	p.got <- options
	return &pb.ContainerReservation{Envs: map[string]string{"MODE": options["mode"]}}, nil
}

// A plugin without OptionReserver refuses every Reserve with options, naming them,
// before its Reserve runs; one with it gets them (and every Reserve) through
// ReserveOptions, and UnknownOptions names what it does not take.
func TestReserveOptions(t *testing.T) {
	t.Run("a plugin that takes none", func(t *testing.T) {
		called := false
		c := configured(t, &funcPlugin{reserve: func(context.Context, []string) (*pb.ContainerReservation, error) {
			called = true
			return nil, nil
		}})
		for _, tt := range []struct {
			opts map[string]string
			want string
		}{
			{map[string]string{"mode": "fast"}, `option "mode" is unknown to plugin "func", which takes none`},
			{map[string]string{"b": "1", "a\n": "2"}, `options "a\n", "b" are unknown to plugin "func", which takes none`},
		} {
			_, err := c.Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: []string{"a"}, Options: tt.opts})
			wantCode(t, "Reserve with options", err, codes.InvalidArgument)
			if got := status.Convert(err).Message(); got != tt.want {
				t.Errorf("message: got %q, want %q", got, tt.want)
			}
		}
		if called {
			t.Error("the plugin's Reserve ran for a request with options")
		}
		if _, err := c.Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: []string{"a"}}); err != nil || !called {
			t.Errorf("Reserve without options: %v, called %v", err, called)
		}
	})
	t.Run("a plugin that takes some", func(t *testing.T) {
		p := &optionPlugin{got: make(chan map[string]string, 2)}
		c := configured(t, p)
		got, err := c.Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: []string{"a"}, Options: map[string]string{"mode": "fast"}})
		if err != nil || got.GetReservation().GetEnvs()["MODE"] != "fast" || (<-p.got)["mode"] != "fast" {
			t.Fatalf("Reserve with a known option: %v, %v", got, err)
		}
		if _, err := c.Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: []string{"a"}}); err != nil || len(<-p.got) != 0 {
			t.Fatalf("Reserve without options: %v", err)
		}
		_, err = c.Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: []string{"a"}, Options: map[string]string{"mode": "x", "speed": "1"}})
		wantCode(t, "Reserve with an unknown option", err, codes.InvalidArgument)
		if got, want := status.Convert(err).Message(), `option "speed" is unknown to plugin "func", which takes mode`; got != want {
			t.Errorf("message: got %q, want %q", got, want)
		}
	})
}

func TestRelease(t *testing.T) {
	t.Run("unimplemented", func(t *testing.T) {
		c := configured(t, &funcPlugin{})
		_, err := c.Release(testContext(t), &pb.ReleaseRequest{ReservationId: "r1", DeviceIds: []string{"a"}})
		wantCode(t, "Release", err, codes.Unimplemented)
	})
	t.Run("released", func(t *testing.T) {
		type call struct {
			id  string
			ids []string
		}
		calls := make(chan call, 1)
		c := configured(t, &releasingPlugin{release: func(_ context.Context, id string, ids []string) error {
			calls <- call{id, ids}
			return nil
		}})
		if _, err := c.Release(testContext(t), &pb.ReleaseRequest{ReservationId: "r1", DeviceIds: []string{"a"}}); err != nil {
			t.Fatalf("Release: %v", err)
		}
		got := <-calls
		if got.id != "r1" || len(got.ids) != 1 || got.ids[0] != "a" {
			t.Errorf("Release call: got %+v, want {r1 [a]}", got)
		}
	})
	t.Run("failed", func(t *testing.T) {
		c := configured(t, &releasingPlugin{release: func(context.Context, string, []string) error {
			return errors.New("still busy")
		}})
		_, err := c.Release(testContext(t), &pb.ReleaseRequest{ReservationId: "r1", DeviceIds: []string{"a"}})
		wantCode(t, "Release", err, codes.Unknown)
		if got := status.Convert(err).Message(); got != "still busy" {
			t.Errorf("message: got %q, want %q", got, "still busy")
		}
	})
}

type reconcilingPlugin struct {
	funcPlugin
	reconcile func(context.Context, []deviceplugin.LiveReservation) error
}

func (p *reconcilingPlugin) Reconcile(ctx context.Context, live []deviceplugin.LiveReservation) error {
	return p.reconcile(ctx, live)
}

// Reconcile hands the plugin the live reservations, or answers UNIMPLEMENTED for a
// plugin without it; a plugin's failure keeps its message.
func TestReconcile(t *testing.T) {
	req := &pb.ReconcileRequest{Reservations: []*pb.LiveReservation{
		{ReservationId: "r1", DeviceIds: []string{"a", "b"}, Options: map[string]string{"mode": "fast"}},
		{ReservationId: "r2", DeviceIds: []string{"c"}},
	}}
	t.Run("unimplemented", func(t *testing.T) {
		_, err := configured(t, &funcPlugin{}).Reconcile(testContext(t), req)
		wantCode(t, "Reconcile", err, codes.Unimplemented)
	})
	t.Run("reconciled", func(t *testing.T) {
		got := make(chan []deviceplugin.LiveReservation, 1)
		c := configured(t, &reconcilingPlugin{reconcile: func(_ context.Context, live []deviceplugin.LiveReservation) error {
			got <- live
			return nil
		}})
		if _, err := c.Reconcile(testContext(t), req); err != nil {
			t.Fatalf("Reconcile: %v", err)
		}
		want := []deviceplugin.LiveReservation{{ID: "r1", DeviceIDs: []string{"a", "b"}, Options: map[string]string{"mode": "fast"}}, {ID: "r2", DeviceIDs: []string{"c"}}}
		if live := <-got; !reflect.DeepEqual(live, want) {
			t.Errorf("live reservations: got %+v, want %+v", live, want)
		}
	})
	t.Run("failed", func(t *testing.T) {
		c := configured(t, &reconcilingPlugin{reconcile: func(context.Context, []deviceplugin.LiveReservation) error {
			return errors.New("NVML: instance 3 cannot be destroyed: in use")
		}})
		_, err := c.Reconcile(testContext(t), req)
		wantCode(t, "Reconcile", err, codes.Unknown)
		if got := status.Convert(err).Message(); !strings.Contains(got, "in use") {
			t.Errorf("message: got %q", got)
		}
	})
}

// TestExamplePlugin runs the package example's plugin through the SDK, so the example
// stays a working plugin and not just code that compiles.
func TestExamplePlugin(t *testing.T) {
	c := configured(t, widgets{})
	ctx := testContext(t)

	fs, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	fp, err := fs.Recv()
	if err != nil {
		t.Fatalf("Fingerprint Recv: %v", err)
	}
	if got := fp.GetGroups()[0].GetDevices()[0].GetId(); got != "w0" {
		t.Errorf("fingerprint device: got %q, want w0", got)
	}

	ss, err := c.Stats(ctx, &pb.StatsRequest{Interval: durationpb.New(10 * time.Millisecond)})
	if err != nil {
		t.Fatalf("Stats: %v", err)
	}
	st, err := ss.Recv()
	if err != nil {
		t.Fatalf("Stats Recv: %v", err)
	}
	if got := st.GetDevices()[0].GetValues()["temperature"].GetUnit(); got != "C" {
		t.Errorf("temperature unit: got %q, want C", got)
	}

	r, err := c.Reserve(ctx, &pb.ReserveRequest{DeviceIds: []string{"w0"}})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	if got := r.GetReservation().GetEnvs()["WIDGETS"]; got != "w0" {
		t.Errorf("WIDGETS: got %q, want w0", got)
	}
	_, err = c.Reserve(ctx, &pb.ReserveRequest{DeviceIds: []string{"w9"}})
	wantCode(t, "Reserve w9", err, codes.Unknown)
}

// checkingPlugin adds CheckConfig to funcPlugin.
type checkingPlugin struct {
	funcPlugin
	checkConfig func(ctx context.Context, cfg []byte) error
}

func (p *checkingPlugin) CheckConfig(ctx context.Context, cfg []byte) error {
	return p.checkConfig(ctx, cfg)
}

// CheckConfig reaches a ConfigChecker, with or without SetConfig before it, and its
// refusal is INVALID_ARGUMENT with its message, as SetConfig's is; a plugin without
// it answers UNIMPLEMENTED.
func TestCheckConfig(t *testing.T) {
	req := &pb.CheckConfigRequest{ConfigJson: []byte(`{"a":1}`)}
	t.Run("unimplemented", func(t *testing.T) {
		setConfigs := 0
		c := deviceplugintest.Connect(t, &funcPlugin{setConfig: func(context.Context, []byte) error {
			setConfigs++
			return nil
		}})
		_, err := c.CheckConfig(testContext(t), req)
		wantCode(t, "CheckConfig", err, codes.Unimplemented)
		if setConfigs != 0 {
			t.Errorf("CheckConfig of a plugin without it called SetConfig %d times, want 0", setConfigs)
		}
	})
	tests := []struct {
		name     string
		implErr  error
		wantCode codes.Code
		wantMsg  string
	}{
		{name: "accepted", wantCode: codes.OK},
		{name: "rejected", implErr: errors.New("a: must be a string"), wantCode: codes.InvalidArgument, wantMsg: "a: must be a string"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			seen := make(chan []byte, 1)
			c := deviceplugintest.Connect(t, &checkingPlugin{checkConfig: func(_ context.Context, cfg []byte) error {
				seen <- cfg
				return tt.implErr
			}})
			_, err := c.CheckConfig(testContext(t), req) // before any SetConfig
			wantCode(t, "CheckConfig", err, tt.wantCode)
			if got := status.Convert(err).Message(); tt.wantMsg != "" && got != tt.wantMsg {
				t.Errorf("CheckConfig message: got %q, want %q", got, tt.wantMsg)
			}
			if got := <-seen; string(got) != string(req.ConfigJson) {
				t.Errorf("config the plugin saw: got %q, want %q", got, req.ConfigJson)
			}
		})
	}
}
