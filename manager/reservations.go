package manager

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/internal/steps"
	"github.com/devicehost/devicehost/manager/inventory"
	"github.com/devicehost/devicehost/manager/ledger"
	"github.com/devicehost/devicehost/manager/supervise"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/textline"
	"github.com/devicehost/devicehost/validate"
)

// This file is the manager's side of reservations, in the order a Reserve runs: the
// claim that keeps concurrent Reserves of a device apart, the ledger's check, the route
// to the plugin the devices are bound to (from the inventory's snapshot), the plugin's
// Reserve (supervise.Supervisor.Reserve), and the ledger write. Release, Reown and Reservations
// are the ledger's, plus a refresh of the inventory's holders.

// reservationStore is what the manager asks of its reservation ledger. The ledger
// (manager/ledger) is its one implementation, and the one place the conflict rules live
// (ledger.Check and ledger.Reserve decide alike, atomically with the write for Reserve);
// the interface is only the seam a test wraps to hold a Reserve between its steps
// (gatedStore in manager_test.go).
type reservationStore interface {
	Check(ownerID string, deviceIDs, takeOver []string, opts map[string]string, consumes []device.Consumption, caps device.Capacity) (*device.Reservation, error)
	Reserve(ctx context.Context, r device.Reservation, takeOver []string, caps device.Capacity) (res device.Reservation, existing bool, err error)
	Release(ctx context.Context, req device.ReleaseRequest, now time.Time) (released, already []device.Reservation, err error)
	Reown(ctx context.Context, req device.ReownRequest) (device.Reservation, error)
	List(ctx context.Context, f device.ReservationFilter) ([]device.Reservation, error)
	Holders() map[string]device.Holder
	Usage() map[device.CounterSetKey]device.CounterUse
	Refused(ctx context.Context, call string, e device.Event, err error)
}

var _ reservationStore = (*ledger.Ledger)(nil)

// Reserve reserves req's devices for req.OwnerID through the plugin they are bound to,
// passing req.PluginOptions to the plugin's Reserve and recording them with the
// reservation. A retried request (same owner, same devices, same plugin options) gets
// the live reservation back; one with other options is a *device.OptionsDifferError.
// A plugin that refuses the request (INVALID_ARGUMENT: an option it does not take) is
// device.ErrInvalidRequest with its message, and nothing is held. Checks, in
// order: holders (ErrDeviceHeld), the inventory (ErrUnknownDevice: unknown group, devices
// not in it or spread over two plugins), the plugin (ErrPluginUnavailable) and health
// (ErrUnhealthyDevice); then the plugin is asked, bounded by ctx, ReserveTimeout and its
// exit; its answer is validated (ErrPluginResponse) and committed to the ledger with the
// reservation, in one durable write, before Reserve returns. Every refusal is in the
// audit trail. A concurrent Reserve touching the same devices is refused with
// ErrDeviceHeld while the first is in flight.
//
// The trust boundary is the host API, not this method: the server (server/api.go)
// checks every request with validate.ReserveRequest, the one place its rules live, before
// it calls Reserve, and so must any other caller (tests, in-process tools). Reserve does
// not check the request again; it asserts only what it cannot run without (an owner and
// a device: an "internal:" error otherwise), and the ledger what it may store. The same
// holds for Release (validate.ReleaseRequest), Reown (validate.ReownRequest) and
// Reservations (validate.ReservationFilter).
//
// Holders whose owner starts with one of req.TakeOverOwnerPrefixes do not refuse the
// Reserve: they keep holding the devices while the plugin is asked (the claim keeps
// every other Reserve off them meanwhile) and are released in the ledger write that
// records the new reservation, all or nothing; the GC then owes their plugin cleanup as
// after a Release. If anything fails before that write, or the write itself, they are
// left as they were. Each one taken over is logged.
func (m *Manager) Reserve(ctx context.Context, req device.ReserveRequest) (device.Reservation, error) {
	if m.stopping.Load() {
		return device.Reservation{}, fmt.Errorf("reserve: %w", device.ErrShuttingDown)
	}
	if req.OwnerID == "" || len(req.DeviceIDs) == 0 {
		return device.Reservation{}, errors.New("reserve: internal: a request without an owner or devices (validate.ReserveRequest refuses it)")
	}
	if req.AdminAccess {
		return m.adminAccess(ctx, req)
	}
	ids := slices.Clone(req.DeviceIDs)
	// A refusal before the ledger's write is recorded in the trail here; one at the
	// write, by the ledger.
	refuse := func(err error) (device.Reservation, error) {
		m.store.Refused(ctx, "reserve", device.Event{Owner: req.OwnerID, Devices: ids}, err)
		return device.Reservation{}, err
	}
	// Each step is a runtime/trace region (free unless the agent is being traced), in
	// the call's task where the server started one: tools/hostbench's breakdown and `go
	// tool trace` read them. See docs/benchmarks.md#where-a-reserve-goes.
	// Claim before checking the store: a Reserve that commits between the check and the
	// claim would otherwise leave this one asking the plugin for a device already held.
	region := steps.Start(ctx, "claim")
	release, err := m.claimAfterCleanups(ctx, req.OwnerID, ids)
	region.End()
	if err != nil {
		return refuse(err)
	}
	defer release()
	takeOver := slices.Clone(req.TakeOverOwnerPrefixes)
	region = steps.Start(ctx, "ledger check")
	opts := maps.Clone(req.PluginOptions)
	existing, err := m.store.Check(req.OwnerID, ids, takeOver, opts, nil, nil)
	region.End()
	if ue := (*ledger.UnansweredError)(nil); errors.As(err, &ue) {
		// Its owner asks again for a reservation left without its answer by a stop.
		return m.answerIntent(ctx, ue.Reservation)
	}
	if err != nil || existing != nil {
		if existing != nil {
			return *existing, nil
		}
		return refuse(err)
	}
	region = steps.Start(ctx, "route")
	snap := m.reg.Snapshot()
	plugin, err := route(snap, req.Group, ids)
	region.End()
	if err != nil {
		return refuse(m.awaitedError(ids, err))
	}
	// Devices that share counters (GPU partitions): Reserves of one counter set run one
	// at a time, and the capacity is checked before the plugin carves anything, so a
	// Reserve that cannot fit never makes the plugin create an instance. The ledger
	// checks it again, atomically with its write.
	consumes, caps, err := consumption(snap, req.Group, ids)
	if err != nil {
		return refuse(err)
	}
	if len(consumes) > 0 {
		region = steps.Start(ctx, "counter sets")
		unlock, err := m.lockCounterSets(ctx, consumes)
		if err != nil {
			region.End()
			return device.Reservation{}, fmt.Errorf("reserve: %w", err)
		}
		defer unlock()
		_, err = m.store.Check(req.OwnerID, ids, takeOver, opts, consumes, caps)
		region.End()
		if err != nil {
			return refuse(err)
		}
	}

	s := m.supervisor(plugin)
	if s == nil { // removed since the snapshot was taken
		return refuse(fmt.Errorf("plugin %q was removed: %w", plugin, device.ErrPluginUnavailable))
	}
	rec := device.Reservation{
		ID:          ledger.NewID(),
		OwnerID:     req.OwnerID,
		Group:       req.Group,
		Plugin:      plugin,
		DeviceIDs:   ids,
		Consumes:    consumes,
		State:       device.ReservationActive,
		CreatedAt:   m.cfg.Now(),
		OwnerLabels: device.OwnerLabelsOf(req.OwnerLabels), // validated at the server
		// Validated at the server; the plugin refuses what it does not take.
		PluginOptions: opts,
	}
	// The plugin is asked first; its answer is recorded with the reservation in one
	// commit, durable before the caller sees it. A stop in between leaves nothing
	// recorded, and the plugin undoes what it prepared at its next Reconcile.
	container, err := m.askPlugin(ctx, s, rec.ID, ids, opts)
	if err != nil {
		return refuse(err)
	}
	// Holders taken over, if any, are released in the same write.
	rec.Container = container
	region = steps.Start(ctx, "ledger commit")
	r, _, err := m.store.Reserve(ctx, rec, takeOver, caps)
	region.End()
	if err != nil {
		return device.Reservation{}, fmt.Errorf("record reservation: %w", err)
	}
	region = steps.Start(ctx, "refresh")
	m.reg.Refresh(ctx)
	region.End()
	for _, id := range r.TakenOver {
		m.log.Info("reservation taken over: released in the write that made the new one",
			"reservation_id", id, "new_reservation_id", r.ID, "new_owner_id", r.OwnerID, "devices", strings.Join(ids, ","))
	}
	return r, nil
}

// askPlugin asks plugin s to reserve ids with the caller's plugin options (nil for
// none) for reservation id and checks its answer: the container reservation to record,
// which names the reservation (device.ReservationEnv) so that the GPU processes it
// starts are known as its holder's (metrics: per-holder memory).
func (m *Manager) askPlugin(ctx context.Context, s *supervise.Supervisor, id string, ids []string, opts map[string]string) (device.ContainerReservation, error) {
	region := steps.Start(ctx, "plugin")
	res, err := s.Reserve(ctx, ids, opts)
	region.End()
	if err != nil {
		return device.ContainerReservation{}, err
	}
	region = steps.Start(ctx, "validate answer")
	err = validate.Reservation(res, ids)
	region.End()
	if err != nil {
		return device.ContainerReservation{}, fmt.Errorf("plugin %q answered Reserve with a reservation that breaks the rules: %s: %w", s.Name(), textline.Line(err.Error(), 0), device.ErrPluginResponse)
	}
	container := fromContainerReservation(res)
	container.Envs[device.ReservationEnv] = id
	return container, nil
}

// answerIntent asks intent r's plugin again (with r's plugin options) for the answer
// the host stopped before writing, and records it in the ledger itself (the caller
// holds r's claim): r with its answer, or the plugin's error. A plugin that refuses
// (pluginRefused) gets the intent withdrawn, its devices freed; one that cannot be
// reached leaves it for its next start.
func (m *Manager) answerIntent(ctx context.Context, r device.Reservation) (device.Reservation, error) {
	s := m.supervisor(r.Plugin)
	if s == nil {
		return device.Reservation{}, fmt.Errorf("reservation %s waits for its plugin %q, which this host does not run: %w", r.ID, r.Plugin, device.ErrPluginUnavailable)
	}
	container, err := m.askPlugin(ctx, s, r.ID, r.DeviceIDs, r.PluginOptions)
	if pluginRefused(err) {
		if werr := m.ledger.Withdraw(context.WithoutCancel(ctx), r.ID); werr != nil {
			err = errors.Join(err, werr)
		} else {
			m.log.Warn("a reservation left without its answer by a stop was withdrawn: its plugin refused it when asked again",
				"reservation_id", r.ID, "owner_id", r.OwnerID, "plugin", r.Plugin, "error", textline.Line(err.Error(), 0))
			m.reg.Refresh(ctx)
		}
	}
	if err != nil {
		return device.Reservation{}, err
	}
	out, err := m.ledger.FinalizeNow(ctx, r.ID, container, "answer asked of the plugin again: the host stopped before writing it")
	if err != nil {
		return device.Reservation{}, err
	}
	m.log.Info("a reservation left without its answer by a stop has it again", "reservation_id", r.ID, "owner_id", r.OwnerID, "plugin", r.Plugin)
	return out, nil
}

// pluginRefused says whether askPlugin's err is the plugin's answer, not its absence:
// it refused the request (device.ErrInvalidRequest: an option it does not take) or its
// answer broke the rules (device.ErrPluginResponse). Asking again gets the same.
func pluginRefused(err error) bool {
	return errors.Is(err, device.ErrPluginResponse) || errors.Is(err, device.ErrInvalidRequest)
}

// intentIDs is the set of the IDs of intents.
func intentIDs(intents []device.Reservation) map[string]bool {
	ids := make(map[string]bool, len(intents))
	for _, r := range intents {
		ids[r.ID] = true
	}
	return ids
}

// answerIntents answers plugin's intents among left (see answerIntent), and takes out of
// left those no longer unanswered. An intent claimed by a Reserve (its owner asking
// again) is left to that Reserve.
func (m *Manager) answerIntents(ctx context.Context, plugin string, left map[string]bool) {
	all := m.ledger.Intents()
	unanswered := intentIDs(all)
	for id := range left {
		if !unanswered[id] {
			delete(left, id) // answered by its owner's Reserve, or released
		}
	}
	for _, r := range all {
		if !left[r.ID] || r.Plugin != plugin {
			continue
		}
		release, err := m.claim(r.OwnerID, r.DeviceIDs)
		if err != nil {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, m.cfg.ReserveTimeout)
		_, err = m.answerIntent(cctx, r)
		cancel()
		release()
		switch {
		case err == nil, pluginRefused(err), errors.Is(err, device.ErrNotFound):
			delete(left, r.ID)
		default:
			m.log.Warn("a reservation left without its answer by a stop is still without it: its devices stay held, and the plugin is asked again at its next start",
				"reservation_id", r.ID, "owner_id", r.OwnerID, "plugin", plugin, "error", textline.Line(err.Error(), 0))
		}
	}
}

// intentsUp tells answerLeftIntents that plugin is up (a supervisor's OnUp): it never
// blocks.
func (m *Manager) intentsUp(plugin string) {
	m.intentMu.Lock()
	m.intentUp[plugin] = true
	m.intentMu.Unlock()
	select {
	case m.intentWake <- struct{}{}:
	default:
	}
}

// answerLeftIntents answers left, the intents the state file held without their answer
// when the manager started (a stop came between a Reserve's reply and the write of its
// answer), plugin by plugin as each comes up (intentsUp), until none is left or ctx
// ends. A Reserve in flight always answers or withdraws its own intent.
func (m *Manager) answerLeftIntents(ctx context.Context, left map[string]bool) {
	for len(left) > 0 {
		select {
		case <-ctx.Done():
			return
		case <-m.intentWake:
		}
		m.intentMu.Lock()
		up := slices.Sorted(maps.Keys(m.intentUp))
		clear(m.intentUp)
		m.intentMu.Unlock()
		for _, plugin := range up {
			m.answerIntents(ctx, plugin, left)
		}
	}
}

// liveReservations lists the live reservations of plugin's devices, with their plugin
// options, for its Reconcile: its intents too, answered or not (their devices are
// held).
func (m *Manager) liveReservations(_ context.Context, plugin string) ([]*pb.LiveReservation, error) {
	var out []*pb.LiveReservation
	for _, r := range m.ledger.Live() {
		if r.Plugin == plugin {
			out = append(out, &pb.LiveReservation{ReservationId: r.ID, DeviceIds: r.DeviceIDs, Options: r.PluginOptions})
		}
	}
	return out, nil
}

// owingRelease returns those of ids (devices of group) that the plugin's Release may
// have something to do for: all but those snap shows with NothingToRelease. A device
// snap does not show (its plugin down, the device gone) is kept.
func owingRelease(snap device.Snapshot, group device.GroupKey, ids []string) []string {
	var none map[string]bool
	for _, d := range devicesIn(snap, group, ids) {
		if d.NothingToRelease {
			if none == nil {
				none = make(map[string]bool, len(ids))
			}
			none[d.ID] = true
		}
	}
	if none == nil {
		return ids
	}
	var out []string
	for _, id := range ids {
		if !none[id] {
			out = append(out, id)
		}
	}
	return out
}

// consumption sums what ids (devices of group and of one plugin, as route found them in
// snap) use of their plugin's counter sets, by set sorted by name, with the
// compatibility groups they all share, and returns the capacities of those sets in
// snap; nothing for devices that share nothing. Devices whose uses of one set have no
// group in common (a time-sliced replica and an MPS share of one GPU) cannot be held
// together: an ErrInvalidRequest says which.
func consumption(snap device.Snapshot, group device.GroupKey, ids []string) ([]device.Consumption, device.Capacity, error) {
	type setUse struct {
		counters map[string]int64
		groups   []string
		first    string // the first device using the set
	}
	sum := make(map[device.CounterSetKey]*setUse)
	for _, d := range devicesIn(snap, group, ids) {
		for _, c := range d.Consumes {
			u := sum[c.Set]
			if u == nil {
				u = &setUse{counters: make(map[string]int64, len(c.Counters)), groups: c.Groups, first: d.ID}
				sum[c.Set] = u
			} else {
				common, ok := device.Compatible(u.groups, c.Groups)
				if !ok {
					return nil, nil, fmt.Errorf("devices %q and %q use counter set %q %s and %s: one reservation cannot hold both: %w",
						u.first, d.ID, c.Set.Name, device.SharedAs(u.groups), device.SharedAs(c.Groups), device.ErrInvalidRequest)
				}
				u.groups = common
			}
			for name, v := range c.Counters {
				u.counters[name] += v
			}
		}
	}
	if len(sum) == 0 {
		return nil, nil, nil
	}
	consumes := make([]device.Consumption, 0, len(sum))
	for _, k := range slices.SortedFunc(maps.Keys(sum), func(a, b device.CounterSetKey) int { return strings.Compare(a.Name, b.Name) }) {
		consumes = append(consumes, device.Consumption{Set: k, Counters: sum[k].counters, Groups: slices.Clone(sum[k].groups)})
	}
	caps := make(device.Capacity, len(sum))
	for _, cs := range snap.Inventory.CounterSets {
		if _, ok := sum[cs.Key]; ok {
			caps[cs.Key] = cs.Capacity
		}
	}
	return consumes, caps, nil
}

// devicesIn yields the plugin and the static part of each device of group in snap
// whose ID is one of ids.
func devicesIn(snap device.Snapshot, group device.GroupKey, ids []string) iter.Seq2[string, device.DeviceInfo] {
	return func(yield func(string, device.DeviceInfo) bool) {
		for _, g := range snap.Inventory.Groups {
			if g.GroupKey != group {
				continue
			}
			for _, d := range g.Devices {
				if slices.Contains(ids, d.ID) && !yield(g.Plugin, d) {
					return
				}
			}
		}
	}
}

// lockCounterSets takes the lock of each counter set consumes uses, in name order, and
// returns the function that gives them back; it gives up, holding none, when ctx ends.
// Reserves of one set (one GPU's partitions) so run one after another: of two that
// would not fit together, the second sees the first's reservation, never its plugin
// call in flight.
func (m *Manager) lockCounterSets(ctx context.Context, consumes []device.Consumption) (func(), error) {
	var held []chan struct{}
	unlock := func() {
		for _, l := range held {
			<-l
		}
	}
	for _, c := range consumes {
		m.claimMu.Lock()
		l := m.setLocks[c.Set]
		if l == nil {
			l = make(chan struct{}, 1)
			m.setLocks[c.Set] = l
		}
		m.claimMu.Unlock()
		select {
		case l <- struct{}{}:
			held = append(held, l)
		case <-ctx.Done():
			unlock()
			return nil, fmt.Errorf("waiting for another Reserve of counter set %q: %w", c.Set.Name, context.Cause(ctx))
		}
	}
	return unlock, nil
}

// awaitedError turns route's ErrUnknownDevice for devices bound to a plugin of this host
// that has not reported them yet since the host started (its first fingerprint after a
// host restart is still to come) into ErrPluginUnavailable naming that plugin: the
// devices are coming back, and a caller that retries gets them. Any other err is
// returned as it is.
func (m *Manager) awaitedError(ids []string, err error) error {
	if !errors.Is(err, device.ErrUnknownDevice) {
		return err
	}
	st, ok := m.reg.AwaitedPlugin(ids)
	if !ok {
		return err
	}
	why := ""
	if st.LastError != "" {
		why = "; last error: " + st.LastError
	}
	return fmt.Errorf("devices %s belong to plugin %q, which has not reported its devices since the host started (it is %s%s); retry once it has: %w",
		inventory.ListIDs(ids), st.Name, st.Status, why, device.ErrPluginUnavailable)
}

// route finds the one plugin that serves every device in ids (not empty) within group, and
// checks that it is running and the devices are healthy.
func route(snap device.Snapshot, group device.GroupKey, ids []string) (string, error) {
	pluginOf := make(map[string]string) // device ID -> plugin, within group
	for _, g := range snap.Inventory.Groups {
		if g.GroupKey != group {
			continue
		}
		for _, d := range g.Devices {
			pluginOf[d.ID] = g.Plugin
		}
	}
	if len(pluginOf) == 0 {
		return "", fmt.Errorf("no device group %s: %w", group, device.ErrUnknownDevice)
	}
	var unknown []string
	plugins := make(map[string]bool)
	for _, id := range ids {
		p, ok := pluginOf[id]
		if !ok {
			unknown = append(unknown, id)
			continue
		}
		plugins[p] = true
	}
	switch {
	case len(unknown) == 1:
		return "", fmt.Errorf("device %s is not in group %s: %w", unknown[0], group, device.ErrUnknownDevice)
	case len(unknown) > 1:
		return "", fmt.Errorf("devices %s are not in group %s: %w", strings.Join(unknown, ", "), group, device.ErrUnknownDevice)
	case len(plugins) > 1:
		return "", fmt.Errorf("devices %s of group %s belong to more than one plugin (%s): %w",
			strings.Join(ids, ", "), group, strings.Join(slices.Sorted(maps.Keys(plugins)), ", "), device.ErrUnknownDevice)
	}
	plugin := pluginOf[ids[0]]
	if st := pluginState(snap, plugin); st.Status != device.PluginRunning {
		return "", fmt.Errorf("plugin %q is %s (last error: %s): %w", plugin, st.Status, st.LastError, device.ErrPluginUnavailable)
	}
	var unhealthy []string
	for _, id := range ids {
		if st := snap.State.Devices[id]; st.Health != device.HealthHealthy {
			unhealthy = append(unhealthy, fmt.Sprintf("%s (%s: %s)", id, st.Health, st.Reason))
		}
	}
	if len(unhealthy) > 0 {
		return "", fmt.Errorf("devices not healthy: %s: %w", strings.Join(unhealthy, ", "), device.ErrUnhealthyDevice)
	}
	return plugin, nil
}

func pluginState(snap device.Snapshot, name string) device.PluginState {
	for _, p := range snap.State.Plugins {
		if p.Name == name {
			return p
		}
	}
	return device.PluginState{}
}

// claim marks ids as being reserved by owner until the returned func is called, so two
// concurrent Reserves never both ask a plugin for the same device. A device already
// claimed is a *device.HeldError whose holder has no reservation ID yet.
func (m *Manager) claim(owner string, ids []string) (func(), error) {
	m.claimMu.Lock()
	defer m.claimMu.Unlock()
	return m.claimLocked(owner, ids)
}

// claimAfterCleanups is claim once no plugin cleanup of ids is in flight: it waits for
// those (bounded by ctx), so that a Reserve never asks the plugin for a device the
// plugin is cleaning up after its previous holder (see cleanup).
func (m *Manager) claimAfterCleanups(ctx context.Context, owner string, ids []string) (func(), error) {
	return m.afterCleanups(ctx, ids, "reserve: waiting for the plugin to clean up after the devices' previous holder",
		func() (func(), error) { return m.claimLocked(owner, ids) })
}

// claimForCleanup marks ids as being cleaned up until the returned func is called:
// Reserves of them wait meanwhile (claimAfterCleanups). It waits (bounded by ctx) for
// another cleanup of one of them to end first. A device a Reserve has claimed is a
// *device.HeldError: the cleanup waits for a later try.
func (m *Manager) claimForCleanup(ctx context.Context, reservationID string, ids []string) (func(), error) {
	return m.afterCleanups(ctx, ids, "waiting for another cleanup of the devices", func() (func(), error) {
		for _, id := range ids {
			if o, ok := m.claims[id]; ok {
				return nil, &device.HeldError{OwnerID: "cleanup of " + reservationID,
					Conflicts: []device.Conflict{{Holder: device.Holder{OwnerID: o}, Overlap: []string{id}, Held: []string{id}}}}
			}
		}
		done := make(chan struct{})
		return holdUnder(&m.claimMu, m.cleaning, ids, done, func() { close(done) }), nil
	})
}

// afterCleanups calls then under claimMu once no plugin cleanup of ids is in flight,
// waiting for those that are, bounded by ctx (an error that says it was waiting).
func (m *Manager) afterCleanups(ctx context.Context, ids []string, waiting string, then func() (func(), error)) (func(), error) {
	for {
		m.claimMu.Lock()
		var wait chan struct{}
		for _, id := range ids {
			if ch, ok := m.cleaning[id]; ok {
				wait = ch
				break
			}
		}
		if wait == nil {
			defer m.claimMu.Unlock()
			return then()
		}
		m.claimMu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, fmt.Errorf("%s: %w", waiting, context.Cause(ctx))
		}
	}
}

// claimLocked is claim under claimMu.
func (m *Manager) claimLocked(owner string, ids []string) (func(), error) {
	busy := make(map[string][]string) // claiming owner -> requested devices it claims
	for _, id := range ids {
		if o, ok := m.claims[id]; ok {
			busy[o] = append(busy[o], id)
		}
	}
	if len(busy) > 0 {
		e := &device.HeldError{OwnerID: owner}
		for _, o := range slices.Sorted(maps.Keys(busy)) {
			devs := busy[o]
			slices.Sort(devs)
			e.Conflicts = append(e.Conflicts, device.Conflict{Holder: device.Holder{OwnerID: o}, Overlap: devs, Held: devs})
		}
		return nil, e
	}
	return holdUnder(&m.claimMu, m.claims, ids, owner, nil), nil
}

// holdUnder sets held[id] to v for each of ids (the caller holds mu) and returns the
// func that deletes them again under mu, then calls after (when not nil).
func holdUnder[V any](mu *sync.Mutex, held map[string]V, ids []string, v V, after func()) func() {
	for _, id := range ids {
		held[id] = v
	}
	return func() {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range ids {
			delete(held, id)
		}
		if after != nil {
			after()
		}
	}
}

// Release ends the reservations req names, durably, frees their devices (watchers get a
// snapshot without the holder) and says which it released and which were released before
// (those are not released twice), each list oldest first. The plugin cleanup is not done
// here: it is left pending in the ledger for the garbage collector, which runs it once,
// with retries (see docs/reservations.md#release-and-garbage-collection). req is trusted,
// as Reserve's is: the server checks it with validate.ReleaseRequest.
func (m *Manager) Release(ctx context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
	if m.stopping.Load() {
		return device.ReleaseResult{}, fmt.Errorf("release: %w", device.ErrShuttingDown)
	}
	// Admin accesses end with their ID, or with their owner's Release.
	if ledger.IsAccessID(req.ReservationID) || req.OwnerID != "" {
		ended, err := m.ledger.RevokeAccess(ctx, req)
		if err != nil {
			return device.ReleaseResult{}, err
		}
		var res device.ReleaseResult
		for _, a := range ended {
			res.Released = append(res.Released, a.ID)
		}
		if req.ReservationID != "" {
			if len(ended) == 0 {
				return device.ReleaseResult{}, fmt.Errorf("admin access %s: %w", req.ReservationID, device.ErrNotFound)
			}
			m.reg.Refresh(ctx)
			return res, nil
		}
		if len(ended) > 0 {
			defer m.reg.Refresh(ctx)
		}
		more, err := m.releaseReservations(ctx, req)
		more.Released = append(res.Released, more.Released...)
		return more, err
	}
	return m.releaseReservations(ctx, req)
}

// releaseReservations is Release of reservations (not admin accesses).
func (m *Manager) releaseReservations(ctx context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
	region := steps.Start(ctx, "ledger commit")
	released, already, err := m.store.Release(ctx, req, m.cfg.Now())
	region.End()
	if err != nil {
		return device.ReleaseResult{}, err
	}
	if len(released) > 0 {
		region = steps.Start(ctx, "refresh")
		m.reg.Refresh(ctx)
		region.End()
	}
	var res device.ReleaseResult
	for _, r := range released {
		res.Released = append(res.Released, r.ID)
	}
	for _, r := range already {
		res.AlreadyReleased = append(res.AlreadyReleased, r.ID)
	}
	return res, nil
}

// adminAccess gives req's owner its devices' CDI names without holding them (see
// device.ReserveRequest.AdminAccess): no plugin call, no holder, no cordon or health
// check (a debugging workload may want a device out of service), recorded in the
// ledger apart from the reservations. The answer is a Reservation whose ID is the
// access's ("acc-...").
func (m *Manager) adminAccess(ctx context.Context, req device.ReserveRequest) (device.Reservation, error) {
	snap := m.reg.Snapshot()
	var plugin string
	infos := make(map[string]device.DeviceInfo, len(req.DeviceIDs))
	for p, d := range devicesIn(snap, req.Group, req.DeviceIDs) {
		infos[d.ID] = d
		if plugin != "" && plugin != p {
			return device.Reservation{}, fmt.Errorf("admin access: devices %s of group %s belong to more than one plugin: %w",
				strings.Join(req.DeviceIDs, ", "), req.Group, device.ErrUnknownDevice)
		}
		plugin = p
	}
	var unknown, noCDI, cdi []string
	for _, id := range req.DeviceIDs {
		info, ok := infos[id]
		switch {
		case !ok:
			unknown = append(unknown, id)
		case len(info.CDIDevices) == 0:
			noCDI = append(noCDI, id)
		default:
			cdi = append(cdi, info.CDIDevices...)
		}
	}
	if len(unknown) > 0 {
		return device.Reservation{}, m.awaitedError(unknown, fmt.Errorf("admin access: %s not in group %s: %w",
			strings.Join(unknown, ", "), req.Group, device.ErrUnknownDevice))
	}
	if len(noCDI) > 0 {
		return device.Reservation{}, fmt.Errorf("admin access to %s: plugin %q reports no CDI names for them (it keeps no CDI spec): %w",
			strings.Join(noCDI, ", "), plugin, device.ErrNoCDIDevices)
	}
	a, err := m.ledger.GrantAccess(ctx, device.AdminAccess{OwnerID: req.OwnerID, Group: req.Group, Plugin: plugin,
		DeviceIDs: req.DeviceIDs, CDIDevices: cdi, Since: m.cfg.Now(), By: device.CallerOf(ctx)})
	if err != nil {
		return device.Reservation{}, err
	}
	m.reg.Refresh(ctx)
	return a.Reservation(), nil
}

// Reown hands a live reservation to another owner; see device.Manager. req is trusted,
// as Reserve's is: the server checks it with validate.ReownRequest.
func (m *Manager) Reown(ctx context.Context, req device.ReownRequest) (device.Reservation, error) {
	if m.stopping.Load() {
		return device.Reservation{}, fmt.Errorf("reown: %w", device.ErrShuttingDown)
	}
	r, err := m.store.Reown(ctx, req)
	if err != nil {
		return device.Reservation{}, err
	}
	m.reg.Refresh(ctx) // the holder's owner changed
	return r, nil
}

// Reservations lists the reservations matching f, oldest first. f is trusted, as
// Reserve's request is: the server checks it with validate.ReservationFilter.
func (m *Manager) Reservations(ctx context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
	rs, err := m.store.List(ctx, f)
	if err != nil || !f.IncludeAdminAccess || f.State == device.ReservationReleased {
		return rs, err
	}
	for _, a := range m.ledger.Accesses() {
		if device.OwnerMatches(f.OwnerID, a.OwnerID) && (f.DeviceID == "" || slices.Contains(a.DeviceIDs, f.DeviceID)) {
			rs = append(rs, a.Reservation())
		}
	}
	return rs, nil
}

// fromContainerReservation converts a reservation that validate.Reservation accepted.
func fromContainerReservation(res *pb.ContainerReservation) device.ContainerReservation {
	out := device.ContainerReservation{
		Envs:       maps.Clone(res.GetEnvs()),
		CDIDevices: slices.Clone(res.GetCdiDevices()),
	}
	if out.Envs == nil {
		out.Envs = map[string]string{}
	}
	for _, m := range res.GetMounts() {
		out.Mounts = append(out.Mounts, device.Mount{HostPath: m.GetHostPath(), ContainerPath: m.GetContainerPath(), ReadOnly: m.GetReadOnly()})
	}
	for _, d := range res.GetDevices() {
		out.Devices = append(out.Devices, device.DeviceSpec{HostPath: d.GetHostPath(), ContainerPath: d.GetContainerPath(), Permissions: d.GetPermissions()})
	}
	return out
}

// Cordon takes a known device out of service; see device.Manager. req is trusted, as
// Reserve's is: the server checks it (validate.CordonRequest) and names who asks.
func (m *Manager) Cordon(ctx context.Context, req device.CordonRequest) (device.Cordon, error) {
	if m.stopping.Load() {
		return device.Cordon{}, fmt.Errorf("cordon: %w", device.ErrShuttingDown)
	}
	if _, ok := m.reg.Snapshot().State.Devices[req.DeviceID]; !ok {
		return device.Cordon{}, fmt.Errorf("cordon: device %q: %w", req.DeviceID, device.ErrUnknownDevice)
	}
	c, err := m.ledger.Cordon(ctx, req.DeviceID, device.Cordon{Reason: req.Reason, By: req.By, Since: m.cfg.Now(), Drain: req.Drain})
	if err != nil {
		return device.Cordon{}, err
	}
	m.reg.Refresh(ctx)
	m.log.Info("device cordoned", "device", req.DeviceID, "reason", textline.Line(req.Reason, 0), "by", req.By, "drain", req.Drain)
	return c, nil
}

// Uncordon lifts a device's cordon; see device.Manager.
func (m *Manager) Uncordon(ctx context.Context, deviceID string) (*device.Cordon, error) {
	if m.stopping.Load() {
		return nil, fmt.Errorf("uncordon: %w", device.ErrShuttingDown)
	}
	was, err := m.ledger.Uncordon(ctx, deviceID)
	if err != nil || was == nil {
		return was, err
	}
	m.reg.Refresh(ctx)
	m.log.Info("device uncordoned", "device", deviceID, "was_reason", textline.Line(was.Reason, 0))
	return was, nil
}

// Events returns a page of the audit trail; see device.Manager.
func (m *Manager) Events(ctx context.Context, f device.EventFilter) (device.EventsResult, error) {
	return m.ledger.Events(ctx, f)
}

// EventsAfter is closed once the trail holds an event after seq; see device.Manager.
func (m *Manager) EventsAfter(seq uint64) <-chan struct{} { return m.ledger.EventsAfter(seq) }
