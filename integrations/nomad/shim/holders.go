package shim

import (
	"cmp"
	"slices"
	"strings"
	"time"

	"github.com/devicehost/devicehost/integrations/nomad/nomadapi"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// AllocOwner is the owner a reservation gets once the shim knows which allocation's
// task holds its devices: "nomad/<namespace>/<job>/<alloc-id>/<task>". A job's
// reservations are those whose owner starts with "nomad/<namespace>/<job>/".
func AllocOwner(namespace, job, allocID, task string) string {
	return OwnerPrefix + namespace + "/" + job + "/" + allocID + "/" + task
}

// isReserveOwner reports whether owner is one Reserve made up ("nomad/<random>"):
// a reservation not yet handed to its allocation.
func isReserveOwner(owner string) bool {
	rest, ok := strings.CutPrefix(owner, OwnerPrefix)
	return ok && rest != "" && !strings.Contains(rest, "/")
}

// nomadView is one answer of Nomad about the node: its allocations, and when the
// request for it was sent (it shows every allocation placed before that).
type nomadView struct {
	issued time.Time
	index  uint64
	allocs []nomadapi.Allocation
}

// taskHold is one device block of one allocation's task.
type taskHold struct {
	alloc   *nomadapi.Allocation
	task    string
	devices []string
}

func (h taskHold) owner() string {
	return AllocOwner(h.alloc.Namespace, h.alloc.JobID, h.alloc.ID, h.task)
}

// holdsByDevice maps each device ID to the device blocks that list it.
func (v *nomadView) holdsByDevice() map[string][]taskHold {
	out := map[string][]taskHold{}
	for i := range v.allocs {
		a := &v.allocs[i]
		if a.AllocatedResources == nil {
			continue
		}
		for task, tr := range a.AllocatedResources.Tasks {
			if tr == nil {
				continue
			}
			for _, d := range tr.Devices {
				if d == nil {
					continue
				}
				h := taskHold{alloc: a, task: task, devices: d.DeviceIDs}
				for _, id := range d.DeviceIDs {
					out[id] = append(out[id], h)
				}
			}
		}
	}
	return out
}

// booking is what the shim remembers of one "nomad/" reservation between passes.
type booking struct {
	// freeSince is when a pass first found no allocation the client still runs
	// holding any of its devices; zero while one does.
	freeSince time.Time
	// ended names the allocation that last held its devices and has ended, for the
	// log ("" if none is known).
	ended string
	// reownFailed is the owner a Reown to which failed and was logged.
	reownFailed string
	// releaseFailed is the last Release error logged.
	releaseFailed string
}

// actionKind is what a pass does with a reservation.
type actionKind int

const (
	actReown actionKind = iota + 1
	actRelease
)

// action is one call a pass makes at the agent.
type action struct {
	kind     actionKind
	res      *pb.Reservation
	newOwner string        // actReown
	why      string        // actRelease: which allocation ended, or that none holds it
	freeFor  time.Duration // actRelease
}

// tracker decides, from Nomad's view of the node and the agent's live reservations,
// which reservation to hand to its allocation and which to release. Owned by the
// follower's goroutine.
type tracker struct {
	grace    time.Duration
	bookings map[string]*booking // by reservation ID
}

func newTracker(grace time.Duration) *tracker {
	return &tracker{grace: grace, bookings: map[string]*booking{}}
}

// decide goes through rs, the agent's live reservations, at now, with v, a view Nomad
// answered, and returns the calls to make and when the next release falls due (zero
// if none waits). Only reservations of "nomad/" owners count, and each only by a view
// whose request was sent after it was made (an older one cannot show its allocation).
//
//   - A reservation any of whose devices a task of an allocation the client has not
//     finished (pending, running, unknown) holds is kept; if it still has the owner
//     Reserve made up, it is handed to that task (AllocOwner), the task whose device
//     block is exactly its devices first, then the newest allocation.
//   - One that no such allocation holds (its allocation complete, failed or lost, or
//     gone from the node) is released once that has been so for the grace period.
func (t *tracker) decide(v *nomadView, rs []*pb.Reservation, now time.Time) ([]action, time.Time) {
	holds := v.holdsByDevice()
	var acts []action
	var next time.Time
	seen := map[string]bool{}
	for _, r := range rs {
		if !strings.HasPrefix(r.GetOwnerId(), OwnerPrefix) || r.GetState() != pb.ReservationState_RESERVATION_STATE_ACTIVE {
			continue
		}
		id := r.GetReservationId()
		seen[id] = true
		bk := t.bookings[id]
		if bk == nil {
			bk = &booking{}
			t.bookings[id] = bk
		}
		if !r.GetCreatedAt().AsTime().Before(v.issued) {
			continue // made after Nomad was asked: judged by the next answer
		}
		var live, ended []taskHold
		for _, dev := range r.GetDeviceIds() {
			for _, h := range holds[dev] {
				if h.alloc.ClientTerminal() {
					ended = append(ended, h)
				} else {
					live = append(live, h)
				}
			}
		}
		if len(live) > 0 {
			bk.freeSince, bk.ended = time.Time{}, ""
			if isReserveOwner(r.GetOwnerId()) {
				if owner := bestHold(live, r.GetDeviceIds()).owner(); owner != bk.reownFailed {
					acts = append(acts, action{kind: actReown, res: r, newOwner: owner})
				}
			}
			continue
		}
		if len(ended) > 0 {
			h := bestHold(ended, r.GetDeviceIds())
			bk.ended = h.owner() + " (" + h.alloc.ClientStatus + ")"
		}
		if bk.freeSince.IsZero() {
			bk.freeSince = now
		}
		due := bk.freeSince.Add(t.grace)
		if now.Before(due) {
			if next.IsZero() || due.Before(next) {
				next = due
			}
			continue
		}
		why := "no allocation on this node holds its devices"
		if bk.ended != "" {
			why = "allocation ended: " + bk.ended
		}
		acts = append(acts, action{kind: actRelease, res: r, why: why, freeFor: now.Sub(bk.freeSince)})
	}
	for id := range t.bookings {
		if !seen[id] {
			delete(t.bookings, id)
		}
	}
	return acts, next
}

// bestHold picks, of holds (not empty), the one whose devices are exactly devices,
// else any; among equals the newest allocation (then the smallest ID and task name,
// so that the choice is stable).
func bestHold(holds []taskHold, devices []string) taskHold {
	exact := func(h taskHold) bool {
		return len(h.devices) == len(devices) && !slices.ContainsFunc(devices, func(d string) bool { return !slices.Contains(h.devices, d) })
	}
	return slices.MinFunc(holds, func(a, b taskHold) int {
		ea, eb := exact(a), exact(b)
		switch {
		case ea && !eb:
			return -1
		case eb && !ea:
			return 1
		}
		return cmp.Or(cmp.Compare(b.alloc.CreateIndex, a.alloc.CreateIndex),
			strings.Compare(a.alloc.ID, b.alloc.ID), strings.Compare(a.task, b.task))
	})
}
