// Package shim is a Nomad device plugin that forwards to a devicehost agent: a Nomad
// client loads it (the binary nomad-device-devicehost) from its plugin_dir, sees the
// agent's devices, health and statistics as its own, and reserves them through the
// agent's ledger. Since Nomad tells a device plugin neither which allocation a Reserve
// is for nor when it ended (hashicorp/nomad#6258), the shim takes devices over from
// earlier Nomad owners and follows the node's allocations in Nomad's HTTP API (see
// follower). See docs/nomad.md.
package shim

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/device"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/integrations/nomad/nomadapi"
)

// Name is the plugin's name in Nomad (PluginInfo); Nomad matches its config block by
// the binary's file name, BinaryName.
const (
	Name       = "devicehost"
	BinaryName = "nomad-device-devicehost"
	Version    = "0.1.0"
)

// DefaultAddress is the agent's default API socket.
const DefaultAddress = "unix:///run/devicehost/devicehost.sock"

// DefaultReserveTimeout bounds a Reserve, including a takeover.
const DefaultReserveTimeout = 30 * time.Second

// OwnerPrefix starts the owner ID of every reservation the shim makes; only
// reservations of such owners are taken over.
const OwnerPrefix = "nomad/"

// Config is the plugin's configuration, the Nomad client's
// plugin "nomad-device-devicehost" { config { ... } } block.
type Config struct {
	// Address of the agent: unix:///path.sock or tcp://host:port.
	Address string `codec:"address"`
	// TLSCert, TLSKey and TLSCA are PEM files for tcp:// (mutual TLS).
	TLSCert string `codec:"tls_cert"`
	TLSKey  string `codec:"tls_key"`
	TLSCA   string `codec:"tls_ca"`
	// Insecure allows plaintext tcp:// to a loopback address.
	Insecure bool `codec:"insecure"`
	// ReserveTimeout bounds a Reserve, e.g. "30s".
	ReserveTimeout string `codec:"reserve_timeout"`

	// FollowAllocations makes the shim follow the node's allocations in Nomad's HTTP
	// API (the default): false keeps reservations nameless and held until taken over.
	FollowAllocations bool `codec:"follow_allocations"`
	// NomadAddress, NomadToken, NomadCACert, NomadClientCert, NomadClientKey and
	// NomadTLSServerName say how to reach the local Nomad agent's HTTP API; each that
	// is empty is taken from the environment as Nomad's CLI does (NOMAD_ADDR,
	// NOMAD_TOKEN, NOMAD_CACERT, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY,
	// NOMAD_TLS_SERVER_NAME), the address else http://127.0.0.1:4646.
	NomadAddress       string `codec:"nomad_address"`
	NomadToken         string `codec:"nomad_token"`
	NomadCACert        string `codec:"nomad_cacert"`
	NomadClientCert    string `codec:"nomad_client_cert"`
	NomadClientKey     string `codec:"nomad_client_key"`
	NomadTLSServerName string `codec:"nomad_tls_server_name"`
	// ReleaseGrace is how long no running allocation must hold a reservation's
	// devices before it is released, e.g. "30s"; at least 1s.
	ReleaseGrace string `codec:"release_grace"`
}

// configSpec is the schema Nomad decodes the config block with, defaults included.
var configSpec = hclspec.NewObject(map[string]*hclspec.Spec{
	"address":         hclspec.NewDefault(hclspec.NewAttr("address", "string", false), hclspec.NewLiteral(fmt.Sprintf("%q", DefaultAddress))),
	"tls_cert":        hclspec.NewDefault(hclspec.NewAttr("tls_cert", "string", false), hclspec.NewLiteral(`""`)),
	"tls_key":         hclspec.NewDefault(hclspec.NewAttr("tls_key", "string", false), hclspec.NewLiteral(`""`)),
	"tls_ca":          hclspec.NewDefault(hclspec.NewAttr("tls_ca", "string", false), hclspec.NewLiteral(`""`)),
	"insecure":        hclspec.NewDefault(hclspec.NewAttr("insecure", "bool", false), hclspec.NewLiteral("false")),
	"reserve_timeout": hclspec.NewDefault(hclspec.NewAttr("reserve_timeout", "string", false), hclspec.NewLiteral(fmt.Sprintf("%q", DefaultReserveTimeout.String()))),

	"follow_allocations":    hclspec.NewDefault(hclspec.NewAttr("follow_allocations", "bool", false), hclspec.NewLiteral("true")),
	"nomad_address":         hclspec.NewDefault(hclspec.NewAttr("nomad_address", "string", false), hclspec.NewLiteral(`""`)),
	"nomad_token":           hclspec.NewDefault(hclspec.NewAttr("nomad_token", "string", false), hclspec.NewLiteral(`""`)),
	"nomad_cacert":          hclspec.NewDefault(hclspec.NewAttr("nomad_cacert", "string", false), hclspec.NewLiteral(`""`)),
	"nomad_client_cert":     hclspec.NewDefault(hclspec.NewAttr("nomad_client_cert", "string", false), hclspec.NewLiteral(`""`)),
	"nomad_client_key":      hclspec.NewDefault(hclspec.NewAttr("nomad_client_key", "string", false), hclspec.NewLiteral(`""`)),
	"nomad_tls_server_name": hclspec.NewDefault(hclspec.NewAttr("nomad_tls_server_name", "string", false), hclspec.NewLiteral(`""`)),
	"release_grace":         hclspec.NewDefault(hclspec.NewAttr("release_grace", "string", false), hclspec.NewLiteral(fmt.Sprintf("%q", DefaultReleaseGrace.String()))),
})

// Plugin is the Nomad device plugin. Its methods are safe for concurrent use; Close
// ends its streams and closes its connection.
type Plugin struct {
	log      hclog.Logger
	newOwner func() string
	getenv   func(string) string
	clock    clock
	// observe, if set before SetConfig, is told of the follower's steps (tests).
	observe func(followEvent)

	mu             sync.Mutex
	cfg            Config
	c              *client.Client
	reserveTimeout time.Duration
	follow         *running // nil when not following Nomad

	inv inventory // device → group, from the latest snapshot
}

// running is a started follower: stop ends it and waits for it.
type running struct {
	f    *follower
	stop func()
}

var _ device.DevicePlugin = (*Plugin)(nil)

// New returns an unconfigured Plugin; Nomad calls SetConfig before anything else.
func New(log hclog.Logger) *Plugin {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	return &Plugin{log: log, newOwner: randomOwner, getenv: os.Getenv, clock: realClock{}}
}

// randomOwner returns a fresh owner ID: Nomad does not tell a plugin the allocation.
func randomOwner() string { return OwnerPrefix + rand.Text() }

// PluginInfo describes the plugin to Nomad.
func (p *Plugin) PluginInfo() (*base.PluginInfoResponse, error) {
	return &base.PluginInfoResponse{
		Type:              base.PluginTypeDevice,
		PluginApiVersions: []string{device.ApiVersion010},
		PluginVersion:     Version,
		Name:              Name,
	}, nil
}

// ConfigSchema returns the config schema, with its defaults.
func (p *Plugin) ConfigSchema() (*hclspec.Spec, error) { return configSpec, nil }

// SetConfig reads the config and prepares the connection to the agent. It does not
// need the agent to be running (the Nomad client may start first): an agent that is
// not there shows as no devices, or every device unhealthy, until it is. A malformed
// address, TLS settings the transport policy refuses and a bad reserve_timeout are
// errors naming the key.
func (p *Plugin) SetConfig(c *base.Config) error {
	var cfg Config
	if len(c.PluginConfig) > 0 {
		if err := base.MsgPackDecode(c.PluginConfig, &cfg); err != nil {
			return fmt.Errorf("decode config: %w", err)
		}
	}
	if cfg.Address == "" {
		cfg.Address = DefaultAddress
	}
	timeout := DefaultReserveTimeout
	if cfg.ReserveTimeout != "" {
		d, err := time.ParseDuration(cfg.ReserveTimeout)
		if err != nil || d <= 0 {
			return fmt.Errorf("reserve_timeout: %q is not a positive duration like \"30s\"", cfg.ReserveTimeout)
		}
		timeout = d
	}
	grace := DefaultReleaseGrace
	if cfg.ReleaseGrace != "" {
		d, err := time.ParseDuration(cfg.ReleaseGrace)
		if err != nil || d < time.Second {
			return fmt.Errorf("release_grace: %q is not a duration of at least 1s like \"30s\"", cfg.ReleaseGrace)
		}
		grace = d
	}
	var nc *nomadapi.Client
	if cfg.FollowAllocations {
		ncfg := nomadapi.FromEnv(nomadapi.Config{
			Address: cfg.NomadAddress, Token: cfg.NomadToken, CACert: cfg.NomadCACert,
			ClientCert: cfg.NomadClientCert, ClientKey: cfg.NomadClientKey, TLSServerName: cfg.NomadTLSServerName,
		}, p.getenv)
		var err error
		if nc, err = nomadapi.New(ncfg); err != nil {
			return fmt.Errorf("nomad_address and TLS settings (or the NOMAD_* environment): %w", err)
		}
	}
	opts := []client.Option{client.WithoutReachCheck()}
	if cfg.Insecure {
		opts = append(opts, client.WithInsecure())
	} else if cfg.TLSCert != "" || cfg.TLSKey != "" || cfg.TLSCA != "" {
		opts = append(opts, client.WithTLS(endpoint.TLS{Cert: cfg.TLSCert, Key: cfg.TLSKey, CA: cfg.TLSCA}))
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	if p.c != nil && p.cfg == cfg {
		p.reserveTimeout = timeout
		return nil
	}
	ac, err := client.Dial(context.Background(), cfg.Address, opts...)
	if err != nil {
		return fmt.Errorf("address %q: %w", cfg.Address, err)
	}
	p.stopFollowing()
	if p.c != nil {
		p.c.Close()
	}
	p.c, p.cfg, p.reserveTimeout = ac, cfg, timeout
	p.log.Info("forwarding to devicehost", "address", cfg.Address)
	if nc != nil {
		p.follow = p.startFollowing(followConfig{nomad: nc, agent: ac, grace: grace, clock: p.clock,
			log: p.log.Named("allocations"), observe: p.observe})
		p.log.Info("following this node's allocations in Nomad", "nomad_address", nc.Address(), "release_grace", grace)
	}
	return nil
}

// startFollowing starts a follower with cfg.
func (p *Plugin) startFollowing(cfg followConfig) *running {
	f := newFollower(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.run(ctx)
	}()
	return &running{f: f, stop: func() {
		cancel()
		<-done
		cfg.nomad.CloseIdleConnections()
	}}
}

// stopFollowing stops the follower, if one runs, and waits for it. Called with mu held.
func (p *Plugin) stopFollowing() {
	if p.follow != nil {
		p.follow.stop()
		p.follow = nil
	}
}

// nudge tells the follower, if one runs, that a reservation was made.
func (p *Plugin) nudge() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.follow != nil {
		p.follow.f.Nudge()
	}
}

// conn returns the agent's client and the config's Reserve deadline.
func (p *Plugin) conn() (*client.Client, time.Duration, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.c == nil {
		return nil, 0, errors.New("devicehost plugin: not configured")
	}
	return p.c, p.reserveTimeout, nil
}

// address returns the configured agent address, for messages.
func (p *Plugin) address() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cfg.Address
}

// Close stops following Nomad and closes the connection to the agent; open
// Fingerprint and Stats channels close. Safe to call more than once.
func (p *Plugin) Close() {
	p.mu.Lock()
	p.stopFollowing()
	c := p.c
	p.c = nil
	p.mu.Unlock()
	if c != nil {
		c.Close()
	}
}
