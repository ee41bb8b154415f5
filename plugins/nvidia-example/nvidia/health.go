package nvidia

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/hashicorp/go-hclog"
)

// applicationXIDs are XIDs that an application's own bug or exit causes; the GPU is
// fine afterwards, so they do not make it unhealthy. NVIDIA's Kubernetes device plugin
// ignores the same set:
// 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing,
// 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout.
var applicationXIDs = map[uint64]bool{13: true, 31: true, 43: true, 45: true, 68: true, 109: true}

// healthBook remembers, per device ID, the last event that made the device unhealthy.
// A device is unhealthy from that event until quiet has passed with no new one. It is
// safe for concurrent use; changes wakes everyone waiting for a change.
//
// It also keeps each device's last XID, critical or not (DCGM's XID_ERRORS field), for
// the stats: that is not a health change, so it wakes no one.
type healthBook struct {
	quiet time.Duration

	mu      sync.Mutex
	actions map[string]pendingAction // device ID -> the recovery action the driver asks for
	last    map[string]healthEvent
	xids    map[string]uint64 // device ID -> the last XID it raised
	changed chan struct{}     // closed and replaced on every change
}

type healthEvent struct {
	at     time.Time
	reason string
}

func newHealthBook(quiet time.Duration) *healthBook {
	return &healthBook{quiet: quiet, actions: make(map[string]pendingAction), last: make(map[string]healthEvent),
		xids: make(map[string]uint64), changed: make(chan struct{})}
}

// pendingAction is a recovery action other than none that the driver reports for a
// GPU, and the health reason it gives.
type pendingAction struct {
	action nvml.DeviceGpuRecoveryAction
	reason string
	caused bool // the reason names the XID that made the plugin ask
}

// recoveryActionNames name the driver's recovery actions in health reasons.
var recoveryActionNames = map[nvml.DeviceGpuRecoveryAction]string{
	nvml.GPU_RECOVERY_ACTION_NONE:                "none",
	nvml.GPU_RECOVERY_ACTION_GPU_RESET:           "GPU reset",
	nvml.GPU_RECOVERY_ACTION_NODE_REBOOT:         "node reboot",
	nvml.GPU_RECOVERY_ACTION_DRAIN_P2P:           "drain P2P",
	nvml.GPU_RECOVERY_ACTION_DRAIN_AND_RESET:     "drain and reset",
	nvml.GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN: "recover IMEX domain",
	nvml.GPU_RECOVERY_ACTION_BUS_RESET:           "bus reset",
	nvml.GPU_RECOVERY_ACTION_SYSTEM_REBOOT:       "system reboot",
}

func recoveryActionName(a nvml.DeviceGpuRecoveryAction) string {
	if n, ok := recoveryActionNames[a]; ok {
		return n
	}
	return fmt.Sprintf("action %d", a)
}

// readRecoveryAction asks the driver which recovery action the GPU needs
// (nvml.FI_DEV_GET_GPU_RECOVERY_ACTION); ok is false when the driver does not say.
func readRecoveryAction(dev nvml.Device) (action nvml.DeviceGpuRecoveryAction, ok bool) {
	fv := []nvml.FieldValue{{FieldId: nvml.FI_DEV_GET_GPU_RECOVERY_ACTION}}
	if ret := dev.GetFieldValues(fv); ret != nvml.SUCCESS || nvml.Return(fv[0].NvmlReturn) != nvml.SUCCESS {
		return 0, false
	}
	switch nvml.ValueType(fv[0].ValueType) {
	case nvml.VALUE_TYPE_UNSIGNED_LONG, nvml.VALUE_TYPE_UNSIGNED_LONG_LONG, nvml.VALUE_TYPE_SIGNED_LONG_LONG:
		return nvml.DeviceGpuRecoveryAction(binary.LittleEndian.Uint64(fv[0].Value[:])), true
	default:
		return nvml.DeviceGpuRecoveryAction(binary.LittleEndian.Uint32(fv[0].Value[:4])), true
	}
}

// setAction records the recovery action the driver reports for id at at; cause, when
// set, is what made the plugin ask (an XID). While it is not none the device is
// unhealthy, whatever its XIDs; none clears it at once. It reports whether the action
// is pending.
func (h *healthBook) setAction(id string, action nvml.DeviceGpuRecoveryAction, at time.Time, cause string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	prev, had := h.actions[id]
	switch {
	case action == nvml.GPU_RECOVERY_ACTION_NONE && had:
		delete(h.actions, id)
		delete(h.last, id) // the driver says the GPU is fine: no quiet period
	case action == nvml.GPU_RECOVERY_ACTION_NONE:
		return false
	case had && prev.action == action && (cause == "" || prev.caused):
		return true // an XID seen by a poll first still gets its XID into the reason
	default:
		reason := fmt.Sprintf("recovery action %q required (reported by the driver at %s)", recoveryActionName(action), at.UTC().Format(time.RFC3339))
		if cause != "" {
			reason = fmt.Sprintf("%s at %s; recovery action %q required", cause, at.UTC().Format(time.RFC3339), recoveryActionName(action))
		}
		h.actions[id] = pendingAction{action: action, reason: reason, caused: cause != ""}
	}
	close(h.changed)
	h.changed = make(chan struct{})
	return action != nvml.GPU_RECOVERY_ACTION_NONE
}

// pollRecoveryActions reads the recovery action of every GPU whose driver reports one
// into h, and says whether any is pending (then the caller polls again after
// recoveryActionPoll, since no event says when the action is done).
func pollRecoveryActions(h *healthBook, gpus []gpu, now time.Time) (pending bool) {
	for _, g := range gpus {
		if a, ok := readRecoveryAction(g.dev); ok && h.setAction(g.uuid, a, now, "") {
			pending = true
		}
	}
	return pending
}

// recoveryActionPoll is how often a GPU with a pending recovery action is asked again.
const recoveryActionPoll = 5 * time.Second

// inherit copies old's events into h, which nobody uses yet.
func (h *healthBook) inherit(old *healthBook) {
	old.mu.Lock()
	defer old.mu.Unlock()
	for id, ev := range old.last {
		h.last[id] = ev
	}
	for id, a := range old.actions {
		h.actions[id] = a
	}
	for id, xid := range old.xids {
		h.xids[id] = xid
	}
}

// recordXID remembers xid as the last XID device id raised.
func (h *healthBook) recordXID(id string, xid uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.xids[id] = xid
}

// lastXID returns the last XID device id raised, 0 when none.
func (h *healthBook) lastXID(id string) uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.xids[id]
}

// markUnhealthy records that id went bad at at for reason. An event older than the one
// already recorded is ignored.
func (h *healthBook) markUnhealthy(id string, at time.Time, reason string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if prev, ok := h.last[id]; ok && prev.at.After(at) {
		return
	}
	h.last[id] = healthEvent{at: at, reason: reason}
	close(h.changed)
	h.changed = make(chan struct{})
}

// status reports id's health at now. While unhealthy, until is when it turns healthy
// again unless another event comes first; zero while a recovery action is pending.
func (h *healthBook) status(id string, now time.Time) (healthy bool, reason string, until time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if a, ok := h.actions[id]; ok {
		return false, a.reason, time.Time{} // until the driver says none
	}
	ev, ok := h.last[id]
	if !ok {
		return true, "", time.Time{}
	}
	until = ev.at.Add(h.quiet)
	if !now.Before(until) {
		return true, "", time.Time{}
	}
	return false, ev.reason, until
}

// changes returns a channel that is closed at the next change. Take it before reading
// the state, so no change between the read and the wait is missed.
func (h *healthBook) changes() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.changed
}

// xidReason is the health reason for a critical XID.
func xidReason(xid uint64, at time.Time) string {
	return fmt.Sprintf("XID %d (critical) at %s", xid, at.UTC().Format(time.RFC3339))
}

// xidWatch turns NVML critical-XID events for a fixed set of GPUs into health book
// entries. Its event set belongs to the goroutine running run.
type xidWatch struct {
	logger hclog.Logger
	clock  clock
	health *healthBook
	set    nvml.EventSet
	gpus   map[string]bool // IDs registered on set
	poll   time.Duration   // how long one Wait may block
}

// waitErrorBackoff is how long the watch pauses after a failed Wait before the next.
const waitErrorBackoff = 5 * time.Second

// startXIDWatch creates an event set and registers gpus for critical XID events. A GPU
// that cannot register is marked unhealthy (except when it simply does not support
// events, which is logged). It returns nil when no event set can be made; the caller
// must call run on a non-nil result, which frees the set.
func startXIDWatch(rt *runtime, gpus []gpu, poll time.Duration) *xidWatch {
	set, ret := rt.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		rt.logger.Warn("cannot watch GPU health: NVML event set not created; XIDs will not be seen", "error", ret)
		return nil
	}
	w := &xidWatch{logger: rt.logger, clock: rt.clock, health: rt.health, set: set,
		gpus: make(map[string]bool), poll: poll}
	for _, g := range gpus {
		supported, ret := g.dev.GetSupportedEventTypes()
		if ret == nvml.SUCCESS {
			if supported&nvml.EventTypeXidCriticalError == 0 {
				ret = nvml.ERROR_NOT_SUPPORTED
			} else {
				ret = g.dev.RegisterEvents(nvml.EventTypeXidCriticalError, set)
			}
		}
		switch ret {
		case nvml.SUCCESS:
			w.gpus[g.uuid] = true
		case nvml.ERROR_NOT_SUPPORTED:
			rt.logger.Warn("GPU does not report XID events; its health is not watched", "gpu", g.uuid)
		default:
			now := rt.clock.Now()
			rt.health.markUnhealthy(g.uuid, now, fmt.Sprintf("cannot watch XID events: %v", ret))
		}
	}
	return w
}

// run waits for XID events until ctx ends, then frees the event set. Each Wait blocks
// at most poll, so run returns within about poll of ctx ending.
func (w *xidWatch) run(ctx context.Context) {
	defer w.set.Free()
	timeoutMS := uint32(max(w.poll.Milliseconds(), 1))
	for ctx.Err() == nil {
		ev, ret := w.set.Wait(timeoutMS)
		switch ret {
		case nvml.SUCCESS:
			w.handle(ev)
		case nvml.ERROR_TIMEOUT:
		default:
			now := w.clock.Now()
			w.logger.Error("waiting for NVML events failed; marking watched GPUs unhealthy", "error", ret)
			for id := range w.gpus {
				w.health.markUnhealthy(id, now, fmt.Sprintf("NVML event wait failed at %s: %v", now.UTC().Format(time.RFC3339), ret))
			}
			t := w.clock.TimerAt(now.Add(waitErrorBackoff))
			select {
			case <-ctx.Done():
			case <-t.C():
			}
			t.Stop()
		}
	}
}

func (w *xidWatch) handle(ev nvml.EventData) {
	if ev.EventType != nvml.EventTypeXidCriticalError {
		return
	}
	xid := ev.EventData
	var id string
	ret := nvml.ERROR_INVALID_ARGUMENT
	if ev.Device != nil {
		id, ret = ev.Device.GetUUID()
	}
	// Every XID is the GPU's last XID (for the stats), whether it hurts health or not.
	switch {
	case ret != nvml.SUCCESS:
		for id := range w.gpus {
			w.health.recordXID(id, xid)
		}
	case w.gpus[id]:
		w.health.recordXID(id, xid)
	}
	now := w.clock.Now()
	if ret == nvml.SUCCESS && w.gpus[id] {
		// Where the driver says what to do, health follows it rather than the list.
		if action, ok := readRecoveryAction(ev.Device); ok {
			if w.health.setAction(id, action, now, fmt.Sprintf("XID %d", xid)) {
				w.logger.Warn("XID; the driver asks for a recovery action, GPU marked unhealthy", "gpu", id, "xid", xid,
					"recovery_action", recoveryActionName(action))
			} else {
				w.logger.Info("XID; the driver asks for no recovery action, GPU stays healthy", "gpu", id, "xid", xid)
			}
			return
		}
	}
	if applicationXIDs[xid] {
		w.logger.Info("application XID; GPU stays healthy", "xid", xid)
		return
	}
	reason := xidReason(xid, now)
	if ret != nvml.SUCCESS {
		// NVML could not say which GPU: like NVIDIA's device plugins, distrust them all.
		w.logger.Warn("critical XID on an unidentified GPU; marking all watched GPUs unhealthy", "xid", xid)
		for id := range w.gpus {
			w.health.markUnhealthy(id, now, reason+" on an unidentified GPU")
		}
		return
	}
	if !w.gpus[id] {
		w.logger.Debug("critical XID on a GPU this plugin does not report", "gpu", id, "xid", xid)
		return
	}
	w.logger.Warn("critical XID; GPU marked unhealthy", "gpu", id, "xid", xid)
	w.health.markUnhealthy(id, now, reason)
}
