package ledger

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/devicehost/devicehost/device"
)

// NewID returns a fresh reservation ID: "res-" and 16 hex digits from crypto/rand.
// Reserve calls it for a reservation that comes without an ID; a caller that needs the
// ID before the commit (to hand it to the plugin, say) may call it itself.
func NewID() string { return "res-" + randomHex() }

// randomHex is 16 random hex digits: a new reservation's or admin access's ID after its
// prefix.
func randomHex() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails; the runtime aborts the program if it could not
	return hex.EncodeToString(b[:])
}

// view is what the conflict rules read: the index, or a batch's overlay on it.
type view interface {
	get(id string) *device.Reservation
	holder(dev string) string
	usedOf(k counterKey) int64
	usersOf(k counterKey) []string
	setUsersOf(set device.CounterSetKey) map[string][]string // must not be changed
}

// decide applies the conflict rules to a request by owner for deviceIDs (valid, no
// duplicates) with plugin options opts that may take devices over from owners starting
// with one of takeOver:
//   - (r, nil, nil) when owner's live reservation r holds exactly deviceIDs (a retry;
//     nothing is taken over) with opts; a *device.OptionsDifferError when it holds them
//     with other options (the plugin prepared them for those);
//   - (nil, victims, nil) when every requested device is free or held by a live
//     reservation whose owner takeOver matches (device.TakesOver): victims are those
//     reservations, sorted by ID, to release with the new one's write (none without
//     holders);
//   - a *device.HeldError otherwise, naming only the holders takeOver does not match;
//   - and then, for a request that uses shared counters (consumes), a *device.CapacityError
//     when, with the live reservations but the victims, a counter would go over its
//     capacity in caps (see decideCapacity).
func decide(v view, owner string, deviceIDs, takeOver []string, opts map[string]string, consumes []device.Consumption, caps device.Capacity) (*device.Reservation, []*device.Reservation, error) {
	prior, victims, err := decideDevices(v, owner, deviceIDs, takeOver)
	if err != nil {
		return nil, nil, err
	}
	if prior != nil {
		if !maps.Equal(prior.PluginOptions, opts) {
			return nil, nil, &device.OptionsDifferError{OwnerID: owner, ReservationID: prior.ID,
				Held: maps.Clone(prior.PluginOptions), Requested: maps.Clone(opts)}
		}
		return prior, nil, nil
	}
	if err := decideCapacity(v, owner, consumes, caps, victims); err != nil {
		return nil, nil, err
	}
	return nil, victims, nil
}

// decideDevices is decide's rules for the devices themselves.
func decideDevices(v view, owner string, deviceIDs, takeOver []string) (*device.Reservation, []*device.Reservation, error) {
	overlap := make(map[string][]string) // holder reservation ID -> requested devices it holds
	for _, d := range deviceIDs {
		if id := v.holder(d); id != "" {
			overlap[id] = append(overlap[id], d)
		}
	}
	if len(overlap) == 0 {
		return nil, nil, nil
	}
	if len(overlap) == 1 {
		for id, devs := range overlap {
			// Both lists are duplicate-free, so equal lengths with every requested
			// device inside r means the same set.
			if r := v.get(id); r.OwnerID == owner && len(devs) == len(deviceIDs) && len(r.DeviceIDs) == len(deviceIDs) {
				return r, nil, nil
			}
		}
	}
	e := &device.HeldError{OwnerID: owner}
	var victims []*device.Reservation
	for id, devs := range overlap {
		r := v.get(id)
		if device.TakesOver(takeOver, r.OwnerID) {
			victims = append(victims, r)
			continue
		}
		slices.Sort(devs)
		held := slices.Clone(r.DeviceIDs)
		slices.Sort(held)
		e.Conflicts = append(e.Conflicts, device.Conflict{
			Holder:  device.Holder{ReservationID: id, OwnerID: r.OwnerID},
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

// Check applies the conflict rules to ownerID asking for deviceIDs with plugin options
// opts, without writing: (r, nil) when ownerID's live reservation r holds exactly
// deviceIDs with opts (a retried Reserve; an *UnansweredError when r is an intent
// without its answer, see intent.go; a *device.OptionsDifferError when r has other
// options),
// (nil, nil) when none of them is held, or each holder's owner starts with one of
// takeOver (see Reserve), and a *device.HeldError (device.ErrDeviceHeld) otherwise, naming
// the holders takeOver does not match; then, when the devices use shared counters
// (consumes), a *device.CapacityError (device.ErrCapacityExceeded) if that use would not fit in
// caps with the live reservations'.
//
// The request is not checked: it is one the host API's server has validated
// (validate.ReserveRequest), so deviceIDs has no duplicates; Reserve asserts what its
// write needs.
//
// The manager calls Check before it asks the plugin; since another Reserve can commit in
// between, Reserve checks again atomically with its write.
func (l *Ledger) Check(ownerID string, deviceIDs, takeOver []string, opts map[string]string, consumes []device.Consumption, caps device.Capacity) (*device.Reservation, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	r, _, err := decide(l.idx, ownerID, deviceIDs, takeOver, opts, consumes, caps)
	if r == nil || err != nil {
		return nil, err
	}
	c, ok := l.shown(r)
	if !ok {
		return nil, &UnansweredError{Reservation: clone(r)}
	}
	return c, nil
}

// Reserve records r as a live reservation, fsynced before it returns, after checking the
// conflict rules atomically with the write:
//   - when r.OwnerID already holds exactly r.DeviceIDs in a live reservation, that
//     reservation is returned with existing true and nothing is written (a retried
//     Reserve creates no duplicate), whatever takeOver says; if its plugin options are
//     not r.PluginOptions, the error is a *device.OptionsDifferError
//     (device.ErrOptionsDiffer) naming it and both sets;
//   - when every requested device is free, or held by a live reservation whose owner
//     starts with one of takeOver (device.TakesOver; see device.ReserveRequest), r is
//     recorded and those holders are marked released (at r's CreatedAt, their plugin
//     cleanup pending, as Release does) in the same transaction, and so the same
//     fsync: both are durable or neither is, and no reader or concurrent Reserve ever
//     sees the devices free in between. Their IDs, sorted, come back in res.TakenOver
//     (never stored);
//   - otherwise the error is a *device.HeldError naming each holder takeOver does not
//     match and the devices in question (device.ErrDeviceHeld), and nothing is written;
//   - and when r uses shared counters (r.Consumes), it is recorded only if that use fits
//     in caps with every live reservation's (the victims' aside), checked in the same
//     atomic write: a *device.CapacityError (device.ErrCapacityExceeded) names every counter it
//     would take over, and its users, otherwise. Of concurrent Reserves for the last of
//     a counter, exactly one succeeds.
//
// Of concurrent Reserves for the same device, exactly one succeeds.
//
// r.ID may be empty, in which case NewID makes one; an ID already in the ledger is a
// *device.FieldError. r.State, r.ReleasedAt, r.CleanupPending and r.TakenOver are
// ignored; a zero r.CreatedAt is set to now.
//
// The request is trusted: the host API's server has validated it
// (validate.ReserveRequest, the one place the API's rules live). Reserve asserts only the
// invariants of a stored reservation (see checkRecord), refusing a request without an
// owner or devices, or naming a device twice, with an "internal:" error, since Open would
// refuse the file with such a record in it.
func (l *Ledger) Reserve(ctx context.Context, r device.Reservation, takeOver []string, caps device.Capacity) (res device.Reservation, existing bool, err error) {
	rec, err := l.newRecord("reserve", r)
	if err != nil {
		return device.Reservation{}, false, err
	}
	val, err := l.submit(ctx, reserveRun(rec, slices.Clone(takeOver), caps, device.CallerOf(ctx)))
	if err != nil {
		l.Refused(ctx, "reserve", device.Event{Owner: rec.OwnerID, Devices: rec.DeviceIDs}, err)
		return device.Reservation{}, false, fmt.Errorf("reserve: %w", err)
	}
	return l.answered(val.(reserveResult))
}

// answered is what Reserve and Intend answer for their write's result: the caller's
// copy of the new reservation, or the existing one as a reader sees it (seen).
func (l *Ledger) answered(got reserveResult) (device.Reservation, bool, error) {
	if got.existing {
		out, err := l.seen(got.r)
		return out, true, err
	}
	out := clone(got.r)
	out.TakenOver = got.takenOver
	return out, false, nil
}

// newRecord checks r for call (Reserve, Intend) against what a stored reservation must
// be (checkRecord, checkConsumes: an "internal:" error otherwise) and returns the
// caller's copy of it, live and stamped (CreatedAt now when zero).
func (l *Ledger) newRecord(call string, r device.Reservation) (device.Reservation, error) {
	if err := checkRecord(r.OwnerID, r.DeviceIDs); err != nil {
		return device.Reservation{}, fmt.Errorf("%s: %w: %w", call, errInternal, err)
	}
	if err := checkConsumes(r.Plugin, r.Consumes); err != nil {
		return device.Reservation{}, fmt.Errorf("%s: %w: %w", call, errInternal, err)
	}
	rec := clone(&r)
	rec.State = device.ReservationActive
	rec.ReleasedAt, rec.CleanupPending, rec.TakenOver = time.Time{}, false, nil
	rec.PluginOptions = nilIfEmpty(rec.PluginOptions)
	if rec.CreatedAt.IsZero() {
		rec.CreatedAt = l.now()
	}
	rec.CreatedAt = normTime(rec.CreatedAt)
	return rec, nil
}

// reserveResult is what reserveRun answers.
type reserveResult struct {
	r         *device.Reservation
	existing  bool
	takenOver []string
}

// reserveRun is the write of Reserve for rec (checked, stamped, owned by
// the run). It decides from the batch's view on every run, so a batch retried after a
// storage failure decides afresh.
func reserveRun(rec device.Reservation, takeOver []string, caps device.Capacity, by string) func(w *txn) (any, error) {
	return func(w *txn) (any, error) {
		prior, victims, err := decide(w, rec.OwnerID, rec.DeviceIDs, takeOver, rec.PluginOptions, rec.Consumes, caps)
		if err != nil || prior != nil {
			return reserveResult{r: prior, existing: true}, err
		}
		// A cordoned device keeps its holder (prior, above) but takes no new one.
		if err := checkCordons(w, rec.DeviceIDs); err != nil {
			return nil, err
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
		// Every decision is made: from here on only writes, and a failed write fails
		// the whole transaction, so the releases never land without the reservation.
		var taken []string
		for _, v := range victims {
			vr := *v // shares v's immutable slices and maps
			vr.State, vr.ReleasedAt, vr.CleanupPending = device.ReservationReleased, nr.CreatedAt, true
			if err := w.putReservation(&vr); err != nil {
				return nil, err
			}
			taken = append(taken, vr.ID)
			if err := w.event(device.Event{Kind: device.EventTakeOver, By: by, Owner: vr.OwnerID, Devices: vr.DeviceIDs,
				Reservations: []string{vr.ID}, Detail: fmt.Sprintf("taken over by reservation %s of owner %q", nr.ID, nr.OwnerID)}); err != nil {
				return nil, err
			}
		}
		if err := w.putReservation(&nr); err != nil {
			return nil, err
		}
		if err := w.event(device.Event{Kind: device.EventReserve, By: by, Owner: nr.OwnerID, Devices: nr.DeviceIDs, Reservations: []string{nr.ID}}); err != nil {
			return nil, err
		}
		return reserveResult{r: &nr, takenOver: taken}, nil
	}
}
