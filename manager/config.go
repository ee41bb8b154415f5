package manager

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/manager/gc"
	"github.com/devicehost/devicehost/pluginloader"
)

// Defaults and bounds for Config. Every zero duration in Config means the default here;
// New refuses a duration below its Min.
const (
	DefaultStatsInterval      = time.Second
	MinStatsInterval          = 100 * time.Millisecond
	DefaultReserveTimeout     = 10 * time.Second
	DefaultStartTimeout       = 10 * time.Second
	DefaultReadyTimeout       = 30 * time.Second
	DefaultFingerprintTimeout = 30 * time.Second
	DefaultKillTimeout        = 5 * time.Second
	DefaultRestartBaseDelay   = 200 * time.Millisecond
	DefaultRestartMaxDelay    = 30 * time.Second
	DefaultStableRunReset     = time.Minute
	DefaultServedReset        = time.Second

	DefaultPluginDirSettle    = 250 * time.Millisecond
	DefaultPluginDirRescan    = 2 * time.Second
	DefaultRemovedPluginGrace = 10 * time.Minute

	DefaultGCInterval         = gc.DefaultInterval
	DefaultGCMaxReservations  = gc.DefaultMaxReservations
	DefaultGCParallelDestroys = gc.DefaultParallel
)

// Config configures a Manager. The zero value is a manager with no plugins; every zero
// field means the documented default. New copies the Config and never modifies the
// caller's value or anything it points to.
type Config struct {
	// Logger is the parent logger; the manager logs through Logger.Named("manager") and
	// each plugin's own log lines come out of Logger.Named(plugin name). Nil discards logs.
	Logger hclog.Logger

	// PluginDir is searched for plugin executables with pluginloader.Discover. Empty
	// means no discovery. New fails when the dir does not exist (ErrNoPluginDir), cannot
	// be read or fails the trust check (pluginloader.CheckPath), or when it holds no
	// usable plugin and some were refused; refused binaries beside good ones are left
	// out with an error log line and the others run.
	//
	// The dir is watched while the manager runs (pluginloader.WatchDir): a binary added is
	// launched, one replaced is restarted on the new file, one removed is stopped, each
	// once the change has settled (PluginDirSettle).
	PluginDir string
	// PluginDirSettle is how long a plugin binary must have been left alone (no write,
	// chmod or rename: its ctime is that old) before a change of it is acted on, and
	// how long a binary must stay gone before its plugin is stopped. A binary some
	// process still has open for writing waits longer, where that can be told (Linux:
	// a read lease). Zero means DefaultPluginDirSettle (250ms).
	PluginDirSettle time.Duration
	// PluginDirRescan is how often the plugin dir is listed again while it cannot be
	// watched (inotify limit reached, dir removed); while it is watched, it is listed on
	// every change in it and every 30s. Zero means DefaultPluginDirRescan (2s).
	PluginDirRescan time.Duration
	// RemovedPluginGrace is how long a plugin removed from the host (its binary gone,
	// no config block left) may come back before the plugin cleanups of its released
	// reservations are given up on (logged and counted done); until then they stay
	// pending and are retried. A plugin with a config block is never given up on. Zero
	// means DefaultRemovedPluginGrace (10m).
	RemovedPluginGrace time.Duration
	// Binaries are plugins to run in addition to those discovered, e.g. the agent's own
	// executable re-executed as a bundled plugin in -dev mode. A name found twice makes
	// New fail.
	Binaries []pluginloader.Binary
	// Plugins holds per-plugin settings keyed by plugin (binary) name. A plugin without
	// an entry runs with no config, no checksum pin and an empty environment.
	Plugins map[string]PluginConfig

	// StateDir holds the durable state: the reservation ledger (ledger.DefaultFileName,
	// created with the dir, mode 0700, when missing) and the sockets of plugins kept
	// across restarts (PluginConfig.Reattach). A state file that is damaged, from an
	// unknown schema version or in use by another process makes New fail with the
	// ledger's error, which says what is wrong and how to recover; it is never wiped.
	//
	// Empty means no durable state, with a warning logged: the ledger lives in a
	// temporary directory (under os.TempDir) that Shutdown removes, so reservations are
	// forgotten when the process ends; until then they are kept, garbage-collected and
	// cleaned up by their plugins as with a StateDir. Reattach needs a StateDir.
	StateDir string

	// GCInterval: every GCInterval the garbage collector deletes the released
	// reservations (plugin cleanup first, when still pending) released at least
	// GCInterval ago, so a released reservation stays listed one to two intervals.
	// Zero means DefaultGCInterval (1m).
	GCInterval time.Duration
	// GCMaxReservations: when the ledger holds more reservations than this (live and
	// released), the oldest released ones are deleted at once until it does not; with
	// none released it says so at INFO, once per change of the count. Zero means
	// DefaultGCMaxReservations (1000).
	GCMaxReservations int
	// GCParallelDestroys bounds how many plugin cleanups the garbage collector runs at
	// once, so that releasing thousands at once causes no spike (its deletions share
	// ledger commits, a batch at a time). Zero means DefaultGCParallelDestroys (2).
	GCParallelDestroys int
	// MaxEvents bounds the audit trail kept in the ledger (Manager.Events): the oldest
	// go first. Zero means ledger.DefaultMaxEvents (10000); negative keeps none.
	// MaxEventAge drops older events; zero means ledger.DefaultMaxEventAge (7 days).
	MaxEvents   int
	MaxEventAge time.Duration

	// StatsInterval is how often each plugin is asked for stats (one stream per plugin)
	// and how often WatchStats readers can be served. Zero means 1s; New refuses one
	// below MinStatsInterval.
	StatsInterval time.Duration
	// ReserveTimeout bounds a plugin's Reserve call, and its Release (the cleanup after a
	// released reservation). Zero means 10s.
	ReserveTimeout time.Duration
	// StartTimeout bounds a plugin launch: process start, handshake, info and config.
	// Zero means 10s.
	StartTimeout time.Duration
	// ReadyTimeout bounds how long Ready waits for plugins that have neither
	// fingerprinted nor failed. Zero means 30s.
	ReadyTimeout time.Duration
	// FingerprintTimeout is how long a launched plugin may take to send its first
	// fingerprint; past it the run counts as failed and the plugin is restarted. Zero
	// means 30s.
	FingerprintTimeout time.Duration
	// KillTimeout is the grace a plugin gets to stop before it is killed outright.
	// Zero means 5s.
	KillTimeout time.Duration

	// RestartBaseDelay is the delay before the first restart of a plugin (and the first
	// retry of its stats stream); each further consecutive failure doubles it, up to
	// RestartMaxDelay, with ±20% jitter. A run that lasted StableRunReset resets it,
	// and so does a run in which the plugin served (its first fingerprint accepted) for
	// ServedReset: a plugin killed after it served is back after RestartBaseDelay, while
	// one that crash-loops before it ever serves keeps backing off. Zeros mean 200ms,
	// 30s, 1m and 1s.
	RestartBaseDelay time.Duration
	RestartMaxDelay  time.Duration
	StableRunReset   time.Duration
	ServedReset      time.Duration

	// Now is the clock used for timestamps (health since-when, plugin errors,
	// reservations). Nil means time.Now.
	Now func() time.Time

	// OnLedgerCommit, when set, is told of every commit of the reservation ledger: how
	// long it took, fsyncs included, and how many writes shared it (see
	// ledger.Options.OnCommit, whose contract it has: quick, never blocking). For
	// metrics; the manager does not depend on what it does.
	OnLedgerCommit func(took time.Duration, writes int)

	// OnConfigRejected, when set, is told of each plugin run that ends because the
	// plugin rejected its config (its SetConfig answered INVALID_ARGUMENT), instead of
	// the manager logging it: what a rejected config means (an agent that does not
	// start, a line naming where the config came from) is the caller's to decide. The
	// plugin is listed as failed either way and is not restarted until its binary or
	// settings change. It is called before the failure is recorded, so before the
	// failure can close Ready. Called from the plugin's supervisor goroutine: quick,
	// never blocking. SetPlugins' own check of new configs returns its rejections
	// instead.
	OnConfigRejected func(*ConfigRejectedError)

	// gcRetryMin, set by tests only, is the GC's delay before retrying a failed plugin
	// cleanup (doubling from there); zero means the ledger's default.
	gcRetryMin time.Duration
}

// ConfigRejectedError is a plugin's refusal of the config its settings hand it: its
// SetConfig (at a start) or CheckConfig (SetPlugins' check) answered INVALID_ARGUMENT,
// and the error matches pluginloader.ErrConfigRejected. Err is the launch's or the
// check's error, with the plugin's message (for a real plugin, a
// *pluginloader.ConfigError holds it apart).
type ConfigRejectedError struct {
	Plugin string
	Err    error
}

func (e *ConfigRejectedError) Error() string { return e.Err.Error() }

// Unwrap returns Err.
func (e *ConfigRejectedError) Unwrap() error { return e.Err }

// ErrNoPluginDir is New's error, wrapped with the path, when Config.PluginDir does not
// exist. (A dir removed while the manager runs is not an error: its plugins are stopped
// and the dir is listed until it is back.)
var ErrNoPluginDir = errors.New("no such directory")

// PluginConfig is the configuration of one plugin.
type PluginConfig struct {
	// ConfigJSON is the plugin's config block, handed over with SetConfig. Nil means
	// none; the plugin decides whether that is acceptable.
	ConfigJSON []byte
	// SHA256 pins the binary's checksum (hex); empty means no pinning.
	SHA256 string
	// Env is the plugin's environment ("KEY=value"). The host's environment is passed
	// on only when InheritEnv is true, and then Env is added to it.
	Env        []string
	InheritEnv bool

	// Reattach keeps the plugin's process running across a crash of the host: the
	// plugin is launched with go-plugin's AutoMTLS off, its reattach data (address,
	// PID, binary) is saved in the ledger, and a host started after a crash on the same
	// StateDir reconnects to it instead of starting a second one. It needs StateDir.
	// Default false, because:
	//
	//   - go-plugin keeps the AutoMTLS keys in the launching process's memory only, so
	//     no later process could reconnect to a plugin launched with them: reattaching
	//     needs AutoMTLS off. The plugin's gRPC listener is then a Unix socket whose
	//     only protection is file permissions. The manager puts it in StateDir/sockets
	//     (mode 0700) when that path is short enough for a socket name, else in the
	//     plugin's temp dir (owner-only by default umask); anyone who can open it can
	//     drive the plugin.
	//   - The host reattaches only to a process it can vouch for: on Linux,
	//     /proc/<pid> must be alive (not a zombie), started at the recorded time since
	//     the same boot, and running the same binary path as before. Anything else is
	//     left alone and the plugin started fresh; a process that passed the check but
	//     cannot be reattached is killed first. Off Linux the check always fails.
	//
	// A graceful Shutdown still stops the plugin (and forgets its record): only a
	// host that ends without Shutdown leaves it running. Whatever supervises the host
	// must then let the plugin outlive it (systemd: KillMode=process, for example), and
	// the plugin must survive losing its stderr pipe to the dead host.
	Reattach bool

	// DeviceIDs, when set, pins the device IDs the plugin may report to those matching
	// one of these patterns ('*' matches any run of characters, e.g. "GPU-*"); an ID
	// outside them is refused, logged, and left out of the inventory. The host's config
	// refuses patterns of two plugins that could match one ID.
	DeviceIDs []string
}

// withDefaults returns a copy of c with every zero field set to its default and every
// reference field copied, or an error naming the first field it refuses.
func (c Config) withDefaults() (Config, error) {
	if c.Logger == nil {
		c.Logger = hclog.NewNullLogger()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	c.Binaries = slices.Clone(c.Binaries)
	for i := range c.Binaries {
		c.Binaries[i].Args = slices.Clone(c.Binaries[i].Args)
		if c.Binaries[i].Name == "" {
			c.Binaries[i].Name = filepath.Base(c.Binaries[i].Path)
		}
	}
	c.Plugins = clonePlugins(c.Plugins)

	durations := []struct {
		name     string
		p        *time.Duration
		def, min time.Duration
	}{
		{"StatsInterval", &c.StatsInterval, DefaultStatsInterval, MinStatsInterval},
		{"ReserveTimeout", &c.ReserveTimeout, DefaultReserveTimeout, 0},
		{"StartTimeout", &c.StartTimeout, DefaultStartTimeout, 0},
		{"ReadyTimeout", &c.ReadyTimeout, DefaultReadyTimeout, 0},
		{"FingerprintTimeout", &c.FingerprintTimeout, DefaultFingerprintTimeout, 0},
		{"KillTimeout", &c.KillTimeout, DefaultKillTimeout, 0},
		{"RestartBaseDelay", &c.RestartBaseDelay, DefaultRestartBaseDelay, 0},
		{"RestartMaxDelay", &c.RestartMaxDelay, DefaultRestartMaxDelay, 0},
		{"StableRunReset", &c.StableRunReset, DefaultStableRunReset, 0},
		{"ServedReset", &c.ServedReset, DefaultServedReset, 0},
		{"GCInterval", &c.GCInterval, DefaultGCInterval, 0},
		{"PluginDirSettle", &c.PluginDirSettle, DefaultPluginDirSettle, 0},
		{"PluginDirRescan", &c.PluginDirRescan, DefaultPluginDirRescan, 0},
		{"RemovedPluginGrace", &c.RemovedPluginGrace, DefaultRemovedPluginGrace, 0},
	}
	for _, d := range durations {
		switch {
		case *d.p < 0:
			return Config{}, fmt.Errorf("manager config: %s is negative (%v)", d.name, *d.p)
		case *d.p == 0:
			*d.p = d.def
		case *d.p < d.min:
			return Config{}, fmt.Errorf("manager config: %s (%v) is below the minimum of %v", d.name, *d.p, d.min)
		}
	}
	counts := []struct {
		name string
		p    *int
		def  int
	}{
		{"GCMaxReservations", &c.GCMaxReservations, DefaultGCMaxReservations},
		{"GCParallelDestroys", &c.GCParallelDestroys, DefaultGCParallelDestroys},
	}
	for _, n := range counts {
		switch {
		case *n.p < 0:
			return Config{}, fmt.Errorf("manager config: %s is negative (%d)", n.name, *n.p)
		case *n.p == 0:
			*n.p = n.def
		}
	}
	if err := checkPlugins(c.StateDir, c.Plugins); err != nil {
		return Config{}, err
	}
	if c.RestartMaxDelay < c.RestartBaseDelay {
		return Config{}, fmt.Errorf("manager config: RestartMaxDelay (%v) is below RestartBaseDelay (%v)", c.RestartMaxDelay, c.RestartBaseDelay)
	}
	return c, nil
}

// clonePlugins deep-copies per-plugin settings, so that no caller's slice is shared.
func clonePlugins(in map[string]PluginConfig) map[string]PluginConfig {
	out := make(map[string]PluginConfig, len(in))
	for name, pc := range in {
		pc.ConfigJSON = slices.Clone(pc.ConfigJSON)
		pc.Env = slices.Clone(pc.Env)
		pc.DeviceIDs = slices.Clone(pc.DeviceIDs)
		out[name] = pc
	}
	return out
}

// checkPlugins refuses per-plugin settings the manager cannot honour.
func checkPlugins(stateDir string, plugins map[string]PluginConfig) error {
	if stateDir != "" {
		return nil
	}
	for _, name := range slices.Sorted(maps.Keys(plugins)) {
		if plugins[name].Reattach {
			return fmt.Errorf("manager config: plugin %q: Reattach needs a StateDir to keep the reattach data in", name)
		}
	}
	return nil
}

// equal reports whether two plugin settings launch the plugin the same way.
func (pc PluginConfig) equal(o PluginConfig) bool {
	return bytes.Equal(pc.ConfigJSON, o.ConfigJSON) && pc.SHA256 == o.SHA256 &&
		slices.Equal(pc.Env, o.Env) && pc.InheritEnv == o.InheritEnv && pc.Reattach == o.Reattach &&
		slices.Equal(pc.DeviceIDs, o.DeviceIDs)
}
