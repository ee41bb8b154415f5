// Command standin is the real-node suite's stand-in for NVIDIA's device plugin: it
// registers a resource (nvidia.com/gpu) with the kubelet, lists the device IDs it is
// given as healthy, and answers Allocate with NVIDIA_VISIBLE_DEVICES, as NVIDIA's plugin
// does with its default (uuid) device ID strategy. It keeps no ledger: what it handed
// out only the kubelet knows, which is what a node moving to devicehost starts from.
//
//	standin -dir /var/lib/kubelet/device-plugins -resource nvidia.com/gpu -ids GPU-a,GPU-b
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	dpapi.UnimplementedDevicePluginServer
	ids  []string
	stop <-chan struct{}
}

func (p *plugin) GetDevicePluginOptions(context.Context, *dpapi.Empty) (*dpapi.DevicePluginOptions, error) {
	return &dpapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *dpapi.Empty, s dpapi.DevicePlugin_ListAndWatchServer) error {
	var devs []*dpapi.Device
	for _, id := range p.ids {
		devs = append(devs, &dpapi.Device{ID: id, Health: dpapi.Healthy})
	}
	if err := s.Send(&dpapi.ListAndWatchResponse{Devices: devs}); err != nil {
		return err
	}
	select {
	case <-s.Context().Done():
	case <-p.stop:
	}
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *dpapi.AllocateRequest) (*dpapi.AllocateResponse, error) {
	out := &dpapi.AllocateResponse{}
	for _, c := range req.GetContainerRequests() {
		out.ContainerResponses = append(out.ContainerResponses, &dpapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.GetDevicesIds(), ",")},
		})
	}
	return out, nil
}

func (p *plugin) PreStartContainer(context.Context, *dpapi.PreStartContainerRequest) (*dpapi.PreStartContainerResponse, error) {
	return &dpapi.PreStartContainerResponse{}, nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "standin:", err)
		os.Exit(1)
	}
}

func run() error {
	dir := flag.String("dir", "/var/lib/kubelet/device-plugins", "the kubelet's device-plugins directory")
	resource := flag.String("resource", "nvidia.com/gpu", "the resource to register")
	ids := flag.String("ids", "", "comma-separated device IDs")
	flag.Parse()
	if *ids == "" {
		return errors.New("-ids is required")
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	sock := filepath.Join(*dir, "standin-"+strings.ReplaceAll(*resource, "/", "_")+".sock")
	os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	defer os.Remove(sock)
	srv := grpc.NewServer()
	dpapi.RegisterDevicePluginServer(srv, &plugin{ids: strings.Split(*ids, ","), stop: ctx.Done()})
	go srv.Serve(lis)
	defer srv.Stop()

	conn, err := grpc.NewClient("unix://"+filepath.Join(*dir, "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
	defer rcancel()
	if _, err := dpapi.NewRegistrationClient(conn).Register(rctx, &dpapi.RegisterRequest{
		Version: dpapi.Version, Endpoint: filepath.Base(sock), ResourceName: *resource,
	}); err != nil {
		return fmt.Errorf("register %s: %w", *resource, err)
	}
	fmt.Printf("registered %s with %d devices at %s\n", *resource, len(strings.Split(*ids, ",")), sock)
	<-ctx.Done()
	return nil
}
