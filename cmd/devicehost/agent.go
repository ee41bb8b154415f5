package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/metrics"
	"github.com/devicehost/devicehost/server"
)

// How long shutdown may take: the API first (open calls get this long to finish before
// they are cut), then the manager (plugins get a graceful stop, then are killed).
const (
	serverShutdownTimeout  = 3 * time.Second
	managerShutdownTimeout = 10 * time.Second
)

const agentUsage = `[-config FILE] [-dev] [flags]

Runs the device host: launches the plugins, serves the host API on -listen, and stops
cleanly on SIGINT or SIGTERM. Flags override the config file. SIGHUP re-reads the config
file and applies its plugin blocks, log_level and max_procs at once.`

// agentArgs is the agent's command line, resolved.
type agentArgs struct {
	cfg agentConfig
	dev bool
	// set holds the flags given explicitly; they win over -dev's settings too.
	set map[string]bool
	// blocks is where the config file's plugin blocks are; nil without -config.
	blocks pluginBlocks
}

// parseAgentArgs reads the agent's flags and config file: defaults, then the file,
// then the flags given.
func parseAgentArgs(env *cmdEnv, args []string) (agentArgs, error) {
	fs := newFlagSet(env, "agent", agentUsage)
	def := defaultAgentConfig()
	configPath := fs.String("config", "", "HCL config `file` (flags override it)")
	dev := fs.Bool("dev", false, "development mode: temporary state dir and socket, bundled nvidia-example plugin simulating a DGX H100")
	listen := fs.String("listen", def.Listen, "`address` to serve on: unix:///path.sock or tcp://host:port")
	pluginDir := fs.String("plugin-dir", def.PluginDir, "`dir`ectory of plugin executables")
	stateDir := fs.String("state-dir", def.StateDir, "`dir`ectory for durable state")
	logLevel := fs.String("log-level", def.LogLevel, "log `level`: trace, debug, info, warn or error")
	logJSON := fs.Bool("log-json", false, "log JSON lines")
	metricsListen := fs.String("metrics-listen", "", "`address` to serve Prometheus metrics on (HTTP, /metrics): tcp://127.0.0.1:9400 or unix:///path.sock; off when empty")
	maxProcs := fs.Int("max-procs", def.MaxProcs, "threads running the agent's Go code at once (GOMAXPROCS); 0: the Go runtime's choice (the cores, or the container's CPU limit)")
	var tlsFlags endpoint.TLS
	registerTLSFlags(fs, &tlsFlags, "the agent's certificate", "the agent's key", "CA that client certificates must chain to")
	if err := parseFlags(fs, args); err != nil {
		return agentArgs{}, err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	cfg := def
	var blocks pluginBlocks
	if *configPath != "" {
		var err error
		if blocks, err = loadConfig(*configPath, &cfg); err != nil {
			return agentArgs{}, err
		}
	}
	override := func(name string, apply func()) {
		if set[name] {
			apply()
		}
	}
	override("listen", func() { cfg.Listen = *listen })
	override("plugin-dir", func() { cfg.PluginDir = *pluginDir })
	override("state-dir", func() { cfg.StateDir = *stateDir })
	override("log-level", func() { cfg.LogLevel = *logLevel })
	override("log-json", func() { cfg.LogJSON = *logJSON })
	override("tls-cert", func() { cfg.TLS.Cert = tlsFlags.Cert })
	override("tls-key", func() { cfg.TLS.Key = tlsFlags.Key })
	override("tls-ca", func() { cfg.TLS.CA = tlsFlags.CA })
	override("insecure", func() { cfg.TLS.Insecure = tlsFlags.Insecure })
	override("metrics-listen", func() { cfg.MetricsListen = *metricsListen })
	override("max-procs", func() { cfg.MaxProcs = *maxProcs })
	if err := checkLogLevel(cfg.LogLevel); err != nil {
		return agentArgs{}, usageError{err.Error()}
	}
	if _, err := endpoint.Parse(cfg.Listen); err != nil {
		return agentArgs{}, usageError{err.Error()}
	}
	if cfg.MaxProcs < 0 {
		return agentArgs{}, usageError{fmt.Sprintf("-max-procs %d: want 0 (the Go runtime's choice) or more", cfg.MaxProcs)}
	}
	if err := checkMetrics(cfg); err != nil {
		return agentArgs{}, usageError{err.Error()}
	}
	return agentArgs{cfg: cfg, dev: *dev, set: set, blocks: blocks}, nil
}

// runAgent is `devicehost agent`.
func runAgent(ctx context.Context, env *cmdEnv, args []string) error {
	// SIGHUP reloads from now on (its default would end the process).
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	a, err := parseAgentArgs(env, args)
	if err != nil {
		return err
	}
	cfg := a.cfg
	log := newLogger(hclog.LoggerOptions{
		Level:      hclog.LevelFromString(cfg.LogLevel),
		JSONFormat: cfg.LogJSON,
		Output:     env.stderr,
		Color:      hclog.ColorOff,
	})
	logMaxProcs(log, cfg.MaxProcs)

	var banner func(endpoint.Address)
	var devDir string
	if a.dev {
		// A dev agent that was killed could not remove its directory: remove those
		// whose agent is provably gone, then make ours.
		removed, err := cleanDeadDevDirs(os.TempDir())
		for _, d := range removed {
			log.Info("dev mode: removed the temporary directory of a dev agent that is no longer running", "path", d)
		}
		if err != nil {
			log.Warn("dev mode: could not clean up after dead dev agents", "error", err)
		}
		dir, release, err := makeDevDir(os.TempDir())
		if err != nil {
			return fmt.Errorf("dev mode: %w", err)
		}
		defer func() {
			if err := os.RemoveAll(dir); err != nil {
				log.Warn("dev mode: could not remove the temporary directory", "path", dir, "error", err)
			}
			release()
		}()
		for _, line := range devConfig(&cfg, a.set, dir) {
			log.Warn("dev mode: " + line)
		}
		devDir = dir
		banner = func(addr endpoint.Address) { printDevBanner(env.stdout, addr, cfg.StateDir, dir) }
	}
	var mx *metrics.Metrics
	var onCommit func(time.Duration, int)
	if cfg.MetricsListen != "" {
		if mx, err = metrics.New(metrics.Options{Logger: log.Named("metrics"), NoHolderLabels: !cfg.MetricsHolderLabels}); err != nil {
			return err
		}
		onCommit = mx.ObserveLedgerCommit
	}
	rejected := newRejections()
	mgr := &realManager{cfg: cfg, onCommit: onCommit, rejected: rejected, blocks: a.blocks}
	r := &reloader{env: env, args: args, devDir: devDir, log: log, cur: cfg, setPlugins: mgr.setPlugins}
	return serveAgent(ctx, cfg, log, mgr.factory, mx, banner, reloadHook{signals: hup, apply: r.reload, rejected: rejected})
}

// devConfig turns cfg into -dev's: socket and state in dir, no plugin dir, the
// bundled nvidia-example plugin simulating a DGX H100, and the other bundled plugins
// (hostdev) that the config file has a plugin block for. Flags given explicitly win.
// It returns a line for each setting of the config file it replaced, for the log: a
// file's listen, state_dir or plugin_dir is not used by a dev agent.
func devConfig(cfg *agentConfig, set map[string]bool, dir string) (replaced []string) {
	def := defaultAgentConfig()
	replace := func(key, flagName string, field *string, with string) {
		if *field != def.fieldOf(key) && *field != with {
			replaced = append(replaced, fmt.Sprintf("the config's %s %q is not used: -dev uses %q (pass -%s to choose)", key, *field, with, flagName))
		}
		*field = with
	}
	if !set["listen"] {
		replace("listen", "listen", &cfg.Listen, "unix://"+filepath.Join(dir, devSocketName))
		cfg.TLS = endpoint.TLS{} // a config file's tcp settings do not apply to the socket
	}
	if !set["state-dir"] {
		replace("state_dir", "state-dir", &cfg.StateDir, filepath.Join(dir, devStateName))
	}
	if !set["plugin-dir"] {
		replace("plugin_dir", "plugin-dir", &cfg.PluginDir, "")
	}
	cfg.Bundled = append(cfg.Bundled, devPluginName)
	for _, name := range slices.Sorted(maps.Keys(bundledPlugins)) {
		if _, configured := cfg.Plugins[name]; configured && name != devPluginName && !slices.Contains(cfg.Bundled, name) {
			cfg.Bundled = append(cfg.Bundled, name) // e.g. hostdev, with the file's config
		}
	}
	ps, ok := cfg.Plugins[devPluginName]
	if !ok {
		ps = pluginSettings{ConfigJSON: []byte(devPluginConfig)}
	}
	if ps.DeviceIDs == nil {
		ps.DeviceIDs = devDeviceIDs // its GPUs', its MIG devices' and its partitions' IDs
	}
	ps.ConfigJSON = devSimState(ps.ConfigJSON, filepath.Join(dir, devSimStateName))
	cfg.Plugins[devPluginName] = ps
	return replaced
}

// devSimState puts the simulated machine's MIG state in the dev agent's own directory
// (sim_state_file), unless the plugin's config names one: two dev agents must not
// share a simulated machine. A config that is not a JSON object is left alone for
// the plugin to refuse.
func devSimState(configJSON []byte, path string) []byte {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(configJSON, &obj); err != nil || obj == nil {
		return configJSON
	}
	if _, ok := obj["simulate"]; !ok {
		return configJSON
	}
	if _, ok := obj["sim_state_file"]; ok {
		return configJSON
	}
	obj["sim_state_file"], _ = json.Marshal(path)
	out, err := json.Marshal(obj)
	if err != nil {
		return configJSON
	}
	return out
}

// devDeviceIDs pins -dev's plugin to NVIDIA's ID forms: GPU UUIDs (and the partitions
// and replicas named after them) and MIG UUIDs.
var devDeviceIDs = []string{"GPU-*", "MIG-*"}

// serveAgent runs the host until ctx ends or the API server fails: it listens on
// cfg.Listen (and, with mx, on cfg.MetricsListen), builds the manager with newManager,
// serves the API (and the metrics), and on the way out shuts the API down, then the
// metrics, then the manager. banner, if set, is called once the API is listening. mx
// nil means no metrics; otherwise cfg.MetricsListen must be set. reload.apply runs for
// each reload signal, between the other events (under systemd, between RELOADING=1 and
// READY=1 once the agent was ready). A plugin config rejection reported to
// reload.rejected before the manager is ready stops the agent: serveAgent shuts down
// and returns it.
func serveAgent(ctx context.Context, cfg agentConfig, log hclog.Logger, newManager device.Factory, mx *metrics.Metrics, banner func(endpoint.Address), reload reloadHook) error {
	addr, err := endpoint.Parse(cfg.Listen)
	if err != nil {
		return err
	}
	// Listen before starting any plugin, so a second agent fails at once.
	lis, err := endpoint.Listen(addr, cfg.TLS)
	if err != nil {
		return err
	}
	listeners, grants, err := openListeners(cfg, lis)
	closeAll := func() {
		for _, l := range listeners {
			l.lis.Close()
		}
	}
	if err != nil {
		closeAll()
		return err
	}
	var mlis net.Listener
	var maddr endpoint.Address
	if mx != nil {
		if mlis, maddr, err = listenMetrics(cfg); err != nil {
			closeAll()
			return err
		}
	}
	mgr, err := newManager(log)
	if err != nil {
		closeAll()
		closeListener(mlis)
		return fmt.Errorf("start the device manager: %w", err)
	}
	// Nothing is served, nor the server made, before every plugin has accepted its
	// config (or failed to start): a config a plugin rejects stops the agent before a
	// client saw it serve. The sockets are bound: a client connecting meanwhile waits.
	if st, ok := mgr.(interface{ Started() <-chan struct{} }); ok {
		select {
		case <-st.Started():
		case <-reload.rejected.ready():
		case <-ctx.Done():
		}
		errs := reload.rejected.take()
		if len(errs) > 0 || ctx.Err() != nil {
			if len(errs) == 0 {
				log.Info("shutting down before serving")
			}
			closeAll()
			closeListener(mlis)
			shutdownManager(mgr, log)
			return errors.Join(errs...)
		}
	}
	api := mgr
	var opts []grpc.ServerOption
	if mx != nil {
		if err := mx.CollectManager(mgr); err != nil {
			closeAll()
			closeListener(mlis)
			shutdownManager(mgr, log)
			return err
		}
		api, opts = mx.Instrument(mgr), mx.ServerOptions()
	}
	srv, err := server.New(server.Config{
		Manager:           api,
		Logger:            log.Named("server"),
		MaxStreams:        cfg.MaxStreams,
		MaxStreamsPerConn: cfg.MaxStreamsPerConn,
		ServerOptions:     opts,
		PeerGrants:        grants,
	})
	if err == nil && mx != nil {
		err = mx.CollectServer(srv)
	}
	if err != nil {
		closeAll()
		closeListener(mlis)
		if srv != nil {
			srv.Shutdown(context.Background())
		}
		shutdownManager(mgr, log)
		return err
	}
	served := make(chan error, len(listeners))
	for _, l := range listeners {
		go func() { served <- srv.ServeListener(l.lis, l.access) }()
	}
	log.Info("listening", "address", lis.Address.String(), "version", version)
	logAccess(log, listeners, cfg.Grants)
	metricsDone := make(chan struct{})
	if mx != nil {
		// A metrics server that fails is logged; the API goes on.
		go func() {
			defer close(metricsDone)
			if err := mx.Serve(mlis); err != nil {
				log.Error("metrics server stopped; the host API goes on", "error", err)
			}
		}()
		log.Info("serving metrics", "address", maddr.String(), "url", metricsURL(maddr, cfg.MetricsTLS.Cert != ""))
	} else {
		close(metricsDone)
	}
	if banner != nil {
		banner(lis.Address)
	}

	// Under systemd (Type=notify): READY=1 when the manager is ready, which is what
	// turns health SERVING; STOPPING=1 as shutdown begins.
	ready := mgr.Ready()
	var serveErr, startErr error
wait:
	for {
		select {
		case <-reload.rejected.ready():
			errs := reload.rejected.take()
			if ready != nil {
				// Still starting: a config a plugin rejects is the agent's config error.
				startErr = errors.Join(errs...)
				break wait
			}
			for _, err := range errs {
				log.Error("plugin rejected its config and will not run until its block is fixed and the agent gets SIGHUP", "error", err.Error())
			}
		case <-ready:
			// A rejection is reported before it can make the manager ready.
			if errs := reload.rejected.take(); len(errs) > 0 {
				startErr = errors.Join(errs...)
				break wait
			}
			ready = nil
			sdNotify(log, daemon.SdNotifyReady)
		case <-reload.signals:
			if reload.apply == nil {
				continue
			}
			if ready == nil { // READY=1 was sent: say the reload is under way until it is done
				sdNotify(log, daemon.SdNotifyReloading)
			}
			reload.apply()
			if ready == nil {
				sdNotify(log, daemon.SdNotifyReady)
			}
		case <-ctx.Done():
			log.Info("shutting down")
			break wait
		case serveErr = <-served:
			if serveErr == nil {
				serveErr = errors.New("the API server stopped")
			}
			break wait
		}
	}
	sdNotify(log, daemon.SdNotifyStopping)
	// Open calls get serverShutdownTimeout to finish however Serve ended.
	sctx, cancel := context.WithTimeout(context.Background(), serverShutdownTimeout)
	srv.Shutdown(sctx)
	cancel()
	for range len(listeners) - 1 {
		// Every Serve has returned after Shutdown; the first error is the one to tell.
		serveErr = cmp.Or(serveErr, <-served)
	}
	if serveErr == nil {
		serveErr = <-served
	}
	if mx != nil {
		mctx, cancel := context.WithTimeout(context.Background(), serverShutdownTimeout)
		mx.Shutdown(mctx)
		cancel()
	}
	<-metricsDone
	shutdownManager(mgr, log)
	if startErr != nil {
		return startErr
	}
	if serveErr != nil {
		return fmt.Errorf("serve the host API: %w", serveErr)
	}
	log.Info("stopped")
	return nil
}

// apiListener is one endpoint of the host API and what its clients may do.
type apiListener struct {
	lis    *endpoint.Listener
	access server.Listener
}

// openListeners opens cfg's listener blocks beside main, the listen address's (the
// admin one), and reads the grants. On error the listeners opened are returned, for the
// caller to close.
func openListeners(cfg agentConfig, main *endpoint.Listener) ([]apiListener, []server.PeerGrant, error) {
	out := []apiListener{{lis: main, access: server.Listener{Name: mainListener, Allow: server.AllowAll, TLS: main.TLSConfig()}}}
	for _, l := range cfg.Listeners {
		allow, err := server.ParseAllow(l.Allow)
		if err != nil {
			return out, nil, fmt.Errorf("listener %q: %w", l.Name, err)
		}
		addr, err := endpoint.Parse(l.Address)
		if err != nil {
			return out, nil, fmt.Errorf("listener %q: %w", l.Name, err)
		}
		lis, err := endpoint.Listen(addr, l.TLS)
		if err != nil {
			return out, nil, fmt.Errorf("listener %q: %w", l.Name, err)
		}
		if l.Mode != 0 {
			// Who may connect at all is the file's mode (and its directory's); what
			// they may do once connected, the grants.
			if err := os.Chmod(addr.Path, l.Mode); err != nil {
				lis.Close()
				return out, nil, fmt.Errorf("listener %q: %w", l.Name, err)
			}
		}
		out = append(out, apiListener{lis: lis, access: server.Listener{Name: l.Name, Allow: allow, TLS: lis.TLSConfig()}})
	}
	var grants []server.PeerGrant
	for _, g := range cfg.Grants {
		allow, err := server.ParseAllow(g.Allow)
		if err != nil {
			return out, nil, fmt.Errorf("grant: %w", err)
		}
		grants = append(grants, server.PeerGrant{UID: g.UID, GID: g.GID, Identity: g.Identity, Allow: allow})
	}
	return out, grants, nil
}

// logAccess says once at start who may do what: with no listener or grant blocks, that
// every client of the one listener may do everything; otherwise each listener's grants
// and each grant.
func logAccess(log hclog.Logger, listeners []apiListener, grants []grantSettings) {
	if len(listeners) == 1 && len(grants) == 0 {
		log.Info("access control is off: every client of the API may do everything (admin); listener and grant blocks restrict it", "address", listeners[0].lis.Address.String())
		return
	}
	for _, l := range listeners {
		log.Info("listener", "name", l.access.Name, "address", l.lis.Address.String(), "allow", l.access.Allow.String())
	}
	for _, g := range grantsText(grants) {
		peer, allow, _ := strings.Cut(g, " ")
		log.Info("grant", "peer", peer, "allow", strings.ReplaceAll(allow, ",", ", "))
	}
}

// closeListener closes l unless it is nil.
func closeListener(l net.Listener) {
	if l != nil {
		l.Close()
	}
}

// shutdownManager stops the manager and its plugins within managerShutdownTimeout.
func shutdownManager(mgr device.Manager, log hclog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), managerShutdownTimeout)
	defer cancel()
	if err := mgr.Shutdown(ctx); err != nil {
		log.Warn("device manager did not shut down cleanly", "error", err)
	}
}

// grpcurlMaxTime bounds the dev banner's grpcurl example of a stream, which the agent
// never ends: the example stops by itself after this many seconds.
const grpcurlMaxTime = 3

// printDevBanner tells a person where the dev agent is and what to try. a is the
// address the agent listens on: for the socket -dev made, its path.
func printDevBanner(w io.Writer, a endpoint.Address, stateDir, tmp string) {
	self := "devicehost"
	if exe, err := os.Executable(); err == nil && strings.Contains(exe, "go-build") {
		self = "go run ./cmd/devicehost" // started with go run
	}
	addr := a.String()
	grpcurl := "grpcurl -plaintext -unix " + a.Path
	if a.Network == "tcp" {
		grpcurl = "grpcurl -plaintext " + a.Host
	}
	fmt.Fprintf(w, `devicehost agent -dev: 8 simulated NVIDIA H100 GPUs (nvidia-example plugin, DGX H100)
  API:    %s
  state:  %s
  PID:    %d (its plugins are its children: pkill -P %d -f 'plugin nvidia-example' stops this agent's alone)
  (%s is removed on exit)

Try, in another terminal:
  export DEVICEHOST_ADDRESS=%s
  %s devices
  %s stats
  %s reserve -owner demo -device <GPU ID from devices>
  %s reservations
  %s list
  %s devicehost.v1.DeviceHost/Fingerprint

`, addr, stateDir, os.Getpid(), os.Getpid(), tmp, addr, self, self, self, self, grpcurl,
		strings.Replace(grpcurl, "grpcurl ", fmt.Sprintf("grpcurl -max-time %d ", grpcurlMaxTime), 1))
}
