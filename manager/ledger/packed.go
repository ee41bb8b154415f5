package ledger

import (
	"encoding/binary"
	"maps"
	"slices"
	"time"

	"github.com/devicehost/devicehost/device"
)

// packed is a released reservation, all but its ID, packed into one string.
//
// A ledger keeps every released reservation in memory until the GC deletes it, up to
// gc.Config.MaxReservations of them (100,000 and more on a busy host), so that reads
// never wait for the disk. As a device.Reservation each costs about 1.5 KiB in a dozen
// heap objects, which Go's garbage collector marks on every cycle, so the ledger's CPU
// per write grew with its size. Packed, one is a single object without pointers, its
// owner (a key of the index) is a substring of it, and its ID is kept beside it, one
// string shared by the index and the GC. Unpacking one takes about a microsecond; the
// ledger does it when a released reservation is read (Get, List, a Release naming it,
// the GC's bookkeeping), a few times per Reserve+Release cycle at most.
//
// Why not leave released reservations in bbolt alone and read them there?
// Measured on a ledger of 100,000 released reservations: one read from the file (a read
// transaction, Get, decodeReservation) took 35 µs, 4.7 KB and 52 allocations, against
// 2.7 µs, 0.75 KB and 7 for unpack; listing all of them 2.8 s against 0.8 s. A cycle
// reads its released reservation about four times (the GC's change feed, CleanupDone,
// the deletion's checks), so the ledger-and-GC CPU per cycle (about 850 µs) would grow
// by some 15%, past the 10% scripts/bench allows. And a long read transaction holds
// bbolt's mmap lock: a List of every reservation would stall any commit that grows the
// file, and every Reserve waiting on that commit, for its whole scan. Reads never
// waiting for the disk or a commit is the point of the index.
//
// Layout: a flags byte (flagCleanupPending), then in this order the owner, the group
// (vendor, type, name), the plugin, the device IDs, the creation and release times,
// the container reservation: envs, mounts, device nodes, CDI names; the use of
// counter sets: per set its name and its counters (name, varint); the owner
// labels; and the plugin options. A string is its
// length (uvarint) and bytes; a list or map is its length plus one (0 for nil, so nil
// and empty stay apart) and its elements; a time is 0 for the zero time, else 1, its
// Unix seconds (varint) and nanoseconds (uvarint).
type packed string

const flagCleanupPending = 1 << 0

// pack packs released reservation r (its ID and TakenOver aside).
func pack(r *device.Reservation) packed {
	var p packer
	var flags byte
	if r.CleanupPending {
		flags |= flagCleanupPending
	}
	p.b = append(p.b, flags)
	p.str(r.OwnerID)
	p.str(r.Group.Vendor)
	p.str(r.Group.Type)
	p.str(r.Group.Name)
	p.str(r.Plugin)
	p.strs(r.DeviceIDs)
	p.time(r.CreatedAt)
	p.time(r.ReleasedAt)
	c := r.Container
	p.strMap(c.Envs)
	p.count(c.Mounts == nil, len(c.Mounts))
	for _, m := range c.Mounts {
		p.str(m.HostPath)
		p.str(m.ContainerPath)
		p.bool(m.ReadOnly)
	}
	p.count(c.Devices == nil, len(c.Devices))
	for _, d := range c.Devices {
		p.str(d.HostPath)
		p.str(d.ContainerPath)
		p.str(d.Permissions)
	}
	p.strs(c.CDIDevices)
	p.count(r.Consumes == nil, len(r.Consumes))
	for _, cons := range r.Consumes {
		p.str(cons.Set.Name) // the set's plugin is the reservation's
		p.count(cons.Counters == nil, len(cons.Counters))
		for _, k := range slices.Sorted(maps.Keys(cons.Counters)) {
			p.str(k)
			p.b = binary.AppendVarint(p.b, cons.Counters[k])
		}
		p.strs(cons.Groups)
	}
	p.str(r.OwnerLabels.Pod)
	p.str(r.OwnerLabels.Namespace)
	p.strMap(r.PluginOptions)
	return packed(p.b)
}

// owner is the reservation's owner ID, a substring of p.
func (p packed) owner() string {
	u := unpacker{s: string(p), i: 1}
	return u.str()
}

// hasDevice says whether the reservation was for device d.
func (p packed) hasDevice(d string) bool {
	u := unpacker{s: string(p), i: 1}
	for range 5 { // owner, vendor, type, name, plugin
		u.str()
	}
	n, _ := u.count()
	for range n {
		if u.str() == d {
			return true
		}
	}
	return false
}

// cleanupPending says whether the reservation's plugin cleanup is owed.
func (p packed) cleanupPending() bool { return p[0]&flagCleanupPending != 0 }

// unpack returns the released reservation p holds, with ID id. Its strings are
// substrings of p; its slices and map are its own.
func (p packed) unpack(id string) *device.Reservation {
	u := unpacker{s: string(p), i: 1}
	r := &device.Reservation{
		ID:             id,
		State:          device.ReservationReleased,
		CleanupPending: p.cleanupPending(),
	}
	r.OwnerID = u.str()
	r.Group.Vendor = u.str()
	r.Group.Type = u.str()
	r.Group.Name = u.str()
	r.Plugin = u.str()
	r.DeviceIDs = u.strs()
	r.CreatedAt = u.time()
	r.ReleasedAt = u.time()
	c := &r.Container
	c.Envs = u.strMap()
	if n, ok := u.count(); ok {
		c.Mounts = make([]device.Mount, n)
		for i := range c.Mounts {
			c.Mounts[i] = device.Mount{HostPath: u.str(), ContainerPath: u.str(), ReadOnly: u.bool()}
		}
	}
	if n, ok := u.count(); ok {
		c.Devices = make([]device.DeviceSpec, n)
		for i := range c.Devices {
			c.Devices[i] = device.DeviceSpec{HostPath: u.str(), ContainerPath: u.str(), Permissions: u.str()}
		}
	}
	c.CDIDevices = u.strs()
	if n, ok := u.count(); ok {
		r.Consumes = make([]device.Consumption, n)
		for i := range r.Consumes {
			cons := device.Consumption{Set: device.CounterSetKey{Plugin: r.Plugin, Name: u.str()}}
			if m, ok := u.count(); ok {
				cons.Counters = make(map[string]int64, m)
				for range m {
					k := u.str()
					cons.Counters[k] = u.varint()
				}
			}
			cons.Groups = u.strs()
			r.Consumes[i] = cons
		}
	}
	r.OwnerLabels = device.OwnerLabels{Pod: u.str(), Namespace: u.str()}
	r.PluginOptions = u.strMap()
	if u.i != len(u.s) {
		panic("ledger: packed reservation has trailing bytes") // only pack makes them
	}
	return r
}

// packer appends a packed reservation's fields.
type packer struct{ b []byte }

func (p *packer) str(s string) {
	p.b = binary.AppendUvarint(p.b, uint64(len(s)))
	p.b = append(p.b, s...)
}

func (p *packer) count(isNil bool, n int) {
	if isNil {
		p.b = append(p.b, 0)
		return
	}
	p.b = binary.AppendUvarint(p.b, uint64(n)+1)
}

// strMap packs m, its keys sorted.
func (p *packer) strMap(m map[string]string) {
	p.count(m == nil, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		p.str(k)
		p.str(m[k])
	}
}

func (p *packer) strs(ss []string) {
	p.count(ss == nil, len(ss))
	for _, s := range ss {
		p.str(s)
	}
}

func (p *packer) bool(v bool) {
	if v {
		p.b = append(p.b, 1)
	} else {
		p.b = append(p.b, 0)
	}
}

func (p *packer) time(t time.Time) {
	if t.IsZero() {
		p.b = append(p.b, 0)
		return
	}
	p.b = append(p.b, 1)
	p.b = binary.AppendVarint(p.b, t.Unix())
	p.b = binary.AppendUvarint(p.b, uint64(t.Nanosecond()))
}

// unpacker reads a packed reservation's fields. Only pack makes what it reads, so a
// malformed one is a bug: it panics.
type unpacker struct {
	s string
	i int
}

func (u *unpacker) uvarint() uint64 {
	var v uint64
	for shift := uint(0); shift < 64; shift += 7 {
		b := u.s[u.i]
		u.i++
		v |= uint64(b&0x7f) << shift
		if b < 0x80 {
			return v
		}
	}
	panic("ledger: malformed packed reservation")
}

func (u *unpacker) varint() int64 {
	ux := u.uvarint() // zig-zag, as binary.AppendVarint writes it
	x := int64(ux >> 1)
	if ux&1 != 0 {
		x = ^x
	}
	return x
}

func (u *unpacker) str() string {
	n := int(u.uvarint())
	s := u.s[u.i : u.i+n]
	u.i += n
	return s
}

// count reads a list's or map's length; ok is false for nil.
func (u *unpacker) count() (n int, ok bool) {
	c := u.uvarint()
	if c == 0 {
		return 0, false
	}
	return int(c - 1), true
}

// strMap unpacks what packer.strMap packed.
func (u *unpacker) strMap() map[string]string {
	n, ok := u.count()
	if !ok {
		return nil
	}
	m := make(map[string]string, n)
	for range n {
		k := u.str()
		m[k] = u.str()
	}
	return m
}

func (u *unpacker) strs() []string {
	n, ok := u.count()
	if !ok {
		return nil
	}
	ss := make([]string, n)
	for i := range ss {
		ss[i] = u.str()
	}
	return ss
}

func (u *unpacker) bool() bool {
	v := u.s[u.i] != 0
	u.i++
	return v
}

func (u *unpacker) time() time.Time {
	if !u.bool() {
		return time.Time{}
	}
	sec := u.varint()
	return time.Unix(sec, int64(u.uvarint())).UTC()
}
