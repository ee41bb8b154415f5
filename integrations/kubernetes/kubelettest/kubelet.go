// Package kubelettest provides stand-ins for the kubelet's side of the device-plugin
// API, for tests of device plugins: a Kubelet that serves the Registration service on
// kubelet.sock in a device-plugins directory and, as the kubelet does, connects back to
// each plugin that registers and runs ListAndWatch on it, recording every update; and
// a PodResources server whose pods the test sets. Both speak real gRPC over Unix
// sockets.
package kubelettest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// SocketName is the kubelet's registration socket in the device-plugins directory.
const SocketName = "kubelet.sock"

// Registration is one RegisterRequest the Kubelet accepted.
type Registration struct {
	Request *dpapi.RegisterRequest
	// At is when the request arrived.
	At time.Time
}

// Update is one ListAndWatch message a plugin sent.
type Update struct {
	Devices []*dpapi.Device
	// At is when it arrived.
	At time.Time
}

// Kubelet is the stand-in kubelet. Its methods are safe for concurrent use; Close
// stops it and everything it started.
type Kubelet struct {
	dir string

	mu       sync.Mutex
	srv      *grpc.Server
	served   chan struct{} // closed when srv's Serve returned
	regs     []Registration
	refused  []Registration     // registrations refused as already connected
	plugins  map[string]*plugin // by resource: the latest registered endpoint
	changed  chan struct{}      // closed and replaced on every registration and update
	sockMade time.Time          // when the current kubelet.sock was bound
	streams  sync.WaitGroup     // ListAndWatch readers
	closed   bool
}

// plugin is a registered endpoint the Kubelet is connected to.
type plugin struct {
	endpoint string
	conn     *grpc.ClientConn
	client   dpapi.DevicePluginClient
	cancel   context.CancelFunc
	updates  []Update
	ended    error // why its ListAndWatch ended; nil while it runs
}

// Start serves the Registration service on dir/kubelet.sock. dir must exist; its
// path must be short enough for Unix socket names (about 100 bytes with the file).
func Start(dir string) (*Kubelet, error) {
	k := &Kubelet{dir: dir, plugins: map[string]*plugin{}, changed: make(chan struct{})}
	if err := k.listen(); err != nil {
		return nil, err
	}
	return k, nil
}

// Dir is the device-plugins directory.
func (k *Kubelet) Dir() string { return k.dir }

// Socket is the path of the registration socket.
func (k *Kubelet) Socket() string { return filepath.Join(k.dir, SocketName) }

// listen binds kubelet.sock and serves on it.
func (k *Kubelet) listen() error {
	lis, err := netListenUnix(k.Socket())
	if err != nil {
		return err
	}
	srv := grpc.NewServer()
	dpapi.RegisterRegistrationServer(srv, &registration{k: k})
	served := make(chan struct{})
	k.mu.Lock()
	k.srv, k.served, k.sockMade = srv, served, time.Now()
	k.mu.Unlock()
	go func() {
		defer close(served)
		srv.Serve(lis)
	}()
	return nil
}

// Restart does what a kubelet restart does to device plugins: the registration
// server stops and every plugin connection is closed, the device-plugins directory is
// emptied (plugins' sockets removed), and a new kubelet.sock is served. It returns
// when the new socket was bound (SocketCreated says when). Not after Close.
func (k *Kubelet) Restart() error {
	k.stop()
	entries, err := os.ReadDir(k.dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(k.dir, e.Name())); err != nil {
			return err
		}
	}
	return k.listen()
}

// SocketCreated is when the current kubelet.sock was bound.
func (k *Kubelet) SocketCreated() time.Time {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.sockMade
}

// stop stops the registration server and disconnects every plugin.
func (k *Kubelet) stop() {
	k.mu.Lock()
	srv, served := k.srv, k.served
	k.srv = nil
	plugins := k.plugins
	k.plugins = map[string]*plugin{}
	k.mu.Unlock()
	if srv != nil {
		srv.Stop()
		<-served
	}
	for _, p := range plugins {
		p.cancel()
		p.conn.Close()
	}
	k.streams.Wait()
}

// Stop does what a kubelet that goes away does: the registration server stops, its
// socket is removed and every plugin connection is closed. Restart serves again.
func (k *Kubelet) Stop() {
	k.stop()
	os.Remove(k.Socket())
}

// Close stops the Kubelet for good and removes its socket.
func (k *Kubelet) Close() {
	k.mu.Lock()
	k.closed = true
	k.mu.Unlock()
	k.Stop()
}

// notifyLocked wakes the waiters. Called with mu held.
func (k *Kubelet) notifyLocked() {
	close(k.changed)
	k.changed = make(chan struct{})
}

// Refused returns the registrations refused because the Kubelet was still connected
// to the endpoint, oldest first.
func (k *Kubelet) Refused() []Registration {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.refused)
}

// Registrations returns the registrations accepted so far, oldest first.
func (k *Kubelet) Registrations() []Registration {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.regs)
}

// WaitRegistrations waits until resource has registered n times in all and returns
// its registrations.
func (k *Kubelet) WaitRegistrations(ctx context.Context, resource string, n int) ([]Registration, error) {
	var out []Registration
	err := k.wait(ctx, func() bool {
		out = out[:0]
		for _, r := range k.regs {
			if r.Request.GetResourceName() == resource {
				out = append(out, r)
			}
		}
		return len(out) >= n
	})
	if err != nil {
		return nil, fmt.Errorf("waiting for registration %d of %s (have %d): %w", n, resource, len(out), err)
	}
	return out, nil
}

// WaitDevices waits until the newest ListAndWatch update of resource's current
// endpoint satisfies ok, and returns it.
func (k *Kubelet) WaitDevices(ctx context.Context, resource string, ok func([]*dpapi.Device) bool) (Update, error) {
	var got Update
	var have bool
	err := k.wait(ctx, func() bool {
		p := k.plugins[resource]
		if p == nil || len(p.updates) == 0 {
			return false
		}
		got, have = p.updates[len(p.updates)-1], true
		return ok(got.Devices)
	})
	if err != nil {
		if have {
			return Update{}, fmt.Errorf("waiting for devices of %s (last update: %s): %w", resource, Describe(got.Devices), err)
		}
		return Update{}, fmt.Errorf("waiting for devices of %s (no update yet): %w", resource, err)
	}
	return got, nil
}

// Updates returns the ListAndWatch updates of resource's current endpoint.
func (k *Kubelet) Updates(resource string) []Update {
	k.mu.Lock()
	defer k.mu.Unlock()
	if p := k.plugins[resource]; p != nil {
		return slices.Clone(p.updates)
	}
	return nil
}

// wait calls cond with mu held until it is true, waking on every change.
func (k *Kubelet) wait(ctx context.Context, cond func() bool) error {
	for {
		k.mu.Lock()
		done, ch := cond(), k.changed
		k.mu.Unlock()
		if done {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Client returns a client of resource's current endpoint, as the kubelet uses it for
// GetPreferredAllocation and Allocate. It is owned by the Kubelet: do not close it.
func (k *Kubelet) Client(resource string) (dpapi.DevicePluginClient, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	p := k.plugins[resource]
	if p == nil {
		return nil, fmt.Errorf("no plugin registered for %s", resource)
	}
	return p.client, nil
}

// registration is the Kubelet's Registration service.
type registration struct {
	dpapi.UnimplementedRegistrationServer
	k *Kubelet
}

// Register checks the request as the kubelet does (API version, resource name with a
// domain, an endpoint that is a file name in the directory), connects to the plugin's
// socket, asks its options and starts reading its ListAndWatch, then records the
// registration. A second registration of a resource at another endpoint replaces the
// first's connection; at the same endpoint, while the Kubelet is still connected to
// it (its ListAndWatch runs), it is refused, as kubelet 1.37 refuses it ("device
// plugin already connected"), and recorded (Refused).
func (r *registration) Register(ctx context.Context, req *dpapi.RegisterRequest) (*dpapi.Empty, error) {
	k := r.k
	endpoint := filepath.Join(k.dir, req.GetEndpoint())
	k.mu.Lock()
	if old := k.plugins[req.GetResourceName()]; old != nil && old.endpoint == req.GetEndpoint() && old.ended == nil {
		k.refused = append(k.refused, Registration{Request: req, At: time.Now()})
		k.notifyLocked()
		k.mu.Unlock()
		return nil, status.Errorf(codes.Unknown, "device plugin already connected: %s", endpoint)
	}
	k.mu.Unlock()
	switch {
	case req.GetVersion() != dpapi.Version:
		return nil, status.Errorf(codes.InvalidArgument, "version %q is not supported; want %q", req.GetVersion(), dpapi.Version)
	case !strings.Contains(req.GetResourceName(), "/"):
		return nil, status.Errorf(codes.InvalidArgument, "resource name %q is not an extended resource name", req.GetResourceName())
	case req.GetEndpoint() == "" || filepath.Base(req.GetEndpoint()) != req.GetEndpoint():
		return nil, status.Errorf(codes.InvalidArgument, "endpoint %q is not a file name", req.GetEndpoint())
	}
	conn, err := grpc.NewClient("unix://"+endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	client := dpapi.NewDevicePluginClient(conn)
	octx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := client.GetDevicePluginOptions(octx, &dpapi.Empty{}); err != nil {
		conn.Close()
		return nil, status.Errorf(codes.Unavailable, "cannot reach the plugin at %s: %v", req.GetEndpoint(), err)
	}
	sctx, stop := context.WithCancel(context.Background())
	p := &plugin{endpoint: req.GetEndpoint(), conn: conn, client: client, cancel: stop}
	k.mu.Lock()
	if k.closed || k.srv == nil {
		k.mu.Unlock()
		stop()
		conn.Close()
		return nil, status.Error(codes.Unavailable, "kubelet stopping")
	}
	old := k.plugins[req.GetResourceName()]
	k.plugins[req.GetResourceName()] = p
	k.regs = append(k.regs, Registration{Request: req, At: time.Now()})
	k.streams.Add(1)
	k.notifyLocked()
	k.mu.Unlock()
	if old != nil {
		old.cancel()
		old.conn.Close()
	}
	go func() {
		defer k.streams.Done()
		err := k.listAndWatch(sctx, p)
		k.mu.Lock()
		p.ended = err
		k.notifyLocked()
		k.mu.Unlock()
	}()
	return &dpapi.Empty{}, nil
}

// listAndWatch records p's ListAndWatch updates until the stream ends.
func (k *Kubelet) listAndWatch(ctx context.Context, p *plugin) error {
	stream, err := p.client.ListAndWatch(ctx, &dpapi.Empty{})
	if err != nil {
		return err
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return err
		}
		k.mu.Lock()
		p.updates = append(p.updates, Update{Devices: resp.GetDevices(), At: time.Now()})
		k.notifyLocked()
		k.mu.Unlock()
	}
}

// Describe renders devices as "ID:Health[@numa]" items, for messages.
func Describe(devs []*dpapi.Device) string {
	parts := make([]string, len(devs))
	for i, d := range devs {
		parts[i] = d.GetID() + ":" + d.GetHealth()
		for _, n := range d.GetTopology().GetNodes() {
			parts[i] += fmt.Sprintf("@%d", n.GetID())
		}
	}
	return "[" + strings.Join(parts, " ") + "]"
}

// AllHealth returns a condition for WaitDevices: exactly n devices, all with health h
// (dpapi.Healthy or dpapi.Unhealthy).
func AllHealth(n int, h string) func([]*dpapi.Device) bool {
	return func(devs []*dpapi.Device) bool {
		if len(devs) != n {
			return false
		}
		for _, d := range devs {
			if d.GetHealth() != h {
				return false
			}
		}
		return true
	}
}
