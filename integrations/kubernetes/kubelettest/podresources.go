package kubelettest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	prapi "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// PodResources is the stand-in of the kubelet's PodResources API: List answers the
// pods the test set. Its methods are safe for concurrent use.
type PodResources struct {
	socket string
	srv    *grpc.Server
	served chan struct{}

	mu      sync.Mutex
	pods    []*prapi.PodResources
	failing error       // List fails with it while set
	lists   []time.Time // when each List call was answered
	changed chan struct{}
}

// StartPodResources serves the PodResources API on socket.
func StartPodResources(socket string) (*PodResources, error) {
	lis, err := netListenUnix(socket)
	if err != nil {
		return nil, err
	}
	p := &PodResources{socket: socket, srv: grpc.NewServer(), served: make(chan struct{}), changed: make(chan struct{})}
	prapi.RegisterPodResourcesListerServer(p.srv, &lister{p: p})
	go func() {
		defer close(p.served)
		p.srv.Serve(lis)
	}()
	return p, nil
}

// Close stops the server and removes its socket.
func (p *PodResources) Close() {
	p.srv.Stop()
	<-p.served
	os.Remove(p.socket)
}

// SetPods sets what List answers from now on.
func (p *PodResources) SetPods(pods ...*prapi.PodResources) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pods = pods
}

// SetFailing makes List fail with err (UNAVAILABLE) while err is not nil, as a
// restarting kubelet's would.
func (p *PodResources) SetFailing(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failing = err
}

// Lists returns how many List calls were answered (successfully or not).
func (p *PodResources) Lists() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.lists)
}

// WaitLists waits until at least n List calls were answered. A plugin that lists
// PodResources and then acts on the answer before it lists again has finished acting
// on answer n-1 once call n arrived.
func (p *PodResources) WaitLists(ctx context.Context, n int) error {
	_, err := p.waitList(ctx, func(i int, _ time.Time) bool { return i+1 >= n })
	return err
}

// WaitListAfter waits for a List call answered at or after t and returns its number
// (the first call is 1).
func (p *PodResources) WaitListAfter(ctx context.Context, t time.Time) (int, error) {
	return p.waitList(ctx, func(_ int, at time.Time) bool { return !at.Before(t) })
}

// waitList waits until the i-th call (from 0), answered at at, satisfies ok, and
// returns i+1.
func (p *PodResources) waitList(ctx context.Context, ok func(i int, at time.Time) bool) (int, error) {
	for {
		p.mu.Lock()
		lists, ch := p.lists, p.changed
		p.mu.Unlock()
		for i, at := range lists {
			if ok(i, at) {
				return i + 1, nil
			}
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return 0, fmt.Errorf("waiting for a PodResources List call (have %d): %w", len(lists), ctx.Err())
		}
	}
}

// Pod is a pod with one container holding devices of one resource.
func Pod(namespace, name, container, resource string, deviceIDs ...string) *prapi.PodResources {
	return &prapi.PodResources{
		Namespace: namespace,
		Name:      name,
		Containers: []*prapi.ContainerResources{{
			Name:    container,
			Devices: []*prapi.ContainerDevices{{ResourceName: resource, DeviceIds: deviceIDs}},
		}},
	}
}

type lister struct {
	prapi.UnimplementedPodResourcesListerServer
	p *PodResources
}

// List answers the pods set, counting the call.
func (l *lister) List(context.Context, *prapi.ListPodResourcesRequest) (*prapi.ListPodResourcesResponse, error) {
	p := l.p
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lists = append(p.lists, time.Now())
	close(p.changed)
	p.changed = make(chan struct{})
	if p.failing != nil {
		return nil, status.Error(codes.Unavailable, p.failing.Error())
	}
	resp := &prapi.ListPodResourcesResponse{}
	for _, pod := range p.pods {
		resp.PodResources = append(resp.PodResources, proto.Clone(pod).(*prapi.PodResources))
	}
	return resp, nil
}

// netListenUnix binds a Unix socket at path, removing a file left there first.
func netListenUnix(path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	return net.Listen("unix", path)
}
