// Package hostdev is devicehost's host-device plugin: it serves device nodes that are
// already on the host (/dev/fuse, /dev/net/tun, /dev/kvm, serial ports, USB devices
// found by vendor, product and serial) as devices of vendor "hostdev", one device type
// per config block (see Config). It watches the nodes with fsnotify: a node that goes
// makes its device unhealthy at once, with the reason, and healthy again when it comes
// back; a USB device keeps its ID (its identity, not its /dev number) across a
// re-plug. Reserve checks every node again and answers the nodes (and the CDI names
// when it keeps a CDI spec), never a file that is not the device node it found.
package hostdev

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/deviceplugin/cdi"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Name and Version identify the plugin.
const (
	Name    = "hostdev"
	Version = "0.1.0"
)

// HoldersCounter is the counter of the counter set a device offered count times
// declares (named by the device's ID without the copy suffix): count holders, each copy
// using one. The DRA driver publishes such a set's copies as one device of count
// holders that allows multiple allocations.
const HoldersCounter = "holders"

// RescanPeriod is how often the plugin scans again without a file system event, as
// a backstop for file systems that send none (sysfs sends none; its USB devices are
// seen through their /dev/bus/usb nodes, which do).
const RescanPeriod = 30 * time.Second

// Plugin is the host-device plugin. It implements deviceplugin.Plugin; make one with
// New. SetConfig must succeed before the other calls, which may then run concurrently.
// Fingerprint starts no goroutine; the watcher it opens is closed when it returns.
type Plugin struct {
	logger hclog.Logger
	// rescanPeriod is RescanPeriod; tests shorten it.
	rescanPeriod time.Duration

	// poke asks every Fingerprint stream to scan again (a Reserve found a node
	// changed, a new config): buffered, so a poke is never lost or blocks.
	pokeMu sync.Mutex
	pokes  map[chan struct{}]bool

	mu    sync.Mutex
	set   *settings
	cdi   *cdi.Writer
	state map[string]*typeState // by type name
	ids   map[string]deviceRef  // every device reported, by ID
	notes map[string]string     // the notes last logged, by type name
}

// typeState is what the plugin knows of one block's things: every thing seen since
// the block was configured, the ones gone kept as unhealthy so a holder's device keeps
// its ID and comes back healthy.
type typeState struct {
	things map[string]*thing // by key
}

// deviceRef is where a device ID points: copy of thing key of type typ.
type deviceRef struct {
	typ string
	key string
}

var (
	_ deviceplugin.Plugin        = (*Plugin)(nil)
	_ deviceplugin.ConfigChecker = (*Plugin)(nil)
)

// New returns an unconfigured plugin that logs to logger (hclog.NewNullLogger when nil).
func New(logger hclog.Logger) *Plugin {
	if logger == nil {
		logger = hclog.NewNullLogger()
	}
	return &Plugin{logger: logger, rescanPeriod: RescanPeriod, pokes: map[chan struct{}]bool{}}
}

// Main serves the plugin to the host that launched this process, and removes its CDI
// spec once the host has stopped it (an agent that stops, an uninstall): not when it
// crashes or is killed, so a restarted plugin's containers keep resolving their names.
func Main() {
	p := New(deviceplugin.Logger())
	deviceplugin.Serve(p)
	p.Shutdown()
}

// Shutdown removes the plugin's CDI spec, if it keeps one. Call it once every other
// call has returned.
func (p *Plugin) Shutdown() {
	p.mu.Lock()
	w := p.cdi
	p.mu.Unlock()
	if w == nil {
		return
	}
	if err := w.Remove(); err != nil {
		p.logger.Warn("CDI spec not removed at shutdown", "error", err)
		return
	}
	p.logger.Info("CDI spec removed at shutdown", "path", w.Path())
}

// Info names the plugin.
func (p *Plugin) Info() deviceplugin.Info { return deviceplugin.Info{Name: Name, Version: Version} }

// CheckConfig says whether SetConfig would accept configJSON, changing nothing: the
// error SetConfig would return.
func (p *Plugin) CheckConfig(_ context.Context, configJSON []byte) error {
	_, err := parseConfig(configJSON)
	return err
}

// SetConfig applies a config: the blocks it drops are forgotten, the others keep
// what they have seen.
func (p *Plugin) SetConfig(_ context.Context, configJSON []byte) error {
	s, err := parseConfig(configJSON)
	if err != nil {
		return err // the SDK answers INVALID_ARGUMENT with it
	}
	var w *cdi.Writer
	if s.cdiDir != "" {
		if w, err = cdi.NewWriter(s.cdiDir, "devicehost-hostdev"); err != nil {
			return fmt.Errorf("config: cdi_spec_dir: %w", err)
		}
	}
	p.mu.Lock()
	p.set, p.cdi = &s, w
	old := p.state
	p.state = make(map[string]*typeState, len(s.types))
	for _, t := range s.types {
		if ts, ok := old[t.name]; ok {
			p.state[t.name] = ts
		} else {
			p.state[t.name] = &typeState{things: map[string]*thing{}}
		}
	}
	p.notes = map[string]string{}
	p.mu.Unlock()
	p.poke()
	return nil
}

// Fingerprint scans at once and sends the inventory, then scans again on every file
// system event in the directories of the configured nodes (and every RescanPeriod),
// sending the inventory when it changed.
func (p *Plugin) Fingerprint(ctx context.Context, send func(*pb.FingerprintResponse) error) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch device nodes: %w", err)
	}
	defer w.Close()
	watched := map[string]bool{}
	poke := p.subscribe()
	defer p.unsubscribe(poke)
	tick := time.NewTicker(p.rescanPeriod)
	defer tick.Stop()

	var last *pb.FingerprintResponse
	for {
		resp, dirs, err := p.scan()
		if err != nil {
			return err
		}
		added := updateWatches(w, watched, dirs, p.logger)
		if last == nil || !equalFingerprint(last, resp) {
			if err := send(resp); err != nil {
				return err
			}
			last = resp
		}
		if added {
			continue // a new directory may have changed before its watch began
		}
		if !waitEvent(ctx, w, tick.C, poke, p.logger) {
			return nil
		}
	}
}

// waitEvent waits for a reason to scan again: a file system event that can change a
// node (a create, a removal, a rename), a tick, or a poke; false once ctx ends. Events
// already queued behind the first are taken with it: one scan sees them all.
func waitEvent(ctx context.Context, w *fsnotify.Watcher, tick <-chan time.Time, poke <-chan struct{}, logger hclog.Logger) bool {
	for {
		select {
		case <-ctx.Done():
			return false
		case <-tick:
			return true
		case <-poke:
			return true
		case err, ok := <-w.Errors:
			if !ok {
				return false
			}
			logger.Warn("watching device nodes", "error", err) // an overflow: scan again
			return true
		case ev, ok := <-w.Events:
			if !ok {
				return false
			}
			if !ev.Has(fsnotify.Create) && !ev.Has(fsnotify.Remove) && !ev.Has(fsnotify.Rename) {
				continue // a write or chmod changes no node
			}
			for {
				select {
				case <-w.Events:
					continue
				default:
				}
				return true
			}
		}
	}
}

// scan scans every block, merges what it found into what the plugin knows, logs the
// notes that changed, keeps the CDI spec, and returns the inventory and the
// directories to watch.
func (p *Plugin) scan() (*pb.FingerprintResponse, []string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.set == nil {
		return nil, nil, errors.New("fingerprint before SetConfig")
	}
	s := *p.set
	resp := &pb.FingerprintResponse{}
	ids := map[string]deviceRef{}
	spec := cdi.Spec{Kind: CDIKind, Devices: map[string]cdi.Edits{}, Nodes: map[string]cdi.Node{}}
	for _, t := range s.types {
		f := scanType(s, t)
		ts := p.state[t.name]
		ts.merge(f.things, t)
		if note := strings.Join(f.notes, "; "); note != p.notes[t.name] {
			p.notes[t.name] = note
			if note != "" {
				p.logger.Warn("device block serves less than configured", "device", t.name, "why", note)
			}
		}
		g := &pb.DeviceGroup{Vendor: Vendor, Type: t.name, Name: t.name, Attributes: groupAttributes(t)}
		for _, key := range slices.Sorted(maps.Keys(ts.things)) {
			th := ts.things[key]
			var holders []*pb.CounterConsumption
			if t.count > 1 {
				// The copies are holders of one thing: a counter set of count holders,
				// one each, so that DRA publishes them as one device of count holders.
				resp.CounterSets = append(resp.CounterSets, &pb.CounterSet{Name: key, Counters: map[string]int64{HoldersCounter: int64(t.count)}})
				holders = []*pb.CounterConsumption{{CounterSet: key, Counters: map[string]int64{HoldersCounter: 1}}}
			}
			for i := range t.copies() {
				id := deviceID(key, t, i)
				d := &pb.Device{Id: id, Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{NumaNode: -1}, NothingToRelease: true, Consumes: holders}
				if th.problem != "" {
					d.Health, d.HealthReason = pb.Health_HEALTH_UNHEALTHY, th.problem
				} else if p.cdi != nil {
					d.CdiDevices = []string{cdi.Name(CDIKind, id)}
					spec.Devices[id] = cdi.Edits{DeviceNodes: deviceNodes(th.nodes, t.perms)}
					for _, n := range th.nodes {
						spec.Nodes[n.host] = cdi.Node{Type: string(n.typ), Major: int64(n.major), Minor: int64(n.minor)}
					}
				}
				ids[id] = deviceRef{typ: t.name, key: key}
				g.Devices = append(g.Devices, d)
			}
		}
		resp.Groups = append(resp.Groups, g)
	}
	if p.cdi != nil {
		if _, err := p.cdi.Write(spec); err != nil {
			p.logger.Warn("cannot write the CDI spec; Reserve answers the nodes without CDI names", "error", err)
			for _, g := range resp.Groups {
				for _, d := range g.Devices {
					d.CdiDevices = nil
				}
			}
		}
	}
	p.ids = ids
	return resp, watchDirs(s), nil
}

// merge takes one scan's things into what the type knows: new and present things as
// found, things no longer found kept with a problem saying they are gone. Things
// gone are dropped first when the type is over its bound.
func (ts *typeState) merge(things []thing, t typeSettings) {
	seen := make(map[string]bool, len(things))
	for _, th := range things {
		seen[th.key] = true
		// A thing never served is served only once it can be; one served keeps
		// its ID whatever happens to it.
		if _, ok := ts.things[th.key]; ok || th.problem == "" {
			ts.things[th.key] = &th
		}
	}
	for key, th := range ts.things {
		if !seen[key] && !strings.HasSuffix(th.problem, goneSuffix) {
			th.problem = gone(t, th)
		}
	}
	limit := MaxMatches / t.copies()
	for _, key := range slices.Sorted(maps.Keys(ts.things)) {
		if len(ts.things) <= limit {
			break
		}
		if !seen[key] {
			delete(ts.things, key)
		}
	}
}

// goneSuffix ends the problem of a thing that a scan no longer finds.
const goneSuffix = "is gone"

// gone says why th, no longer found, is unhealthy.
func gone(t typeSettings, th *thing) string {
	if t.usb != nil {
		return fmt.Sprintf("USB device %s:%s (%s) is unplugged: it %s", t.usb.Vendor, t.usb.Product, th.key, goneSuffix)
	}
	var paths []string
	for _, n := range th.nodes {
		paths = append(paths, n.path)
	}
	if len(paths) == 0 {
		return "the device " + goneSuffix
	}
	return strings.Join(paths, ", ") + " " + goneSuffix
}

// groupAttributes describe a block: its paths or its USB identity.
func groupAttributes(t typeSettings) map[string]*pb.Value {
	str := func(s string) *pb.Value { return &pb.Value{Kind: &pb.Value_StringValue{StringValue: s}} }
	if t.usb != nil {
		a := map[string]*pb.Value{"usb_vendor": str(t.usb.Vendor), "usb_product": str(t.usb.Product)}
		if t.usb.Serial != "" {
			a["usb_serial"] = str(t.usb.Serial)
		}
		return a
	}
	return map[string]*pb.Value{"paths": str(strings.Join(t.paths, ","))}
}

// deviceNodes are the nodes as a container gets them.
func deviceNodes(nodes []node, perms string) []cdi.DeviceNode {
	out := make([]cdi.DeviceNode, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, cdi.DeviceNode{HostPath: n.host, ContainerPath: n.path, Permissions: perms})
	}
	return out
}

// Reserve answers the device nodes of ids, each checked again on the file system: a
// node that is gone, is no longer a device node, or has other numbers than the
// fingerprint's refuses the Reserve (and the plugin scans again), so a container never
// gets a file that is not the device it was promised.
func (p *Plugin) Reserve(_ context.Context, ids []string) (*pb.ContainerReservation, error) {
	p.mu.Lock()
	if p.set == nil {
		p.mu.Unlock()
		return nil, status.Error(codes.FailedPrecondition, "reserve before SetConfig")
	}
	s := *p.set
	type want struct {
		id    string
		nodes []node
		perms string
	}
	var wants []want
	var unknown, unhealthy []string
	for _, id := range ids {
		ref, ok := p.ids[id]
		if !ok {
			unknown = append(unknown, id)
			continue
		}
		th := p.state[ref.typ].things[ref.key]
		if th.problem != "" {
			unhealthy = append(unhealthy, fmt.Sprintf("%s (%s)", id, th.problem))
			continue
		}
		t, _ := s.typeByName(ref.typ)
		wants = append(wants, want{id: id, nodes: th.nodes, perms: t.perms})
	}
	useCDI := p.cdi != nil
	p.mu.Unlock()
	switch {
	case len(unknown) > 0:
		return nil, status.Errorf(codes.NotFound, "unknown device IDs %q", unknown)
	case len(unhealthy) > 0:
		return nil, status.Errorf(codes.FailedPrecondition, "devices not available: %s", strings.Join(unhealthy, ", "))
	}
	r := &pb.ContainerReservation{}
	seen := map[string]bool{}
	var changed []string
	for _, w := range wants {
		for _, n := range w.nodes {
			now, err := statNode(s.devRoot, n.path)
			switch {
			case err != nil:
				changed = append(changed, fmt.Sprintf("device %s: %v", w.id, err))
				continue
			case now != n:
				changed = append(changed, fmt.Sprintf("device %s: %s is now %s", w.id, n, now))
				continue
			}
			if !seen[n.path] {
				seen[n.path] = true
				r.Devices = append(r.Devices, &pb.DeviceSpec{HostPath: n.host, ContainerPath: n.path, Permissions: w.perms})
			}
		}
		if useCDI {
			r.CdiDevices = append(r.CdiDevices, cdi.Name(CDIKind, w.id))
		}
	}
	if len(changed) > 0 {
		p.poke()
		return nil, status.Errorf(codes.FailedPrecondition, "device nodes changed since they were found: %s", strings.Join(changed, "; "))
	}
	return r, nil
}

// typeByName finds a block.
func (s settings) typeByName(name string) (typeSettings, bool) {
	for _, t := range s.types {
		if t.name == name {
			return t, true
		}
	}
	return typeSettings{}, false
}

// Stats: a device node has no statistics (deviceplugin.NoStats).
func (p *Plugin) Stats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
	return deviceplugin.NoStats(ctx, interval, send)
}

func (p *Plugin) subscribe() chan struct{} {
	c := make(chan struct{}, 1)
	p.pokeMu.Lock()
	p.pokes[c] = true
	p.pokeMu.Unlock()
	return c
}

func (p *Plugin) unsubscribe(c chan struct{}) {
	p.pokeMu.Lock()
	delete(p.pokes, c)
	p.pokeMu.Unlock()
}

// poke asks every Fingerprint stream to scan again.
func (p *Plugin) poke() {
	p.pokeMu.Lock()
	defer p.pokeMu.Unlock()
	for c := range p.pokes {
		select {
		case c <- struct{}{}:
		default: // one is pending already
		}
	}
}
