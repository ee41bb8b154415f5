package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
)

// Admin accesses (device.ReserveRequest.AdminAccess): owners that see devices without
// holding them, as Kubernetes' DRA admin access gives monitoring and debugging pods.
// They are kept apart from the reservations: no Reserve checks them, no holder or
// counter counts them, and releasing one asks nothing of a plugin. They outlive the
// host, so the listing of a device's admin accesses stays true across restarts.
//
//	admin-access/<access ID>    record envelope around accessRecord's JSON
//
// The bucket is created by the first access, so a file without it (same schema
// version) has none, and an older devicehost that opens a file with it ignores it.
var bucketAccess = []byte("admin-access")

// accessRecord is an admin access as stored.
type accessRecord struct {
	Owner   string    `json:"owner"`
	Vendor  string    `json:"vendor"`
	Type    string    `json:"type"`
	Name    string    `json:"name"`
	Plugin  string    `json:"plugin,omitempty"`
	Devices []string  `json:"devices"`
	CDI     []string  `json:"cdi"`
	Since   time.Time `json:"since"`
	By      string    `json:"by,omitempty"`
}

// accessView is the admin accesses in memory: immutable once stored.
type accessView struct {
	byID     map[string]device.AdminAccess
	byDevice map[string][]device.Holder // each sorted by access ID
}

func newAccessView(byID map[string]device.AdminAccess) *accessView {
	v := &accessView{byID: byID, byDevice: make(map[string][]device.Holder)}
	for _, id := range slices.Sorted(maps.Keys(byID)) {
		a := byID[id]
		for _, d := range a.DeviceIDs {
			v.byDevice[d] = append(v.byDevice[d], device.Holder{ReservationID: a.ID, OwnerID: a.OwnerID})
		}
	}
	return v
}

// newAccessID is a new admin access ID: "acc-" and 16 hex digits.
func newAccessID() string { return "acc-" + randomHex() }

// IsAccessID reports whether id names an admin access rather than a reservation.
func IsAccessID(id string) bool { return strings.HasPrefix(id, "acc-") }

// GrantAccess records admin access a (its ID is made here), durably before it returns,
// and returns it as recorded. The owner asking again for exactly the devices of one of
// its accesses gets that one back, and nothing is written (the kubelet retries a
// prepare). An access without owner or devices is an "internal:" error (the server
// validates the request).
func (l *Ledger) GrantAccess(ctx context.Context, a device.AdminAccess) (device.AdminAccess, error) {
	if a.OwnerID == "" || len(a.DeviceIDs) == 0 {
		return device.AdminAccess{}, fmt.Errorf("admin access: %w: no owner or devices (%q: %v)", errInternal, a.OwnerID, a.DeviceIDs)
	}
	l.accessMu.Lock()
	defer l.accessMu.Unlock()
	cur := l.access.Load()
	want := slices.Sorted(slices.Values(a.DeviceIDs))
	for _, have := range cur.byID {
		if have.OwnerID == a.OwnerID && slices.Equal(slices.Sorted(slices.Values(have.DeviceIDs)), want) {
			return cloneAccess(have), nil
		}
	}
	for _, d := range a.DeviceIDs {
		if n := len(cur.byDevice[d]); n >= device.MaxAdminAccessPerDevice {
			return device.AdminAccess{}, fmt.Errorf("admin access for owner %q: device %s has %d admin accesses, the most it may have; release one first: %w",
				a.OwnerID, d, n, device.ErrTooManyAccesses)
		}
	}
	a.ID = newAccessID()
	a.Since = normTime(a.Since)
	a.DeviceIDs = slices.Clone(a.DeviceIDs)
	a.CDIDevices = slices.Clone(a.CDIDevices)
	payload, err := json.Marshal(accessRecord{Owner: a.OwnerID, Vendor: a.Group.Vendor, Type: a.Group.Type, Name: a.Group.Name,
		Plugin: a.Plugin, Devices: a.DeviceIDs, CDI: a.CDIDevices, Since: a.Since, By: a.By})
	if err != nil {
		return device.AdminAccess{}, fmt.Errorf("admin access: %w", err)
	}
	_, err = l.submit(ctx, func(w *txn) (any, error) {
		if err := w.put(bucketAccess, []byte(a.ID), seal(payload)); err != nil {
			return nil, &storageError{Err: fmt.Errorf("store admin access %s: %w", a.ID, err)}
		}
		return nil, w.event(device.Event{Kind: device.EventAdminAccess, By: device.CallerOf(ctx), Owner: a.OwnerID,
			Devices: a.DeviceIDs, Reservations: []string{a.ID}})
	})
	if err != nil {
		return device.AdminAccess{}, fmt.Errorf("admin access for owner %q: %w", a.OwnerID, err)
	}
	next := maps.Clone(cur.byID)
	next[a.ID] = a
	l.access.Store(newAccessView(next))
	return cloneAccess(a), nil
}

// RevokeAccess ends the admin accesses req names (by ID, or every one of an owner),
// durably before it returns, and returns them; none is no error. An access named by
// ID whose owner is not under req.OwnerPrefixes is not ended: a *device.PermissionError.
func (l *Ledger) RevokeAccess(ctx context.Context, req device.ReleaseRequest) ([]device.AdminAccess, error) {
	l.accessMu.Lock()
	defer l.accessMu.Unlock()
	cur := l.access.Load()
	var gone []device.AdminAccess
	switch {
	case req.ReservationID != "":
		a, ok := cur.byID[req.ReservationID]
		if !ok {
			return nil, nil
		}
		if !device.OwnerUnder(a.OwnerID, req.OwnerPrefixes) {
			return nil, &device.PermissionError{
				Call:  fmt.Sprintf("release admin access %q of owner %q", a.ID, a.OwnerID),
				Lacks: "reserve:" + a.OwnerID,
			}
		}
		gone = append(gone, a)
	case req.OwnerID != "":
		for _, id := range slices.Sorted(maps.Keys(cur.byID)) {
			if a := cur.byID[id]; a.OwnerID == req.OwnerID {
				gone = append(gone, a)
			}
		}
	}
	if len(gone) == 0 {
		return nil, nil
	}
	_, err := l.submit(ctx, func(w *txn) (any, error) {
		if w.tx.Bucket(bucketAccess) == nil {
			return nil, nil
		}
		for _, a := range gone {
			if err := w.del(bucketAccess, []byte(a.ID)); err != nil {
				return nil, &storageError{Err: fmt.Errorf("delete admin access %s: %w", a.ID, err)}
			}
			if err := w.event(device.Event{Kind: device.EventAdminAccessEnd, By: device.CallerOf(ctx), Owner: a.OwnerID,
				Devices: a.DeviceIDs, Reservations: []string{a.ID}}); err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	if err != nil {
		return nil, fmt.Errorf("end admin access: %w", err)
	}
	next := maps.Clone(cur.byID)
	for _, a := range gone {
		delete(next, a.ID)
	}
	l.access.Store(newAccessView(next))
	out := make([]device.AdminAccess, len(gone))
	for i, a := range gone {
		out[i] = cloneAccess(a)
	}
	return out, nil
}

// Accesses returns the live admin accesses, sorted by ID.
func (l *Ledger) Accesses() []device.AdminAccess {
	v := l.access.Load()
	out := make([]device.AdminAccess, 0, len(v.byID))
	for _, id := range slices.Sorted(maps.Keys(v.byID)) {
		out = append(out, cloneAccess(v.byID[id]))
	}
	return out
}

// AccessByDevice returns the live admin accesses by device ID, each sorted by ID: an
// immutable map. Cheap, and safe to call with any lock held (the inventory calls it
// under its own).
func (l *Ledger) AccessByDevice() map[string][]device.Holder { return l.access.Load().byDevice }

func cloneAccess(a device.AdminAccess) device.AdminAccess {
	a.DeviceIDs = slices.Clone(a.DeviceIDs)
	a.CDIDevices = slices.Clone(a.CDIDevices)
	return a
}

// loadAccesses reads every admin access of db. A record that cannot be read is left
// out and named in the error, which wraps ErrCorrupt: it held nothing, so nothing is
// lost but its listing.
func loadAccesses(db *bolt.DB, path string) (map[string]device.AdminAccess, error) {
	out := make(map[string]device.AdminAccess)
	var bad []error
	err := db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketAccess)
		if b == nil {
			return nil
		}
		return b.ForEach(func(k, v []byte) error {
			var rec accessRecord
			payload, err := unseal(v)
			if err == nil {
				err = json.Unmarshal(payload, &rec)
			}
			if err == nil && (rec.Owner == "" || len(rec.Devices) == 0 || !IsAccessID(string(k))) {
				err = errors.New("no owner, no devices or not an access ID")
			}
			if err != nil {
				bad = append(bad, fmt.Errorf("admin access record %q: %v: %w", k, err, ErrCorrupt))
				return nil
			}
			out[string(k)] = device.AdminAccess{ID: string(k), OwnerID: rec.Owner,
				Group: device.GroupKey{Vendor: rec.Vendor, Type: rec.Type, Name: rec.Name}, Plugin: rec.Plugin,
				DeviceIDs: rec.Devices, CDIDevices: rec.CDI, Since: rec.Since, By: rec.By}
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("read admin accesses from %s: %w", path, err)
	}
	if len(bad) > 0 {
		return out, fmt.Errorf("admin accesses in %s: %w", path, errors.Join(bad...))
	}
	return out, nil
}
