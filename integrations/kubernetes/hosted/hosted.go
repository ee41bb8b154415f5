// Package hosted runs the kubelet's device plugins, unmodified, under devicehost: a
// devicehost plugin (deviceplugin.Plugin) that serves the kubelet's side of the
// device-plugin API v1beta1 (Registration on kubelet.sock in a directory of its own),
// connects back to each plugin that registers as the kubelet does, and reports each
// registered resource "DOMAIN/NAME" as a device group of vendor DOMAIN and type NAME,
// its devices' health ListAndWatch's. A Reserve calls the plugin's Allocate (and
// PreStartContainer when the plugin asks for it) and answers what it returned. Every
// answer of a plugin is bounded and every call has a deadline; a plugin whose stream
// ends makes its devices unhealthy at once, with the reason, until it registers again.
// See docs/kubernetes-device-plugins.md.
package hosted

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/integrations/kubernetes"
	"github.com/devicehost/devicehost/internal/suggest"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Name and Version identify the plugin.
const (
	Name    = "kubernetes-device-plugins"
	Version = "0.1.0"
)

// SocketName is the registration socket in the plugins' directory, the kubelet's name
// for it: a plugin given the directory as its plugin directory registers there.
const SocketName = "kubelet.sock"

// Bounds on what a hosted plugin may send and how long it may take.
const (
	// MaxResources is the most resources registered at once.
	MaxResources = 64
	// MaxDevices is the most devices of one resource the plugin reports; the rest of a
	// ListAndWatch update is left out, and said so in the log.
	MaxDevices = 1024
	// MaxMessageBytes bounds one message from a plugin (a ListAndWatch update, an
	// Allocate answer).
	MaxMessageBytes = 4 << 20
	// CallTimeout bounds GetDevicePluginOptions, and Allocate and PreStartContainer
	// beyond the Reserve's own deadline.
	CallTimeout = 30 * time.Second
	// maxEndpointLen bounds an endpoint's file name.
	maxEndpointLen = 100
)

// Config is the plugin's config: the directory of kubelet.sock, which the hosted
// plugins are given as their plugin directory. The agent's
// `kubernetes_device_plugins { dir = "..." }` block writes it.
type Config struct {
	Dir string `json:"dir"`
}

// DefaultDir is the directory when Config.Dir is empty.
const DefaultDir = "/var/lib/devicehost/device-plugins"

// Plugin is the host of the kubelet's device plugins. Make one with New; SetConfig
// starts its registration server, Shutdown stops it and every connection to a plugin.
// Safe for concurrent use.
type Plugin struct {
	logger hclog.Logger

	mu        sync.Mutex
	dir       string
	srv       *grpc.Server
	served    chan struct{} // closed when srv's Serve returned
	resources map[string]*resource
	changed   chan struct{} // closed and replaced on every change of what Fingerprint sends
	streams   sync.WaitGroup
	closed    bool
}

// resource is one registered resource and its plugin.
type resource struct {
	name     string // DOMAIN/NAME
	endpoint string // the socket's file name in the directory
	conn     *grpc.ClientConn
	client   dpapi.DevicePluginClient
	opts     *dpapi.DevicePluginOptions
	cancel   context.CancelFunc // ends its ListAndWatch
	devices  []*dpapi.Device    // the last update, bounded
	// down says why the plugin is not serving ("" while its ListAndWatch runs).
	down string
}

var (
	_ deviceplugin.Plugin        = (*Plugin)(nil)
	_ deviceplugin.ConfigChecker = (*Plugin)(nil)
)

// New returns an unconfigured host that logs to logger (a null logger when nil).
func New(logger hclog.Logger) *Plugin {
	if logger == nil {
		logger = hclog.NewNullLogger()
	}
	return &Plugin{logger: logger, resources: map[string]*resource{}, changed: make(chan struct{})}
}

// Main serves the host to the agent that launched this process.
func Main() {
	p := New(deviceplugin.Logger())
	deviceplugin.Serve(p)
	p.Shutdown()
}

// Info names the plugin.
func (p *Plugin) Info() deviceplugin.Info { return deviceplugin.Info{Name: Name, Version: Version} }

func parseConfig(configJSON []byte) (Config, error) {
	var c Config
	if trimmed := bytes.TrimSpace(configJSON); len(trimmed) > 0 && !bytes.Equal(trimmed, []byte("null")) {
		dec := json.NewDecoder(bytes.NewReader(trimmed))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&c); err != nil {
			return Config{}, fmt.Errorf("config: %w", suggest.UnknownField(err, suggest.JSONKeys(Config{})))
		}
	}
	if c.Dir == "" {
		c.Dir = DefaultDir
	}
	if !filepath.IsAbs(c.Dir) {
		return Config{}, fmt.Errorf("config: dir = %q: want an absolute path", c.Dir)
	}
	c.Dir = filepath.Clean(c.Dir)
	if len(filepath.Join(c.Dir, SocketName)) > 100 {
		return Config{}, fmt.Errorf("config: dir = %q: too long for a Unix socket path", c.Dir)
	}
	return c, nil
}

// CheckConfig says whether SetConfig would accept configJSON, changing nothing.
func (p *Plugin) CheckConfig(_ context.Context, configJSON []byte) error {
	_, err := parseConfig(configJSON)
	return err
}

// SetConfig starts the registration server in the config's directory (again, in the
// new one, when it changed).
func (p *Plugin) SetConfig(_ context.Context, configJSON []byte) error {
	c, err := parseConfig(configJSON)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("shut down")
	}
	if p.srv != nil && p.dir == c.Dir {
		return nil
	}
	p.stopServerLocked()
	if err := os.MkdirAll(c.Dir, 0o750); err != nil {
		return fmt.Errorf("plugins' directory: %w", err)
	}
	// As the kubelet does when it starts: every socket of the directory goes, the
	// plugins' too, so that each plugin (which watches its socket) registers again.
	p.removeSocketsLocked(c.Dir)
	sock := filepath.Join(c.Dir, SocketName)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("registration socket: %w", err)
	}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(64 << 10))
	dpapi.RegisterRegistrationServer(srv, registration{p: p})
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis) // ends with Stop
	}()
	p.dir, p.srv, p.served = c.Dir, srv, served
	p.logger.Info("serving the kubelet's registration for device plugins", "socket", sock)
	return nil
}

// maxDirEntries bounds the entries read from the plugins' directory at start.
const maxDirEntries = 4096

// removeSocketsLocked removes the Unix sockets in dir (at most maxDirEntries entries
// read); other files stay.
func (p *Plugin) removeSocketsLocked(dir string) {
	f, err := os.Open(dir)
	if err != nil {
		return
	}
	entries, _ := f.ReadDir(maxDirEntries)
	f.Close()
	for _, e := range entries {
		if e.Type()&os.ModeSocket == 0 {
			continue
		}
		if err := os.Remove(filepath.Join(dir, e.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
			p.logger.Warn("cannot remove a socket of the plugins' directory", "socket", e.Name(), "error", err)
			continue
		}
		if e.Name() != SocketName {
			p.logger.Info("removed a plugin's socket, as the kubelet does at start, so that its plugin registers again", "socket", e.Name())
		}
	}
}

// stopServerLocked stops the registration server and every plugin's connection.
func (p *Plugin) stopServerLocked() {
	if p.srv == nil {
		return
	}
	p.srv.Stop()
	<-p.served
	_ = os.Remove(filepath.Join(p.dir, SocketName))
	for _, r := range p.resources {
		r.disconnect("the host stopped")
	}
	p.srv = nil
	p.notifyLocked()
}

// Shutdown stops the registration server and every plugin's stream, and waits for
// them. The plugins' sockets are theirs: left as they are.
func (p *Plugin) Shutdown() {
	p.mu.Lock()
	p.closed = true
	p.stopServerLocked()
	p.mu.Unlock()
	p.streams.Wait()
}

func (p *Plugin) notifyLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// disconnect ends r's stream and connection; why says so in its devices' health.
func (r *resource) disconnect(why string) {
	if r.cancel != nil {
		r.cancel()
		r.cancel = nil
	}
	if r.conn != nil {
		_ = r.conn.Close()
		r.conn = nil
	}
	if r.down == "" {
		r.down = why
	}
}

// registration is the Registration service.
type registration struct {
	dpapi.UnimplementedRegistrationServer
	p *Plugin
}

// Register takes a plugin's registration, as the kubelet does: the API version, the
// resource name and the endpoint checked; a resource another endpoint serves is
// refused; then it connects to the plugin and runs its ListAndWatch.
func (s registration) Register(_ context.Context, req *dpapi.RegisterRequest) (*dpapi.Empty, error) {
	p := s.p
	name, endpoint := req.GetResourceName(), req.GetEndpoint()
	switch {
	case req.GetVersion() != dpapi.Version:
		return nil, status.Errorf(codes.InvalidArgument, "version %q: this host speaks %s", req.GetVersion(), dpapi.Version)
	case endpoint == "" || len(endpoint) > maxEndpointLen || strings.ContainsAny(endpoint, "/\x00") || endpoint == "." || endpoint == ".." || endpoint == SocketName:
		return nil, status.Errorf(codes.InvalidArgument, "endpoint %q: want a socket's file name in the plugins' directory", endpoint)
	}
	if err := kubernetes.ValidateResourceName(name); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.srv == nil {
		return nil, status.Error(codes.Unavailable, "the host is stopping")
	}
	old, known := p.resources[name]
	switch {
	case known && old.down == "" && old.endpoint != endpoint:
		return nil, status.Errorf(codes.AlreadyExists, "resource %s is served by the plugin at %s, which is still connected: a second plugin cannot serve it", name, old.endpoint)
	case !known && len(p.resources) >= MaxResources:
		return nil, status.Errorf(codes.ResourceExhausted, "%d resources registered, the most this host takes", MaxResources)
	}
	conn, err := grpc.NewClient("unix://"+filepath.Join(p.dir, endpoint),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxMessageBytes)))
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "endpoint %q: %v", endpoint, err)
	}
	r := &resource{name: name, endpoint: endpoint, conn: conn, client: dpapi.NewDevicePluginClient(conn), opts: req.GetOptions()}
	if known {
		old.disconnect("re-registered")
		r.devices = old.devices // kept, as unhealthy, until the new stream's first update
	}
	r.down = "connecting"
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	p.resources[name] = r
	p.notifyLocked()
	p.streams.Add(1)
	go func() {
		defer p.streams.Done()
		p.watch(ctx, r)
	}()
	p.logger.Info("device plugin registered", "resource", name, "endpoint", endpoint)
	return &dpapi.Empty{}, nil
}

// watch runs r's ListAndWatch until it ends or ctx does, taking each update, and marks
// r down with the reason when it ends.
func (p *Plugin) watch(ctx context.Context, r *resource) {
	why := p.listAndWatch(ctx, r)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.resources[r.name] != r {
		return // replaced by a new registration
	}
	if r.down == "" || r.down == "connecting" {
		r.down = why
	}
	p.logger.Warn("device plugin disconnected: its devices are unhealthy until it registers again", "resource", r.name, "why", why)
	p.notifyLocked()
}

func (p *Plugin) listAndWatch(ctx context.Context, r *resource) string {
	p.mu.Lock()
	client := r.client
	p.mu.Unlock()
	if client == nil {
		return "the host stopped"
	}
	octx, cancel := context.WithTimeout(ctx, CallTimeout)
	opts, err := client.GetDevicePluginOptions(octx, &dpapi.Empty{})
	cancel()
	if err != nil {
		return fmt.Sprintf("GetDevicePluginOptions: %v", err)
	}
	stream, err := client.ListAndWatch(ctx, &dpapi.Empty{})
	if err != nil {
		return fmt.Sprintf("ListAndWatch: %v", err)
	}
	p.mu.Lock()
	r.opts = opts
	p.mu.Unlock()
	for {
		resp, err := stream.Recv()
		if err != nil {
			return fmt.Sprintf("ListAndWatch ended: %v", err)
		}
		devs := resp.GetDevices()
		if len(devs) > MaxDevices {
			p.logger.Warn("device plugin reports more devices than the host takes; the rest are left out", "resource", r.name, "devices", len(devs), "max", MaxDevices)
			devs = devs[:MaxDevices]
		}
		p.mu.Lock()
		if p.resources[r.name] != r {
			p.mu.Unlock()
			return "re-registered"
		}
		r.devices, r.down = devs, ""
		p.notifyLocked()
		p.mu.Unlock()
	}
}

// Fingerprint sends the inventory now and on every change: a group per registered
// resource, its devices as the plugin's last update has them, unhealthy with the
// reason while the plugin is not connected.
func (p *Plugin) Fingerprint(ctx context.Context, send func(*pb.FingerprintResponse) error) error {
	var last *pb.FingerprintResponse
	for {
		p.mu.Lock()
		resp := p.inventoryLocked()
		changed := p.changed
		p.mu.Unlock()
		if last == nil || !proto.Equal(last, resp) {
			if err := send(resp); err != nil {
				return err
			}
			last = resp
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}

// inventoryLocked is the inventory: a group per resource in name order. A device ID
// another resource reports first is left out (device IDs are the host's, one device
// each), and said so in the log.
func (p *Plugin) inventoryLocked() *pb.FingerprintResponse {
	resp := &pb.FingerprintResponse{}
	seen := map[string]string{}
	for _, name := range slices.Sorted(maps.Keys(p.resources)) {
		r := p.resources[name]
		domain, short, _ := strings.Cut(name, "/")
		g := &pb.DeviceGroup{Vendor: domain, Type: short, Name: short,
			Attributes: map[string]*pb.Value{"resource": {Kind: &pb.Value_StringValue{StringValue: name}}}}
		for _, d := range r.devices {
			if other, dup := seen[d.GetID()]; dup {
				p.logger.Warn("device ID reported by two resources; the second is left out", "device", d.GetID(), "first", other, "second", name)
				continue
			}
			seen[d.GetID()] = name
			dev := &pb.Device{Id: d.GetID(), Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{NumaNode: -1}}
			if nodes := d.GetTopology().GetNodes(); len(nodes) > 0 && nodes[0].GetID() >= 0 && nodes[0].GetID() < 1<<16 {
				dev.Locality.NumaNode = int32(nodes[0].GetID())
			}
			switch {
			case r.down != "":
				dev.Health, dev.HealthReason = pb.Health_HEALTH_UNHEALTHY, "device plugin "+r.endpoint+" not connected: "+r.down
			case d.GetHealth() != dpapi.Healthy:
				dev.Health, dev.HealthReason = pb.Health_HEALTH_UNHEALTHY, "the device plugin reports it "+d.GetHealth()
			}
			g.Devices = append(g.Devices, dev)
		}
		resp.Groups = append(resp.Groups, g)
	}
	return resp
}

// Reserve calls the owning plugin's Allocate for ids (and PreStartContainer when it
// asked for it) and answers what Allocate returned.
func (p *Plugin) Reserve(ctx context.Context, ids []string) (*pb.ContainerReservation, error) {
	p.mu.Lock()
	var r *resource
	for _, res := range p.resources {
		if slices.ContainsFunc(res.devices, func(d *dpapi.Device) bool { return slices.Contains(ids, d.GetID()) }) {
			if r != nil && r != res {
				p.mu.Unlock()
				return nil, status.Errorf(codes.InvalidArgument, "devices %q are of two resources, %s and %s", ids, r.name, res.name)
			}
			r = res
		}
	}
	var client dpapi.DevicePluginClient
	var preStart bool
	var down string
	if r != nil {
		client, preStart, down = r.client, r.opts.GetPreStartRequired(), r.down
	}
	p.mu.Unlock()
	switch {
	case r == nil:
		return nil, status.Errorf(codes.NotFound, "unknown device IDs %q", ids)
	case down != "" || client == nil:
		return nil, status.Errorf(codes.Unavailable, "device plugin of %s not connected: %s", r.name, down)
	}
	ctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	resp, err := client.Allocate(ctx, &dpapi.AllocateRequest{ContainerRequests: []*dpapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "%s: Allocate: %v", r.name, err)
	}
	if n := len(resp.GetContainerResponses()); n != 1 {
		return nil, status.Errorf(codes.Internal, "%s: Allocate answered %d container responses for one container", r.name, n)
	}
	if preStart {
		if _, err := client.PreStartContainer(ctx, &dpapi.PreStartContainerRequest{DevicesIds: ids}); err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "%s: PreStartContainer: %v", r.name, err)
		}
	}
	return reservation(resp.GetContainerResponses()[0]), nil
}

// reservation is a container's Allocate answer as the host's reservation; the host
// validates it. Annotations have no place in a reservation and are left out.
func reservation(c *dpapi.ContainerAllocateResponse) *pb.ContainerReservation {
	r := &pb.ContainerReservation{Envs: maps.Clone(c.GetEnvs())}
	for _, m := range c.GetMounts() {
		r.Mounts = append(r.Mounts, &pb.Mount{HostPath: m.GetHostPath(), ContainerPath: m.GetContainerPath(), ReadOnly: m.GetReadOnly()})
	}
	for _, d := range c.GetDevices() {
		r.Devices = append(r.Devices, &pb.DeviceSpec{HostPath: d.GetHostPath(), ContainerPath: d.GetContainerPath(), Permissions: d.GetPermissions()})
	}
	for _, d := range c.GetCdiDevices() {
		r.CdiDevices = append(r.CdiDevices, d.GetName())
	}
	return r
}

// Stats: a kubelet device plugin's device has no statistics (deviceplugin.NoStats).
func (p *Plugin) Stats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
	return deviceplugin.NoStats(ctx, interval, send)
}
