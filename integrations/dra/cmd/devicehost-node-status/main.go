// Command devicehost-node-status tells the cluster what the devicehost agent on its node
// serves: node labels in the names and formats of NVIDIA's GPU Feature Discovery (and
// devicehost.io/ ones for other devices), and the DevicehostDevicesHealthy node condition,
// written with server-side apply as the field manager devicehost-node-status.
//
//	devicehost-node-status -address unix:///run/devicehost/devicehost.sock -node-name NODE
//	devicehost-node-status -remove-all     # an uninstall: take them off every node
//
// In a pod: no -kubeconfig (in-cluster config) and NODE_NAME from the downward API.
// See docs/kubernetes.md, "Node labels and condition".
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/dra/nodestatus"
	"github.com/devicehost/devicehost/integrations/liveness"
	"github.com/devicehost/devicehost/textline"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "devicehost-node-status:", err)
		os.Exit(1)
	}
}

// settings are the command's flags.
type settings struct {
	address, kubeconfig, nodeName, machineFile string
	resync, unreachable                        time.Duration
	removeAll                                  bool
	healthSocket                               string
	logLevel                                   string
	logJSON                                    bool
}

func newFlags(s *settings) *flag.FlagSet {
	fs := flag.NewFlagSet("devicehost-node-status", flag.ContinueOnError)
	fs.StringVar(&s.address, "address", "unix:///run/devicehost/devicehost.sock", "the devicehost agent's `address` (unix:///path.sock or tcp://host:port)")
	fs.StringVar(&s.kubeconfig, "kubeconfig", "", "kubeconfig `file` (default: in-cluster config)")
	fs.StringVar(&s.nodeName, "node-name", os.Getenv("NODE_NAME"), "this node's `name` (default $NODE_NAME)")
	fs.StringVar(&s.machineFile, "machine-file", "/sys/class/dmi/id/product_name", "`file` holding the machine type for nvidia.com/gpu.machine (\"\" for none)")
	fs.DurationVar(&s.resync, "resync", 5*time.Minute, "how often the node is written again though nothing changed")
	fs.DurationVar(&s.unreachable, "unreachable-after", 30*time.Second, "how long the agent may be unreachable before the condition turns Unknown")
	fs.StringVar(&s.healthSocket, "health-socket", "", "grpc.health.v1 socket `path` for a liveness probe: NOT_SERVING while a write to the API server has been stuck for a minute or the agent unreachable for 3 (\"\" for none)")
	fs.BoolVar(&s.removeAll, "remove-all", false, "remove the labels and condition this command wrote from every node, and exit (an uninstall)")
	fs.StringVar(&s.logLevel, "log-level", "info", "log `level`: trace, debug, info, warn, error")
	fs.BoolVar(&s.logJSON, "log-json", false, "log in JSON")
	return fs
}

func run(ctx context.Context, args []string) error {
	var s settings
	fs := newFlags(&s)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if !s.removeAll && s.nodeName == "" {
		return errors.New("-node-name (or NODE_NAME) is required")
	}
	if s.resync < time.Second || s.unreachable < time.Second {
		return fmt.Errorf("-resync %v and -unreachable-after %v must each be at least 1s", s.resync, s.unreachable)
	}
	level := hclog.LevelFromString(s.logLevel)
	if level == hclog.NoLevel {
		return fmt.Errorf("-log-level %q: want trace, debug, info, warn or error", s.logLevel)
	}
	log := hclog.New(&hclog.LoggerOptions{Name: "devicehost-node-status", Level: level, JSONFormat: s.logJSON, Output: os.Stderr})
	var cfg *rest.Config
	var err error
	if s.kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", s.kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return fmt.Errorf("kubernetes client config: %w", err)
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	if s.removeAll {
		nodes, err := nodestatus.RemoveAll(ctx, kube, log)
		log.Info("removed the node labels and condition", "nodes", strings.Join(nodes, ","))
		return err
	}
	c, err := client.Dial(ctx, s.address, client.WithoutReachCheck())
	if err != nil {
		return err
	}
	defer c.Close()
	p := &nodestatus.Publisher{Kube: kube, Node: s.nodeName, Log: log}
	rc := nodestatus.RunConfig{Machine: readMachine(s.machineFile), Resync: s.resync, Unreachable: s.unreachable, Retry: 5 * time.Second}
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if s.healthSocket != "" {
		m, err := liveness.New(liveness.Config{Logger: log.Named("liveness")})
		if err != nil {
			return err
		}
		lis, err := liveness.Listen(s.healthSocket)
		if err != nil {
			return err
		}
		rc.Tokens, rc.Agent = m.Loop("node status"), m.Agent
		wg.Go(func() { m.Run(ctx) })
		wg.Go(func() {
			if err := m.Serve(ctx, lis); err != nil {
				log.Error("health socket stopped", "error", err)
			}
		})
	}
	log.Info("publishing node status", "node", s.nodeName, "agent", s.address, "condition", nodestatus.ConditionType)
	return nodestatus.Run(ctx, c, p, rc)
}

// readMachine is the machine type in file, one line at most 256 bytes; "" when there is
// none to read (a VM without DMI, a container without /sys).
func readMachine(file string) string {
	if file == "" {
		return ""
	}
	f, err := os.Open(file)
	if err != nil {
		return ""
	}
	defer f.Close()
	buf := make([]byte, 256)
	n, _ := f.Read(buf)
	return textline.Line(strings.TrimSpace(string(buf[:n])), 256)
}
