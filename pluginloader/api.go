// Package pluginloader finds device plugin binaries and launches them with go-plugin.
//
// THIS FILE IS THE AGREED API (written first so the manager can be built against it).
// Bodies marked "TODO(loader)" are filled in by the loader work; signatures change only
// by agreement.
package pluginloader

import (
	"context"
	"errors"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/go-plugin"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Binary is a plugin executable found in the plugin dir.
type Binary struct {
	Name string   // file name, used as the plugin's name in logs and config
	Path string   // absolute path
	Args []string // extra arguments (e.g. "plugin nvidia-example" when the host re-executes itself)
}

// Options says how to launch one plugin. The zero value launches with defaults.
type Options struct {
	// Logger is the host's logger; the plugin's log lines come out of
	// Logger.Named(binary name). Nil means hclog.NewNullLogger().
	Logger hclog.Logger
	// StartTimeout bounds the launch: process start, handshake, GetPluginInfo and
	// SetConfig. Zero means 10s.
	StartTimeout time.Duration
	// SHA256 pins the binary's checksum (hex). Empty means no pinning. A mismatch is
	// refused before the binary runs.
	SHA256 string
	// Env is the plugin process's environment. The host's environment is not passed
	// on unless InheritEnv is true (then Env is added to it).
	Env        []string
	InheritEnv bool
	// ConfigJSON is the plugin's config block, handed over with SetConfig.
	ConfigJSON []byte
	// Reattach, when set, attaches to an already running plugin instead of launching.
	Reattach *plugin.ReattachConfig
	// AutoMTLS turns on go-plugin's mutual TLS between host and plugin. Default true is
	// expressed as DisableAutoMTLS=false.
	DisableAutoMTLS bool
}

// Plugin is a launched, configured plugin process.
//
// Client's RPCs fail with codes.Unavailable or codes.Canceled once the process has exited;
// use Exited to tell that from a caller's own cancellation. Kill must be called exactly
// once to release the process and its goroutines, even after it has exited.
type Plugin struct {
	// TODO(loader): fields.
}

// ErrChecksumMismatch, ErrProtocolVersion, ErrConfigRejected, ErrInsecurePath are wrapped
// by Launch/Discover errors so callers (the manager) can tell a permanent failure from a
// crash worth retrying.
var (
	ErrChecksumMismatch = errors.New("plugin checksum mismatch")
	ErrProtocolVersion  = errors.New("no common plugin protocol version")
	ErrConfigRejected   = errors.New("plugin rejected its config")
	ErrInsecurePath     = errors.New("insecure plugin path")
)

// Discover lists the executables in dir, sorted by name. Folders and non-executable
// files are skipped with a log line; a world-writable dir or binary is an error wrapping
// ErrInsecurePath that names the path.
func Discover(dir string, log hclog.Logger) ([]Binary, error) {
	return nil, errors.New("TODO(loader)")
}

// Launch starts bin (or reattaches per opts.Reattach), does the handshake, checks the
// protocol version, calls GetPluginInfo and SetConfig, and returns the running plugin.
// ctx bounds the launch only, not the plugin's life.
func Launch(ctx context.Context, bin Binary, opts Options) (*Plugin, error) {
	return nil, errors.New("TODO(loader)")
}

// Client is the plugin's gRPC client.
func (p *Plugin) Client() pb.DevicePluginClient { return nil }

// Info is what the plugin said in GetPluginInfo.
func (p *Plugin) Info() *pb.GetPluginInfoResponse { return nil }

// Exited is closed as soon as the plugin process has exited (go-plugin's done context).
func (p *Plugin) Exited() <-chan struct{} { return nil }

// ExitReason says why the process ended ("exit status 2", "signal: killed"); empty while
// it runs.
func (p *Plugin) ExitReason() string { return "" }

// PID is the plugin process's ID.
func (p *Plugin) PID() int { return 0 }

// ReattachConfig is what a later host needs to reattach to this process.
func (p *Plugin) ReattachConfig() *plugin.ReattachConfig { return nil }

// Kill stops the plugin: gracefully first, then forcefully after a grace period bounded
// by ctx. Safe to call after the process has exited; returns once it is gone.
func (p *Plugin) Kill(ctx context.Context) {}
