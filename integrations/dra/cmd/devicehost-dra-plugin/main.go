// Command devicehost-dra-plugin is devicehost's Kubernetes DRA driver: a client of the
// devicehost agent on the node that publishes its devices as ResourceSlices and serves
// the kubelet's NodePrepareResources and NodeUnprepareResources calls.
//
//	devicehost-dra-plugin -address unix:///run/devicehost/devicehost.sock \
//	    -kubeconfig FILE -node-name NODE
//
// In a pod: no -kubeconfig (in-cluster config) and NODE_NAME from the downward API.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/flowcontrol"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/dra"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "devicehost-dra-plugin:", err)
		os.Exit(1)
	}
}

// settings are the command's flags.
type settings struct {
	address, kubeconfig, nodeName, driverName string
	pluginDir, registryDir, cdiDir            string
	staleGrace, staleInterval                 time.Duration
	logLevel                                  string
	logJSON                                   bool
	healthSocket                              string
	healthStall, healthAgent                  time.Duration
	kubeQPS                                   float64
	kubeBurst                                 int
}

// newFlags returns the command's flag set, filling s.
func newFlags(s *settings) *flag.FlagSet {
	fs := flag.NewFlagSet("devicehost-dra-plugin", flag.ContinueOnError)
	fs.StringVar(&s.address, "address", "unix:///run/devicehost/devicehost.sock", "the devicehost agent's `address` (unix:///path.sock or tcp://host:port)")
	fs.StringVar(&s.kubeconfig, "kubeconfig", "", "kubeconfig `file` (default: in-cluster config)")
	fs.StringVar(&s.nodeName, "node-name", os.Getenv("NODE_NAME"), "this node's `name` (default $NODE_NAME)")
	fs.StringVar(&s.driverName, "driver-name", dra.DefaultDriverName, "DRA driver `name`")
	fs.StringVar(&s.pluginDir, "plugin-dir", "", "`dir`ectory of the DRA socket (default "+filepath.Join(kubeletplugin.KubeletPluginsDir, "<driver-name>")+")")
	fs.StringVar(&s.registryDir, "registry-dir", dra.DefaultRegistryDir, "the kubelet's plugin registration `dir`ectory")
	fs.StringVar(&s.cdiDir, "cdi-dir", dra.DefaultCDIDir, "`dir`ectory for the per-claim CDI specs")
	fs.DurationVar(&s.staleGrace, "stale-grace", dra.DefaultStaleGrace, "how long a claim must be gone from the API server before its reservations are released")
	fs.DurationVar(&s.staleInterval, "stale-interval", dra.DefaultStaleInterval, "how often reservations of claims are checked against the API server")
	fs.StringVar(&s.logLevel, "log-level", "info", "log `level`: trace, debug, info, warn, error")
	fs.BoolVar(&s.logJSON, "log-json", false, "log in JSON")
	fs.StringVar(&s.healthSocket, "health-socket", "", "grpc.health.v1 socket `path` for a liveness probe (default <plugin-dir>/"+dra.HealthSocketName+`; "" for none)`)
	fs.DurationVar(&s.healthStall, "health-stall-timeout", dra.DefaultHealthStallTimeout, "health NOT_SERVING once the agent watch has made no progress this long (at least 1s)")
	fs.DurationVar(&s.healthAgent, "health-agent-timeout", dra.DefaultHealthAgentTimeout, "health NOT_SERVING once the agent has been unreachable this long (at least 1s)")
	fs.Float64Var(&s.kubeQPS, "kube-api-qps", defaultKubeQPS, "requests a second the driver makes to the API server at most, over time (slice writes, claim status writes, lists)")
	fs.IntVar(&s.kubeBurst, "kube-api-burst", defaultKubeBurst, "requests the driver may make to the API server at once, above -kube-api-qps")
	return fs
}

// The API server rate limit's defaults: client-go's own, and those of the NVIDIA DRA
// driver.
const (
	defaultKubeQPS   = 5
	defaultKubeBurst = 10
)

// minHealthTimeout is the least -health-stall-timeout and -health-agent-timeout may be.
const minHealthTimeout = time.Second

// finish checks the flags and fills the defaults that depend on others (set: the
// flags given).
func (s *settings) finish(set map[string]bool) error {
	var errs []error
	if s.nodeName == "" {
		errs = append(errs, errors.New("-node-name (or NODE_NAME) is required"))
	}
	if s.healthStall < minHealthTimeout {
		errs = append(errs, fmt.Errorf("-health-stall-timeout %v is below the minimum of %v", s.healthStall, minHealthTimeout))
	}
	if s.healthAgent < minHealthTimeout {
		errs = append(errs, fmt.Errorf("-health-agent-timeout %v is below the minimum of %v", s.healthAgent, minHealthTimeout))
	}
	if !(s.kubeQPS > 0) || s.kubeQPS > math.MaxFloat32 {
		errs = append(errs, fmt.Errorf("-kube-api-qps %v: want a number of requests a second above 0", s.kubeQPS))
	}
	if s.kubeBurst < 1 {
		errs = append(errs, fmt.Errorf("-kube-api-burst %d: want 1 or more", s.kubeBurst))
	}
	if s.pluginDir == "" {
		s.pluginDir = filepath.Join(kubeletplugin.KubeletPluginsDir, s.driverName)
	}
	if !set["health-socket"] {
		s.healthSocket = filepath.Join(s.pluginDir, dra.HealthSocketName)
	} else if s.healthSocket != "" && !filepath.IsAbs(s.healthSocket) {
		errs = append(errs, fmt.Errorf("-health-socket %q: want an absolute path", s.healthSocket))
	}
	return errors.Join(errs...)
}

// restConfig is the API server client's configuration: from -kubeconfig or in the
// cluster, as protobuf, at the -kube-api-qps and -kube-api-burst pace.
func (s *settings) restConfig() (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if s.kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", s.kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client config: %w", err)
	}
	// Protobuf, as the kubelet and the controllers talk to the API server: a GPU's
	// ResourceSlice with its MIG partitions and counters costs a fraction of JSON's CPU
	// to encode on each change the driver publishes, and to decode in the answer and in
	// the informer's event of that same write.
	cfg.ContentType = runtime.ContentTypeProtobuf
	cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	// One limiter for every client made from cfg (the typed one, whose REST client
	// writes the slices, and the metadata one), so that the flags bound the driver's
	// requests as a whole.
	cfg.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(float32(s.kubeQPS), s.kubeBurst)
	return cfg, nil
}

func run(args []string) error {
	var st settings
	fs := newFlags(&st)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if err := st.finish(set); err != nil {
		return err
	}
	log := hclog.New(&hclog.LoggerOptions{Name: "dra", Level: hclog.LevelFromString(st.logLevel), JSONFormat: st.logJSON})

	cfg, err := st.restConfig()
	if err != nil {
		return err
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	meta, err := metadata.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("kubernetes metadata client: %w", err)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	// The agent may start after the driver (another container of the pod): no reach
	// check; the watch reconnects, and the devices are tainted until it answers. At
	// least once a second (a retry is a dial of a local socket): with the clients'
	// default of 5 s, the pool of the real node's MIG case was published 6.2-6.3 s after
	// the agent's restart in 3 runs of 7 (the retries 3.1 and 6.3 s after the
	// disconnect), 3.0-3.2 s in the others; with 1 s, 3.0-3.2 s in 4 of 4.
	agent, err := client.Dial(ctx, st.address, client.WithoutReachCheck(), client.WithBackoff(100*time.Millisecond, time.Second))
	if err != nil {
		return err
	}
	defer agent.Close()
	d, err := dra.New(dra.Config{
		Agent:              agent,
		Kube:               kube,
		Meta:               meta,
		NodeName:           st.nodeName,
		DriverName:         st.driverName,
		PluginDir:          st.pluginDir,
		RegistryDir:        st.registryDir,
		CDIDir:             st.cdiDir,
		StaleGrace:         st.staleGrace,
		StaleInterval:      st.staleInterval,
		Logger:             log,
		HealthSocket:       st.healthSocket,
		HealthStallTimeout: st.healthStall,
		HealthAgentTimeout: st.healthAgent,
	})
	if err != nil {
		return err
	}
	return d.Run(ctx)
}
