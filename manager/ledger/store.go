package ledger

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"

	"github.com/devicehost/devicehost/device"
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
// A record envelope is a 4-byte big-endian CRC-32C of the payload followed by the
// payload. bbolt checksums only its meta pages, so the CRC is what names a record whose
// bytes changed under us.
const schemaVersion uint32 = 1

var (
	bucketMeta         = []byte("meta")
	bucketReservations = []byte("reservations")
	bucketReattach     = []byte("reattach")
	keySchemaVersion   = []byte("schema_version")
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// maxCheckProblems is how many consistency problems Open names before summarising.
const maxCheckProblems = 3

func seal(payload []byte) []byte {
	out := make([]byte, 4, 4+len(payload))
	return sealIn(append(out, payload...))
}

// sealIn fills in the checksum of b, a record envelope whose payload follows the 4
// bytes left for it, and returns b.
func sealIn(b []byte) []byte {
	binary.BigEndian.PutUint32(b, crc32.Checksum(b[4:], castagnoli))
	return b
}

// unseal checks an envelope and returns its payload, which aliases v.
func unseal(v []byte) ([]byte, error) {
	if len(v) < 4 {
		return nil, fmt.Errorf("%d bytes, shorter than its checksum", len(v))
	}
	stored, payload := binary.BigEndian.Uint32(v), v[4:]
	if got := crc32.Checksum(payload, castagnoli); got != stored {
		return nil, fmt.Errorf("checksum mismatch (stored %08x, computed %08x)", stored, got)
	}
	return payload, nil
}

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
}

// consumptionV1 is a reservation's use of one counter set of its plugin.
type consumptionV1 struct {
	Set      string           `json:"set"`
	Counters map[string]int64 `json:"counters"`
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
	}
	for _, c := range rec.Consumes {
		r.Consumes = append(r.Consumes, device.Consumption{Set: device.CounterSetKey{Plugin: rec.Plugin, Name: c.Set}, Counters: c.Counters})
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

// openBolt opens the bbolt file and turns bbolt's errors into ones that say what to do.
func openBolt(path string, timeout time.Duration) (db *bolt.DB, err error) {
	// A damaged file can make bbolt fault on its memory map or panic on a bad page;
	// either is a corrupt file, not a reason to crash.
	var file *os.File // kept to release the file and its lock should bbolt panic
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			if file != nil { // bbolt's memory map of it leaks: this path ends the agent
				unlockFile(file)
				_ = file.Close() // the panic is the error to report
			}
			db, err = nil, corruptError(path, fmt.Sprintf("bbolt cannot read it (%v)", r), nil)
		}
	}()
	db, err = bolt.Open(path, 0o600, &bolt.Options{
		Timeout: timeout,
		OpenFile: func(name string, flag int, perm os.FileMode) (*os.File, error) {
			f, err := os.OpenFile(name, flag, perm)
			file = f
			return f, err
		},
	})
	switch {
	case err == nil:
		return db, nil
	case errors.Is(err, berrors.ErrTimeout):
		return nil, &StateFileError{
			Path:    path,
			Kind:    ErrLocked,
			Problem: fmt.Sprintf("locked by another process (waited %s)", timeout),
			Recovery: "the state dir is in use by another devicehost: stop that agent, " +
				"or give this one a different -state-dir",
			Err: err,
		}
	case errors.Is(err, berrors.ErrInvalid), errors.Is(err, berrors.ErrChecksum),
		errors.Is(err, berrors.ErrVersionMismatch),
		strings.HasPrefix(err.Error(), "file size too small"): // bbolt has no sentinel for this one
		return nil, corruptError(path, fmt.Sprintf("not a readable bbolt database (%v)", err), err)
	default:
		return nil, fmt.Errorf("open state file %s: %w", path, err)
	}
}

// loadOrInit checks the file, applies what an earlier version's log holds that it lacks
// (replayLog), and
// loads its reservations, or initialises a new file. It writes nothing else to a file
// that has buckets.
func loadOrInit(db *bolt.DB, path string) (idx *index, replayed int, err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			idx, err = nil, corruptError(path, fmt.Sprintf("bbolt cannot read it (%v)", r), nil)
		}
	}()
	if err := checkConsistency(db, path); err != nil {
		return nil, 0, err
	}
	if replayed, err = replayLog(db, path); err != nil {
		return nil, 0, err
	}
	idx = newIndex()
	fresh := false
	err = db.View(func(tx *bolt.Tx) error {
		if k, _ := tx.Cursor().First(); k == nil {
			fresh = true
			return nil
		}
		if err := checkSchema(tx, path); err != nil {
			return err
		}
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
			return nil, 0, sfe
		}
		return nil, 0, fmt.Errorf("read state file %s: %w", path, err)
	}
	if !fresh {
		return idx, replayed, nil
	}
	err = db.Update(func(tx *bolt.Tx) error {
		meta, err := tx.CreateBucket(bucketMeta)
		if err != nil {
			return err
		}
		var v [4]byte
		binary.BigEndian.PutUint32(v[:], schemaVersion)
		if err := meta.Put(keySchemaVersion, v[:]); err != nil {
			return err
		}
		if _, err := tx.CreateBucket(bucketReservations); err != nil {
			return err
		}
		_, err = tx.CreateBucket(bucketReattach)
		return err
	})
	if err != nil {
		return nil, 0, fmt.Errorf("initialise state file %s: %w", path, err)
	}
	// The file may be new: make its directory entry durable too, or a power cut could
	// lose the whole file along with the reservations committed to it.
	if err := syncDir(filepath.Dir(path)); err != nil {
		return nil, 0, fmt.Errorf("initialise state file %s: %w", path, err)
	}
	return idx, replayed, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

// checkConsistency runs bbolt's page-level check: every page reachable or free, no page
// twice, keys in order.
func checkConsistency(db *bolt.DB, path string) error {
	var problems []string
	n := 0
	err := db.View(func(tx *bolt.Tx) error {
		for e := range tx.Check() { // drained to the end: Check's goroutine closes it
			if n++; len(problems) < maxCheckProblems {
				problems = append(problems, e.Error())
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("check state file %s: %w", path, err)
	}
	if n == 0 {
		return nil
	}
	msg := "bbolt consistency check failed: " + strings.Join(problems, "; ")
	if n > len(problems) {
		msg += fmt.Sprintf(" (and %d more)", n-len(problems))
	}
	return corruptError(path, msg, nil)
}

func checkSchema(tx *bolt.Tx, path string) error {
	meta := tx.Bucket(bucketMeta)
	if meta == nil {
		return corruptError(path, "no devicehost meta bucket: it is not a devicehost state file "+
			"(or its meta data is lost)", nil)
	}
	v := meta.Get(keySchemaVersion)
	if len(v) != 4 {
		return corruptError(path, fmt.Sprintf("schema version record is %d bytes, want 4", len(v)), nil)
	}
	switch got := binary.BigEndian.Uint32(v); {
	case got == schemaVersion:
	case got > schemaVersion:
		return &StateFileError{
			Path: path,
			Kind: ErrSchemaVersion,
			Problem: fmt.Sprintf("schema version %d is newer than this devicehost understands (%d)",
				got, schemaVersion),
			Recovery: "run a newer devicehost, or move the file aside to start with an empty " +
				"ledger (held devices will be forgotten)",
		}
	default:
		return &StateFileError{
			Path:    path,
			Kind:    ErrSchemaVersion,
			Problem: fmt.Sprintf("schema version %d is not one devicehost ever wrote (this one writes %d)", got, schemaVersion),
			Recovery: fmt.Sprintf("the file was left untouched: restore it from a backup, or move it aside "+
				"(mv %s %s.corrupt) to start with an empty ledger (held devices will be forgotten)", path, path),
		}
	}
	for _, b := range [][]byte{bucketReservations, bucketReattach} {
		if tx.Bucket(b) == nil {
			return corruptError(path, fmt.Sprintf("schema 1 file without its %s bucket", b), nil)
		}
	}
	return nil
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
