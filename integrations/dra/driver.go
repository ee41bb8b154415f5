// Package dra is devicehost's Kubernetes Dynamic Resource Allocation driver: a client of
// the agent (package client) that publishes the agent's devices as the node's
// ResourceSlices and serves the kubelet's DRA calls through the kubeletplugin helper of
// k8s.io/dynamic-resource-allocation: NodePrepareResources is one idempotent Reserve per
// claim, with a CDI spec, NodeUnprepareResources its Release, and WatchHealthStatus the
// agent's health. The agent's ledger is its only state. See docs/kubernetes.md#dra-driver.
package dra

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sync/errgroup"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/liveness"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Defaults of Config.
const (
	DefaultDriverName    = "devicehost.io"
	DefaultRegistryDir   = kubeletplugin.KubeletRegistryDir
	DefaultCDIDir        = "/var/run/cdi"
	DefaultStaleGrace    = 2 * time.Minute
	DefaultStaleInterval = time.Minute
	// healthResend is how often WatchHealthStatus repeats its report when nothing
	// changed: well inside the kubelet's 30 s before it calls a device's health
	// unknown.
	healthResend = 10 * time.Second
	// DefaultHealthStallTimeout and DefaultHealthAgentTimeout bound the driver's
	// liveness (Config.HealthSocket).
	DefaultHealthStallTimeout = liveness.DefaultStallTimeout
	DefaultHealthAgentTimeout = liveness.DefaultAgentTimeout
	// HealthSocketName is the health socket's usual name, in PluginDir.
	HealthSocketName = "health.sock"
)

// Config configures a Driver. Zero values take the defaults named.
type Config struct {
	// Agent is the client of the agent; required. The Driver does not close it.
	Agent *client.Client
	// Kube is the API server client; required.
	Kube kubernetes.Interface
	// Meta is the API server's metadata client (metadata.NewForConfig), through which
	// the informer of the pool's slices watches their metadata alone; nil: through
	// Kube, each slice whole (a fake clientset).
	Meta metadata.Interface
	// ResourceREST is the REST client of the resource.k8s.io/v1 API through which the
	// slices' updates go as bytes (slicewire.go); nil: Kube's. A fake clientset has
	// none: its tests give one.
	ResourceREST rest.Interface
	// NodeName is the node's name, and the name of its pool; required.
	NodeName string
	// DriverName is the DRA driver's name (DefaultDriverName).
	DriverName string
	// PluginDir is where the DRA socket is made (kubelet's plugins dir/<driver>).
	PluginDir string
	// RegistryDir is the kubelet's plugin registry (DefaultRegistryDir).
	RegistryDir string
	// CDIDir is where the per-claim CDI specs go (DefaultCDIDir).
	CDIDir string
	// StaleGrace is how long a reservation's claim must be missing from the API
	// server before it is released (DefaultStaleGrace); StaleInterval is how often
	// that is checked (DefaultStaleInterval).
	StaleGrace    time.Duration
	StaleInterval time.Duration
	// SysfsRoot is where pcieRoot is read ("": the host's /sys).
	SysfsRoot string
	// Logger (default: a null logger).
	Logger hclog.Logger
	// HelperOptions are added to the kubeletplugin helper's options (tests).
	HelperOptions []kubeletplugin.Option
	// HealthSocket is where the driver serves grpc.health.v1 for a liveness probe:
	// SERVING while it is live, NOT_SERVING while its agent watch is stuck for
	// HealthStallTimeout or it has not reached the agent for HealthAgentTimeout
	// (DefaultHealthStallTimeout, DefaultHealthAgentTimeout). Empty: none.
	HealthSocket       string
	HealthStallTimeout time.Duration
	HealthAgentTimeout time.Duration
}

// Driver is the DRA driver. Make one with New and call Run once.
type Driver struct {
	cfg   Config
	log   hclog.Logger
	agent *client.Client
	cdi   *cdiSpecs
	pci   *pciAttributes

	fatal chan error // HandleError's fatal errors, for Run

	mu      sync.Mutex
	cur     *view         // latest; nil before the first snapshot
	changed chan struct{} // closed and replaced when cur changes

	// stale: owner -> when the GC first saw its claim missing. Only the GC goroutine
	// touches it.
	stale map[string]time.Time
	// afterStaleRound, if set, is called after every round of the stale-claim GC
	// (tests).
	afterStaleRound func(staleRound)
	// beforeUpdate, if set, is called by the agent watch before it takes in each
	// update (tests).
	beforeUpdate func()

	// statuses are the claims whose device status the driver writes (status.go).
	statuses claimStatuses
	// kubelet counts the kubelet's calls in flight (calls.go).
	kubelet *calls
}

// New checks cfg and returns a Driver; it starts nothing.
func New(cfg Config) (*Driver, error) {
	if cfg.Agent == nil {
		return nil, errors.New("dra: Config.Agent is required")
	}
	if cfg.Kube == nil {
		return nil, errors.New("dra: Config.Kube is required")
	}
	if cfg.NodeName == "" {
		return nil, errors.New("dra: Config.NodeName is required")
	}
	if cfg.DriverName == "" {
		cfg.DriverName = DefaultDriverName
	}
	if cfg.PluginDir == "" {
		cfg.PluginDir = filepath.Join(kubeletplugin.KubeletPluginsDir, cfg.DriverName)
	}
	if cfg.RegistryDir == "" {
		cfg.RegistryDir = DefaultRegistryDir
	}
	if cfg.CDIDir == "" {
		cfg.CDIDir = DefaultCDIDir
	}
	if cfg.StaleGrace <= 0 {
		cfg.StaleGrace = DefaultStaleGrace
	}
	if cfg.StaleInterval <= 0 {
		cfg.StaleInterval = DefaultStaleInterval
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if err := (liveness.Config{StallTimeout: cfg.HealthStallTimeout, AgentTimeout: cfg.HealthAgentTimeout}).Check(); err != nil {
		return nil, fmt.Errorf("dra: health: %w", err)
	}
	if cfg.ResourceREST == nil {
		cfg.ResourceREST = cfg.Kube.ResourceV1().RESTClient()
	}
	if c, ok := cfg.ResourceREST.(*rest.RESTClient); ok && c == nil {
		return nil, errors.New("dra: Config.ResourceREST is required where Config.Kube has no REST client (a fake clientset)")
	}
	cfg.HelperOptions = append([]kubeletplugin.Option(nil), cfg.HelperOptions...)
	cdi, err := newCDISpecs(cfg.CDIDir, cfg.DriverName)
	if err != nil {
		return nil, err
	}
	d := &Driver{
		cfg:      cfg,
		log:      cfg.Logger,
		agent:    cfg.Agent,
		cdi:      cdi,
		fatal:    make(chan error, 1),
		changed:  make(chan struct{}),
		stale:    make(map[string]time.Time),
		pci:      &pciAttributes{},
		statuses: newClaimStatuses(),
		kubelet:  newCalls(),
	}
	if cfg.SysfsRoot != "" {
		d.pci.sysfs = []deviceattribute.MachineModifier{deviceattribute.WithFSFromRoot(cfg.SysfsRoot)}
	}
	return d, nil
}

// Run repairs the CDI specs from the agent's ledger, makes PluginDir if it is
// missing, starts the kubeletplugin helper (registration and DRA sockets), publishes
// the pool from the agent's Fingerprint stream and collects stale claims, until ctx
// ends (nil) or a fatal error. Everything it started is stopped when it returns.
func (d *Driver) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	// The helper and the health socket (by default) listen in PluginDir, and neither
	// makes it; on a node where nothing made it (a driver run outside a pod, a hostPath
	// of the kubelet's whole plugins directory) it must not be a reason to fail.
	if err := os.MkdirAll(d.cfg.PluginDir, 0o750); err != nil {
		return fmt.Errorf("dra: plugin directory: %w", err)
	}
	mon, _ := liveness.New(liveness.Config{StallTimeout: d.cfg.HealthStallTimeout, AgentTimeout: d.cfg.HealthAgentTimeout,
		Logger: d.log.Named("health")}) // checked by New
	watchTokens := mon.Loop("agent watch")
	// Only the agent watch is watched. The publish loop's first sync waits
	// for the ResourceSlice informer to sync with the API server (about a second in the
	// tests, and as long as the API server is unreachable on a node that starts without
	// it), and a stuck stale-claim loop only delays releasing claims deleted while the
	// driver was down, its rounds waiting on that same API server: a restart would mend
	// neither.
	var healthLis net.Listener
	if d.cfg.HealthSocket != "" {
		lis, err := liveness.Listen(d.cfg.HealthSocket)
		if err != nil {
			return fmt.Errorf("dra: %w", err)
		}
		healthLis = lis
		defer lis.Close() // when Run fails before Serve has it
	}

	// Repair the specs before the kubelet can ask (a tmpfs /var/run/cdi lost at
	// reboot); an agent that is not there yet is repaired on its first snapshot.
	rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
	if err := d.repairCDI(rctx); err != nil {
		d.log.Warn("CDI specs not repaired at start; repaired once the agent answers", "error", err)
	}
	rcancel()

	opts := append([]kubeletplugin.Option{
		kubeletplugin.DriverName(d.cfg.DriverName),
		kubeletplugin.KubeClient(d.cfg.Kube),
		kubeletplugin.NodeName(d.cfg.NodeName),
		kubeletplugin.PluginDataDirectoryPath(d.cfg.PluginDir),
		kubeletplugin.RegistrarDirectoryPath(d.cfg.RegistryDir),
		kubeletplugin.GRPCInterceptor(d.kubelet.interceptor),
	}, d.cfg.HelperOptions...)
	helper, err := kubeletplugin.Start(ctx, d, opts...)
	if err != nil {
		return fmt.Errorf("dra: start kubelet plugin: %w", err)
	}
	defer helper.Stop()
	d.log.Info("serving the kubelet", "driver", d.cfg.DriverName, "node", d.cfg.NodeName,
		"plugin_dir", d.cfg.PluginDir, "registry_dir", d.cfg.RegistryDir)

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { mon.Run(gctx); return nil })
	if healthLis != nil {
		g.Go(func() error { return mon.Serve(gctx, healthLis) })
	}
	g.Go(func() error { return d.watchLoop(gctx, mon, watchTokens) })
	g.Go(func() error { return d.publishLoop(gctx) })
	g.Go(func() error { return d.staleLoop(gctx) })
	g.Go(func() error { return d.statusLoop(gctx) })
	g.Go(func() error {
		select {
		case err := <-d.fatal:
			if ctx.Err() != nil {
				// Run is ending: the helper's servers stop with its context, and say
				// so ("the server has been stopped"); that is no failure of Run.
				return nil
			}
			return err
		case <-gctx.Done():
			return nil
		}
	})
	return g.Wait()
}

// watchLoop follows the agent's Fingerprint stream: each snapshot (or word that the
// agent is gone) becomes the current view at once, for Prepare and health; publishing
// it is publishLoop's. It reports the watch's connection to mon, and takes its tokens
// while it waits.
func (d *Driver) watchLoop(ctx context.Context, mon *liveness.Monitor, tokens <-chan struct{}) error {
	var lastSnap *pb.FingerprintResponse
	wasDown := true
	cache := newViewCache()
	updates := d.agent.WatchDevices(ctx)
	for {
		u, ok := liveness.Next(tokens, updates)
		if !ok {
			return nil
		}
		mon.Agent(!u.Disconnected())
		if d.beforeUpdate != nil {
			d.beforeUpdate()
		}
		d.kubelet.deferred(ctx, maxDefer)
		o := buildOptions{driver: d.cfg.DriverName, pool: d.cfg.NodeName, pci: d.pci, cache: cache}
		snap := u.Snapshot
		if u.Disconnected() {
			if !wasDown {
				d.log.Warn("agent unreachable: devices published tainted, health unknown", "error", u.Err, "retry_in", u.RetryIn)
			}
			wasDown = true
			if lastSnap == nil {
				// Nothing known yet: leave the pool as an earlier process published it
				// rather than publish it empty.
				continue
			}
			o.disconnected = u.Err
			snap = lastSnap // keep the devices, tainted
		} else {
			if wasDown {
				// (Re)connected: the agent may have restarted with a ledger this
				// process has not seen; make the specs match it.
				if err := d.repairCDI(ctx); err != nil && ctx.Err() == nil {
					d.log.Warn("CDI specs not repaired", "error", err)
				}
			}
			wasDown = false
			lastSnap = snap
		}
		v, problems := buildView(snap, o)
		for _, p := range problems {
			d.log.Warn("device left out of or changed in the ResourceSlice", "problem", p)
		}
		d.setView(v)
	}
}

// publishLoop writes the current view's slices through a publisher whenever the view
// changes, and again republishDelay after someone else's last change to them (the
// kubelet deletes every ResourceSlice of its node when it starts; left to itself the
// helper's controller wrote them again 30 s later, 14 s measured on the real node, and
// until then the scheduler places no claim on this node). A write that fails is tried
// again, after 100 ms doubling up to 30 s. The first sync waits for the informer of
// the node's slices (about a second in the tests, and as long as the API server is
// unreachable).
func (d *Driver) publishLoop(ctx context.Context) error {
	p := newPublisher(d.cfg.Kube, d.cfg.Meta, d.cfg.ResourceREST, d.cfg.DriverName, d.cfg.NodeName, d.log)
	inf, err := p.informer()
	if err != nil {
		return fmt.Errorf("dra: ResourceSlice informer: %w", err)
	}
	defer run(ctx, inf)()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return nil // ctx ended
	}
	var (
		backoff time.Duration
		retry   = time.NewTimer(time.Hour)
		settle  = time.NewTimer(time.Hour) // armed by someone else's change
		due     = true
		mending bool // someone else changed the slices: say so if this sync writes
	)
	retry.Stop()
	settle.Stop() // since Go 1.23 a stopped timer sends nothing
	defer retry.Stop()
	defer settle.Stop()
	for {
		v, changed := d.current()
		if v != nil && due {
			writes, err := p.sync(ctx, v)
			if mending && writes > 0 {
				d.log.Info("ResourceSlices of the pool changed or deleted by someone else (the kubelet deletes them at its start): publishing them again", "writes", writes)
			}
			mending = false
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				backoff = min(max(2*backoff, 100*time.Millisecond), 30*time.Second)
				d.log.Warn("ResourceSlices not published; trying again", "error", err, "retry_in", backoff)
				retry.Reset(backoff)
			} else {
				backoff = 0
				retry.Stop()
			}
		}
		due = true
		select {
		case <-changed:
		case <-retry.C:
		case <-settle.C:
			mending = true
		case <-p.foreign:
			settle.Reset(republishDelay) // a later change of the burst pushes it back
			due = false
		case <-ctx.Done():
			return nil
		}
	}
}

// setView makes v current and wakes its watchers.
func (d *Driver) setView(v *view) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.cur = v
	close(d.changed)
	d.changed = make(chan struct{})
}

// current returns the current view (nil before the first) and a channel closed when
// it changes.
func (d *Driver) current() (*view, <-chan struct{}) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cur, d.changed
}

// HandleError implements kubeletplugin.DRAPlugin: background errors of the helper.
// Recoverable ones are logged; a fatal one ends Run.
func (d *Driver) HandleError(_ context.Context, err error, msg string) {
	if errors.Is(err, kubeletplugin.ErrRecoverable) {
		d.log.Error(msg, "error", err)
		return
	}
	select {
	case d.fatal <- fmt.Errorf("dra: %s: %w", msg, err):
	default:
	}
}

// WatchHealthStatus implements kubeletplugin.DRAPlugin: a report of every device at
// once, again when a device's health or the agent's reachability changes, and every
// healthResend in between. Most of the snapshot's changes (a holder, a taint) say
// nothing new of health: sending 232 devices to the kubelet for each Reserve was work
// for both.
func (d *Driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	t := time.NewTicker(healthResend)
	defer t.Stop()
	var last *kubeletplugin.DeviceHealthReport // sent last; nil: send
	for {
		v, changed := d.current()
		if v != nil && (last == nil || !v.reportedIn(*last)) {
			r := v.healthReport(time.Now())
			select {
			case reports <- r:
				last = &r
			case <-ctx.Done():
				return nil
			}
		}
		select {
		case <-changed:
		case <-t.C:
			last = nil
		case <-ctx.Done():
			return nil
		}
	}
}

// reportedIn reports whether r says of every device what v's healthReport says, their
// times aside (checked without building a report: most changes of the pool, a holder,
// a taint, say nothing new of health).
func (v *view) reportedIn(r kubeletplugin.DeviceHealthReport) bool {
	if len(r.Devices) != len(v.order) {
		return false
	}
	for i, name := range v.order {
		x, y := r.Devices[i], v.deviceHealth(name, time.Time{})
		if x.PoolName != y.PoolName || x.DeviceName != y.DeviceName || x.Health != y.Health ||
			x.HealthCheckTimeout != y.HealthCheckTimeout || x.Message != y.Message {
			return false
		}
	}
	return true
}

// healthReport is every device's health: the agent's, or unknown while it cannot be
// reached.
func (v *view) healthReport(now time.Time) kubeletplugin.DeviceHealthReport {
	r := kubeletplugin.DeviceHealthReport{Devices: make([]kubeletplugin.DeviceHealth, 0, len(v.order))}
	for _, name := range v.order {
		r.Devices = append(r.Devices, v.deviceHealth(name, now))
	}
	return r
}

// deviceHealth is device name's health as healthReport says it.
func (v *view) deviceHealth(name string, now time.Time) kubeletplugin.DeviceHealth {
	ref := v.devices[name]
	h := kubeletplugin.DeviceHealth{PoolName: v.pool, DeviceName: name, LastUpdated: now, Message: ref.reason}
	switch {
	case v.disconnected != nil:
		h.Health = kubeletplugin.HealthStatusUnknown
		h.Message = "devicehost agent unreachable: " + v.disconnected.Error()
	case ref.health == pb.Health_HEALTH_HEALTHY:
		h.Health = kubeletplugin.HealthStatusHealthy
	case ref.health == pb.Health_HEALTH_UNHEALTHY:
		h.Health = kubeletplugin.HealthStatusUnhealthy
	default:
		h.Health = kubeletplugin.HealthStatusUnknown
	}
	return h
}

var _ kubeletplugin.DRAPlugin = (*Driver)(nil)
