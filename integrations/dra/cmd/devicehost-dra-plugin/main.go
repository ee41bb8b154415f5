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
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
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
	return fs
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
	if st.nodeName == "" {
		return errors.New("-node-name (or NODE_NAME) is required")
	}
	log := hclog.New(&hclog.LoggerOptions{Name: "dra", Level: hclog.LevelFromString(st.logLevel), JSONFormat: st.logJSON})

	var cfg *rest.Config
	var err error
	if st.kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", st.kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return fmt.Errorf("kubernetes client config: %w", err)
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	// The agent may start after the driver (another container of the pod): no reach
	// check; the watch reconnects, and the devices are tainted until it answers.
	agent, err := client.Dial(ctx, st.address, client.WithoutReachCheck(), client.WithBackoff(100*time.Millisecond, 5*time.Second))
	if err != nil {
		return err
	}
	defer agent.Close()
	d, err := dra.New(dra.Config{
		Agent:         agent,
		Kube:          kube,
		NodeName:      st.nodeName,
		DriverName:    st.driverName,
		PluginDir:     st.pluginDir,
		RegistryDir:   st.registryDir,
		CDIDir:        st.cdiDir,
		StaleGrace:    st.staleGrace,
		StaleInterval: st.staleInterval,
		Logger:        log,
	})
	if err != nil {
		return err
	}
	return d.Run(ctx)
}
