// Package adapter runs one unmodified Nomad device plugin binary under devicehost: a
// devicehost plugin (deviceplugin.Plugin) that launches it with Nomad's go-plugin
// handshake, configures it the way a Nomad client does, and translates its Fingerprint,
// Stats and Reserve. A Nomad plugin that exits is not restarted here: the adapter reports
// it (Options.OnExit) and devicehost's supervisor restarts the adapter with its backoff.
// See docs/nomad.md.
package adapter

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/go-plugin"
	"github.com/hashicorp/nomad/plugins/base"
	bstructs "github.com/hashicorp/nomad/plugins/base/structs"
	"github.com/hashicorp/nomad/plugins/device"
	nproto "github.com/hashicorp/nomad/plugins/device/proto"
	"google.golang.org/grpc"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/integrations/nomad/nomadconfig"
)

// Name and Version are the adapter's plugin name and version (GetPluginInfo).
const (
	Name    = "devicehost-plugin-nomad"
	Version = "0.1.0"
)

// DefaultEmptyInventoryAfter is how long the adapter waits for the Nomad plugin's first
// fingerprint before it reports an empty inventory (see Config.EmptyInventoryAfter).
const DefaultEmptyInventoryAfter = 5 * time.Second

// defaultStartTimeout bounds the Nomad plugin's launch when SetConfig's context has no
// deadline.
const defaultStartTimeout = time.Minute

// Config is the adapter's config block, as the host hands it over (JSON):
//
//	plugin "nomad-nvidia" {
//	  config {
//	    nomad_plugin = "/opt/nomad/plugins/nomad-device-nvidia"
//	    nomad_config {
//	      fingerprint_period = "5s"
//	    }
//	  }
//	}
type Config struct {
	// NomadPlugin is the Nomad device plugin binary: an absolute path. Required.
	NomadPlugin string `json:"nomad_plugin"`
	// NomadArgs are its command-line arguments (a Nomad client's plugin "args").
	NomadArgs []string `json:"nomad_args,omitempty"`
	// NomadConfig is the plugin's config, as the body of a Nomad client's
	// plugin "..." { config { ... } } block: in the agent's config file a
	// nomad_config { ... } block or a nomad_config = { ... } object, an object either
	// way by the time it gets here. The plugin's ConfigSchema fills in its defaults.
	NomadConfig json.RawMessage `json:"nomad_config,omitempty"`
	// EmptyInventoryAfter ("5s" by default, "0s" never): a Nomad plugin that has
	// found no devices sends no fingerprint at all, which Nomad reads as "none". The
	// host wants a first inventory, so when the plugin has sent none this long after
	// the stream opened, the adapter sends an empty one.
	EmptyInventoryAfter string `json:"empty_inventory_after,omitempty"`
}

// Options configures an Adapter.
type Options struct {
	// Logger is the adapter's logger; the Nomad plugin's log lines come out of it,
	// named "nomad". Nil means no logging.
	Logger hclog.Logger
	// OnExit is called, once, from a goroutine of the adapter, when the running Nomad
	// plugin exits without the adapter having stopped it. The binary exits there.
	// Nil means nothing is called.
	OnExit func(err error)
}

// Adapter is a deviceplugin.Plugin backed by a Nomad device plugin process. Its methods
// are safe for concurrent use. SetConfig launches the Nomad plugin; Close stops it and
// waits for the adapter's goroutines.
type Adapter struct {
	log    hclog.Logger
	onExit func(error)

	mu      sync.Mutex
	cur     *instance // nil until SetConfig succeeds, and after Close
	closed  bool
	watches sync.WaitGroup
}

var _ deviceplugin.Plugin = (*Adapter)(nil)

// New returns an Adapter; nothing runs until SetConfig.
func New(opts Options) *Adapter {
	log := opts.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	onExit := opts.OnExit
	if onExit == nil {
		onExit = func(error) {}
	}
	return &Adapter{log: log, onExit: onExit}
}

// Info names the adapter.
func (a *Adapter) Info() deviceplugin.Info { return deviceplugin.Info{Name: Name, Version: Version} }

// instance is one launched Nomad plugin.
type instance struct {
	client     *plugin.Client
	dev        *nomadDevice
	path       string
	config     []byte        // the adapter config it was launched with
	emptyAfter time.Duration // Config.EmptyInventoryAfter
	stopping   chan struct{} // closed when the adapter stops it on purpose
	stopOnce   sync.Once

	known knownDevices
}

// stop kills the Nomad plugin on purpose (its exit is then not reported).
func (in *instance) stop() {
	in.stopOnce.Do(func() { close(in.stopping) })
	in.client.Kill()
}

// SetConfig parses the adapter's config, launches the Nomad plugin, checks that it is
// a device plugin speaking API v0.1.0, encodes nomad_config with the plugin's
// ConfigSchema and hands it over. Every failure is an error naming what was wrong,
// which the host reports as a rejected config: a missing binary, a plugin that does not
// start or speak Nomad's protocol, a config its schema or the plugin refuses.
//
// Called again with the same config while the plugin runs (a host that reattached),
// it keeps the running plugin; with another config it stops the plugin and launches
// it anew.
func (a *Adapter) SetConfig(ctx context.Context, configJSON []byte) error {
	cfg, emptyAfter, err := parseConfig(configJSON)
	if err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return errors.New("adapter is closed")
	}
	if a.cur != nil {
		if bytes.Equal(a.cur.config, configJSON) && !a.cur.client.Exited() {
			return nil
		}
		a.cur.stop()
		a.cur = nil
	}
	in, err := a.launch(ctx, cfg)
	if err != nil {
		return err
	}
	in.config = bytes.Clone(configJSON)
	in.emptyAfter = emptyAfter
	a.cur = in
	a.watches.Add(1)
	go a.watchExit(in)
	return nil
}

// parseConfig reads and checks the adapter's config block.
func parseConfig(configJSON []byte) (Config, time.Duration, error) {
	var cfg Config
	if len(bytes.TrimSpace(configJSON)) == 0 {
		return cfg, 0, errors.New("no config: nomad_plugin is required (the Nomad device plugin binary)")
	}
	dec := json.NewDecoder(bytes.NewReader(configJSON))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cfg); err != nil {
		return cfg, 0, fmt.Errorf("config (keys: nomad_plugin, nomad_args, nomad_config, empty_inventory_after): %w", err)
	}
	switch {
	case cfg.NomadPlugin == "":
		return cfg, 0, errors.New("nomad_plugin: required (the Nomad device plugin binary)")
	case !filepath.IsAbs(cfg.NomadPlugin):
		return cfg, 0, fmt.Errorf("nomad_plugin: %q is not an absolute path", cfg.NomadPlugin)
	}
	st, err := os.Stat(cfg.NomadPlugin)
	if err != nil {
		return cfg, 0, fmt.Errorf("nomad_plugin: %w", err)
	}
	if !st.Mode().IsRegular() || st.Mode().Perm()&0o111 == 0 {
		return cfg, 0, fmt.Errorf("nomad_plugin: %s is not an executable file", cfg.NomadPlugin)
	}
	// As devicehost refuses for its own plugins: anyone could replace such a binary,
	// and it runs as the agent's user with the devices.
	if st.Mode().Perm()&0o002 != 0 {
		return cfg, 0, fmt.Errorf("nomad_plugin: %s is world-writable (mode %s)", cfg.NomadPlugin, st.Mode().Perm())
	}
	if dir, err := os.Stat(filepath.Dir(cfg.NomadPlugin)); err == nil && dir.Mode().Perm()&0o002 != 0 && dir.Mode()&os.ModeSticky == 0 {
		return cfg, 0, fmt.Errorf("nomad_plugin: its directory %s is world-writable (mode %s)", filepath.Dir(cfg.NomadPlugin), dir.Mode().Perm())
	}
	emptyAfter := DefaultEmptyInventoryAfter
	if cfg.EmptyInventoryAfter != "" {
		if emptyAfter, err = time.ParseDuration(cfg.EmptyInventoryAfter); err != nil || emptyAfter < 0 {
			return cfg, 0, fmt.Errorf("empty_inventory_after: %q is not a duration like \"5s\" (or \"0s\": never)", cfg.EmptyInventoryAfter)
		}
	}
	if n := strings.TrimSpace(string(cfg.NomadConfig)); n != "" && n != "null" && !strings.HasPrefix(n, "{") {
		return cfg, 0, fmt.Errorf("nomad_config: must be an object, got %.40s", n)
	}
	return cfg, emptyAfter, nil
}

// launch starts the Nomad plugin and configures it; on failure nothing is left running.
func (a *Adapter) launch(ctx context.Context, cfg Config) (_ *instance, err error) {
	start := defaultStartTimeout
	if dl, ok := ctx.Deadline(); ok {
		start = time.Until(dl)
	}
	cmd := exec.Command(cfg.NomadPlugin, cfg.NomadArgs...)
	cmd.Env = pluginEnv(os.Environ())
	setProcAttrs(cmd)
	client := plugin.NewClient(&plugin.ClientConfig{
		HandshakeConfig: base.Handshake,
		Plugins: map[string]plugin.Plugin{
			base.PluginTypeBase:   &base.PluginBase{},
			base.PluginTypeDevice: &devicePlugin{},
		},
		Cmd:              cmd,
		SkipHostEnv:      true, // cmd.Env is the adapter's environment, less go-plugin's
		AllowedProtocols: []plugin.Protocol{plugin.ProtocolGRPC},
		// Mutual TLS between the adapter and the Nomad plugin, as devicehost does with
		// its plugins. A plugin built with a go-plugin too old for it serves plaintext,
		// which the client then accepts.
		AutoMTLS:     true,
		Logger:       a.log.Named("nomad"),
		StartTimeout: start,
	})
	defer func() {
		if err != nil {
			client.Kill()
		}
	}()
	rpc, err := client.Client()
	if err != nil {
		return nil, fmt.Errorf("start Nomad plugin %s: %w", cfg.NomadPlugin, err)
	}
	raw, err := rpc.Dispense(base.PluginTypeBase)
	if err != nil {
		return nil, fmt.Errorf("the Nomad plugin %s: %w", cfg.NomadPlugin, err)
	}
	bp, ok := raw.(base.BasePlugin)
	if !ok {
		return nil, fmt.Errorf("the Nomad plugin %s: base plugin of type %T", cfg.NomadPlugin, raw)
	}
	info, err := bp.PluginInfo()
	if err != nil {
		return nil, fmt.Errorf("the Nomad plugin %s: plugin info: %w", cfg.NomadPlugin, err)
	}
	if info.Type != base.PluginTypeDevice {
		return nil, fmt.Errorf("the Nomad plugin %s (%q) is a %q plugin, not a device plugin", cfg.NomadPlugin, info.Name, info.Type)
	}
	if !slices.Contains(info.PluginApiVersions, device.ApiVersion010) {
		return nil, fmt.Errorf("the Nomad plugin %s (%q) speaks device API %q; the adapter speaks %s",
			cfg.NomadPlugin, info.Name, info.PluginApiVersions, device.ApiVersion010)
	}
	schema, err := bp.ConfigSchema()
	if err != nil {
		return nil, fmt.Errorf("the Nomad plugin %s (%q): config schema: %w", cfg.NomadPlugin, info.Name, err)
	}
	packed, err := nomadconfig.Encode(schema, cfg.NomadConfig)
	if err != nil {
		return nil, fmt.Errorf("nomad_config for %q: %w", info.Name, err)
	}
	raw, err = rpc.Dispense(base.PluginTypeDevice)
	if err != nil {
		return nil, fmt.Errorf("the Nomad plugin %s (%q): %w", cfg.NomadPlugin, info.Name, err)
	}
	dev, ok := raw.(*nomadDevice)
	if !ok {
		return nil, fmt.Errorf("the Nomad plugin %s: device plugin of type %T", cfg.NomadPlugin, raw)
	}
	if err := dev.SetConfig(&base.Config{ApiVersion: device.ApiVersion010, PluginConfig: packed}); err != nil {
		return nil, fmt.Errorf("the Nomad plugin %q rejected its config: %w", info.Name, err)
	}
	a.log.Info("Nomad plugin running", "nomad_plugin", info.Name, "version", info.PluginVersion, "path", cfg.NomadPlugin)
	return &instance{client: client, dev: dev, path: cfg.NomadPlugin, stopping: make(chan struct{})}, nil
}

// pluginEnv is environ without what go-plugin told the adapter when devicehost launched
// it (its handshake cookie, ports, protocol versions, AutoMTLS certificate, socket
// settings): the Nomad plugin must read only what the adapter's own go-plugin client
// tells it.
func pluginEnv(environ []string) []string {
	out := make([]string, 0, len(environ))
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "PLUGIN_") || name == deviceplugin.Handshake.MagicCookieKey {
			continue
		}
		out = append(out, kv)
	}
	return out
}

// watchExit reports in's exit unless the adapter stopped it.
func (a *Adapter) watchExit(in *instance) {
	defer a.watches.Done()
	select {
	case <-in.dev.done.Done():
	case <-in.stopping:
		return
	}
	select {
	case <-in.stopping:
		return
	default:
	}
	err := fmt.Errorf("the Nomad plugin %s exited", in.path)
	a.log.Error("Nomad plugin exited; the adapter exits so that devicehost restarts it with backoff", "path", in.path)
	a.onExit(err)
}

// Close stops the Nomad plugin and waits for the adapter's goroutines. Later calls
// fail. Safe to call more than once.
func (a *Adapter) Close() {
	a.mu.Lock()
	a.closed = true
	in := a.cur
	a.cur = nil
	a.mu.Unlock()
	if in != nil {
		in.stop()
	}
	a.watches.Wait()
}

// current returns the running instance, or an error before SetConfig and after Close.
func (a *Adapter) current() (*instance, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cur == nil {
		return nil, errors.New("no Nomad plugin running (SetConfig has not succeeded)")
	}
	return a.cur, nil
}

// pluginError explains an error the Nomad plugin's client returned.
func pluginError(in *instance, what string, err error) error {
	if errors.Is(err, bstructs.ErrPluginShutdown) {
		return fmt.Errorf("%s: Nomad plugin %s exited", what, in.path)
	}
	return fmt.Errorf("%s: Nomad plugin: %w", what, err)
}

// devicePlugin is Nomad's go-plugin glue for device plugins, which also hands out the
// raw gRPC client (for calls with a deadline) and go-plugin's exit context.
type devicePlugin struct {
	device.PluginDevice
}

// GRPCClient wraps Nomad's client.
func (p *devicePlugin) GRPCClient(ctx context.Context, broker *plugin.GRPCBroker, conn *grpc.ClientConn) (any, error) {
	typed, err := p.PluginDevice.GRPCClient(ctx, broker, conn)
	if err != nil {
		return nil, err
	}
	dp, ok := typed.(device.DevicePlugin)
	if !ok {
		return nil, fmt.Errorf("nomad device client of type %T", typed)
	}
	return &nomadDevice{DevicePlugin: dp, raw: nproto.NewDevicePluginClient(conn), done: ctx}, nil
}

// nomadDevice is the adapter's end of a Nomad device plugin.
type nomadDevice struct {
	device.DevicePlugin
	raw  nproto.DevicePluginClient
	done context.Context // ends when the plugin process exits
}
