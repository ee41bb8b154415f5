package manager

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/deviceplugin/deviceplugintest"
	"github.com/devicehost/devicehost/manager/supervise"
	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/logtest"
	"github.com/devicehost/devicehost/tools/testwait"
)

// This file holds the in-process test harness: fakeDevices, a deviceplugin.Plugin whose
// devices and misbehaviour a test controls, served by the SDK's real server over
// go-plugin's in-process test connection; a launcher that starts one per launch; a log recorder; and
// startManager. Real plugin processes are in process_test.go.

// fakeDevices is a device plugin whose state outlives its "processes", like hardware: a
// relaunched plugin reports the same devices. Safe for concurrent use.
type fakeDevices struct {
	name string

	mu           sync.Mutex
	groups       []*pb.DeviceGroup // what Fingerprint sends; replaced, never modified
	counterSets  []*pb.CounterSet  // sent with groups; replaced, never modified
	changed      chan struct{}     // closed and replaced by setGroups
	hangStart    bool              // launch blocks until its deadline
	launchErr    string            // launch fails at once with this message (the binary is gone)
	hangFP       bool              // Fingerprint sends nothing
	statsErr     string            // Stats fails at once with this message
	rejectConfig string            // SetConfig fails with this message
	reserve      func(ctx context.Context, ids []string) (*pb.ContainerReservation, error)
	release      func(ctx context.Context, reservationID string, ids []string) error // nil: succeed
	statsStreams int                                                                 // Stats streams opened, over all processes
	reserves     int                                                                 // Reserve calls, over all processes
	released     []string                                                            // reservation IDs of successful Release calls, in order
	reconciles   [][]deviceplugin.LiveReservation                                    // what each Reconcile call handed over, in order
	releasedCh   chan struct{}                                                       // closed and replaced on each successful Release
}

func newFakeDevices(name string, groups ...*pb.DeviceGroup) *fakeDevices {
	return &fakeDevices{name: name, groups: groups, changed: make(chan struct{}), releasedCh: make(chan struct{})}
}

// set changes a knob under the lock.
func (f *fakeDevices) set(fn func(f *fakeDevices)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

// setGroups replaces the inventory; open Fingerprint streams send it.
func (f *fakeDevices) setGroups(groups ...*pb.DeviceGroup) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.groups = groups
	close(f.changed)
	f.changed = make(chan struct{})
}

func (f *fakeDevices) streams() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.statsStreams
}

func (f *fakeDevices) Info() deviceplugin.Info {
	return deviceplugin.Info{Name: f.name, Version: "1.2.3"}
}

func (f *fakeDevices) SetConfig(context.Context, []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.rejectConfig != "" {
		return errors.New(f.rejectConfig)
	}
	return nil
}

func (f *fakeDevices) Fingerprint(ctx context.Context, send func(*pb.FingerprintResponse) error) error {
	for {
		f.mu.Lock()
		groups, sets, changed, hang := f.groups, f.counterSets, f.changed, f.hangFP
		f.mu.Unlock()
		if !hang {
			if err := send(&pb.FingerprintResponse{Groups: groups, CounterSets: sets}); err != nil {
				return err
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}

func (f *fakeDevices) Stats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
	f.mu.Lock()
	f.statsStreams++
	streams, statsErr := f.statsStreams, f.statsErr
	f.mu.Unlock()
	if statsErr != "" {
		return status.Error(codes.Internal, statsErr)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for seq := int64(1); ; seq++ {
		f.mu.Lock()
		groups := f.groups
		f.mu.Unlock()
		resp := &pb.StatsResponse{}
		for _, g := range groups {
			for _, d := range g.GetDevices() {
				resp.Devices = append(resp.Devices, &pb.DeviceStats{
					DeviceId: d.GetId(),
					Values: map[string]*pb.Value{
						"seq":           {Kind: &pb.Value_IntValue{IntValue: seq}},
						"stats_streams": {Kind: &pb.Value_IntValue{IntValue: int64(streams)}},
					},
					Timestamp: timestamppb.Now(),
				})
			}
		}
		if err := send(resp); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (f *fakeDevices) Reserve(ctx context.Context, ids []string) (*pb.ContainerReservation, error) {
	f.mu.Lock()
	fn := f.reserve
	f.reserves++
	f.mu.Unlock()
	if fn != nil {
		return fn(ctx, ids)
	}
	return &pb.ContainerReservation{Envs: map[string]string{"FAKE_VISIBLE_DEVICES": strings.Join(ids, ",")}}, nil
}

func (f *fakeDevices) Release(ctx context.Context, reservationID string, ids []string) error {
	f.mu.Lock()
	fn := f.release
	f.mu.Unlock()
	if fn != nil {
		if err := fn(ctx, reservationID, ids); err != nil {
			return err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.released = append(f.released, reservationID)
	close(f.releasedCh)
	f.releasedCh = make(chan struct{})
	return nil
}

// reserveCalls returns how many Reserve calls the plugin got.
// Reconcile records what the host handed over.
func (f *fakeDevices) Reconcile(_ context.Context, live []deviceplugin.LiveReservation) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reconciles = append(f.reconciles, live)
	return nil
}

func (f *fakeDevices) reconcileCalls() [][]deviceplugin.LiveReservation {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.reconciles)
}

func (f *fakeDevices) reserveCalls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reserves
}

// waitReleased waits until the plugin has cleaned up after every one of ids, and
// returns every reservation ID it cleaned up after, in order.
func (f *fakeDevices) waitReleased(t *testing.T, ids ...string) []string {
	t.Helper()
	deadline := time.NewTimer(testwait.Timeout)
	defer deadline.Stop()
	for {
		f.mu.Lock()
		got, ch := slices.Clone(f.released), f.releasedCh
		f.mu.Unlock()
		if !slices.ContainsFunc(ids, func(id string) bool { return !slices.Contains(got, id) }) {
			return got
		}
		select {
		case <-ch:
		case <-deadline.C:
			t.Fatalf("plugin %s cleaned up after %v within %v, want %v among them", f.name, got, testwait.Timeout, ids)
		}
	}
}

// group builds a device group of healthy devices with the given IDs.
func group(vendor, typ, name string, ids ...string) *pb.DeviceGroup {
	g := &pb.DeviceGroup{Vendor: vendor, Type: typ, Name: name}
	for _, id := range ids {
		g.Devices = append(g.Devices, &pb.Device{Id: id, Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{NumaNode: -1}})
	}
	return g
}

// withUnhealthy returns a copy of g in which device id is unhealthy for reason.
func withUnhealthy(g *pb.DeviceGroup, id, reason string) *pb.DeviceGroup {
	g = proto.Clone(g).(*pb.DeviceGroup)
	for _, d := range g.Devices {
		if d.Id == id {
			d.Health, d.HealthReason = pb.Health_HEALTH_UNHEALTHY, reason
		}
	}
	return g
}

// inproc is a plugin "process" served in-process by the SDK's test helper
// (deviceplugintest.Serve: go-plugin's TestPluginGRPCConn); its Exit stands in for the
// process dying.
type inproc struct {
	*deviceplugintest.Conn
	info *pb.GetPluginInfoResponse
}

var _ supervise.Plugin = (*inproc)(nil)

// startInproc serves impl for t. Safe to call from any goroutine.
func startInproc(t testing.TB, impl deviceplugin.Plugin) (*inproc, error) {
	c, err := deviceplugintest.Serve(t, impl)
	if err != nil {
		return nil, err
	}
	return &inproc{Conn: c}, nil
}

// handshake is what pluginloader.Launch asks of a plugin once it serves: its info,
// then SetConfig with configJSON, a refusal wrapping pluginloader.ErrConfigRejected.
// The launchers of fakeDevices and of fixtures both use it; on an error the caller
// kills the "process".
func (p *inproc) handshake(ctx context.Context, configJSON []byte) error {
	info, err := p.Client().GetPluginInfo(ctx, &pb.GetPluginInfoRequest{})
	if err != nil {
		return fmt.Errorf("get plugin info: %w", err)
	}
	p.info = info
	if _, err := p.Client().SetConfig(ctx, &pb.SetConfigRequest{ConfigJson: configJSON, ProtocolVersion: deviceplugin.ProtocolVersion}); err != nil {
		if status.Code(err) == codes.InvalidArgument {
			return fmt.Errorf("%w: %s", pluginloader.ErrConfigRejected, status.Convert(err).Message())
		}
		return fmt.Errorf("set config: %w", err)
	}
	return nil
}

func (p *inproc) Client() pb.DevicePluginClient   { return p.Conn.Client() }
func (p *inproc) Info() *pb.GetPluginInfoResponse { return p.info }

// CheckConfig is pluginloader's CheckConfig, on the in-process connection.
func (p *inproc) CheckConfig(ctx context.Context, configJSON []byte) error {
	return pluginloader.CheckConfig(ctx, p.info.GetName(), p, p.Client(), configJSON)
}

// exit makes the plugin "die": Exited closes with reason and its server stops.
func (p *inproc) exit(reason string) { p.Exit(reason) }

func (p *inproc) Kill(context.Context) { p.Close() }

// launcher launches fakeDevices in-process by plugin name and remembers every launch.
// Safe for concurrent use.
type launcher struct {
	t       testing.TB // the test the plugins are served for
	devices map[string]*fakeDevices

	mu       sync.Mutex
	launches map[string][]*inproc
}

func newLauncher(t testing.TB, devices ...*fakeDevices) *launcher {
	l := &launcher{t: t, devices: make(map[string]*fakeDevices), launches: make(map[string][]*inproc)}
	for _, d := range devices {
		l.devices[d.name] = d
	}
	return l
}

// launch does what pluginloader.Launch does, in-process: start, info, config.
func (l *launcher) launch(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options) (supervise.Plugin, error) {
	d, ok := l.devices[bin.Name]
	if !ok {
		return nil, fmt.Errorf("no fake plugin %q", bin.Name)
	}
	d.mu.Lock()
	hang, launchErr := d.hangStart, d.launchErr
	d.mu.Unlock()
	if launchErr != "" {
		return nil, errors.New(launchErr)
	}
	if hang {
		<-ctx.Done()
		return nil, fmt.Errorf("plugin did not start: %w", ctx.Err())
	}
	p, err := startInproc(l.t, d)
	if err != nil {
		return nil, err
	}
	if err := p.handshake(ctx, opts.ConfigJSON); err != nil {
		p.Kill(ctx)
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.launches[bin.Name] = append(l.launches[bin.Name], p)
	return p, nil
}

// latest returns the plugin's most recent launch and how many there were.
func (l *launcher) latest(name string) (*inproc, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ps := l.launches[name]
	if len(ps) == 0 {
		return nil, 0
	}
	return ps[len(ps)-1], len(ps)
}

// logRecorder is an hclog sink that keeps every line. Safe for concurrent use.
type logRecorder struct{ logtest.Recorder }

func newLogRecorder() *logRecorder { return &logRecorder{} }

// lines returns the lines holding every one of subs.
func (r *logRecorder) lines(subs ...string) []string {
	var out []string
	for _, line := range r.Lines() {
		if logtest.Containing(subs...)(line) {
			out = append(out, line)
		}
	}
	return out
}

// waitLine waits until a log line holds every one of subs and returns it.
func (r *logRecorder) waitLine(t *testing.T, subs ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	line, err := r.Wait(ctx, logtest.Containing(subs...))
	if err != nil {
		t.Fatalf("no log line with %q within %v; log:\n%s", subs, testwait.Timeout, r.String())
	}
	return line
}

// testConfig is a Config with short timings for tests, logging into a new recorder.
func testConfig(t testing.TB) (Config, *logRecorder) {
	t.Helper()
	rec := newLogRecorder()
	return Config{
		Logger:         hclog.New(&hclog.LoggerOptions{Name: "test", Level: hclog.Debug, Output: rec}),
		StatsInterval:  MinStatsInterval,
		ReserveTimeout: 2 * time.Second,
		// The default, not a short one: a real plugin process's launch (start,
		// AutoMTLS, handshake, GetPluginInfo, SetConfig) took over 2s on a loaded 2-core
		// machine under -race, and the timeout made a restart that tests counting
		// restarts or checking LastError failed on. A test of a hung start sets its own.
		StartTimeout:       DefaultStartTimeout,
		ReadyTimeout:       5 * time.Second,
		FingerprintTimeout: 3 * time.Second,
		KillTimeout:        2 * time.Second,
		RestartBaseDelay:   20 * time.Millisecond,
		RestartMaxDelay:    200 * time.Millisecond,
		StableRunReset:     time.Minute,
	}, rec
}

// startInprocManager starts a manager whose plugins are the given fakes, run in-process,
// and shuts it down in t.Cleanup. It returns the manager and the launcher. Reservations
// go to the ledger in cfg.StateDir when it is set, else in a temporary directory.
func startInprocManager(t testing.TB, cfg Config, devices ...*fakeDevices) (*Manager, *launcher) {
	t.Helper()
	l := newLauncher(t, devices...)
	for _, d := range devices {
		cfg.Binaries = append(cfg.Binaries, pluginloader.Binary{Name: d.name, Path: "/inproc/" + d.name})
	}
	m, err := newManager(cfg, l.launch)
	if err != nil {
		t.Fatalf("newManager: %v", err)
	}
	t.Cleanup(func() { shutdown(t, m) })
	return m, l
}

// shutdown stops m within testwait.Timeout.
func shutdown(t testing.TB, m *Manager) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if err := m.Shutdown(ctx); err != nil {
		t.Errorf("Shutdown: %v", err)
	}
}

// waitSnapshot reads snapshots from m until ok accepts one, and returns it: the wait
// for an event, where testwait.WaitFor polls for a condition no event announces.
func waitSnapshot(t *testing.T, m *Manager, what string, ok func(device.Snapshot) bool) device.Snapshot {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	var last device.Snapshot
	for snap := range m.Watch(ctx) {
		if ok(snap) {
			return snap
		}
		last = snap
	}
	t.Fatalf("no snapshot with %s within %v; last: %+v", what, testwait.Timeout, last)
	return device.Snapshot{}
}

// blockedIn says whether a goroutine is blocked in a select or a channel operation
// inside fn, a function as a stack trace names it ("manager.(*Manager).claimForCleanup",
// inlined or not). It is the barrier of a test that asserts that something waits: the
// waiter is seen waiting, where a wall-clock window would pass on a slow machine
// without checking. The manager's tests run one at a time, so the goroutine is the
// test's own.
func blockedIn(fn string) bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		header, _, _ := strings.Cut(g, "\n")
		if (strings.Contains(header, " [select") || strings.Contains(header, " [chan ")) && strings.Contains(g, "/"+fn+"(") {
			return true
		}
	}
	return false
}

// healthIs reports whether every listed device has health h.
func healthIs(h device.Health, ids ...string) func(device.Snapshot) bool {
	return func(s device.Snapshot) bool {
		for _, id := range ids {
			st, ok := s.State.Devices[id]
			if !ok || st.Health != h {
				return false
			}
		}
		return true
	}
}

// pluginOf returns the named plugin's state in s.
func pluginOf(s device.Snapshot, name string) device.PluginState {
	return pluginState(s, name)
}

// deviceIDs lists the IDs in inv, in inventory order, as "plugin/id".
func deviceIDs(inv device.Inventory) []string {
	var out []string
	for _, g := range inv.Groups {
		for _, d := range g.Devices {
			out = append(out, g.Plugin+"/"+d.ID)
		}
	}
	return out
}
