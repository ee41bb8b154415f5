package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/backoff"
	"github.com/devicehost/devicehost/endpoint"
)

// Timing of registration.
const (
	registerTimeout = 5 * time.Second
	// A failed sync is tried again after retryBase, doubling up to retryMax with
	// jitter (see backoff); a re-created kubelet socket is noticed at once through
	// fsnotify.
	retryBase = 100 * time.Millisecond
	retryMax  = 5 * time.Second
	// resyncInterval is how often the registrar checks the sockets without being told:
	// a safety net for a missed file event (say, the directory itself replaced).
	resyncInterval = 10 * time.Second
	// maxSocketPath is the longest path a Unix socket can be bound at (sun_path).
	maxSocketPath = 107
)

// socketName is the file name of resource's plugin socket in the device-plugins
// directory. A valid resource name has exactly one '/', and its domain no '_', so the
// names of two resources never collide.
func socketName(resource string) string {
	return "devicehost-" + strings.Replace(resource, "/", "_", 1) + ".sock"
}

// registrar owns the plugin servers: one per resource, each on its own socket,
// registered with the kubelet. Its run loop is the only goroutine that touches them.
type registrar struct {
	b       *Bridge
	dir     string
	kubelet string // the kubelet's registration socket
	watcher *fsnotify.Watcher
	kickCh  chan struct{}
	servers map[string]*pluginServer
	retry   backoff.Backoff // the delays of retries after failed syncs in a row
	log     hclog.Logger

	kubeletCreates int // kubelet.sock creations seen: kubelet (re)starts
	// afterSync, when set (tests), is called by the run loop after each sync with
	// kubeletCreates and whether the sync succeeded.
	afterSync func(kubeletCreates int, ok bool)
	// tokens are the run loop's liveness tokens (see liveness.Monitor.Loop).
	tokens <-chan struct{}
}

func newRegistrar(b *Bridge) (*registrar, error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("watch the device-plugins directory: %w", err)
	}
	if err := w.Add(b.cfg.DevicePluginDir); err != nil {
		w.Close()
		return nil, fmt.Errorf("watch the device-plugins directory: %w", err)
	}
	return &registrar{
		b:         b,
		dir:       b.cfg.DevicePluginDir,
		kubelet:   filepath.Join(b.cfg.DevicePluginDir, KubeletSocketName),
		watcher:   w,
		kickCh:    make(chan struct{}, 1),
		servers:   map[string]*pluginServer{},
		retry:     backoff.Backoff{Base: retryBase, Max: retryMax, HardMax: true},
		log:       b.log.Named("register"),
		afterSync: b.afterSync,
	}, nil
}

// kick asks the run loop to look at the resources and sockets again. It never blocks.
func (r *registrar) kick() {
	select {
	case r.kickCh <- struct{}{}:
	default:
	}
}

// run serves and registers until ctx ends, then stops every server, removes their
// sockets and closes the watcher.
func (r *registrar) run(ctx context.Context) {
	defer r.watcher.Close()
	defer func() {
		for _, ps := range r.servers {
			ps.stop()
		}
	}()
	resync := time.NewTicker(resyncInterval)
	defer resync.Stop()
	events, errs := r.watcher.Events, r.watcher.Errors
	for {
		var retry <-chan time.Time
		var timer *time.Timer
		ok := r.sync(ctx)
		if r.afterSync != nil {
			r.afterSync(r.kubeletCreates, ok)
		}
		if ok {
			r.retry.Reset()
		} else {
			timer = time.NewTimer(r.retry.Next())
			retry = timer.C
		}
		r.wait(ctx, retry, resync.C, &events, &errs)
		if timer != nil {
			timer.Stop()
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// wait waits for a reason to sync again (a kick, the retry or resync timer, a file
// event), taking the liveness tokens meanwhile, or for ctx to end.
func (r *registrar) wait(ctx context.Context, retry, resync <-chan time.Time, events *chan fsnotify.Event, errs *chan error) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.tokens:
			continue // live; keep waiting
		case <-r.kickCh:
		case <-retry:
		case <-resync:
		case ev, ok := <-*events:
			switch {
			case !ok:
				*events = nil
			case filepath.Base(ev.Name) == KubeletSocketName && ev.Has(fsnotify.Create):
				// A kubelet (re)started. The sync below registers with it unless the
				// bridge already has: it may have seen the new socket while serving
				// its own again (the kubelet empties the directory first). Kubelet
				// 1.37 refuses a second registration of an endpoint it is connected
				// to ("device plugin already connected"), so none is sent.
				r.kubeletCreates++
				r.log.Info("the kubelet's socket was created", "socket", ev.Name)
			}
		case err, ok := <-*errs:
			if !ok {
				*errs = nil
			} else {
				r.log.Warn("watching the device-plugins directory", "error", err)
			}
		}
		return
	}
}

// sync makes every resource served on an intact socket and registered with the
// kubelet whose socket is there now: registered once per kubelet socket (a restarted
// kubelet binds a new one, another file). It reports false when something failed and
// should be tried again.
func (r *registrar) sync(ctx context.Context) bool {
	ok := true
	kubelet, kerr := os.Stat(r.kubelet)
	for _, res := range r.b.state.view().resources {
		ps := r.servers[res.Name]
		if ps != nil && !ps.intact() {
			r.log.Info("plugin socket is gone (kubelet restart?): serving it again", "resource", res.Name, "socket", ps.socket)
			ps.stop()
			ps = nil
			delete(r.servers, res.Name)
		}
		if ps == nil {
			var err error
			ps, err = r.serve(res)
			if err != nil {
				r.log.Error("cannot serve resource", "resource", res.Name, "error", err)
				ok = false
				continue
			}
			r.servers[res.Name] = ps
		}
		if kerr != nil {
			if ps.lastErr != kerr.Error() {
				r.log.Info("waiting for the kubelet's socket", "socket", r.kubelet, "error", kerr)
				ps.lastErr = kerr.Error()
			}
			ok = false
			continue
		}
		if ps.registeredWith != nil && sameSocket(ps.registeredWith, kubelet) {
			continue
		}
		start := time.Now()
		if err := r.register(ctx, ps); err != nil {
			ps.registeredWith = nil
			if msg := err.Error(); msg != ps.lastErr {
				r.log.Warn("cannot register with the kubelet; trying again", "resource", res.Name, "error", err)
				ps.lastErr = msg
			}
			ok = false
			continue
		}
		ps.registeredWith, ps.lastErr = kubelet, ""
		r.log.Info("registered with the kubelet", "resource", res.Name, "endpoint", filepath.Base(ps.socket),
			"took", time.Since(start))
	}
	return ok
}

// register sends the kubelet a RegisterRequest for ps. The kubelet connects back to
// ps's socket before it answers.
func (r *registrar) register(ctx context.Context, ps *pluginServer) error {
	ctx, cancel := context.WithTimeout(ctx, registerTimeout)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+r.kubelet, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = dpapi.NewRegistrationClient(conn).Register(ctx, &dpapi.RegisterRequest{
		Version:      dpapi.Version,
		Endpoint:     filepath.Base(ps.socket),
		ResourceName: ps.resource,
		Options:      &dpapi.DevicePluginOptions{GetPreferredAllocationAvailable: true},
	})
	return err
}

// sameSocket reports whether a and b are the same socket file: the same inode and
// the same modification time (a new socket may get a freed inode number again).
func sameSocket(a, b os.FileInfo) bool {
	return os.SameFile(a, b) && a.ModTime().Equal(b.ModTime())
}

// pluginServer is the DevicePlugin service of one resource on its socket.
type pluginServer struct {
	resource string
	socket   string
	file     os.FileInfo // the socket as bound; the listener keeps its inode alive
	srv      *grpc.Server
	served   chan struct{} // closed when Serve has returned

	// Owned by the registrar's loop.
	registeredWith os.FileInfo // the kubelet socket registered with; nil: not registered
	lastErr        string      // the last problem logged, so it is logged once
}

// serve binds res's socket and serves the DevicePlugin service on it.
func (r *registrar) serve(res Resource) (*pluginServer, error) {
	path := filepath.Join(r.dir, socketName(res.Name))
	if len(path) > maxSocketPath {
		return nil, fmt.Errorf("socket path %s is %d bytes long; a Unix socket path can be at most %d", path, len(path), maxSocketPath)
	}
	lis, file, err := listenSocket(path)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	dpapi.RegisterDevicePluginServer(srv, &resourcePlugin{b: r.b, resource: res.Name})
	ps := &pluginServer{resource: res.Name, socket: path, file: file, srv: srv, served: make(chan struct{})}
	go func() {
		defer close(ps.served)
		srv.Serve(lis) // returns when stop stops srv
	}()
	return ps, nil
}

// intact reports whether ps's socket file is still the one it bound.
func (ps *pluginServer) intact() bool {
	fi, err := os.Lstat(ps.socket)
	return err == nil && os.SameFile(fi, ps.file)
}

// stop removes ps's socket, if it is still ps's, and stops the server: open streams
// end, and Serve's goroutine is gone when stop returns.
func (ps *pluginServer) stop() {
	// Check and remove while the listener still holds the inode, so a new socket at
	// the same path (another process's) is never taken for ours.
	if ps.intact() {
		os.Remove(ps.socket)
	}
	ps.srv.Stop()
	<-ps.served
}

// listenSocket binds a Unix socket at path, mode 0600, replacing a stale socket left
// by a process that died, but never a live one or a file that is not a socket. The
// listener does not unlink path on close (the socket there may no longer be ours).
func listenSocket(path string) (net.Listener, os.FileInfo, error) {
	lis, err := endpoint.ListenUnix(path)
	if errors.Is(err, endpoint.ErrSocketInUse) {
		return nil, nil, fmt.Errorf("listen on %s: another process serves this socket (a second kubelet-plugin for the same resource?)", path)
	} else if err != nil {
		return nil, nil, err
	}
	lis.SetUnlinkOnClose(false)
	fi, err := os.Lstat(path)
	if err == nil {
		err = os.Chmod(path, 0o600)
	}
	if err != nil {
		lis.Close()
		return nil, nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	return lis, fi, nil
}
