package ledger

import (
	"context"
	"fmt"

	"github.com/devicehost/devicehost/device"
)

// Reown hands the live reservation req.ReservationID from req.OwnerID to
// req.NewOwnerID, durably before it returns, and returns it as stored: only its owner
// changes. Reowning to the owner it already has is not an error and writes nothing.
// An unknown ID wraps device.ErrNotFound; a released reservation, or one owned by
// another owner than req.OwnerID, is a *device.FieldError (nothing is written). req is
// one the host API's server has validated (validate.ReownRequest); an empty new owner,
// which no stored reservation may have (see checkRecord), is an "internal:" error.
func (l *Ledger) Reown(ctx context.Context, req device.ReownRequest) (device.Reservation, error) {
	if req.NewOwnerID == "" {
		return device.Reservation{}, fmt.Errorf("reown: %w: no new owner ID", errInternal)
	}
	by := device.CallerOf(ctx)
	val, err := l.submit(ctx, func(w *txn) (any, error) {
		r := w.get(req.ReservationID)
		if err := checkReown(r, req); err != nil || r.OwnerID == req.NewOwnerID {
			return r, err
		}
		if w.ov.isIntent(r.ID) { // an answered one's answer rides ahead of this write
			return nil, &device.FieldError{Field: "reservation_id", Rule: fmt.Sprintf(
				"reservation %s is recorded without its plugin's answer (the host stopped before writing it); it can be reowned once its plugin is up and has answered again", r.ID)}
		}
		nr := *r // shares r's immutable slices and maps
		nr.OwnerID = req.NewOwnerID
		nr.OwnerLabels = device.OwnerLabels{} // they named the old owner's workload
		if err := w.putReservation(&nr); err != nil {
			return nil, err
		}
		if err := w.event(device.Event{Kind: device.EventReown, By: by, Owner: r.OwnerID, NewOwner: nr.OwnerID,
			Devices: nr.DeviceIDs, Reservations: []string{nr.ID}}); err != nil {
			return nil, err
		}
		return &nr, nil
	})
	if err != nil {
		l.Refused(ctx, "reown", device.Event{Owner: req.OwnerID, NewOwner: req.NewOwnerID, Reservations: nonEmpty(req.ReservationID)}, err)
		return device.Reservation{}, fmt.Errorf("reown: %w", err)
	}
	return l.seen(val.(*device.Reservation))
}

// checkReown says why r (nil: unknown) cannot be reowned as req asks, or nil.
func checkReown(r *device.Reservation, req device.ReownRequest) error {
	switch {
	case r == nil:
		return fmt.Errorf("reservation %q: %w", req.ReservationID, device.ErrNotFound)
	case r.OwnerID == req.NewOwnerID:
		return nil // done already: a retried call
	case r.State != device.ReservationActive:
		return &device.FieldError{Field: "reservation_id", Rule: fmt.Sprintf("reservation %s is released", r.ID)}
	case r.OwnerID != req.OwnerID:
		return &device.FieldError{Field: "owner_id", Rule: fmt.Sprintf("reservation %s is owned by %q, not %q", r.ID, r.OwnerID, req.OwnerID)}
	}
	return nil
}
