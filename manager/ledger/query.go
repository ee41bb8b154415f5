package ledger

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/devicehost/devicehost/device"
)

// Counts is how many reservations the ledger holds.
type Counts struct {
	Total          int // Live + Released
	Live           int
	Released       int // listed until garbage collection deletes them
	CleanupPending int // released, plugin cleanup not yet done
}

// Counts returns the current counts.
func (l *Ledger) Counts() Counts {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.idx.counts()
}

// Get returns reservation id, live or released; an unknown id wraps device.ErrNotFound.
func (l *Ledger) Get(id string) (device.Reservation, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	r := l.copyOf(id)
	if r == nil {
		return device.Reservation{}, fmt.Errorf("reservation %q: %w", id, device.ErrNotFound)
	}
	return *r, nil
}

// copyOf is idx.copyOf as readers see it (under mu): nil for an unanswered intent too,
// an answered one with its answer (see intent.go).
func (l *Ledger) copyOf(id string) *device.Reservation {
	if r := l.idx.live[id]; r != nil {
		c, _ := l.shown(r)
		return c
	}
	return l.idx.copyOf(id)
}

// List returns the reservations matching f, oldest first (by CreatedAt, then ID). An
// OwnerID ending in "/" matches every owner that starts with it.
// Released reservations are listed until they are deleted. f is one the host API's
// server has validated (validate.ReservationFilter); a State outside the known values is
// an "internal:" error. ctx is unused: List never waits.
func (l *Ledger) List(_ context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
	switch f.State {
	case device.ReservationAny, device.ReservationActive, device.ReservationReleased:
	default:
		return nil, fmt.Errorf("list reservations: %w: unknown state %d", errInternal, f.State)
	}
	// An owner ending in "/" is a prefix: "nomad/default/train/" lists a job's.
	prefix := strings.HasSuffix(f.OwnerID, "/")
	ownerOK := func(owner string) bool { return device.OwnerMatches(f.OwnerID, owner) }
	match := func(r *device.Reservation) bool {
		return ownerOK(r.OwnerID) &&
			(f.State == device.ReservationAny || r.State == f.State) &&
			(f.DeviceID == "" || slices.Contains(r.DeviceIDs, f.DeviceID))
	}
	var rs []*device.Reservation // the caller's copies
	l.mu.RLock()
	if f.OwnerID != "" && !prefix {
		for _, id := range l.idx.ownerIDs(f.OwnerID) {
			if r := l.copyOf(id); r != nil && match(r) {
				rs = append(rs, r)
			}
		}
	} else {
		for _, r := range l.idx.live {
			if match(r) {
				if c, ok := l.shown(r); ok {
					rs = append(rs, c)
				}
			}
		}
		if f.State != device.ReservationActive {
			for _, rr := range l.idx.released {
				if (f.DeviceID == "" || rr.p.hasDevice(f.DeviceID)) && ownerOK(rr.p.owner()) {
					rs = append(rs, rr.p.unpack(rr.id)) // unpacked afresh: the caller's
				}
			}
		}
	}
	l.mu.RUnlock()
	sortReservations(rs)
	out := make([]device.Reservation, len(rs))
	for i, r := range rs {
		out[i] = *r
	}
	return out, nil
}

// Holders returns, by device ID, the live reservation holding each held device. The map
// is the caller's.
func (l *Ledger) Holders() map[string]device.Holder {
	l.mu.RLock()
	defer l.mu.RUnlock()
	out := make(map[string]device.Holder, len(l.idx.held))
	for dev, id := range l.idx.held {
		r := l.idx.live[id]
		out[dev] = device.Holder{ReservationID: id, OwnerID: r.OwnerID, OwnerLabels: r.OwnerLabels}
	}
	return out
}
