// Package fixtureplugin is a device plugin for tests of the loader and the manager,
// whose behaviour is set by its config. It runs in-process (New, with
// deviceplugintest.Connect) or as a real plugin process (Build, then launch the binary).
//
// Its knobs (Config's fields, and the environment variables the binary reads) are
// listed in docs/fixture-plugin.md.
package fixtureplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/deviceplugin"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

// Name is the fixture's plugin name (GetPluginInfo) and the binary's file name.
const Name = "fixture"

// Version is the fixture's plugin version.
const Version = "0.0.1-test"

// ExitCode is the status the process exits with when exit_after fires.
const ExitCode = 3

// Group is one device group of the fixture's inventory.
type Group struct {
	Vendor       string   `json:"vendor"`
	Type         string   `json:"type"`
	Name         string   `json:"name"`
	IDs          []string `json:"ids"`
	UnhealthyIDs []string `json:"unhealthy_ids,omitempty"`
	// CDIKind, when set, gives each device the CDI name CDIKind=<ID> (Device.cdi_devices).
	CDIKind string `json:"cdi_kind,omitempty"`
}

// StatValue is one extra stats value of the stats_values knob.
type StatValue struct {
	Value float64 `json:"value"`
	Unit  string  `json:"unit,omitempty"`
}

// Duration is a time.Duration that reads and writes JSON as a string ("250ms").
type Duration time.Duration

// MarshalJSON writes d as a duration string.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON reads a duration string.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration must be a string like \"250ms\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// Config is the fixture's config block; docs/fixture-plugin.md says what each knob does.
// The zero value is the default fixture.
type Config struct {
	Groups    []Group  `json:"groups,omitempty"`
	ReportEnv []string `json:"report_env,omitempty"`
	ReportPID bool     `json:"report_pid,omitempty"`

	LogInfo       string   `json:"log_info,omitempty"`
	LogDebug      string   `json:"log_debug,omitempty"`
	LogRaw        []string `json:"log_raw,omitempty"`
	LogFlood      int      `json:"log_flood,omitempty"`
	ExitAfter     Duration `json:"exit_after,omitempty"`
	RejectConfig  string   `json:"reject_config,omitempty"`
	SetConfigHang bool     `json:"set_config_hang,omitempty"`

	FingerprintHang        bool     `json:"fingerprint_hang,omitempty"`
	FingerprintEndAfter    int      `json:"fingerprint_end_after,omitempty"`
	FingerprintBadAfter    bool     `json:"fingerprint_bad_after,omitempty"`
	FingerprintChangeEvery Duration `json:"fingerprint_change_every,omitempty"`
	FingerprintPadBytes    int      `json:"fingerprint_pad_bytes,omitempty"`

	StatsHang   bool                 `json:"stats_hang,omitempty"`
	StatsError  string               `json:"stats_error,omitempty"`
	StatsValues map[string]StatValue `json:"stats_values,omitempty"`

	ReserveHang  bool   `json:"reserve_hang,omitempty"`
	ReserveBad   bool   `json:"reserve_bad,omitempty"`
	ReserveError string `json:"reserve_error,omitempty"`

	ReleaseError string `json:"release_error,omitempty"`
	LogRelease   bool   `json:"log_release,omitempty"`

	// Hostile-plugin knobs of the manager's tests.
	FingerprintInvalid bool     `json:"fingerprint_invalid,omitempty"`
	FingerprintError   string   `json:"fingerprint_error,omitempty"`
	FingerprintDelay   Duration `json:"fingerprint_delay,omitempty"`
	AttributeBytes     int      `json:"attribute_bytes,omitempty"`
	StatsValueBytes    int      `json:"stats_value_bytes,omitempty"`
	ReserveTag         string   `json:"reserve_tag,omitempty"`
}

// Bounds of the padding knobs: what fits in the attributes of a group and the values of
// a device without breaking validate's count and length limits.
const (
	MaxAttributeBytes  = (validate.MaxAttributes - 8) * validate.MaxStringValueLen
	MaxStatsValueBytes = (validate.MaxStatsValues - 8) * validate.MaxStringValueLen
)

// padding returns string values named prefix+index holding n bytes in all, each at most
// validate.MaxStringValueLen bytes.
func padding(prefix string, n int) map[string]*pb.Value {
	out := make(map[string]*pb.Value)
	for i := 0; n > 0; i++ {
		size := min(n, validate.MaxStringValueLen)
		out[fmt.Sprintf("%s%03d", prefix, i)] = &pb.Value{Kind: &pb.Value_StringValue{StringValue: strings.Repeat("p", size)}}
		n -= size
	}
	return out
}

// JSON encodes c as the config block a host hands over.
func (c Config) JSON() []byte {
	b, err := json.Marshal(c)
	if err != nil {
		panic(fmt.Sprintf("fixtureplugin: encoding Config: %v", err)) // only plain fields: cannot happen
	}
	return b
}

// DefaultGroups is the inventory used when the config has no groups.
func DefaultGroups() []Group {
	return []Group{{Vendor: "fixture", Type: "widget", Name: "Widget 1000", IDs: []string{"w0", "w1"}}}
}

// Plugin is the fixture plugin. Set the exported fields before the first call; the
// methods are safe for concurrent use.
type Plugin struct {
	// Log is where log_info / log_debug / log_flood go; nil means deviceplugin.Logger().
	Log hclog.Logger
	// Stderr is where log_raw goes; nil means os.Stderr (when called). The binary sets it
	// to the stderr the host reads, before go-plugin's Serve replaces os.Stderr.
	Stderr io.Writer
	// Exit ends the process for exit_after; nil means os.Exit. In-process tests set it.
	Exit func(code int)
	// InfoProtocolVersions, when set, replaces the protocol versions GetPluginInfo
	// claims (the binary sets it from FIXTURE_INFO_PROTOCOLS). Used by the server that
	// Server returns.
	InfoProtocolVersions []string
	// NoCheckConfig, when set, makes the server that Server returns answer CheckConfig
	// with UNIMPLEMENTED, as a plugin without it does (the binary sets it from
	// FIXTURE_NO_CHECK_CONFIG=1).
	NoCheckConfig bool

	mu        sync.Mutex
	cfg       Config
	exitTimer *time.Timer

	statsStreams atomic.Int64
}

var (
	_ deviceplugin.Plugin        = (*Plugin)(nil)
	_ deviceplugin.Releaser      = (*Plugin)(nil)
	_ deviceplugin.ConfigChecker = (*Plugin)(nil)
)

// New returns a fixture plugin with the default config.
func New() *Plugin {
	return &Plugin{}
}

// Info names the fixture.
func (p *Plugin) Info() deviceplugin.Info {
	return deviceplugin.Info{Name: Name, Version: Version}
}

// SetConfig reads the knobs. Unknown knobs are refused, so a typo in a test fails loudly.
func (p *Plugin) SetConfig(ctx context.Context, configJSON []byte) error {
	cfg, err := parseConfig(configJSON)
	if err != nil {
		return err
	}
	if cfg.SetConfigHang {
		<-ctx.Done()
		return ctx.Err()
	}

	p.mu.Lock()
	p.cfg = cfg
	if p.exitTimer != nil {
		p.exitTimer.Stop()
		p.exitTimer = nil
	}
	if cfg.ExitAfter > 0 {
		exit := p.Exit
		if exit == nil {
			exit = os.Exit
		}
		p.exitTimer = time.AfterFunc(time.Duration(cfg.ExitAfter), func() { exit(ExitCode) })
	}
	p.mu.Unlock()

	// DEBUG first: once a host has the INFO line, it has had the DEBUG line too.
	log := p.logger()
	if cfg.LogDebug != "" {
		log.Debug(cfg.LogDebug)
	}
	if cfg.LogInfo != "" {
		log.Info(cfg.LogInfo)
	}
	for _, line := range cfg.LogRaw {
		fmt.Fprintln(p.stderr(), line)
	}
	for i := range cfg.LogFlood {
		log.Info(fmt.Sprintf("fixture: flood line %d", i))
	}
	return nil
}

// CheckConfig refuses what SetConfig refuses (reject_config included), with the same
// message, and changes nothing: set_config_hang, exit_after and the log knobs are
// SetConfig's doing only.
func (p *Plugin) CheckConfig(_ context.Context, configJSON []byte) error {
	_, err := parseConfig(configJSON)
	return err
}

// parseConfig decodes and checks the knobs; no groups means DefaultGroups.
func parseConfig(configJSON []byte) (Config, error) {
	var cfg Config
	if len(bytes.TrimSpace(configJSON)) > 0 {
		dec := json.NewDecoder(bytes.NewReader(configJSON))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&cfg); err != nil {
			return Config{}, fmt.Errorf("fixture config: %w", err)
		}
	}
	if cfg.RejectConfig != "" {
		return Config{}, errors.New(cfg.RejectConfig)
	}
	if len(cfg.Groups) == 0 {
		cfg.Groups = DefaultGroups()
	}
	if cfg.FingerprintPadBytes < 0 || cfg.LogFlood < 0 {
		return Config{}, errors.New("fixture config: fingerprint_pad_bytes and log_flood must be 0 or more")
	}
	if cfg.FingerprintEndAfter < 0 {
		return Config{}, fmt.Errorf("fixture config: fingerprint_end_after: must be 0 or more, got %d", cfg.FingerprintEndAfter)
	}
	if cfg.AttributeBytes < 0 || cfg.AttributeBytes > MaxAttributeBytes {
		return Config{}, fmt.Errorf("fixture config: attribute_bytes: must be 0 to %d, got %d", MaxAttributeBytes, cfg.AttributeBytes)
	}
	if cfg.StatsValueBytes < 0 || cfg.StatsValueBytes > MaxStatsValueBytes {
		return Config{}, fmt.Errorf("fixture config: stats_value_bytes: must be 0 to %d, got %d", MaxStatsValueBytes, cfg.StatsValueBytes)
	}
	return cfg, nil
}

// stderr is where log_raw goes: Stderr, or os.Stderr.
func (p *Plugin) stderr() io.Writer {
	if p.Stderr != nil {
		return p.Stderr
	}
	return os.Stderr
}

// Stop cancels a pending exit_after. In-process tests call it in cleanup.
func (p *Plugin) Stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exitTimer != nil {
		p.exitTimer.Stop()
		p.exitTimer = nil
	}
}

func (p *Plugin) logger() hclog.Logger {
	if p.Log != nil {
		return p.Log
	}
	return deviceplugin.Logger()
}

func (p *Plugin) config() Config {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cfg
}

// Fingerprint sends the configured inventory, then changes per the knobs.
func (p *Plugin) Fingerprint(ctx context.Context, send func(*pb.FingerprintResponse) error) error {
	cfg := p.config()
	if cfg.FingerprintHang {
		<-ctx.Done()
		return ctx.Err()
	}
	if cfg.FingerprintError != "" {
		return errors.New(cfg.FingerprintError)
	}
	if cfg.FingerprintDelay > 0 {
		t := time.NewTimer(time.Duration(cfg.FingerprintDelay))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}

	toggled := false
	sent := 0
	sendInventory := func() error {
		if err := send(inventory(cfg, toggled)); err != nil {
			return err
		}
		sent++
		if cfg.FingerprintEndAfter > 0 && sent >= cfg.FingerprintEndAfter {
			return fmt.Errorf("fixture: fingerprint stream ended after %d messages", sent)
		}
		return nil
	}

	if err := sendInventory(); err != nil {
		return err
	}
	if cfg.FingerprintBadAfter {
		bad := inventory(cfg, toggled)
		g := bad.Groups[0]
		if len(g.Devices) > 0 {
			dup := &pb.Device{Id: g.Devices[0].Id, Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{NumaNode: -1}}
			g.Devices = append(g.Devices, dup)
		}
		if err := send(bad); err != nil {
			return err
		}
	}

	var tick <-chan time.Time
	if cfg.FingerprintChangeEvery > 0 {
		t := time.NewTicker(time.Duration(cfg.FingerprintChangeEvery))
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick:
			toggled = !toggled
			if err := sendInventory(); err != nil {
				return err
			}
		}
	}
}

// inventory builds a full fingerprint from cfg; toggled flips the first device's health.
func inventory(cfg Config, toggled bool) *pb.FingerprintResponse {
	var env map[string]*pb.Value
	for _, name := range cfg.ReportEnv {
		if v, ok := os.LookupEnv(name); ok {
			if env == nil {
				env = make(map[string]*pb.Value)
			}
			env["env_"+name] = &pb.Value{Kind: &pb.Value_StringValue{StringValue: v}}
		}
	}

	resp := &pb.FingerprintResponse{}
	for gi, g := range cfg.Groups {
		attrs := map[string]*pb.Value{"memory": {Kind: &pb.Value_IntValue{IntValue: 1024}, Unit: "MiB"}}
		for k, v := range env {
			attrs[k] = v
		}
		if cfg.ReportPID {
			attrs["pid"] = &pb.Value{Kind: &pb.Value_IntValue{IntValue: int64(os.Getpid())}}
		}
		if gi == 0 && cfg.FingerprintPadBytes > 0 {
			attrs["pad"] = &pb.Value{Kind: &pb.Value_StringValue{StringValue: strings.Repeat("x", cfg.FingerprintPadBytes)}}
		}
		for k, v := range padding("pad_", cfg.AttributeBytes) {
			attrs[k] = v
		}
		group := &pb.DeviceGroup{Vendor: g.Vendor, Type: g.Type, Name: g.Name, Attributes: attrs}
		for di, id := range g.IDs {
			d := &pb.Device{Id: id, Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{NumaNode: -1}}
			if slices.Contains(g.UnhealthyIDs, id) {
				d.Health, d.HealthReason = pb.Health_HEALTH_UNHEALTHY, "fixture: configured unhealthy"
			}
			if g.CDIKind != "" {
				d.CdiDevices = []string{g.CDIKind + "=" + id}
			}
			if toggled && gi == 0 && di == 0 {
				if d.Health == pb.Health_HEALTH_HEALTHY {
					d.Health, d.HealthReason = pb.Health_HEALTH_UNHEALTHY, "fixture: toggled"
				} else {
					d.Health, d.HealthReason = pb.Health_HEALTH_HEALTHY, ""
				}
			}
			group.Devices = append(group.Devices, d)
		}
		if cfg.FingerprintInvalid && gi == 0 && len(group.Devices) > 0 {
			group.Devices = append(group.Devices, group.Devices[0])
		}
		resp.Groups = append(resp.Groups, group)
	}
	return resp
}

// Stats sends the counters described in docs/fixture-plugin.md.
func (p *Plugin) Stats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
	cfg := p.config()
	if cfg.StatsError != "" {
		return errors.New(cfg.StatsError)
	}
	p.statsStreams.Add(1)
	if cfg.StatsHang {
		<-ctx.Done()
		return ctx.Err()
	}

	t := time.NewTicker(interval)
	defer t.Stop()
	for seq := int64(1); ; seq++ {
		now := time.Now()
		resp := &pb.StatsResponse{}
		for _, g := range cfg.Groups {
			for _, id := range g.IDs {
				values := padding("pad_", cfg.StatsValueBytes)
				for name, v := range cfg.StatsValues {
					values[name] = &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: v.Value}, Unit: v.Unit}
				}
				values["seq"] = &pb.Value{Kind: &pb.Value_IntValue{IntValue: seq}}
				values["stats_streams"] = &pb.Value{Kind: &pb.Value_IntValue{IntValue: p.statsStreams.Load()}}
				values["temperature"] = &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: 40}, Unit: "C"}
				resp.Devices = append(resp.Devices, &pb.DeviceStats{
					DeviceId:  id,
					Timestamp: timestamppb.New(now),
					Values:    values,
				})
			}
		}
		if err := send(resp); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Reserve answers per the knobs; see docs/fixture-plugin.md.
func (p *Plugin) Reserve(ctx context.Context, ids []string) (*pb.ContainerReservation, error) {
	cfg := p.config()
	if cfg.ReserveHang {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if cfg.ReserveError != "" {
		return nil, errors.New(cfg.ReserveError)
	}
	if len(ids) == 0 {
		return nil, errors.New("fixture: no device IDs to reserve")
	}
	var unknown []string
	for _, id := range ids {
		if !knownID(cfg, id) {
			unknown = append(unknown, id)
		}
	}
	if len(unknown) > 0 {
		return nil, fmt.Errorf("fixture: unknown device IDs: %s", strings.Join(unknown, ", "))
	}

	res := &pb.ContainerReservation{
		Envs:    map[string]string{"FIXTURE_DEVICES": strings.Join(ids, ",")},
		Devices: []*pb.DeviceSpec{{HostPath: "/dev/null", ContainerPath: "/dev/fixture0", Permissions: "rw"}},
	}
	for _, id := range ids {
		res.CdiDevices = append(res.CdiDevices, "fixture.example/widget="+id)
	}
	if cfg.ReserveBad {
		res.Envs["LD_PRELOAD"] = "/x"
	}
	if cfg.ReserveTag != "" {
		res.Envs["FIXTURE_TAG"] = cfg.ReserveTag
	}
	return res, nil
}

func knownID(cfg Config, id string) bool {
	for _, g := range cfg.Groups {
		if slices.Contains(g.IDs, id) {
			return true
		}
	}
	return false
}

// Release fails with release_error when set, else succeeds; with log_release it logs
// the call either way.
func (p *Plugin) Release(_ context.Context, reservationID string, deviceIDs []string) error {
	cfg := p.config()
	var err error
	if cfg.ReleaseError != "" {
		err = errors.New(cfg.ReleaseError)
	}
	if cfg.LogRelease {
		p.logger().Info("fixture: release", "reservation_id", reservationID,
			"device_ids", strings.Join(deviceIDs, ","), "failed", err != nil)
	}
	return err
}

// Server returns the gRPC server for p: the SDK's adapter, with GetPluginInfo's
// protocol versions replaced when InfoProtocolVersions is set, and without CheckConfig
// when NoCheckConfig is.
func (p *Plugin) Server() pb.DevicePluginServer {
	var impl deviceplugin.Plugin = p
	if p.NoCheckConfig {
		impl = checkless{Plugin: p, Releaser: p}
	}
	s := deviceplugin.NewServer(impl)
	if len(p.InfoProtocolVersions) == 0 {
		return s
	}
	return &infoOverride{Server: s, versions: slices.Clone(p.InfoProtocolVersions)}
}

type infoOverride struct {
	*deviceplugin.Server
	versions []string
}

func (s *infoOverride) GetPluginInfo(ctx context.Context, req *pb.GetPluginInfoRequest) (*pb.GetPluginInfoResponse, error) {
	resp, err := s.Server.GetPluginInfo(ctx, req)
	if err != nil {
		return nil, err
	}
	resp.ProtocolVersions = s.versions
	return resp, nil
}

// checkless is the fixture without CheckConfig: the SDK answers it UNIMPLEMENTED.
type checkless struct {
	deviceplugin.Plugin
	deviceplugin.Releaser
}
