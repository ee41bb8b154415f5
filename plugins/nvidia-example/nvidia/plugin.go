// Package nvidia is devicehost's example NVIDIA GPU plugin, on go-nvml's nvml.Interface:
// with real NVML it reports the machine's GPUs, and with config simulate = "dgxh100" (or
// another of go-nvml's mock servers) it runs the same code on simulated ones. It reports
// health from XID events, hands out NVIDIA_VISIBLE_DEVICES and CDI names (cdi.go), and
// partitions GPUs by MIG or time-slicing (mig.go, simmig.go). See Config for the keys
// and plugins/nvidia-example/README.md for its behaviour.
package nvidia

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/deviceplugin/cdi"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Name and Version identify the plugin.
const (
	Name    = "nvidia-example"
	Version = "0.1.0"
)

// defaultEventPoll bounds one NVML event wait, and so how long a Fingerprint stream
// takes to stop once its context ends.
const defaultEventPoll = 500 * time.Millisecond

// minStatsInterval is the shortest stats interval the plugin honours.
const minStatsInterval = 100 * time.Millisecond

// Plugin is the NVIDIA GPU device plugin. It implements deviceplugin.Plugin; make one
// with New. SetConfig must succeed before the other calls, which may then run
// concurrently. Fingerprint and Stats run only while called and stop every goroutine
// they start before returning. Close releases NVML once no call is running.
type Plugin struct {
	logger hclog.Logger

	// Seams for tests; New sets them.
	clock      clock
	openNVML   func() nvml.Interface
	eventPoll  time.Duration
	charDevice func(path string) bool // is path a character device on this host
	migMinors  string                 // the driver's MIG capability table (migMinorsPath)

	// migMu serialises every change to MIG instances (and the CDI spec that lists
	// them), across runtimes.
	migMu sync.Mutex

	mu     sync.Mutex
	sim    *simMIG        // the simulated machine's MIG state, kept across SetConfigs
	mps    *mpsSupervisor // MPS control daemons, kept across SetConfigs; nil when off
	rt     *runtime       // nil until SetConfig succeeds
	nvml   nvml.Interface // the real library once opened, shared by every runtime
	nvmlUp bool           // nvml initialised
	closed bool
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
	return &Plugin{
		logger:     logger,
		clock:      realClock{},
		openNVML:   func() nvml.Interface { return nvml.New() },
		eventPoll:  defaultEventPoll,
		charDevice: isCharDevice,
		migMinors:  migMinorsPath,
	}
}

// Main serves the plugin to the host that launched this process, logging through the
// SDK's logger, and returns when the host is done with it; the process should then
// exit. The plugin binary's main, and the devicehost binary re-executed as this plugin,
// call it. It does not Close the plugin: a stream may still be inside an NVML event
// wait, and process exit releases NVML anyway.
func Main() {
	RunSimulatedMPSIfAsked()
	p := New(deviceplugin.Logger())
	deviceplugin.Serve(p)
	// Serve returns when the host stops the plugin (an agent that stops, a helm
	// uninstall), not when the plugin crashes or is killed.
	p.Shutdown()
}

// runtime is everything one successful SetConfig decided. It never changes; a later
// SetConfig with a different config makes a new one, and calls already running keep
// the one they started with.
type runtime struct {
	settings
	logger hclog.Logger
	clock  clock
	lib    nvml.Interface // nil: no NVML and no simulation, so no devices
	health *healthBook
	cdi    *cdiPublisher // nil: no CDI spec (cdi_spec_dir = "")
	// numaFromNVML says whether the library has nvmlDeviceGetNumaNodeId; calling a
	// symbol the loaded driver lacks would crash the process.
	numaFromNVML bool
	// gpm says whether the library has every call GPU performance monitoring needs
	// (gpmSymbols).
	gpm    bool
	mpsSup *mpsSupervisor // the plugin's; nil without sharing = "mps"
	migMu  *sync.Mutex    // the plugin's
	latest atomic.Pointer[inventory]
}

// Info names the plugin.
func (p *Plugin) Info() deviceplugin.Info { return deviceplugin.Info{Name: Name, Version: Version} }

// SetConfig checks the config block (see Config) and opens NVML or builds the simulated
// machine. A bad config is refused and leaves any earlier one in force. Calling it
// again with the same config (a host reattaching) changes nothing; a different config
// takes effect for calls made afterwards, keeping the GPUs' health, and restarts any
// injected faults' clock.
func (p *Plugin) SetConfig(_ context.Context, configJSON []byte) error {
	s, err := parseConfig(configJSON)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("plugin closed")
	}
	if p.rt != nil && reflect.DeepEqual(p.rt.settings, s) {
		return nil
	}
	rt := &runtime{settings: s, logger: p.logger, clock: p.clock, health: newHealthBook(s.quietPeriod), migMu: &p.migMu}
	if s.cdiDir != "" {
		if rt.cdi, err = newCDIPublisher(s.cdiDir, p.logger, p.charDevice, p.migMinors); err != nil {
			return err
		}
	}
	if p.rt != nil {
		rt.health.inherit(p.rt.health)
	}
	if s.simulate != "" {
		mig := p.sim
		if mig == nil || mig.path != s.simStateFile || mig.machine != s.simulate {
			if mig, err = loadSimMIG(s.simStateFile, s.simulate, simulatedUUIDs(s.simulate)); err != nil {
				return err
			}
		}
		sim := newSimLib(s.simulate, p.clock, mig)
		if err := sim.scheduleFaults(p.clock.Now(), s.faults); err != nil {
			return err
		}
		if ret := sim.Init(); ret != nvml.SUCCESS {
			return fmt.Errorf("simulate %s: init: %w", s.simulate, ret)
		}
		// The simulated operator turns MIG mode on where the config partitions GPUs,
		// and off where sim_mig_mode_off says (on real GPUs that is the operator's job:
		// the plugin never changes it).
		var want, off []int
		for i := range sim.devices {
			if s.simMIGModeOff[i] {
				off = append(off, i)
			} else if s.wantsMIG(i) {
				want = append(want, i)
			}
		}
		changed, err := mig.enableMIG(want)
		if err != nil {
			return err
		}
		turnedOff, err := mig.disableMIG(off)
		if err != nil {
			return err
		}
		p.sim = mig
		rt.lib = sim
		rt.numaFromNVML = true
		rt.gpm = true
		p.logger.Info("running on simulated GPUs", "machine", s.simulate, "gpus", len(sim.devices),
			"xid_events_scheduled", len(sim.faults), "sim_state_file", s.simStateFile,
			"mig_instances", mig.instanceCount(), "mig_mode_turned_on", changed, "mig_mode_turned_off", turnedOff)
	} else if lib := p.openRealNVML(); lib != nil {
		rt.lib = lib
		rt.numaFromNVML = lib.Extensions().LookupSymbol("nvmlDeviceGetNumaNodeId") == nil
		rt.gpm = true
		for _, sym := range gpmSymbols {
			rt.gpm = rt.gpm && lib.Extensions().LookupSymbol(sym) == nil
		}
	}
	if rt.lib != nil {
		if err := rt.applyLayout(); err != nil {
			return err
		}
		rt.reportMIGModes()
	}
	if err := p.configureMPSLocked(rt); err != nil {
		return err
	}
	if old := p.rt; old != nil && old.cdi != nil && (rt.cdi == nil || rt.cdi.w.Path() != old.cdi.w.Path()) {
		// The spec moved or is off: the old file would name GPUs nobody keeps up to date.
		if err := old.cdi.w.Remove(); err != nil {
			p.logger.Warn("old CDI spec not removed", "error", err)
		}
	}
	p.rt = rt
	return nil
}

// configureMPSLocked gives rt the MPS supervisor its settings want: the one running
// when its directory, control binary and isolation are the same, else a new one. A
// change that would strand the daemons of held shares is refused. Called with p.mu
// held, after every other step of SetConfig succeeded.
func (p *Plugin) configureMPSLocked(rt *runtime) error {
	want := rt.mps.shares > 0
	if p.mps != nil && want && p.mps.sameAs(rt.settings.mps) {
		rt.mpsSup = p.mps
		return nil
	}
	if p.mps != nil {
		if n := p.mps.active(); n > 0 {
			return fmt.Errorf("config: the MPS settings (sharing, mps_isolation, mps_dir, mps_control) cannot change while %d MPS control daemons serve held shares; release those shares first", n)
		}
	}
	var sup *mpsSupervisor
	if want {
		var err error
		if sup, err = newMPSSupervisor(rt.settings.mps, rt.simulate != "", p.logger); err != nil {
			return err
		}
	}
	if p.mps != nil {
		p.mps.close()
	}
	p.mps, rt.mpsSup = sup, sup
	return nil
}

// CheckConfig refuses what SetConfig would refuse, with the same message, and changes
// nothing: no GPU, no file, no state of the plugin. It checks the keys and values
// (parseConfig) and, with simulate, the simulator's state file (read only, and only
// when SetConfig would read it: not the file of the machine that runs) and the GPUs
// that inject_faults name. What only applying shows is not checked: whether the GPUs
// offer mig_layout's profiles (SetConfig creates the instances), and the CDI spec
// directory. MIG mode, the layout and the CDI spec are SetConfig's alone. Safe to call
// at any time, beside every other call.
func (p *Plugin) CheckConfig(_ context.Context, configJSON []byte) error {
	s, err := parseConfig(configJSON)
	if err != nil || s.simulate == "" {
		return err
	}
	uuids := simulatedUUIDs(s.simulate)
	p.mu.Lock()
	loaded := p.sim != nil && p.sim.path == s.simStateFile && p.sim.machine == s.simulate
	p.mu.Unlock()
	if !loaded {
		if _, err := loadSimMIG(s.simStateFile, s.simulate, uuids); err != nil {
			return err
		}
	}
	return checkFaults(s.faults, uuids)
}

// openRealNVML returns the initialised NVML library, or nil with one log line when
// there is none. Called with p.mu held.
//
// go-nvml does not panic when libnvidia-ml is missing: Init returns
// ERROR_LIBRARY_NOT_FOUND. Any other call before a successful Init would jump to an
// unresolved symbol and crash, so a library that did not initialise is never used.
func (p *Plugin) openRealNVML() nvml.Interface {
	if p.nvmlUp {
		return p.nvml
	}
	if p.nvml == nil {
		p.nvml = p.openNVML()
	}
	if ret := p.nvml.Init(); ret != nvml.SUCCESS {
		p.logger.Warn(`NVML is not available, so this plugin reports no GPUs; set simulate = "dgxh100" (or dgxa100, dgxh200, dgxb200) to run on simulated GPUs`,
			"error", ret.Error())
		return nil
	}
	p.nvmlUp = true
	driver, _ := p.nvml.SystemGetDriverVersion()
	p.logger.Info("using NVML", "driver_version", driver)
	return p.nvml
}

// Shutdown is Close for a plugin the host has stopped: its CDI spec goes too, since
// nobody keeps its devices up to date any more and a runtime must not resolve them. The
// next plugin to start writes it again before it reports a GPU.
func (p *Plugin) Shutdown() {
	p.mu.Lock()
	rt := p.rt
	p.mu.Unlock()
	if rt != nil && rt.cdi != nil {
		if err := rt.cdi.w.Remove(); err != nil {
			p.logger.Warn("CDI spec not removed at shutdown", "error", err)
		} else {
			p.logger.Info("CDI spec removed at shutdown", "path", rt.cdi.w.Path())
		}
	}
	p.Close()
}

// Close shuts NVML down. Call it once every other call has returned; the plugin
// refuses calls afterwards.
func (p *Plugin) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	if p.mps != nil {
		p.mps.close()
	}
	if p.nvmlUp {
		if ret := p.nvml.Shutdown(); ret != nvml.SUCCESS {
			p.logger.Warn("NVML shutdown failed", "error", ret)
		}
		p.nvmlUp = false
	}
}

func (p *Plugin) runtime() (*runtime, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, errors.New("plugin closed")
	}
	if p.rt == nil {
		return nil, errors.New("not configured: SetConfig has not succeeded")
	}
	return p.rt, nil
}

// Fingerprint sends the inventory at once, then whenever it changes: on a re-read every
// fingerprint_period, on a critical XID, when a GPU's quiet period ends, and when the
// recovery action the driver reports for a GPU changes (asked at each send, and every
// recoveryActionPoll while one is pending). Without
// NVML it sends one empty inventory and waits for ctx to end. Each reading of the GPUs
// is published to the CDI spec (when cdi_spec_dir is set) before it is sent, so the
// host never hands out a CDI name that the spec does not hold yet.
func (p *Plugin) Fingerprint(ctx context.Context, send func(*pb.FingerprintResponse) error) error {
	rt, err := p.runtime()
	if err != nil {
		return err
	}
	if rt.lib == nil {
		rt.publishCDI(&inventory{}) // a spec left from when there were GPUs goes
		if err := send(&pb.FingerprintResponse{}); err != nil {
			return err
		}
		<-ctx.Done()
		return nil
	}

	inv, err := rt.scan()
	if err != nil {
		return err
	}
	rt.publishCDI(inv)
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	if w := startXIDWatch(rt, inv.gpus, p.eventPoll); w != nil {
		wg.Go(func() { w.run(ctx) })
	}

	var last *pb.FingerprintResponse
	nextScan := rt.clock.Now().Add(rt.fingerprintPeriod)
	for {
		changed := rt.health.changes()
		mpsChanged := rt.mpsSup.changes()
		now := rt.clock.Now()
		if !now.Before(nextScan) {
			if inv, err = rt.scan(); err != nil {
				return err
			}
			rt.publishCDI(inv)
			nextScan = now.Add(rt.fingerprintPeriod)
		}
		pending := pollRecoveryActions(rt.health, inv.gpus, now)
		resp, recovery := inv.fingerprint(rt.health, now, rt.cdi != nil, rt.mpsSup)
		if last == nil || !protoEqual(resp, last) {
			if err := send(resp); err != nil {
				return err
			}
			last = resp
		}
		wake := nextScan
		if !recovery.IsZero() && recovery.Before(wake) {
			wake = recovery
		}
		if poll := now.Add(recoveryActionPoll); pending && poll.Before(wake) {
			wake = poll
		}
		t := rt.clock.TimerAt(wake)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-changed:
		case <-mpsChanged:
		case <-t.C():
		}
		t.Stop()
	}
}

// Stats sends one sample of every GPU and of every MIG device that exists at once,
// and then every interval (at least minStatsInterval). Tensor activity, where GPM
// supports the GPU, is in every sample but the first: it is the activity between two
// samples. A sample that cannot be taken is logged and skipped. Without NVML it sends
// nothing and waits for ctx to end.
func (p *Plugin) Stats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
	rt, err := p.runtime()
	if err != nil {
		return err
	}
	if rt.lib == nil {
		<-ctx.Done()
		return nil
	}
	interval = max(interval, minStatsInterval)
	var gpmLib nvml.Interface
	if rt.gpm {
		gpmLib = rt.lib
	}
	gpm := newGPMSampler(gpmLib)
	defer gpm.close()
	next := rt.clock.Now()
	for {
		now := rt.clock.Now()
		if resp, err := rt.sample(now, gpm); err != nil {
			rt.logger.Warn("stats sample skipped", "error", err)
		} else if err := send(resp); err != nil {
			return err
		}
		next = next.Add(interval)
		if !next.After(now) { // fell behind: skip the missed ticks
			next = now.Add(interval)
		}
		t := rt.clock.TimerAt(next)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C():
		}
	}
}

// Reserve exposes the devices to a container: NVIDIA_VISIBLE_DEVICES lists their
// UUIDs in request order (a replica's GPU once; a MIG device's "MIG-..." UUID), and
// each device gets the CDI name nvidia.com/gpu=<device ID>. An on-demand MIG device's GPU and
// compute instance are created first, and the CDI spec gains it before the answer;
// if any create fails, what this call made is destroyed and the error names the
// device. IDs that are unknown, ignored or repeated refuse the whole request with an
// error naming them, as a gRPC status: NOT_FOUND for unknown or ignored IDs, else
// INVALID_ARGUMENT.
func (p *Plugin) Reserve(ctx context.Context, deviceIDs []string) (*pb.ContainerReservation, error) {
	return p.ReserveOptions(ctx, deviceIDs, nil)
}

// ReserveOptions is Reserve with the Reserve's options, all for MPS shares:
// mps_isolation ("shared" or "per-holder") chooses the MPS isolation, among the
// config's mps_isolation_allowed (the config's mps_isolation when absent);
// mps_thread_percentage (1 to 100) and mps_memory_limit (MiB, at least 1) lower the
// holder's limits below what its shares give. Any other option, a bad value, a limit
// above the shares', an option on devices that are not MPS shares, or an isolation
// the config does not allow is refused with INVALID_ARGUMENT naming it, before
// anything is prepared.
func (p *Plugin) ReserveOptions(ctx context.Context, deviceIDs []string, options map[string]string) (*pb.ContainerReservation, error) {
	rt, err := p.runtime()
	if err != nil {
		return nil, err
	}
	if len(deviceIDs) == 0 {
		return nil, status.Error(codes.InvalidArgument, "reserve: no device IDs")
	}
	inv := &inventory{}
	if rt.lib != nil {
		if inv, err = rt.current(); err != nil {
			return nil, fmt.Errorf("reserve: %w", err)
		}
	}
	var unknown, ignored, repeated []string
	seen := make(map[string]bool)
	for _, id := range deviceIDs {
		_, known := inv.targets[id]
		switch {
		case seen[id]:
			repeated = append(repeated, id)
		case rt.ignored[id]:
			ignored = append(ignored, id)
		case !known:
			unknown = append(unknown, id)
		}
		seen[id] = true
	}
	var problems []string
	if len(unknown) > 0 {
		problems = append(problems, "unknown device IDs "+strings.Join(unknown, ", "))
	}
	if len(ignored) > 0 {
		problems = append(problems, "ignored GPU IDs (ignored_gpu_ids) "+strings.Join(ignored, ", "))
	}
	if len(repeated) > 0 {
		problems = append(problems, "device IDs given more than once "+strings.Join(repeated, ", "))
	}
	if len(problems) > 0 {
		code := codes.InvalidArgument
		if len(unknown)+len(ignored) > 0 {
			code = codes.NotFound
		}
		return nil, status.Error(code, "reserve: "+strings.Join(problems, "; "))
	}

	shares, device, err := mpsRequest(inv, deviceIDs)
	if err != nil {
		return nil, err
	}
	if err := rt.checkOptions(inv, deviceIDs, shares, options); err != nil {
		return nil, err
	}
	if len(shares) > 0 {
		return rt.reserveShares(ctx, inv, device, shares, rt.isolationOf(options), options)
	}
	uuids, err := rt.prepare(inv, deviceIDs)
	if err != nil {
		return nil, err
	}
	var visible, names []string
	for i, u := range uuids {
		if !slices.Contains(visible, u) {
			visible = append(visible, u)
		}
		names = append(names, cdi.Name(cdiKind, deviceIDs[i]))
	}
	return &pb.ContainerReservation{
		Envs:       map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(visible, ",")},
		CdiDevices: names,
	}, nil
}

// prepare returns the UUID each device ID exposes, creating on-demand MIG instances
// (and publishing them to the CDI spec) on the way. On failure it destroys the
// instances it created.
func (rt *runtime) prepare(inv *inventory, ids []string) ([]string, error) {
	uuids := make([]string, len(ids))
	var parts []int
	for i, id := range ids {
		t := inv.targets[id]
		uuids[i] = t.uuid
		if t.kind == targetPartition {
			parts = append(parts, i)
		}
	}
	if len(parts) == 0 {
		return uuids, nil
	}
	rt.migMu.Lock()
	defer rt.migMu.Unlock()
	var made []target
	for _, i := range parts {
		t := inv.targets[ids[i]]
		u, created, err := createPartition(inv.gpus[t.gpu], t.profile, t.placement)
		if err != nil {
			for _, m := range made {
				if uerr := destroyPartition(inv.gpus[m.gpu], m.profile, m.placement.Start); uerr != nil {
					err = errors.Join(err, fmt.Errorf("undoing an earlier device of this request: %w", uerr))
				}
			}
			return nil, rt.partitionRefusal(inv, ids[i:i+1], t, err)
		}
		if created {
			made = append(made, t)
		}
		uuids[i] = u
	}
	rt.publishCDILocked(inv)
	return uuids, nil
}

// Release destroys the MIG instances of the on-demand MIG devices among deviceIDs,
// and stops the MPS daemons their last shares leave idle (and an on-demand
// placement's instance with its last share); other devices need nothing. Idempotent:
// an instance already gone is fine, and so are IDs the plugin no longer reports.
func (p *Plugin) Release(_ context.Context, _ string, deviceIDs []string) error {
	rt, err := p.runtime()
	if err != nil || rt.lib == nil {
		return err
	}
	inv, err := rt.current()
	if err != nil {
		if rt.mpsSup != nil {
			rt.mpsSup.release(deviceIDs)
		}
		return fmt.Errorf("release: %w", err)
	}
	rt.migMu.Lock()
	defer rt.migMu.Unlock()
	if rt.mpsSup != nil {
		rt.mpsSup.release(deviceIDs) // the daemon of the last share of a device stops
	}
	var errs []error
	destroyed := false
	for _, id := range deviceIDs {
		t, ok := inv.targets[id]
		if !ok || !t.onDemand() || t.kind == targetMPS && rt.mpsSup.serves(t.divides) {
			continue
		}
		if err := destroyPartition(inv.gpus[t.gpu], t.profile, t.placement.Start); err != nil {
			errs = append(errs, fmt.Errorf("release %s: %w", id, err))
		}
		destroyed = true
	}
	if destroyed {
		rt.publishCDILocked(inv)
	}
	return errors.Join(errs...)
}

// Reconcile makes the on-demand GPUs' MIG instances match the live reservations: an
// instance that a live reservation's device, or an MPS share of it, names is kept (its
// compute instance made if a crash left it without one; a placement with live shares
// gets its instance made again if it is gone, for their daemon); every other instance
// on an on-demand GPU (left by a Reserve the host never recorded, or by a crash
// mid-create) is destroyed. Then the MPS daemons match the live shares. Static
// layouts and whole GPUs are not touched.
func (p *Plugin) Reconcile(ctx context.Context, live []deviceplugin.LiveReservation) error {
	rt, err := p.runtime()
	if err != nil || rt.lib == nil {
		return err
	}
	inv, err := rt.current()
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	held := make(map[string]bool)
	shared := make(map[string]target) // on-demand placements with live MPS shares, by partition ID
	for _, r := range live {
		for _, id := range r.DeviceIDs {
			held[id] = true
			if t, ok := inv.targets[id]; ok && t.kind == targetMPS && t.onDemand() {
				held[t.divides] = true
				shared[t.divides] = t
			}
		}
	}
	rt.migMu.Lock()
	defer rt.migMu.Unlock()
	var errs []error
	kept, destroyed := 0, 0
	partitions := make(map[string]string) // partition ID -> its MIG device's UUID
	for i, g := range inv.gpus {
		plan := inv.plans[i]
		if plan.mode != modeOnDemand {
			continue
		}
		existing, err := listGPUInstances(g, plan.profiles)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, e := range existing {
			id := partitionID(g.uuid, e.profile.name, e.info.Placement.Start)
			if t, ok := inv.targets[id]; ok && held[id] && t.placement == e.info.Placement {
				if uuid, _, err := createPartition(g, e.profile, e.info.Placement); err != nil {
					errs = append(errs, fmt.Errorf("reconcile: adopting %s: %w", id, err))
				} else {
					partitions[id] = uuid
				}
				kept++
				continue
			}
			if err := destroyGPUInstance(e.gi); err != nil {
				errs = append(errs, fmt.Errorf("reconcile: destroying the %s instance at %d on GPU %s: %w", e.profile.name, e.info.Placement.Start, g.uuid, err))
				continue
			}
			rt.logger.Info("reconcile: destroyed a MIG instance no live reservation holds", "device", id)
			destroyed++
		}
	}
	for _, id := range slices.Sorted(maps.Keys(shared)) {
		if _, ok := partitions[id]; ok {
			continue
		}
		t := shared[id]
		uuid, _, err := createPartition(inv.gpus[t.gpu], t.profile, t.placement)
		if err != nil {
			errs = append(errs, fmt.Errorf("reconcile: the MIG instance of %s, whose MPS shares are held: %w", id, err))
			continue
		}
		rt.logger.Info("reconcile: made again the MIG instance of held MPS shares", "device", id)
		partitions[id] = uuid
	}
	rt.logger.Info("reconciled MIG instances with the live reservations", "reservations", len(live), "kept", kept, "destroyed", destroyed)
	rt.publishCDILocked(inv)
	if rt.mpsSup != nil {
		if err := rt.mpsSup.reconcile(ctx, rt.mpsWants(inv, live, partitions)); err != nil {
			errs = append(errs, fmt.Errorf("reconcile: %w", err))
		}
	}
	return errors.Join(errs...)
}

var (
	_ deviceplugin.Releaser       = (*Plugin)(nil)
	_ deviceplugin.Reconciler     = (*Plugin)(nil)
	_ deviceplugin.OptionReserver = (*Plugin)(nil)
)

// publishCDI writes the CDI spec for inv, when the plugin keeps one.
func (rt *runtime) publishCDI(inv *inventory) {
	if rt.cdi == nil {
		return
	}
	rt.migMu.Lock()
	defer rt.migMu.Unlock()
	rt.publishCDILocked(inv)
}

// publishCDILocked writes the CDI spec: inv's GPUs, their replicas, and the MIG
// devices that exist on its MIG GPUs now, each named by its device ID. Called with
// the MIG lock held, so that a spec read before a create is not written after a
// later one.
func (rt *runtime) publishCDILocked(inv *inventory) {
	if rt.cdi == nil {
		return
	}
	var more []cdiAlias
	for i, g := range inv.gpus {
		plan := inv.plans[i]
		for k := range plan.replicas {
			more = append(more, cdiAlias{name: replicaID(g.uuid, k), parent: g})
		}
		if plan.mode == modeWhole {
			for k := range plan.mps {
				more = append(more, cdiAlias{name: mpsShareID(g.uuid, k), parent: g})
			}
		}
		switch plan.mode {
		case modeStatic:
			for _, m := range readMIGDevices(g, nil) {
				more = append(more, cdiAlias{name: m.uuid, parent: g, mig: true, gi: m.gi, ci: m.ci})
				for k := range plan.mps {
					more = append(more, cdiAlias{name: mpsShareID(m.uuid, k), parent: g, mig: true, gi: m.gi, ci: m.ci})
				}
			}
		case modeOnDemand:
			for _, m := range readMIGDevices(g, plan.profiles) {
				if m.profile != nil {
					id := partitionID(g.uuid, m.profile.name, m.placement.Start)
					more = append(more, cdiAlias{name: id, parent: g, mig: true, gi: m.gi, ci: m.ci})
					for k := range plan.mps {
						more = append(more, cdiAlias{name: mpsShareID(id, k), parent: g, mig: true, gi: m.gi, ci: m.ci})
					}
				}
			}
		}
	}
	rt.cdi.publish(inv.gpus, more)
}
