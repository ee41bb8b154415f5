package ledger

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger/store"
)

// The file layout, schema version 1:
//
//	meta/schema_version       4-byte big-endian uint32
//	reservations/<ID>         record envelope around a JSON recordV1
//	reattach/<plugin name>    record envelope around the opaque reattach bytes
//	owners/<device ID>        record envelope around the name of the plugin the device ID
//	                          is bound to (bindings.go; created by its first write)
//	intents/<ID>              a reservation recorded without its plugin's answer, as in
//	                          reservations/ (intent.go; created by its first write)
//
// A record envelope is a checksum of the payload followed by the payload (store.Seal).
const schemaVersion uint32 = 1

var (
	bucketReservations = []byte("reservations")
	bucketReattach     = []byte("reattach")
)

// seal and unseal are the storage layer's record envelope.
var (
	seal   = store.Seal
	unseal = store.Unseal
)

// recordV1 is a reservation as schema version 1 stores it. It is kept apart from
// device.Reservation so that a change to the domain type cannot silently change the
// file format.
type recordV1 struct {
	ID             string      `json:"id"`
	OwnerID        string      `json:"owner_id"`
	Group          groupV1     `json:"group"`
	Plugin         string      `json:"plugin"`
	DeviceIDs      []string    `json:"device_ids"`
	Container      containerV1 `json:"container"`
	State          string      `json:"state"` // "active" or "released"
	CreatedAt      time.Time   `json:"created_at"`
	ReleasedAt     time.Time   `json:"released_at"`
	CleanupPending bool        `json:"cleanup_pending"`
	// Consumes is left out when empty, so that a file of a host without shared
	// counters stays readable by a version that predates them.
	Consumes []consumptionV1 `json:"consumes,omitempty"`
	// OwnerLabels likewise (ReserveRequest.OwnerLabels, by key), for a version that
	// predates them.
	OwnerLabels map[string]string `json:"owner_labels,omitempty"`
	// PluginOptions likewise (ReserveRequest.PluginOptions).
	PluginOptions map[string]string `json:"plugin_options,omitempty"`
}

// consumptionV1 is a reservation's use of one counter set of its plugin.
type consumptionV1 struct {
	Set      string           `json:"set"`
	Counters map[string]int64 `json:"counters"`
	// Groups are the use's compatibility groups, left out when none, so that a file
	// without them stays readable by a version that predates them.
	Groups []string `json:"groups,omitempty"`
}

type groupV1 struct {
	Vendor string `json:"vendor"`
	Type   string `json:"type"`
	Name   string `json:"name"`
}

type containerV1 struct {
	Envs       map[string]string `json:"envs"`
	Mounts     []mountV1         `json:"mounts"`
	Devices    []deviceSpecV1    `json:"devices"`
	CDIDevices []string          `json:"cdi_devices"`
}

type mountV1 struct {
	HostPath      string `json:"host_path"`
	ContainerPath string `json:"container_path"`
	ReadOnly      bool   `json:"read_only"`
}

type deviceSpecV1 struct {
	HostPath      string `json:"host_path"`
	ContainerPath string `json:"container_path"`
	Permissions   string `json:"permissions"`
}

// encodeReservation returns r as schema version 1 stores it: a record envelope around
// the JSON of its recordV1. A state or a time the record cannot hold (a year past 9999)
// is an error naming the reservation.
func encodeReservation(r *device.Reservation) ([]byte, error) {
	var state string
	switch r.State {
	case device.ReservationActive:
		state = "active"
	case device.ReservationReleased:
		state = "released"
	default:
		return nil, fmt.Errorf("reservation %q: cannot store state %v", r.ID, r.State)
	}
	rec := recordV1{
		ID:             r.ID,
		OwnerID:        r.OwnerID,
		Group:          groupV1{Vendor: r.Group.Vendor, Type: r.Group.Type, Name: r.Group.Name},
		Plugin:         r.Plugin,
		DeviceIDs:      r.DeviceIDs,
		Container:      containerV1{Envs: r.Container.Envs, CDIDevices: r.Container.CDIDevices},
		State:          state,
		CreatedAt:      r.CreatedAt,
		ReleasedAt:     r.ReleasedAt,
		CleanupPending: r.CleanupPending,
		OwnerLabels:    r.OwnerLabels.Map(),
		PluginOptions:  r.PluginOptions,
	}
	for _, c := range r.Consumes {
		rec.Consumes = append(rec.Consumes, consumptionV1{Set: c.Set.Name, Counters: c.Counters, Groups: c.Groups})
	}
	if r.Container.Mounts != nil {
		rec.Container.Mounts = make([]mountV1, len(r.Container.Mounts))
		for i, m := range r.Container.Mounts {
			rec.Container.Mounts[i] = mountV1(m)
		}
	}
	if r.Container.Devices != nil {
		rec.Container.Devices = make([]deviceSpecV1, len(r.Container.Devices))
		for i, d := range r.Container.Devices {
			rec.Container.Devices[i] = deviceSpecV1(d)
		}
	}
	v, err := json.Marshal(rec)
	if err != nil {
		return nil, fmt.Errorf("reservation %q: %w", r.ID, err)
	}
	return seal(v), nil
}

// decodeReservation reads the record stored under key, checking its envelope, its
// fields (no unknown ones) and that it is a reservation the ledger could have written.
func decodeReservation(key, v []byte) (*device.Reservation, error) {
	payload, err := unseal(v)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.DisallowUnknownFields()
	var rec recordV1
	if err := dec.Decode(&rec); err != nil {
		return nil, fmt.Errorf("undecodable: %w", err)
	}
	if dec.More() {
		return nil, errors.New("undecodable: trailing data after the record")
	}
	r := &device.Reservation{
		ID:             rec.ID,
		OwnerID:        rec.OwnerID,
		Group:          device.GroupKey{Vendor: rec.Group.Vendor, Type: rec.Group.Type, Name: rec.Group.Name},
		Plugin:         rec.Plugin,
		DeviceIDs:      rec.DeviceIDs,
		Container:      device.ContainerReservation{Envs: rec.Container.Envs, CDIDevices: rec.Container.CDIDevices},
		CreatedAt:      normTime(rec.CreatedAt),
		ReleasedAt:     normTime(rec.ReleasedAt),
		CleanupPending: rec.CleanupPending,
		OwnerLabels:    device.OwnerLabelsOf(rec.OwnerLabels),
		PluginOptions:  nilIfEmpty(rec.PluginOptions),
	}
	for _, c := range rec.Consumes {
		r.Consumes = append(r.Consumes, device.Consumption{Set: device.CounterSetKey{Plugin: rec.Plugin, Name: c.Set}, Counters: c.Counters,
			Groups: c.Groups})
	}
	if rec.Container.Mounts != nil {
		r.Container.Mounts = make([]device.Mount, len(rec.Container.Mounts))
		for i, m := range rec.Container.Mounts {
			r.Container.Mounts[i] = device.Mount(m)
		}
	}
	if rec.Container.Devices != nil {
		r.Container.Devices = make([]device.DeviceSpec, len(rec.Container.Devices))
		for i, d := range rec.Container.Devices {
			r.Container.Devices[i] = device.DeviceSpec(d)
		}
	}
	switch rec.State {
	case "active":
		r.State = device.ReservationActive
	case "released":
		r.State = device.ReservationReleased
	default:
		return nil, fmt.Errorf("unknown state %q", rec.State)
	}
	switch {
	case r.ID != string(key):
		return nil, fmt.Errorf("stored under key %q but its ID is %q", key, r.ID)
	case r.State == device.ReservationActive && (!r.ReleasedAt.IsZero() || r.CleanupPending):
		return nil, errors.New("active but carries release data")
	case r.State == device.ReservationReleased && r.ReleasedAt.IsZero():
		return nil, errors.New("released without a release time")
	}
	if err := checkRecord(r.OwnerID, r.DeviceIDs); err != nil {
		return nil, err
	}
	if err := checkConsumes(r.Plugin, r.Consumes); err != nil {
		return nil, err
	}
	return r, nil
}

// checkRecord checks the invariants every stored reservation keeps, which the index and
// the conflict rules (decide) rely on: an owner, at least one device, and no device ID
// empty or named twice. Open checks them on every record it loads, and Reserve and
// Reown assert them before they write one, so that no write can leave a record Open
// would refuse. They are not the host API's rules (lengths, UTF-8, printable...): those
// are validate's, checked once at the server.
func checkRecord(owner string, deviceIDs []string) error {
	switch {
	case owner == "":
		return errors.New("no owner ID")
	case len(deviceIDs) == 0:
		return errors.New("no device IDs")
	}
	var seen map[string]int // only for long lists; a short one is searched in place
	if len(deviceIDs) > 16 {
		seen = make(map[string]int, len(deviceIDs))
	}
	for i, id := range deviceIDs {
		if id == "" {
			return fmt.Errorf("device ID %d is empty", i)
		}
		j, dup := -1, false
		if seen != nil {
			j, dup = seen[id]
			seen[id] = i
		} else if j = slices.Index(deviceIDs[:i], id); j >= 0 {
			dup = true
		}
		if dup {
			return fmt.Errorf("device ID %q named twice (%d and %d)", id, j, i)
		}
	}
	return nil
}

// load reads the reservations and intents of the open file (store.Open checked it).
func load(db *bolt.DB, path string) (idx *index, err error) {
	// A damaged page can make bbolt fault on its memory map or panic: a corrupt file,
	// not a reason to crash.
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			idx, err = nil, corruptError(path, fmt.Sprintf("bbolt cannot read it (%v)", r), nil)
		}
	}()
	idx = newIndex()
	err = db.View(func(tx *bolt.Tx) error {
		err := tx.Bucket(bucketReservations).ForEach(func(k, v []byte) error {
			r, err := decodeReservation(k, v)
			if err != nil {
				return corruptError(path, fmt.Sprintf("reservation record %q: %v", k, err), err)
			}
			if dev, other := idx.clash(r); other != "" {
				return corruptError(path, fmt.Sprintf("live reservations %q and %q both hold device %s",
					other, r.ID, dev), nil)
			}
			idx.add(r)
			return nil
		})
		if err != nil {
			return err
		}
		return loadIntents(tx, path, idx)
	})
	if err != nil {
		var sfe *StateFileError
		if errors.As(err, &sfe) {
			return nil, sfe
		}
		return nil, fmt.Errorf("read state file %s: %w", path, err)
	}
	return idx, nil
}

// loadIntents adds the file's intents (see intent.go) to idx, after its reservations.
func loadIntents(tx *bolt.Tx, path string, idx *index) error {
	b := tx.Bucket(bucketIntents)
	if b == nil {
		return nil
	}
	return b.ForEach(func(k, v []byte) error {
		r, err := decodeReservation(k, v)
		switch {
		case err != nil:
			return corruptError(path, fmt.Sprintf("intent record %q: %v", k, err), err)
		case r.State != device.ReservationActive:
			return corruptError(path, fmt.Sprintf("intent record %q is not live", k), nil)
		case idx.has(r.ID):
			return corruptError(path, fmt.Sprintf("intent %q is a reservation record too", k), nil)
		}
		if dev, other := idx.clash(r); other != "" {
			return corruptError(path, fmt.Sprintf("intent %q and live reservation %q both hold device %s",
				r.ID, other, dev), nil)
		}
		idx.add(r)
		idx.intent[r.ID] = struct{}{}
		return nil
	})
}

// nilIfEmpty is m, or nil when it has no entries: a reservation without plugin options
// has nil ones, however it was made or read.
func nilIfEmpty(m map[string]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	return m
}
