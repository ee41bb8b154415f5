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

func run(args []string) error {
	fs := flag.NewFlagSet("devicehost-dra-plugin", flag.ContinueOnError)
	address := fs.String("address", "unix:///run/devicehost/devicehost.sock", "the devicehost agent's `address` (unix:///path.sock or tcp://host:port)")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig `file` (default: in-cluster config)")
	nodeName := fs.String("node-name", os.Getenv("NODE_NAME"), "this node's `name` (default $NODE_NAME)")
	driverName := fs.String("driver-name", dra.DefaultDriverName, "DRA driver `name`")
	pluginDir := fs.String("plugin-dir", "", "`dir`ectory of the DRA socket (default "+filepath.Join(kubeletplugin.KubeletPluginsDir, "<driver-name>")+")")
	registryDir := fs.String("registry-dir", dra.DefaultRegistryDir, "the kubelet's plugin registration `dir`ectory")
	cdiDir := fs.String("cdi-dir", dra.DefaultCDIDir, "`dir`ectory for the per-claim CDI specs")
	staleGrace := fs.Duration("stale-grace", dra.DefaultStaleGrace, "how long a claim must be gone from the API server before its reservations are released")
	staleInterval := fs.Duration("stale-interval", dra.DefaultStaleInterval, "how often reservations of claims are checked against the API server")
	logLevel := fs.String("log-level", "info", "log `level`: trace, debug, info, warn, error")
	logJSON := fs.Bool("log-json", false, "log in JSON")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	if *nodeName == "" {
		return errors.New("-node-name (or NODE_NAME) is required")
	}
	log := hclog.New(&hclog.LoggerOptions{Name: "dra", Level: hclog.LevelFromString(*logLevel), JSONFormat: *logJSON})

	var cfg *rest.Config
	var err error
	if *kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", *kubeconfig)
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
	agent, err := client.Dial(ctx, *address, client.WithoutReachCheck(), client.WithBackoff(100*time.Millisecond, 5*time.Second))
	if err != nil {
		return err
	}
	defer agent.Close()
	d, err := dra.New(dra.Config{
		Agent:         agent,
		Kube:          kube,
		NodeName:      *nodeName,
		DriverName:    *driverName,
		PluginDir:     *pluginDir,
		RegistryDir:   *registryDir,
		CDIDir:        *cdiDir,
		StaleGrace:    *staleGrace,
		StaleInterval: *staleInterval,
		Logger:        log,
	})
	if err != nil {
		return err
	}
	return d.Run(ctx)
}
