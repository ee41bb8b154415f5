// Package kubernetes is devicehost's kubelet device plugin: a bridge that serves the
// agent's devices to the kubelet through the device-plugin API v1beta1, one socket and
// registration per resource, as a client of the agent (package client) only, so that its
// failure never touches the agent. It turns each container's Allocate into a Reserve and,
// since the kubelet says neither which pod an Allocate is for nor when a device is free,
// follows the kubelet's PodResources API to hand each reservation to its container and
// release it after a grace period. See docs/kubernetes.md.
package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	prapi "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/liveness"
)

// Defaults of Config.
const (
	DefaultDevicePluginDir      = "/var/lib/kubelet/device-plugins"
	DefaultPodResourcesSocket   = "/var/lib/kubelet/pod-resources/kubelet.sock"
	DefaultReleaseGrace         = 30 * time.Second
	DefaultPodResourcesInterval = 5 * time.Second
	// KubeletSocketName is the kubelet's registration socket in the device-plugins
	// directory.
	KubeletSocketName = "kubelet.sock"
	// DefaultHealthStallTimeout and DefaultHealthAgentTimeout bound the bridge's
	// liveness (Config.HealthSocket).
	DefaultHealthStallTimeout = liveness.DefaultStallTimeout
	DefaultHealthAgentTimeout = liveness.DefaultAgentTimeout
)

// Config configures a Bridge. Zero fields mean the documented defaults; New copies
// the Config and never modifies the caller's value.
type Config struct {
	// Client reaches the agent. Required; the Bridge does not close it. Dial it with
	// client.WithoutReachCheck to let the bridge start before the agent.
	Client *client.Client
	// DevicePluginDir is the kubelet's device-plugins directory: its registration
	// socket (KubeletSocketName) is there, and the bridge puts its own sockets there.
	// Empty means DefaultDevicePluginDir. It must exist.
	DevicePluginDir string
	// PodResourcesSocket is the kubelet's PodResources API socket. Empty means
	// DefaultPodResourcesSocket.
	PodResourcesSocket string
	// Resources are the extended resources to serve. None means one per device group
	// the agent reports, named DefaultResourceName(vendor, type, name); groups of one vendor
	// and type then make one resource. New refuses invalid or overlapping resources.
	Resources []Resource
	// ReleaseGrace is how long a reservation the bridge made may go without a pod
	// holding its devices (by PodResources) before the bridge releases it: it covers
	// the time between Allocate and the pod showing up. Zero means DefaultReleaseGrace.
	ReleaseGrace time.Duration
	// PodResourcesInterval is how often the bridge lists PodResources. Zero means
	// DefaultPodResourcesInterval.
	PodResourcesInterval time.Duration
	// Logger receives the bridge's log lines. Nil discards them.
	Logger hclog.Logger
	// DeviceListStrategy says whether Allocate answers list the devices as env vars,
	// CDI names or both. Zero means both (DefaultDeviceListStrategy).
	DeviceListStrategy DeviceListStrategy
	// PCIeRoot names the PCIe root of a device from its PCI bus ID, for
	// GetPreferredAllocation ("" when unknown). Nil means SysfsPCIeRoot("/sys").
	PCIeRoot func(busID string) string
	// HealthSocket is where the bridge serves grpc.health.v1 for a liveness probe:
	// SERVING while it is live, NOT_SERVING while one of its loops is stuck for
	// HealthStallTimeout or it has not reached the agent for HealthAgentTimeout (see
	// the liveness rules in docs/kubernetes.md). Empty: no health socket.
	HealthSocket string
	// HealthStallTimeout and HealthAgentTimeout: zero means DefaultHealthStallTimeout
	// and DefaultHealthAgentTimeout.
	HealthStallTimeout time.Duration
	HealthAgentTimeout time.Duration
}

// Bridge serves the agent's devices to the kubelet. Run serves until its context
// ends; a Bridge runs once.
type Bridge struct {
	cfg      Config
	c        *client.Client
	log      hclog.Logger
	state    *state
	pcieRoot func(string) string
	ran      sync.Once

	// allocMu orders Allocate's Reserve against the release decisions, so that a
	// reservation the kubelet has just allocated again is never released under it.
	allocMu  sync.Mutex
	bookings map[string]*booking // by reservation ID; guarded by allocMu
	// adoptFailed are the adoptions that failed in the last release pass (resource,
	// pod, devices), so each failure is logged once; guarded by allocMu.
	adoptFailed map[string]bool

	// pods is the kubelet's PodResources API, set by Run before anything is served;
	// nil when its socket cannot be used.
	pods prapi.PodResourcesListerClient

	// now is the clock of the release decisions (time.Now; tests set their own).
	now func() time.Time
	// afterSync is the registrar's test hook (see registrar.afterSync).
	afterSync func(kubeletCreates int, ok bool)
	// beforeUpdate, when set (tests), is called by the device watch before it takes in
	// each update.
	beforeUpdate func()
}

// New checks cfg and returns a Bridge for it.
func New(cfg Config) (*Bridge, error) {
	if cfg.Client == nil {
		return nil, errors.New("kubelet bridge: Config.Client is nil")
	}
	cfg.Resources = slices.Clone(cfg.Resources)
	if err := ValidateResources(cfg.Resources); err != nil {
		return nil, fmt.Errorf("kubelet bridge: %w", err)
	}
	if cfg.ReleaseGrace < 0 || cfg.PodResourcesInterval < 0 {
		return nil, errors.New("kubelet bridge: ReleaseGrace and PodResourcesInterval must not be negative")
	}
	if err := (liveness.Config{StallTimeout: cfg.HealthStallTimeout, AgentTimeout: cfg.HealthAgentTimeout}).Check(); err != nil {
		return nil, fmt.Errorf("kubelet bridge: health: %w", err)
	}
	if cfg.DevicePluginDir == "" {
		cfg.DevicePluginDir = DefaultDevicePluginDir
	}
	if cfg.PodResourcesSocket == "" {
		cfg.PodResourcesSocket = DefaultPodResourcesSocket
	}
	if cfg.ReleaseGrace == 0 {
		cfg.ReleaseGrace = DefaultReleaseGrace
	}
	if cfg.PodResourcesInterval == 0 {
		cfg.PodResourcesInterval = DefaultPodResourcesInterval
	}
	if cfg.DeviceListStrategy == (DeviceListStrategy{}) {
		cfg.DeviceListStrategy = DeviceListStrategy{EnvVar: true, CDI: true}
	}
	log := cfg.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	root := cfg.PCIeRoot
	if root == nil {
		root = SysfsPCIeRoot("/sys")
	}
	return &Bridge{
		cfg:      cfg,
		c:        cfg.Client,
		log:      log,
		state:    newState(cfg.Resources),
		pcieRoot: root,
		bookings: map[string]*booking{},
		now:      time.Now,
	}, nil
}

// Run serves the kubelet until ctx ends: it watches the agent's devices, serves and
// registers a device plugin per resource (again after every kubelet restart), and
// releases reservations no pod holds any more. When ctx ends it stops serving, removes
// its sockets and returns nil once every goroutine it started has ended. It fails at
// once when the device-plugins directory is missing or cannot be watched, or when
// called a second time.
func (b *Bridge) Run(ctx context.Context) error {
	first := false
	b.ran.Do(func() { first = true })
	if !first {
		return errors.New("kubelet bridge: Run called twice")
	}
	dir := b.cfg.DevicePluginDir
	if fi, err := os.Stat(dir); err != nil {
		return fmt.Errorf("device-plugins directory: %w", err)
	} else if !fi.IsDir() {
		return fmt.Errorf("device-plugins directory %s is not a directory", dir)
	}
	mon, _ := liveness.New(liveness.Config{StallTimeout: b.cfg.HealthStallTimeout, AgentTimeout: b.cfg.HealthAgentTimeout,
		Logger: b.log.Named("health")}) // checked by New
	var healthLis net.Listener
	if b.cfg.HealthSocket != "" {
		lis, err := liveness.Listen(b.cfg.HealthSocket)
		if err != nil {
			return err
		}
		healthLis = lis
	}
	reg, err := newRegistrar(b)
	if err != nil {
		if healthLis != nil {
			healthLis.Close()
		}
		return err
	}
	reg.tokens = mon.Loop("registrar")
	b.log.Info("serving the kubelet", "agent", b.c.Address(), "device_plugin_dir", dir,
		"pod_resources", b.cfg.PodResourcesSocket, "release_grace", b.cfg.ReleaseGrace,
		"device_list_strategy", b.cfg.DeviceListStrategy.String(), "health_socket", b.cfg.HealthSocket)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	watchTokens := mon.Loop("device watch")
	wg.Go(func() { b.watchDevices(ctx, reg.kick, mon, watchTokens) })
	if lister, closePods, err := b.dialPodResources(); err != nil {
		b.log.Error("cannot use the PodResources socket: reservations will not be released, nor devices of gone pods taken over",
			"socket", b.cfg.PodResourcesSocket, "error", err)
	} else {
		defer closePods()
		b.pods = lister
		releaseTokens := mon.Loop("release")
		wg.Go(func() { b.releaseLoop(ctx, lister, releaseTokens) })
	}
	wg.Go(func() { mon.Run(ctx) })
	if healthLis != nil {
		wg.Go(func() {
			if err := mon.Serve(ctx, healthLis); err != nil {
				b.log.Error("the health socket stopped serving: the liveness probe will fail", "error", err)
			}
		})
	}
	reg.run(ctx)
	cancel()
	wg.Wait()
	b.log.Info("stopped serving the kubelet")
	return nil
}

// watchDevices feeds the agent's device watch into state until ctx ends, and kicks the
// registrar when a new resource is to be served.
// It reports the watch's connection to mon, and takes its tokens while it waits.
func (b *Bridge) watchDevices(ctx context.Context, kick func(), mon *liveness.Monitor, tokens <-chan struct{}) {
	connected := true         // so that a first failure is logged
	mixed := map[string]int{} // resources of several groups: the number last logged
	updates := b.c.WatchDevices(ctx)
	for {
		u, ok := liveness.Next(tokens, updates)
		if !ok {
			return
		}
		mon.Agent(!u.Disconnected())
		if b.beforeUpdate != nil {
			b.beforeUpdate()
		}
		ch := b.state.update(u)
		switch {
		case u.Disconnected() && connected:
			b.log.Warn("the agent is not reachable: reporting every device unhealthy to the kubelet until it is back",
				"error", u.Err, "retry_in", u.RetryIn)
		case !u.Disconnected() && !connected:
			b.log.Info("the agent is reachable: reporting device health again")
		}
		connected = !u.Disconnected()
		for _, rg := range ch.refused {
			b.log.Warn("device group not served: its default resource name is not one the kubelet accepts; configure a resource for it",
				"group", groupLabel(rg.group), "error", rg.err)
		}
		for _, r := range ch.added {
			b.log.Info("serving resource", "resource", r.Name, "vendor", r.Vendor, "type", r.Type)
		}
		if len(ch.added) > 0 {
			kick()
		}
		if !u.Disconnected() {
			v := b.state.view()
			for _, r := range v.resources {
				gs := v.groups(r)
				if len(gs) > 1 && mixed[r.Name] != len(gs) {
					names := make([]string, len(gs))
					for i, g := range gs {
						names[i] = g.GetName()
					}
					b.log.Info("resource covers several device groups: each container gets devices of one of them; "+
						"configure a resource per model to let pods choose", "resource", r.Name, "groups", names)
				}
				mixed[r.Name] = len(gs)
			}
		}
	}
}
