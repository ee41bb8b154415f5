package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/hcl/v2"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/integrations/kubernetes"
)

// The least the kubelet-plugin's durations may be: a shorter grace period would release
// reservations of pods the kubelet has not reported yet, and listing PodResources more
// often only loads the kubelet.
const (
	minReleaseGrace         = time.Second
	minPodResourcesInterval = 100 * time.Millisecond
	minHealthTimeout        = time.Second
)

// kubeletHealthSocketName is the default health socket's name, in the directory of the
// agent's unix socket (in the DaemonSet, the node's /run/devicehost, which every container mounts).
const kubeletHealthSocketName = "kubelet-plugin-health.sock"

const kubeletPluginUsage = `[-config FILE] [flags]

Serves the agent's devices to the kubelet as a device plugin (device-plugin API
v1beta1): a resource per device group, named <vendor>.com/<type>, unless the config
file's kubernetes block names the resources. It registers with the kubelet (again
whenever the kubelet restarts), turns each container's Allocate into a Reserve at the
agent, and releases a reservation once no pod in the kubelet's PodResources API has
held its devices for -release-grace. Stops on SIGINT or SIGTERM, removing its sockets.
Flags override the config file.

It serves grpc.health.v1 on -health-socket (default: kubelet-plugin-health.sock beside
the agent's unix socket) for a liveness probe: NOT_SERVING while one of its loops has
made no progress for -health-stall-timeout, or it has not reached the agent for
-health-agent-timeout; SERVING otherwise.`

// kubeletPluginConfig is the kubelet-plugin's configuration: defaults, then the config
// file, then flags.
type kubeletPluginConfig struct {
	Address              string
	TLS                  endpoint.TLS
	DevicePluginDir      string
	PodResourcesSocket   string
	ReleaseGrace         time.Duration
	PodResourcesInterval time.Duration
	DeviceListStrategy   kubernetes.DeviceListStrategy
	Resources            []kubernetes.Resource
	LogLevel             string
	LogJSON              bool
	// HealthSocket is "" for none; healthSocketSet says the file or a flag set it (else
	// it defaults to one beside the agent's unix socket).
	HealthSocket       string
	healthSocketSet    bool
	HealthStallTimeout time.Duration
	HealthAgentTimeout time.Duration
}

// runKubeletPlugin is `devicehost kubelet-plugin`.
func runKubeletPlugin(ctx context.Context, env *cmdEnv, args []string) error {
	cfg, err := parseKubeletPluginArgs(env, args)
	if err != nil {
		return err
	}
	log := newLogger(hclog.LoggerOptions{
		Name:       "kubelet-plugin",
		Level:      hclog.LevelFromString(cfg.LogLevel),
		JSONFormat: cfg.LogJSON,
		Output:     env.stderr,
		Color:      hclog.ColorOff,
	})
	// The agent may start after the bridge, or restart under it: no reach check, the
	// device watch reconnects by itself and reports the devices unhealthy meanwhile.
	c, err := client.Dial(ctx, cfg.Address, client.WithTLS(cfg.TLS), client.WithoutReachCheck())
	var ce *endpoint.ConfigError
	if errors.As(err, &ce) {
		return usageError{err.Error()}
	}
	if err != nil {
		return err
	}
	defer c.Close()
	b, err := kubernetes.New(kubernetes.Config{
		Client:               c,
		DevicePluginDir:      cfg.DevicePluginDir,
		PodResourcesSocket:   cfg.PodResourcesSocket,
		Resources:            cfg.Resources,
		ReleaseGrace:         cfg.ReleaseGrace,
		PodResourcesInterval: cfg.PodResourcesInterval,
		DeviceListStrategy:   cfg.DeviceListStrategy,
		Logger:               log,
		HealthSocket:         cfg.HealthSocket,
		HealthStallTimeout:   cfg.HealthStallTimeout,
		HealthAgentTimeout:   cfg.HealthAgentTimeout,
	})
	if err != nil {
		return err
	}
	return b.Run(ctx)
}

// parseKubeletPluginArgs reads the kubelet-plugin's flags and config file.
func parseKubeletPluginArgs(env *cmdEnv, args []string) (kubeletPluginConfig, error) {
	fs := newFlagSet(env, "kubelet-plugin", kubeletPluginUsage)
	var cf clientFlags
	cf.register(fs, env)
	configPath := fs.String("config", "", "HCL config `file` with a kubernetes block (flags override it)")
	dpDir := fs.String("device-plugin-dir", kubernetes.DefaultDevicePluginDir, "the kubelet's device-plugins `dir`ectory")
	prSocket := fs.String("pod-resources-socket", kubernetes.DefaultPodResourcesSocket, "the kubelet's PodResources API socket `path`")
	grace := fs.Duration("release-grace", kubernetes.DefaultReleaseGrace, "release a reservation once no pod has held its devices this long (at least 1s)")
	interval := fs.Duration("pod-resources-interval", kubernetes.DefaultPodResourcesInterval, "how often to list the kubelet's PodResources (at least 100ms)")
	strategy := fs.String("device-list-strategy", kubernetes.DefaultDeviceListStrategy,
		"how Allocate lists a container's devices: `envvar` (NVIDIA_VISIBLE_DEVICES), cdi-cri (CDI names) or both, comma-separated")
	logLevel := fs.String("log-level", defaultLogLevel, "log `level`: trace, debug, info, warn or error")
	logJSON := fs.Bool("log-json", false, "log JSON lines")
	healthSocket := fs.String("health-socket", "", "grpc.health.v1 socket `path` for a liveness probe (default "+kubeletHealthSocketName+
		" beside the agent's unix socket; \"\" for none)")
	stall := fs.Duration("health-stall-timeout", kubernetes.DefaultHealthStallTimeout, "NOT_SERVING once a loop has made no progress this long (at least 1s)")
	agentTimeout := fs.Duration("health-agent-timeout", kubernetes.DefaultHealthAgentTimeout, "NOT_SERVING once the agent has been unreachable this long (at least 1s)")
	if err := parseFlags(fs, args); err != nil {
		return kubeletPluginConfig{}, err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	cfg := kubeletPluginConfig{
		Address:            cf.address,
		DevicePluginDir:    kubernetes.DefaultDevicePluginDir,
		PodResourcesSocket: kubernetes.DefaultPodResourcesSocket,
		LogLevel:           defaultLogLevel,
	}
	if *configPath != "" {
		if err := loadKubeletConfigFile(*configPath, &cfg); err != nil {
			return kubeletPluginConfig{}, err
		}
	}
	override := func(name string, apply func()) {
		if set[name] {
			apply()
		}
	}
	override("address", func() { cfg.Address = cf.address })
	override("device-plugin-dir", func() { cfg.DevicePluginDir = *dpDir })
	override("pod-resources-socket", func() { cfg.PodResourcesSocket = *prSocket })
	override("release-grace", func() { cfg.ReleaseGrace = *grace })
	override("pod-resources-interval", func() { cfg.PodResourcesInterval = *interval })
	if set["device-list-strategy"] {
		ds, err := kubernetes.ParseDeviceListStrategy(*strategy)
		if err != nil {
			return kubeletPluginConfig{}, usagef("-device-list-strategy: %v", err)
		}
		cfg.DeviceListStrategy = ds
	}
	override("log-level", func() { cfg.LogLevel = *logLevel })
	override("log-json", func() { cfg.LogJSON = *logJSON })
	override("health-socket", func() { cfg.HealthSocket, cfg.healthSocketSet = *healthSocket, true })
	override("health-stall-timeout", func() { cfg.HealthStallTimeout = *stall })
	override("health-agent-timeout", func() { cfg.HealthAgentTimeout = *agentTimeout })
	cfg.TLS = cf.tls
	switch {
	case set["release-grace"] && *grace < minReleaseGrace:
		return kubeletPluginConfig{}, usagef("-release-grace %v is below the minimum of %v", *grace, minReleaseGrace)
	case set["pod-resources-interval"] && *interval < minPodResourcesInterval:
		return kubeletPluginConfig{}, usagef("-pod-resources-interval %v is below the minimum of %v", *interval, minPodResourcesInterval)
	case set["health-stall-timeout"] && *stall < minHealthTimeout:
		return kubeletPluginConfig{}, usagef("-health-stall-timeout %v is below the minimum of %v", *stall, minHealthTimeout)
	case set["health-agent-timeout"] && *agentTimeout < minHealthTimeout:
		return kubeletPluginConfig{}, usagef("-health-agent-timeout %v is below the minimum of %v", *agentTimeout, minHealthTimeout)
	case cfg.HealthSocket != "" && !filepath.IsAbs(cfg.HealthSocket):
		return kubeletPluginConfig{}, usagef("health socket %q: want an absolute path", cfg.HealthSocket)
	}
	if err := checkLogLevel(cfg.LogLevel); err != nil {
		return kubeletPluginConfig{}, usageError{err.Error()}
	}
	a, err := endpoint.Parse(cfg.Address)
	if err != nil {
		return kubeletPluginConfig{}, usageError{err.Error()}
	}
	if !cfg.healthSocketSet && a.Network == "unix" {
		cfg.HealthSocket = filepath.Join(filepath.Dir(a.Path), kubeletHealthSocketName)
	}
	return cfg, nil
}

// kubeletFileSchema is the kubelet-plugin's config file: one kubernetes block.
type kubeletFileSchema struct {
	Kubernetes []kubernetesSchema `hcl:"kubernetes,block"`
}

type kubernetesSchema struct {
	Address              *hcl.Attribute   `hcl:"address,optional"`
	DevicePluginDir      *hcl.Attribute   `hcl:"device_plugin_dir,optional"`
	PodResourcesSocket   *hcl.Attribute   `hcl:"pod_resources_socket,optional"`
	ReleaseGrace         *hcl.Attribute   `hcl:"release_grace,optional"`
	PodResourcesInterval *hcl.Attribute   `hcl:"pod_resources_interval,optional"`
	DeviceListStrategy   *hcl.Attribute   `hcl:"device_list_strategy,optional"`
	HealthSocket         *hcl.Attribute   `hcl:"health_socket,optional"`
	HealthStallTimeout   *hcl.Attribute   `hcl:"health_stall_timeout,optional"`
	HealthAgentTimeout   *hcl.Attribute   `hcl:"health_agent_timeout,optional"`
	Resources            []resourceSchema `hcl:"resource,block"`
	DefRange             hcl.Range        `hcl:",def_range"`
}

type resourceSchema struct {
	Name     string         `hcl:"name,label"`
	Vendor   *hcl.Attribute `hcl:"vendor,optional"`
	Type     *hcl.Attribute `hcl:"type,optional"`
	Model    *hcl.Attribute `hcl:"name,optional"`
	DefRange hcl.Range      `hcl:",def_range"`
}

// loadKubeletConfigFile reads the kubelet-plugin's HCL (or HCL JSON, for a .json name)
// config file over cfg. Every problem is reported with the file, line and key.
func loadKubeletConfigFile(path string, cfg *kubeletPluginConfig) error {
	var fs kubeletFileSchema
	diags, err := decodeConfigFile(path, &fs)
	if err != nil {
		return err
	}
	d := decoder{diags: diags}
	for i, k := range fs.Kubernetes {
		if i > 0 {
			d.diags = append(d.diags, &hcl.Diagnostic{
				Severity: hcl.DiagError,
				Summary:  "Duplicate kubernetes block",
				Detail:   fmt.Sprintf("the kubernetes block is already at line %d; write one.", fs.Kubernetes[0].DefRange.Start.Line),
				Subject:  k.DefRange.Ptr(),
			})
			continue
		}
		d.address(k.Address, false, &cfg.Address)
		d.str(k.DevicePluginDir, &cfg.DevicePluginDir)
		d.str(k.PodResourcesSocket, &cfg.PodResourcesSocket)
		d.duration(k.ReleaseGrace, minReleaseGrace, &cfg.ReleaseGrace)
		d.duration(k.PodResourcesInterval, minPodResourcesInterval, &cfg.PodResourcesInterval)
		if k.HealthSocket != nil {
			d.str(k.HealthSocket, &cfg.HealthSocket)
			cfg.healthSocketSet = true
		}
		d.duration(k.HealthStallTimeout, minHealthTimeout, &cfg.HealthStallTimeout)
		d.duration(k.HealthAgentTimeout, minHealthTimeout, &cfg.HealthAgentTimeout)
		if a := k.DeviceListStrategy; a != nil {
			var s string
			before := len(d.diags)
			d.str(a, &s)
			if len(d.diags) == before {
				if ds, err := kubernetes.ParseDeviceListStrategy(s); err != nil {
					d.fail(a, "Invalid value", err.Error())
				} else {
					cfg.DeviceListStrategy = ds
				}
			}
		}
		for _, rs := range k.Resources {
			if err := kubernetes.ValidateResourceName(rs.Name); err != nil {
				d.diags = append(d.diags, &hcl.Diagnostic{
					Severity: hcl.DiagError,
					Summary:  "Invalid resource name",
					Detail:   err.Error() + ".",
					Subject:  rs.DefRange.Ptr(),
				})
				continue
			}
			r := kubernetes.Resource{Name: rs.Name}
			d.required(rs.DefRange, "vendor", rs.Vendor, &r.Vendor)
			d.required(rs.DefRange, "type", rs.Type, &r.Type)
			if rs.Model != nil {
				d.str(rs.Model, &r.Model)
			}
			cfg.Resources = append(cfg.Resources, r)
		}
		if !d.diags.HasErrors() {
			if err := kubernetes.ValidateResources(cfg.Resources); err != nil {
				d.diags = append(d.diags, &hcl.Diagnostic{
					Severity: hcl.DiagError,
					Summary:  "Invalid resources",
					Detail:   strings.ReplaceAll(err.Error(), "\n", "; ") + ".",
					Subject:  k.DefRange.Ptr(),
				})
			}
		}
	}
	if d.diags.HasErrors() {
		return diagError(path, d.diags)
	}
	return nil
}

// required decodes the string attribute key of the block at block, which must be set
// and not empty.
func (d *decoder) required(block hcl.Range, key string, a *hcl.Attribute, out *string) {
	if a == nil {
		d.diags = append(d.diags, &hcl.Diagnostic{
			Severity: hcl.DiagError,
			Summary:  "Missing required argument",
			Detail:   fmt.Sprintf("The argument %q is required.", key),
			Subject:  block.Ptr(),
		})
		return
	}
	var s string
	before := len(d.diags)
	d.str(a, &s)
	if s == "" && len(d.diags) == before {
		d.fail(a, "Invalid value", "must not be empty")
		return
	}
	*out = s
}
