// Package pluginloader finds device plugin binaries and launches them with go-plugin.
//
// Discover lists the plugin dir; Launch starts one binary (or reattaches to a running
// plugin), checks its protocol version, hands it its config and returns a *Plugin: the
// gRPC client, a channel closed when the process exits, and Kill. Each plugin's log
// lines come out of the host's logger, named after the plugin, in the host's format.
package pluginloader

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/deviceplugin"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/textline"
)

// Binary is a plugin executable found in the plugin dir.
type Binary struct {
	Name string   // file name, used as the plugin's name in logs and config
	Path string   // absolute path
	Args []string // extra arguments (e.g. "plugin nvidia-example" when the host re-executes itself)
}

// DefaultStartTimeout is the StartTimeout used when Options leaves it zero.
const DefaultStartTimeout = 10 * time.Second

// Options says how to launch one plugin. The zero value launches with defaults.
// Launch does not modify it.
type Options struct {
	// Logger is the host's logger; the plugin's log lines come out of
	// Logger.Named(binary name). Nil means hclog.NewNullLogger().
	Logger hclog.Logger
	// StartTimeout bounds the launch: process start, handshake, GetPluginInfo and
	// SetConfig. Zero means DefaultStartTimeout (10s).
	StartTimeout time.Duration
	// SHA256 pins the binary's checksum (hex). Empty means no pinning. A mismatch is
	// refused before the binary runs.
	SHA256 string
	// Env is the plugin process's environment. The host's environment is not passed
	// on unless InheritEnv is true (then Env is added to it, and wins over it). Without
	// InheritEnv the plugin gets Env plus go-plugin's own variables and nothing else
	// (no PATH, no HOME: put them in Env if the plugin needs them).
	Env        []string
	InheritEnv bool
	// ConfigJSON is the plugin's config block, handed over with SetConfig.
	ConfigJSON []byte
	// HostVersion is sent with SetConfig, for the plugin's logs. Optional.
	HostVersion string
	// Reattach, when set, attaches to an already running plugin instead of launching.
	// Only a plugin launched with DisableAutoMTLS can be reattached (go-plugin keeps the
	// TLS keys in memory only); Binary.Path is then used for SHA256 only and may be empty.
	Reattach *plugin.ReattachConfig
	// AutoMTLS turns on go-plugin's mutual TLS between host and plugin. Default true is
	// expressed as DisableAutoMTLS=false.
	DisableAutoMTLS bool
	// SurviveHost lets the plugin process outlive the host. By default a launched plugin
	// is tied to the host's life (on Linux, the kernel SIGKILLs it when the host dies), so
	// a crashed host leaks no plugin process. Set it only for plugins a restarted host
	// will reattach to (with DisableAutoMTLS).
	SurviveHost bool
	// MaxRecvMsgSize bounds one message the host reads from the plugin (a fingerprint,
	// a stats sample, a reservation). A bigger one fails that call or stream with
	// codes.ResourceExhausted, naming the plugin and the size, without being read into
	// memory. Zero means DefaultMaxRecvMsgSize (4 MiB).
	MaxRecvMsgSize int
	// LogLimit bounds the plugin's log lines that reach Logger; zero fields mean the
	// defaults (see LogLimit).
	LogLimit LogLimit
}

// DefaultMaxRecvMsgSize is the MaxRecvMsgSize used when Options leaves it zero: 4 MiB,
// gRPC's own default, which go-plugin lifts to 2 GiB for plugin connections.
const DefaultMaxRecvMsgSize = 4 << 20

// Plugin is a launched, configured plugin process.
//
// Client's RPCs fail with codes.Unavailable or codes.Canceled once the process has exited;
// use ExitContext (or RPCError) to tell that from a caller's own cancellation. Kill must be
// called to release the process and its goroutines, even after it has exited; it may be
// called more than once. All methods are safe for concurrent use.
type Plugin struct {
	name     string
	log      hclog.Logger // the host's logger
	plog     *pluginLog   // the plugin's stderr
	client   *plugin.Client
	rpc      *deviceplugin.Client
	info     *pb.GetPluginInfoResponse
	cmd      *exec.Cmd          // nil when reattached
	stopProc context.CancelFunc // SIGKILLs cmd's process group (exec.CommandContext); no-op when reattached
	pid      int
	reattach *plugin.ReattachConfig // nil when the plugin cannot be reattached
	killOnce sync.Once
	// stopping is set once Kill begins: an exit from then on is the host's doing.
	stopping atomic.Bool
	// goLog gates go-plugin's log lines (pluginLogger); Kill shuts it before it returns.
	goLog logGate
	// cleanedUp is set by Kill once go-plugin's goroutines have ended, which orders
	// cmd.ProcessState (written by them) before a read that checks it.
	cleanedUp bool
}

// Discover lists the executables in dir, sorted by name. Folders and non-executable
// files are skipped with a log line. Every binary, and the dir, must pass CheckPath's
// trust rules (the dir itself without the sticky-bit exception: anyone who can add a file
// to it could add a plugin); a refusal is an error wrapping ErrInsecurePath that names the
// path, its owner and mode, and the fix.
//
// An untrusted dir refuses everything (nil, err). Untrusted binaries are left out and
// reported together in err, while the other binaries are still returned, so a caller
// may run those and report the error. Symlinks are followed (the target and every
// directory on the way are checked); the link's path is returned.
func Discover(dir string, log hclog.Logger) ([]Binary, error) {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("plugin dir %s: %w", dir, err)
	}
	if _, err := checkDir(abs); err != nil {
		return nil, fmt.Errorf("plugin dir: %w", err)
	}
	entries, err := os.ReadDir(abs) // sorted by name
	if err != nil {
		return nil, fmt.Errorf("plugin dir: %w", err)
	}

	var bins []Binary
	var errs []error
	for _, e := range entries {
		path := filepath.Join(abs, e.Name())
		fi, err := os.Stat(path)
		switch {
		case err != nil:
			log.Warn("skipping plugin dir entry", "path", path, "error", err)
			continue
		case fi.IsDir():
			log.Info("skipping folder in plugin dir", "path", path)
			continue
		case !fi.Mode().IsRegular():
			log.Info("skipping plugin dir entry: not a regular file", "path", path, "mode", fi.Mode().String())
			continue
		case fi.Mode().Perm()&0o111 == 0:
			log.Info("skipping plugin dir entry: not executable", "path", path, "mode", fi.Mode().Perm().String())
			continue
		}
		if _, err := CheckPath(path); err != nil {
			errs = append(errs, fmt.Errorf("plugin %q refused: %w", e.Name(), err))
			continue
		}
		bins = append(bins, Binary{Name: e.Name(), Path: path})
	}
	return bins, errors.Join(errs...)
}

// CheckDir is CheckPath for a plugin dir, as Discover checks it: the dir itself gets no
// sticky-bit exception, since anyone who can add a file to it could add a plugin. It
// returns the resolved path; a refusal wraps ErrInsecurePath.
func CheckDir(path string) (string, error) {
	return checkDir(path)
}

// Launch starts bin (or reattaches per opts.Reattach), does the handshake, checks the
// protocol version, calls GetPluginInfo and SetConfig, and returns the running plugin.
// ctx bounds the launch only, not the plugin's life. The whole launch, the kill of a
// plugin that failed it included, takes about StartTimeout at most.
//
// Errors are one line in the loader's words, name the plugin, and wrap
// ErrInsecurePath (see CheckPath; checked before the binary runs), ErrChecksumMismatch
// (checked before the binary runs), ErrNotPlugin (no go-plugin handshake with the
// host's magic cookie), ErrProtocolVersion (go-plugin handshake or GetPluginInfo
// without "v1"; the message names both sides' versions), ErrConfigRejected (SetConfig
// answered INVALID_ARGUMENT: a *ConfigError with the plugin's message, clipped; the
// kill that follows is logged at INFO as "stopping plugin after it rejected its
// config"), ErrExited (the
// plugin died while starting; the message says how), or context.DeadlineExceeded when
// StartTimeout passed (the message names the step that did not answer). On error
// nothing is left running.
func Launch(ctx context.Context, bin Binary, opts Options) (*Plugin, error) {
	log := opts.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	timeout := opts.StartTimeout
	if timeout <= 0 {
		timeout = DefaultStartTimeout
	}
	maxRecv := opts.MaxRecvMsgSize
	if maxRecv <= 0 {
		maxRecv = DefaultMaxRecvMsgSize
	}
	name := bin.Name
	if name == "" {
		name = filepath.Base(bin.Path)
	}
	launchCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	p := &Plugin{name: name, log: log, plog: newPluginLog(name, log, opts.LogLimit), stopProc: func() {}}
	cfg := &plugin.ClientConfig{
		HandshakeConfig:  deviceplugin.Handshake,
		VersionedPlugins: deviceplugin.VersionedPlugins(nil),
		AllowedProtocols: []plugin.Protocol{plugin.ProtocolGRPC},
		Logger:           pluginLogger{Logger: log.Named(name), stopping: &p.stopping, gate: &p.goLog},
		StartTimeout:     timeout,
		// The environment is built here (processEnv): go-plugin's own inheritance would
		// put the host's variables after Env, so they would win over it.
		SkipHostEnv:     true,
		Stderr:          p.plog,
		GRPCDialOptions: dialOptions(name, maxRecv),
	}
	if opts.SHA256 != "" {
		want, err := checkSHA256(bin.Path, opts.SHA256)
		if err != nil {
			return nil, err
		}
		if opts.Reattach == nil {
			// go-plugin checks again right before exec, narrowing the window for a swap.
			cfg.SecureConfig = &plugin.SecureConfig{Checksum: want, Hash: sha256.New()}
		}
	}
	if opts.Reattach != nil {
		rc := *opts.Reattach
		if rc.Protocol != "" && rc.Protocol != plugin.ProtocolGRPC {
			return nil, fmt.Errorf("reattach plugin %q: protocol %q, host speaks only %q", name, rc.Protocol, plugin.ProtocolGRPC)
		}
		if rc.ProtocolVersion != 0 && rc.ProtocolVersion != deviceplugin.HandshakeVersion {
			return nil, fmt.Errorf("reattach plugin %q: plugin speaks go-plugin protocol %d, host speaks %d: %w",
				name, rc.ProtocolVersion, deviceplugin.HandshakeVersion, ErrProtocolVersion)
		}
		rc.Protocol, rc.ProtocolVersion = plugin.ProtocolGRPC, deviceplugin.HandshakeVersion
		cfg.Reattach = &rc
		cfg.Plugins = cfg.VersionedPlugins[deviceplugin.HandshakeVersion]
		p.pid = rc.Pid
		p.reattach = &rc
	} else {
		real, err := CheckPath(bin.Path)
		if err != nil {
			return nil, fmt.Errorf("plugin %q: %w", name, err)
		}
		if err := checkExecutable(real); err != nil {
			return nil, fmt.Errorf("plugin %q: %w", name, err)
		}
		procCtx, stop := context.WithCancel(context.Background())
		// The checked file is what runs: no symlink on the way can be repointed after
		// the check. argv[0] stays the name the plugin was found under.
		cmd := exec.CommandContext(procCtx, real, bin.Args...)
		cmd.Args[0] = bin.Path
		cmd.Env = processEnv(opts)
		setProcAttrs(cmd, opts.SurviveHost)
		cfg.Cmd = cmd
		cfg.AutoMTLS = !opts.DisableAutoMTLS
		p.cmd, p.stopProc = cmd, stop
	}
	p.client = plugin.NewClient(cfg)

	if err := p.start(ctx, launchCtx, timeout); err != nil {
		return nil, err
	}
	if err := p.handshake(ctx, launchCtx, timeout, opts); err != nil {
		p.abort()
		return nil, err
	}
	if p.cmd != nil {
		p.pid = p.cmd.Process.Pid
		if opts.DisableAutoMTLS {
			if rc := p.client.ReattachConfig(); rc != nil {
				rc.ProtocolVersion = deviceplugin.HandshakeVersion
				p.reattach = rc
			}
		}
	}
	return p, nil
}

// start runs go-plugin's start (process, handshake, connection) bounded by launchCtx.
// On error the plugin has been killed.
func (p *Plugin) start(ctx, launchCtx context.Context, timeout time.Duration) error {
	type started struct {
		cp  plugin.ClientProtocol
		err error
	}
	ch := make(chan started, 1)
	go func() {
		cp, err := p.client.Client()
		ch <- started{cp, err}
	}()
	var st started
	select {
	case st = <-ch:
	case <-launchCtx.Done():
		p.stopProc() // go-plugin's Start takes no context: kill the process group to end it
		st = <-ch
	}
	if st.err != nil {
		timedOut := launchCtx.Err() != nil // before abort, which may take a while
		p.abort()
		if timedOut {
			return p.timeoutError(ctx, "", timeout)
		}
		return p.startError(st.err, p.exitReason(), p.plog.sawCookieNote())
	}
	raw, err := st.cp.Dispense(deviceplugin.PluginKey)
	if err == nil {
		rpc, ok := raw.(*deviceplugin.Client)
		if !ok {
			err = fmt.Errorf("dispensed %T, want *deviceplugin.Client", raw)
		}
		p.rpc = rpc
	}
	if err != nil {
		p.abort()
		return fmt.Errorf("plugin %q: %s", p.name, hostText(err.Error()))
	}
	return nil
}

// handshake asks for the plugin's info, checks its protocol versions and configures it.
func (p *Plugin) handshake(ctx, launchCtx context.Context, timeout time.Duration, opts Options) error {
	callCtx, cancel := p.CallContext(launchCtx)
	defer cancel()

	info, err := p.rpc.GetPluginInfo(callCtx, &pb.GetPluginInfoRequest{})
	if err != nil {
		return p.launchRPCError(ctx, launchCtx, timeout, "GetPluginInfo", err)
	}
	if !slices.Contains(info.GetProtocolVersions(), deviceplugin.ProtocolVersion) {
		return fmt.Errorf("plugin %q speaks protocol versions [%s], host speaks [%s]: %w",
			p.name, textline.Escape(strings.Join(info.GetProtocolVersions(), ", "), maxQuoted), deviceplugin.ProtocolVersion, ErrProtocolVersion)
	}
	p.info = info

	_, err = p.rpc.SetConfig(callCtx, &pb.SetConfigRequest{
		ConfigJson:      opts.ConfigJSON,
		ProtocolVersion: deviceplugin.ProtocolVersion,
		HostVersion:     opts.HostVersion,
	})
	if status.Code(err) == codes.InvalidArgument && !deadlineReached(launchCtx) {
		// Said here, so that the kill that follows is not taken for a crash.
		p.log.Info("stopping plugin after it rejected its config", "plugin", p.name)
		return &ConfigError{Plugin: p.name, Message: textline.Escape(status.Convert(err).Message(), maxQuoted)}
	}
	if err != nil {
		return p.launchRPCError(ctx, launchCtx, timeout, "SetConfig", err)
	}
	return nil
}

func (p *Plugin) launchRPCError(ctx, launchCtx context.Context, timeout time.Duration, rpc string, err error) error {
	if exited := p.RPCError(launchCtx, err); errors.Is(exited, ErrExited) {
		return p.exitedError("during "+rpc, p.ExitReason())
	}
	if deadlineReached(launchCtx) {
		return p.timeoutError(ctx, rpc, timeout)
	}
	return fmt.Errorf("plugin %q: %s failed: %s", p.name, rpc, rpcText(err))
}

// deadlineReached reports whether ctx has ended or its deadline is less than 100ms
// away. gRPC hands the deadline to the plugin, whose answer to it (DeadlineExceeded, or
// the SDK's INVALID_ARGUMENT "context deadline exceeded" from SetConfig) can arrive a
// moment before ctx itself ends (the deadline travels rounded down): that is the
// timeout, not the plugin's own error.
func deadlineReached(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	deadline, ok := ctx.Deadline()
	return ok && time.Until(deadline) < 100*time.Millisecond
}

// abort stops what a failed launch started, without a graceful wait.
func (p *Plugin) abort() {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p.Kill(ctx)
}

// exitReason is the process's exit once Kill has cleaned up ("signal: killed", "exit
// status 1"); "" for a reattached plugin or before then.
func (p *Plugin) exitReason() string {
	if p.cmd == nil || !p.cleanedUp || p.cmd.ProcessState == nil {
		return ""
	}
	return p.cmd.ProcessState.String()
}

// processEnv is the plugin's environment before go-plugin appends its own variables.
// exec.Cmd keeps the last of duplicate names, so Env wins over the inherited ones.
func processEnv(opts Options) []string {
	var env []string
	if opts.InheritEnv {
		env = os.Environ()
	}
	return append(env, opts.Env...) // a fresh slice: never the caller's backing array
}

// checkExecutable refuses a path that is not a regular, executable file.
func checkExecutable(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("plugin binary: %w", err)
	}
	switch perm := fi.Mode().Perm(); {
	case !fi.Mode().IsRegular():
		return fmt.Errorf("plugin binary %s: not a regular file", path)
	case perm&0o111 == 0:
		return fmt.Errorf("plugin binary %s: not executable (mode %s)", path, perm)
	}
	return nil
}

// checkSHA256 compares the file's SHA-256 with wantHex and returns the decoded sum.
func checkSHA256(path, wantHex string) ([]byte, error) {
	want, err := hex.DecodeString(wantHex)
	if err != nil || len(want) != sha256.Size {
		return nil, fmt.Errorf("plugin %s: pinned sha256 %q is not 64 hex digits", path, wantHex)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("plugin checksum: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return nil, fmt.Errorf("plugin checksum %s: %w", path, err)
	}
	if got := h.Sum(nil); !slices.Equal(got, want) {
		return nil, fmt.Errorf("plugin %s: sha256 is %x, want %x: %w", path, got, want, ErrChecksumMismatch)
	}
	return want, nil
}

// Client is the plugin's gRPC client.
func (p *Plugin) Client() pb.DevicePluginClient { return p.rpc }

// Info is what the plugin said in GetPluginInfo. Shared: do not modify it.
func (p *Plugin) Info() *pb.GetPluginInfoResponse { return p.info }

// Name is the plugin's name as the host knows it (Binary.Name).
func (p *Plugin) Name() string { return p.name }

// ExitContext ends as soon as the plugin process has exited (go-plugin's done
// context). A reattached plugin's exit is noticed by polling, within about a second.
func (p *Plugin) ExitContext() context.Context { return p.rpc.ExitContext() }

// ExitReason says why the process ended ("exit status 2", "signal: killed"); empty while
// it runs.
func (p *Plugin) ExitReason() string {
	select {
	case <-p.ExitContext().Done():
	default:
		return ""
	}
	// go-plugin cancels its done context after cmd.Wait has set ProcessState, so this
	// read is ordered after that write.
	if p.cmd != nil && p.cmd.ProcessState != nil {
		return p.cmd.ProcessState.String()
	}
	return "exited"
}

// PID is the plugin process's ID.
func (p *Plugin) PID() int { return p.pid }

// ReattachConfig is what a later host needs to reattach to this process. It is nil for
// a plugin launched with AutoMTLS, which cannot be reattached. The caller may keep and
// change the returned value.
func (p *Plugin) ReattachConfig() *plugin.ReattachConfig {
	if p.reattach == nil {
		return nil
	}
	rc := *p.reattach
	return &rc
}

// Process is what the done-context rule (CallContext, RPCError) needs of a plugin
// process: *Plugin, or a caller's stand-in for one (the manager's in-process test
// plugins). ExitContext ends once the process has exited; ExitReason then says why.
type Process interface {
	ExitContext() context.Context
	ExitReason() string
}

// exitGrace bounds how long RPCError waits for a plugin's exit to be noticed after an
// RPC to it failed the way a dead connection does. A launched plugin's connection
// breaks a moment before its process has been reaped (milliseconds); a reattached
// plugin's exit is noticed by go-plugin polling its PID once a second. So a second
// covers both: shorter, and a reattached plugin's crash would be recorded as a broken
// connection instead of its exit. Only an RPC that fails with Unavailable or Canceled
// while the plugin lives pays it, once per failure.
const exitGrace = time.Second

// CallContext returns a context for an RPC to p: it ends when ctx does or when the
// plugin process exits (then context.Cause is ErrExited). Call cancel when the RPC is
// done; it releases everything CallContext started.
func (p *Plugin) CallContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return CallContext(ctx, p)
}

// RPCError classifies err, returned by an RPC to p that was made with ctx: see the
// function RPCError. An exit is reported as "plugin NAME: REASON: plugin process exited".
func (p *Plugin) RPCError(ctx context.Context, err error) error {
	if err := RPCError(ctx, p, err); errors.Is(err, ErrExited) {
		return fmt.Errorf("plugin %q: %w", p.name, err)
	}
	return err
}

// CallContext returns a context for an RPC to p: it ends when ctx does or when p
// exits (then context.Cause is ErrExited). Call cancel when the RPC is done; it
// releases what CallContext registered.
//
// It starts no goroutine: the exit is watched by context.AfterFunc on p's exit
// context, so a call pays a registration, not a goroutine and the thread wake-up that
// starting one costs (measured on every Reserve: docs/benchmarks.md#where-a-reserve-goes).
func CallContext(ctx context.Context, p Process) (context.Context, context.CancelFunc) {
	cctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(p.ExitContext(), func() { cancel(ErrExited) })
	return cctx, func() {
		stop()
		cancel(context.Canceled)
	}
}

// RPCError is go-plugin's done-context rule: err, returned by an RPC to p that was
// made with ctx (or with a context from CallContext(ctx, p)), means "the plugin
// exited" when it is Unavailable or Canceled and p has exited, or exits within a
// second (exitGrace). Then RPCError returns "REASON: plugin process exited", wrapping
// ErrExited. Otherwise it returns err itself: when err is nil or of another code, when
// ctx ended first for another cause (the caller gave up: that is not the plugin's
// exit), and when neither the exit nor the end of ctx came within that second.
func RPCError(ctx context.Context, p Process, err error) error {
	if err == nil {
		return nil
	}
	if code := status.Code(err); code != codes.Unavailable && code != codes.Canceled {
		return err
	}
	if ctx.Err() != nil && !errors.Is(context.Cause(ctx), ErrExited) {
		return err
	}
	t := time.NewTimer(exitGrace)
	defer t.Stop()
	select {
	case <-p.ExitContext().Done():
	case <-ctx.Done():
		select {
		case <-p.ExitContext().Done(): // ctx ended because p exited (CallContext), or both came
		default:
			return err
		}
	case <-t.C:
		return err
	}
	return fmt.Errorf("%s: %w", p.ExitReason(), ErrExited)
}

// killGrace bounds go-plugin's graceful stop (it closes the connection and waits 2s for
// the process to exit) before Kill SIGKILLs the plugin's process group anyway.
const killGrace = 3 * time.Second

// escapeWait bounds how long Kill waits, after the SIGKILL, for go-plugin to finish:
// that only takes longer when a process that left the plugin's process group (setsid)
// still holds the plugin's stdout or stderr.
const escapeWait = 2 * time.Second

// Kill stops the plugin: gracefully first (go-plugin asks it to shut down and waits up
// to 2s), then forcefully, SIGKILLing the plugin's whole process group (its children
// too), once ctx ends or 3s have passed. Safe to call after the process has exited and
// more than once (later calls wait for the first); returns once the process group is gone
// and go-plugin's goroutines have ended, or, when a process that left the plugin's group
// keeps its stdout or stderr open, 2s after the SIGKILL, with an ERROR logged (go-plugin's
// goroutines then end when that process closes them).
func (p *Plugin) Kill(ctx context.Context) {
	p.killOnce.Do(func() {
		p.stopping.Store(true)
		defer p.goLog.close()
		done := make(chan struct{})
		go func() {
			defer close(done)
			p.client.Kill()
		}()
		grace := time.NewTimer(killGrace)
		defer grace.Stop()
		select {
		case <-done:
		case <-ctx.Done():
		case <-grace.C:
		}
		select {
		case <-done:
		default:
			p.forceKill()
			wait := time.NewTimer(escapeWait)
			defer wait.Stop()
			select {
			case <-done:
			case <-wait.C:
				p.log.Error("plugin killed, but a process outside its process group still holds its stdout or stderr; not waiting for it",
					"plugin", p.name, "pid", p.pid)
				p.plog.close()
				p.stopProc()
				return
			}
		}
		p.cleanedUp = true
		p.plog.close()
		p.stopProc()
	})
}

func (p *Plugin) forceKill() {
	if p.cmd != nil {
		p.stopProc() // exec.CommandContext's Cancel kills the group; a no-op once reaped
		return
	}
	if p.rpc != nil && p.rpc.ExitContext().Err() != nil {
		return // reattached and already gone: its PID may belong to someone else now
	}
	if p.pid > 0 {
		killReattached(p.pid)
	}
}

// pluginLogger is the logger go-plugin gets: the host's logger named after the plugin.
// go-plugin names the plugin's stderr lines once more after the binary's file name,
// which says nothing new ("nvidia-example.nvidia-example") or something wrong when the
// host re-executes itself ("nvidia-example.devicehost"), so naming it again keeps the
// plugin's name.
//
// go-plugin parses the plugin's stderr lines with the logger Named returns, unless that
// logger's level is Off. It is, so that pluginLog (ClientConfig.Stderr) alone turns
// them into log lines; the returned logger still logs what go-plugin says itself.
//
// go-plugin logs the process's exit at ERROR when it was not clean ("plugin process
// exited: error=\"signal: killed\""). Once Kill has begun that exit is the host's
// own doing, said where it was decided (a stop, a plugin that rejected its config),
// so it is logged at DEBUG; an exit nobody asked for stays an ERROR.
//
// Every line goes through the Plugin's gate, which Kill shuts before it returns: some
// of go-plugin's goroutines outlive Kill (its stdio reader ends when the connection's
// close reaches it, and says so), and once Kill has returned the caller may close the
// log's sink.
type pluginLogger struct {
	hclog.Logger
	stopping *atomic.Bool // the Plugin's: set once Kill begins
	gate     *logGate     // the Plugin's: shut when Kill returns
}

// goPluginExited is go-plugin's message for the exit of a process it launched.
const goPluginExited = "plugin process exited"

func (l pluginLogger) Log(level hclog.Level, msg string, args ...any) {
	l.gate.do(func() { l.Logger.Log(level, msg, args...) })
}
func (l pluginLogger) Trace(msg string, args ...any) { l.Log(hclog.Trace, msg, args...) }
func (l pluginLogger) Debug(msg string, args ...any) { l.Log(hclog.Debug, msg, args...) }
func (l pluginLogger) Info(msg string, args ...any)  { l.Log(hclog.Info, msg, args...) }
func (l pluginLogger) Warn(msg string, args ...any)  { l.Log(hclog.Warn, msg, args...) }
func (l pluginLogger) Error(msg string, args ...any) {
	if msg == goPluginExited && l.stopping.Load() {
		l.Log(hclog.Debug, msg+" (stopped by the host)", args...)
		return
	}
	l.Log(hclog.Error, msg, args...)
}

func (l pluginLogger) With(args ...any) hclog.Logger {
	l.Logger = l.Logger.With(args...)
	return l
}
func (l pluginLogger) Named(string) hclog.Logger      { return stderrOff{l} }
func (l pluginLogger) ResetNamed(string) hclog.Logger { return stderrOff{l} }

// stderrOff is pluginLogger reporting level Off to go-plugin's stderr reader.
type stderrOff struct{ pluginLogger }

func (l stderrOff) GetLevel() hclog.Level { return hclog.Off }
func (l stderrOff) With(args ...any) hclog.Logger {
	l.Logger = l.Logger.With(args...)
	return l
}
func (l stderrOff) Named(string) hclog.Logger      { return l }
func (l stderrOff) ResetNamed(string) hclog.Logger { return l }

// logGate lets log lines through until close; close returns once no line is being
// written, and none is written after.
type logGate struct {
	mu   sync.RWMutex
	shut bool
}

func (g *logGate) do(write func()) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if !g.shut {
		write()
	}
}

func (g *logGate) close() {
	g.mu.Lock()
	g.shut = true
	g.mu.Unlock()
}
