package manager

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/devicehost/devicehost/manager/device"
)

// reservationStore is where the manager keeps reservations. memStore keeps them in
// memory; the bbolt ledger (manager/ledger) implements the same methods durably. It speaks
// only the contract's types, so an implementation need not import this package.
//
// Implementations are safe for concurrent use and never call back into the manager.
// Returned values are copies the caller may keep.
type reservationStore interface {
	// Check says whether owner may reserve deviceIDs, taking over holders whose owner
	// starts with one of takeOver (device.TakesOver): (r, nil) when owner already
	// holds exactly those devices in live reservation r (a retried Reserve), (nil, nil)
	// when each of them is free or held by a reservation it may take over, and a
	// *device.HeldError naming the other holders and the overlap otherwise.
	Check(ownerID string, deviceIDs, takeOver []string) (*device.Reservation, error)
	// Reserve records r as live, durably before it returns, and in the same write
	// releases the live reservations it takes over (as Release does, at r.CreatedAt),
	// returning their IDs, sorted, in the result's TakenOver. It re-checks as Check
	// does, atomically with the write: a retry by the same owner returns the existing
	// reservation instead, with existing true (taking nothing over), a conflict is a
	// *device.HeldError and writes nothing.
	Reserve(ctx context.Context, r device.Reservation, takeOver []string) (res device.Reservation, existing bool, err error)
	// Release marks the live reservations named by req released at time at, with their
	// plugin cleanup pending, and returns them; those req named that were released
	// before come back apart, in already, unchanged. Both are oldest first. An unknown
	// reservation ID wraps device.ErrNotFound; an owner with no reservations matches
	// nothing.
	Release(ctx context.Context, req device.ReleaseRequest, at time.Time) (released, already []device.Reservation, err error)
	// Reown hands a live reservation to another owner, durably before it returns, as
	// device.Manager's Reown describes.
	Reown(ctx context.Context, req device.ReownRequest) (device.Reservation, error)
	// CleanupDone records that the plugin cleaned up after a released reservation.
	CleanupDone(ctx context.Context, reservationID string) error
	// List returns the reservations matching f, oldest first.
	List(ctx context.Context, f device.ReservationFilter) ([]device.Reservation, error)
	// Holders returns the live reservation holding each held device, by device ID.
	Holders() map[string]device.Holder
}

// memStore is a reservationStore in memory: reservations end with the process.
type memStore struct {
	mu     sync.Mutex
	byID   map[string]*device.Reservation
	order  []string          // IDs, oldest first
	holder map[string]string // device ID -> live reservation ID
}

var _ reservationStore = (*memStore)(nil)

func newMemStore() *memStore {
	return &memStore{byID: make(map[string]*device.Reservation), holder: make(map[string]string)}
}

func (s *memStore) Check(ownerID string, deviceIDs, takeOver []string) (*device.Reservation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, _, err := s.checkLocked(ownerID, deviceIDs, takeOver)
	if r != nil {
		c := cloneReservation(*r)
		return &c, err
	}
	return nil, err
}

// checkLocked applies the conflict rules the ledger applies: (r, nil, nil) when
// ownerID's live reservation r holds exactly deviceIDs, (nil, victims, nil) when each
// of them is free or held by a live reservation takeOver matches (victims, sorted by
// ID), and a *device.HeldError naming every other holder otherwise.
func (s *memStore) checkLocked(ownerID string, deviceIDs, takeOver []string) (*device.Reservation, []*device.Reservation, error) {
	overlap := make(map[string][]string) // holder reservation ID -> requested devices it holds
	for _, id := range deviceIDs {
		if rid, ok := s.holder[id]; ok {
			overlap[rid] = append(overlap[rid], id)
		}
	}
	if len(overlap) == 0 {
		return nil, nil, nil
	}
	if len(overlap) == 1 {
		for rid := range overlap {
			if r := s.byID[rid]; r.OwnerID == ownerID && sameSet(r.DeviceIDs, deviceIDs) {
				return r, nil, nil
			}
		}
	}
	e := &device.HeldError{OwnerID: ownerID}
	var victims []*device.Reservation
	for rid, devs := range overlap {
		r := s.byID[rid]
		if device.TakesOver(takeOver, r.OwnerID) {
			victims = append(victims, r)
			continue
		}
		held := slices.Clone(r.DeviceIDs)
		slices.Sort(held)
		slices.Sort(devs)
		e.Conflicts = append(e.Conflicts, device.Conflict{
			Holder:  device.Holder{ReservationID: rid, OwnerID: r.OwnerID},
			Overlap: devs,
			Held:    held,
		})
	}
	if len(e.Conflicts) == 0 {
		slices.SortFunc(victims, func(a, b *device.Reservation) int { return strings.Compare(a.ID, b.ID) })
		return nil, victims, nil
	}
	slices.SortFunc(e.Conflicts, func(a, b device.Conflict) int {
		return strings.Compare(a.Holder.ReservationID, b.Holder.ReservationID)
	})
	return nil, nil, e
}

func (s *memStore) Reserve(_ context.Context, r device.Reservation, takeOver []string) (device.Reservation, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	existing, victims, err := s.checkLocked(r.OwnerID, r.DeviceIDs, takeOver)
	if err != nil {
		return device.Reservation{}, false, err
	}
	if existing != nil {
		return cloneReservation(*existing), true, nil
	}
	if _, dup := s.byID[r.ID]; dup {
		return device.Reservation{}, false, fmt.Errorf("reservation ID %s already used", r.ID)
	}
	var taken []string
	for _, v := range victims {
		s.releaseLocked(v, r.CreatedAt)
		taken = append(taken, v.ID)
	}
	r = cloneReservation(r)
	r.State, r.TakenOver = device.ReservationActive, nil
	s.byID[r.ID] = &r
	s.order = append(s.order, r.ID)
	for _, id := range r.DeviceIDs {
		s.holder[id] = r.ID
	}
	out := cloneReservation(r)
	out.TakenOver = taken
	return out, false, nil
}

// releaseLocked marks the live reservation r released at at, its cleanup pending, and
// frees its devices.
func (s *memStore) releaseLocked(r *device.Reservation, at time.Time) {
	r.State, r.ReleasedAt, r.CleanupPending = device.ReservationReleased, at, true
	for _, d := range r.DeviceIDs {
		if s.holder[d] == r.ID {
			delete(s.holder, d)
		}
	}
}

func (s *memStore) Release(_ context.Context, req device.ReleaseRequest, at time.Time) (released, already []device.Reservation, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ids []string
	switch {
	case req.ReservationID != "":
		if _, ok := s.byID[req.ReservationID]; !ok {
			return nil, nil, fmt.Errorf("reservation %s: %w", req.ReservationID, device.ErrNotFound)
		}
		ids = []string{req.ReservationID}
	default:
		for _, id := range s.order {
			if s.byID[id].OwnerID == req.OwnerID {
				ids = append(ids, id)
			}
		}
	}
	for _, id := range ids {
		r := s.byID[id]
		if r.State != device.ReservationActive {
			already = append(already, cloneReservation(*r))
			continue
		}
		s.releaseLocked(r, at)
		released = append(released, cloneReservation(*r))
	}
	return released, already, nil
}

func (s *memStore) Reown(_ context.Context, req device.ReownRequest) (device.Reservation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.byID[req.ReservationID]
	switch {
	case !ok:
		return device.Reservation{}, fmt.Errorf("reservation %s: %w", req.ReservationID, device.ErrNotFound)
	case r.OwnerID == req.NewOwnerID:
	case r.State != device.ReservationActive:
		return device.Reservation{}, &device.FieldError{Field: "reservation_id", Rule: fmt.Sprintf("reservation %s is released", r.ID)}
	case r.OwnerID != req.OwnerID:
		return device.Reservation{}, &device.FieldError{Field: "owner_id", Rule: fmt.Sprintf("reservation %s is owned by %q, not %q", r.ID, r.OwnerID, req.OwnerID)}
	default:
		r.OwnerID = req.NewOwnerID
	}
	return cloneReservation(*r), nil
}

func (s *memStore) CleanupDone(_ context.Context, reservationID string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.byID[reservationID]
	if !ok {
		return fmt.Errorf("reservation %s: %w", reservationID, device.ErrNotFound)
	}
	r.CleanupPending = false
	return nil
}

func (s *memStore) List(_ context.Context, f device.ReservationFilter) ([]device.Reservation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []device.Reservation
	for _, id := range s.order {
		r := s.byID[id]
		if (f.OwnerID == "" || r.OwnerID == f.OwnerID) &&
			(f.DeviceID == "" || slices.Contains(r.DeviceIDs, f.DeviceID)) &&
			(f.State == device.ReservationAny || r.State == f.State) {
			out = append(out, cloneReservation(*r))
		}
	}
	return out, nil
}

func (s *memStore) Holders() map[string]device.Holder {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]device.Holder, len(s.holder))
	for dev, rid := range s.holder {
		out[dev] = device.Holder{ReservationID: rid, OwnerID: s.byID[rid].OwnerID}
	}
	return out
}

// sameSet reports whether a and b hold the same IDs (each list has no duplicates).
func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	x, y := slices.Clone(a), slices.Clone(b)
	slices.Sort(x)
	slices.Sort(y)
	return slices.Equal(x, y)
}

// cloneReservation deep-copies r, so no two holders share a map or slice.
func cloneReservation(r device.Reservation) device.Reservation {
	r.DeviceIDs = slices.Clone(r.DeviceIDs)
	r.TakenOver = slices.Clone(r.TakenOver)
	c := r.Container
	c.Envs = maps.Clone(c.Envs)
	c.Mounts = slices.Clone(c.Mounts)
	c.Devices = slices.Clone(c.Devices)
	c.CDIDevices = slices.Clone(c.CDIDevices)
	r.Container = c
	return r
}
