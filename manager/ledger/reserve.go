package ledger

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/devicehost/devicehost/manager/device"
)

// maxIDLen bounds reservation, owner and device IDs and plugin names kept in the file.
const maxIDLen = 256

// NewID returns a fresh reservation ID: "res-" and 16 hex digits from crypto/rand.
// Reserve calls it for a reservation that comes without an ID; a caller that needs the
// ID before the commit (to hand it to the plugin, say) may call it itself.
func NewID() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails; the runtime aborts the program if it could not
	return "res-" + hex.EncodeToString(b[:])
}

// ConflictError is the contract's device.HeldError: it says which live reservations
// hold devices a request asked for, and matches device.ErrDeviceHeld under errors.Is.
type ConflictError = device.HeldError

// Conflict is one live reservation a request collides with.
type Conflict = device.Conflict

// view is what the conflict rules read: the index, or a batch's overlay on it.
type view interface {
	get(id string) *device.Reservation
	holder(dev string) string
}

// decide applies the conflict rules to a request by owner for deviceIDs (valid, no
// duplicates): (r, nil) when owner's live reservation r holds exactly deviceIDs,
// (nil, nil) when none of them is held, a *ConflictError otherwise.
func decide(v view, owner string, deviceIDs []string) (*device.Reservation, error) {
	overlap := make(map[string][]string) // holder reservation ID -> requested devices it holds
	for _, d := range deviceIDs {
		if id := v.holder(d); id != "" {
			overlap[id] = append(overlap[id], d)
		}
	}
	if len(overlap) == 0 {
		return nil, nil
	}
	if len(overlap) == 1 {
		for id, devs := range overlap {
			// Both lists are duplicate-free, so equal lengths with every requested
			// device inside r means the same set.
			if r := v.get(id); r.OwnerID == owner && len(devs) == len(deviceIDs) && len(r.DeviceIDs) == len(deviceIDs) {
				return r, nil
			}
		}
	}
	e := &ConflictError{OwnerID: owner}
	for id, devs := range overlap {
		r := v.get(id)
		slices.Sort(devs)
		held := slices.Clone(r.DeviceIDs)
		slices.Sort(held)
		e.Conflicts = append(e.Conflicts, Conflict{
			Holder:  device.Holder{ReservationID: id, OwnerID: r.OwnerID},
			Overlap: devs,
			Held:    held,
		})
	}
	slices.SortFunc(e.Conflicts, func(a, b Conflict) int {
		return strings.Compare(a.Holder.ReservationID, b.Holder.ReservationID)
	})
	return nil, e
}

func checkID(field, id string) error {
	switch {
	case id == "":
		return &device.FieldError{Field: field, Rule: "must not be empty"}
	case len(id) > maxIDLen:
		return &device.FieldError{Field: field, Rule: fmt.Sprintf("longer than %d bytes", maxIDLen)}
	case !utf8.ValidString(id):
		return &device.FieldError{Field: field, Rule: "not valid UTF-8"}
	}
	return nil
}

func checkDeviceIDs(ids []string) error {
	if len(ids) == 0 {
		return &device.FieldError{Field: "device_ids", Rule: "must not be empty"}
	}
	seen := make(map[string]int, len(ids))
	for i, id := range ids {
		field := fmt.Sprintf("device_ids[%d]", i)
		if err := checkID(field, id); err != nil {
			return err
		}
		if j, dup := seen[id]; dup {
			return &device.FieldError{Field: field, Rule: fmt.Sprintf("duplicate of device_ids[%d]", j)}
		}
		seen[id] = i
	}
	return nil
}

func checkRequest(owner string, deviceIDs []string) error {
	if err := checkID("owner_id", owner); err != nil {
		return err
	}
	return checkDeviceIDs(deviceIDs)
}

// Check applies the conflict rules to ownerID asking for deviceIDs, without writing:
// (r, nil) when ownerID's live reservation r holds exactly deviceIDs (a retried Reserve),
// (nil, nil) when none of them is held, and a *ConflictError (device.ErrDeviceHeld)
// otherwise. A malformed request is a *device.FieldError.
//
// The manager calls Check before it asks the plugin; since another Reserve can commit in
// between, Reserve checks again atomically with its write.
func (l *Ledger) Check(ownerID string, deviceIDs []string) (*device.Reservation, error) {
	if err := checkRequest(ownerID, deviceIDs); err != nil {
		return nil, err
	}
	l.mu.RLock()
	defer l.mu.RUnlock()
	r, err := decide(l.idx, ownerID, deviceIDs)
	if r == nil || err != nil {
		return nil, err
	}
	c := clone(r)
	return &c, nil
}

// Reserve records r as a live reservation, fsynced before it returns, after checking the
// conflict rules atomically with the write:
//   - when r.OwnerID already holds exactly r.DeviceIDs in a live reservation, that
//     reservation is returned with existing true and nothing is written (a retried
//     Reserve creates no duplicate);
//   - when any requested device is held otherwise (by another owner, or by the same
//     owner for a different set of devices), the error is a *ConflictError naming each
//     holder and the devices in question; it matches device.ErrDeviceHeld.
//
// Of concurrent Reserves for the same device, exactly one succeeds.
//
// r.ID may be empty, in which case NewID makes one; an ID already in the ledger is
// refused. r.State, r.ReleasedAt and r.CleanupPending are ignored; a zero r.CreatedAt is
// set to now. The request is refused with a *device.FieldError when the owner ID, a
// device ID or the reservation ID is empty, too long or not UTF-8, or a device is named
// twice.
func (l *Ledger) Reserve(ctx context.Context, r device.Reservation) (res device.Reservation, existing bool, err error) {
	if err := checkRequest(r.OwnerID, r.DeviceIDs); err != nil {
		return device.Reservation{}, false, err
	}
	if r.ID != "" {
		if err := checkID("reservation_id", r.ID); err != nil {
			return device.Reservation{}, false, err
		}
	}
	rec := clone(&r)
	rec.State = device.ReservationActive
	rec.ReleasedAt, rec.CleanupPending = time.Time{}, false
	if rec.CreatedAt.IsZero() {
		rec.CreatedAt = l.now()
	}
	rec.CreatedAt = normTime(rec.CreatedAt)
	type result struct {
		r        *device.Reservation
		existing bool
	}
	val, err := l.submit(ctx, func(w *txn) (any, error) {
		if prior, err := decide(w, rec.OwnerID, rec.DeviceIDs); err != nil || prior != nil {
			return result{prior, true}, err
		}
		nr := rec // a fresh copy per run: the batch may be retried
		switch {
		case nr.ID == "":
			nr.ID = NewID()
			for w.get(nr.ID) != nil { // 64 random bits: all but impossible
				nr.ID = NewID()
			}
		case w.get(nr.ID) != nil:
			return nil, &device.FieldError{Field: "reservation_id",
				Rule: fmt.Sprintf("%q is already used by another reservation", nr.ID)}
		}
		if err := w.putReservation(&nr); err != nil {
			return nil, err
		}
		return result{&nr, false}, nil
	})
	if err != nil {
		return device.Reservation{}, false, fmt.Errorf("reserve: %w", err)
	}
	got := val.(result)
	return clone(got.r), got.existing, nil
}

// Commit is Reserve without the existing flag: it returns the stored reservation, which
// is an earlier one when the same owner already held exactly these devices. It is the
// method set the manager's reservation store expects.
func (l *Ledger) Commit(ctx context.Context, r device.Reservation) (device.Reservation, error) {
	res, _, err := l.Reserve(ctx, r)
	return res, err
}
