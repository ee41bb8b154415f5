package dra

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	metaapply "k8s.io/client-go/applyconfigurations/meta/v1"
	resourceapply "k8s.io/client-go/applyconfigurations/resource/v1"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Claim device status (DRAResourceClaimDeviceStatus, GA in Kubernetes 1.37): after a
// claim is prepared the driver writes status.devices[] for each of its devices in it,
// with conditions Ready and Healthy (following the device's health while the claim
// stays prepared) and data naming the device, and removes its entries when the claim
// is unprepared. The entries are the driver's own fields (server-side apply, field
// manager the driver's name), so they live beside other drivers' entries. A status the
// API server refuses is logged: the claim stays prepared, as the kubelet asked.

// deviceStatusData is the data of a device's status entry.
type deviceStatusData struct {
	UUID         string   `json:"uuid"`
	Product      string   `json:"product,omitempty"`
	Type         string   `json:"type"`
	MIGProfile   string   `json:"migProfile,omitempty"`
	CDIDeviceIDs []string `json:"cdiDeviceIDs,omitempty"`
}

// preparedClaim is a claim this driver prepared, and the health its status says of
// each of its devices, by DRA device name.
type preparedClaim struct {
	namespace, name string
	devices         []allocated
	cdi             map[string][]string // agent device ID -> CDI IDs
	health          map[string]pb.Health
}

// claimStatuses tracks the claims whose device status the driver keeps.
type claimStatuses struct {
	mu     sync.Mutex
	claims map[string]*preparedClaim // by claim UID
	kick   chan struct{}             // a claim was added: statusLoop has a status to write
	// write is held across each write of a claim's status, so that a clear (Unprepare)
	// and statusLoop's write of the same claim never cross: no entry is written after
	// the claim's entries were removed.
	write sync.Mutex
}

func newClaimStatuses() claimStatuses {
	return claimStatuses{claims: make(map[string]*preparedClaim), kick: make(chan struct{}, 1)}
}

// add records a claim just prepared, its status not written yet (health nil), and
// wakes statusLoop.
func (cs *claimStatuses) add(uid string, pc *preparedClaim) {
	cs.mu.Lock()
	cs.claims[uid] = pc
	cs.mu.Unlock()
	select {
	case cs.kick <- struct{}{}:
	default:
	}
}

// statusWriteTimeout bounds one write of a claim's status.
const statusWriteTimeout = 10 * time.Second

// writeClaimStatus applies the status of claim pc's devices in view v (nil: healthy as
// prepared), and records it as written. Only with statuses.write held.
func (d *Driver) writeClaimStatus(ctx context.Context, uid string, pc *preparedClaim, v *view) error {
	if d.cfg.Kube == nil {
		return nil
	}
	now := metav1.NewTime(time.Now())
	st := resourceapply.ResourceClaimStatus()
	health := make(map[string]pb.Health, len(pc.devices))
	for _, a := range pc.devices {
		h, reason := a.ref.health, a.ref.reason
		if v != nil {
			if cur, ok := v.devices[a.ref.name]; ok {
				h, reason = cur.health, cur.reason
			}
			if v.disconnected != nil {
				h, reason = pb.Health_HEALTH_UNKNOWN, "the agent cannot be reached"
			}
		}
		health[a.ref.name] = h
		healthy, why := metav1.ConditionTrue, "Healthy"
		msg := "the agent reports the device healthy"
		switch h {
		case pb.Health_HEALTH_HEALTHY:
		case pb.Health_HEALTH_UNHEALTHY:
			healthy, why, msg = metav1.ConditionFalse, "Unhealthy", reason
		default:
			healthy, why, msg = metav1.ConditionUnknown, "Unknown", reason
		}
		if msg == "" {
			msg = "no reason given"
		}
		data := deviceStatusData{UUID: a.ref.id, Product: a.ref.group.name, Type: a.ref.group.typ, CDIDeviceIDs: pc.cdi[a.ref.id]}
		if p := a.ref.pool; p != nil && p.kind == poolMPS {
			data.UUID = p.parent // the device its MPS shares divide
		}
		if a.ref.group.typ == "mig" || a.ref.group.typ == "mig.mps" { // a MIG device or its pooled shares
			data.Product, data.MIGProfile = "", a.ref.group.name
		}
		raw, err := json.Marshal(data)
		if err != nil {
			return err
		}
		ds := resourceapply.AllocatedDeviceStatus().
			WithDriver(d.cfg.DriverName).WithPool(d.cfg.NodeName).WithDevice(a.ref.name)
		if a.shareID != nil {
			ds.WithShareID(string(*a.shareID)) // an allocation of a consumable device
		}
		st.WithDevices(ds.
			WithConditions(
				metaapply.Condition().WithType("Ready").WithStatus(metav1.ConditionTrue).WithReason("Prepared").
					WithMessage("reserved at the agent and prepared for the claim's pods").WithLastTransitionTime(now),
				metaapply.Condition().WithType("Healthy").WithStatus(healthy).WithReason(why).
					WithMessage(truncate(msg, 1024)).WithLastTransitionTime(now),
			).
			WithData(runtime.RawExtension{Raw: raw}))
	}
	ctx, cancel := context.WithTimeout(ctx, statusWriteTimeout)
	defer cancel()
	_, err := d.cfg.Kube.ResourceV1().ResourceClaims(pc.namespace).ApplyStatus(ctx,
		resourceapply.ResourceClaim(pc.name, pc.namespace).WithStatus(st),
		metav1.ApplyOptions{FieldManager: d.cfg.DriverName, Force: true})
	if err != nil {
		return fmt.Errorf("claim %s/%s: write its device status: %w", pc.namespace, pc.name, err)
	}
	d.statuses.mu.Lock()
	pc.health = health
	d.statuses.mu.Unlock()
	return nil
}

// clearClaimStatus removes the driver's entries from the claim's status, and forgets it.
// A claim already gone is not an error.
func (d *Driver) clearClaimStatus(ctx context.Context, ref claimRef) error {
	d.statuses.write.Lock()
	defer d.statuses.write.Unlock()
	d.statuses.mu.Lock()
	delete(d.statuses.claims, ref.uid)
	d.statuses.mu.Unlock()
	if d.cfg.Kube == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, statusWriteTimeout)
	defer cancel()
	_, err := d.cfg.Kube.ResourceV1().ResourceClaims(ref.namespace).ApplyStatus(ctx,
		resourceapply.ResourceClaim(ref.name, ref.namespace).WithStatus(resourceapply.ResourceClaimStatus()),
		metav1.ApplyOptions{FieldManager: d.cfg.DriverName, Force: true})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("claim %s/%s: clear its device status: %w", ref.namespace, ref.name, err)
	}
	return nil
}

// statusRetry is how soon statusLoop tries again a status the API server refused.
var statusRetry = 5 * time.Second

// statusLoop writes the device status of every claim prepared since (health nil) and
// again of every one whose devices' health changed in the current view, until ctx
// ends. A write that fails is tried again statusRetry later.
func (d *Driver) statusLoop(ctx context.Context) error {
	retry := time.NewTimer(statusRetry)
	retry.Stop()
	defer retry.Stop()
	defer d.cdi.discard()
	for {
		// A prepare kicks this loop once it has its answer: the next claim's CDI spec
		// file is made here, and the claim's status written, off the kubelet's wait
		// (deferred while it waits).
		d.kubelet.deferred(ctx, maxDefer)
		d.cdi.ahead()
		v, changed := d.current()
		failed := false
		for _, uid := range d.statuses.due(v) {
			if err := d.writeDue(ctx, uid, v); err != nil && ctx.Err() == nil {
				failed = true
				d.log.Warn("claim device status not written", "error", err)
			}
		}
		if failed {
			retry.Reset(statusRetry)
		}
		select {
		case <-changed:
		case <-d.statuses.kick:
		case <-retry.C:
		case <-ctx.Done():
			return nil
		}
	}
}

// due are the UIDs of the claims whose status is not written yet, or says another
// health than view v (nil: no view yet) does, sorted.
func (cs *claimStatuses) due(v *view) []string {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	var out []string
	for uid, pc := range cs.claims {
		if pc.health == nil {
			out = append(out, uid)
			continue
		}
		if v == nil {
			continue
		}
		for _, a := range pc.devices {
			h := pb.Health_HEALTH_UNKNOWN
			if cur, ok := v.devices[a.ref.name]; ok && v.disconnected == nil {
				h = cur.health
			}
			if h != pc.health[a.ref.name] {
				out = append(out, uid)
				break
			}
		}
	}
	slices.Sort(out)
	return out
}

// writeDue writes claim uid's status, if the claim is still prepared once no other
// write of a status runs.
func (d *Driver) writeDue(ctx context.Context, uid string, v *view) error {
	d.statuses.write.Lock()
	defer d.statuses.write.Unlock()
	d.statuses.mu.Lock()
	pc := d.statuses.claims[uid]
	d.statuses.mu.Unlock()
	if pc == nil {
		return nil
	}
	return d.writeClaimStatus(ctx, uid, pc, v)
}

// truncate cuts s to at most n bytes.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
