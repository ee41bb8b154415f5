package dra

import (
	"bytes"
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/blang/semver/v4"
	"google.golang.org/protobuf/proto"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// ClaimOwnerPrefix starts the owner ID of every reservation the driver makes:
// "k8s-claim/<namespace>/<name>/<uid>".
const ClaimOwnerPrefix = "k8s-claim/"

// Limits of a ResourceSlice (resource.k8s.io/v1).
const (
	maxDevicesPerSlice     = resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures
	maxCounterSetsPerSlice = resourceapi.ResourceSliceMaxCounterSets
	maxAttributesPerDevice = resourceapi.ResourceSliceMaxAttributesAndCapacitiesPerDevice
	maxStringValue         = resourceapi.DeviceAttributeMaxValueLength
)

// groupKey names a device group at the agent.
type groupKey struct{ vendor, typ, name string }

// deviceRef is one of the agent's devices as the driver publishes it.
type deviceRef struct {
	name   string // DRA device name
	group  groupKey
	id     string // the agent's device ID
	health pb.Health
	reason string
	pool   *sharePool // a pooled device of MPS shares (mpspool.go); id is poolID
}

// view is what one Fingerprint snapshot gives the driver: the pool's slices, and the
// devices by DRA name. Immutable once built.
type view struct {
	pool    string
	slices  []resourceslice.Slice
	devices map[string]*deviceRef // read-only: a device's ref may be the last view's
	order   []string              // device names in publishing order
	// disconnected is why the agent cannot be read, or nil.
	disconnected error
	// encs are the slices' encodings (sliceEncoding), in their order.
	encs []sliceEnc
}

// sliceEnc is what the publisher compares to tell whether a slice says what it last
// wrote there: the encoding of the slice's fields besides its devices, and each
// device's (deterministic: the generated code sorts map keys). A device the view cache
// kept has the encoding it had, the same bytes, which compare at once. valid is false
// where the slice would not encode (then write it: one write too many is harmless).
type sliceEnc struct {
	valid bool
	rest  []byte
	devs  [][]byte
}

// equal reports whether two valid encodings are the same.
func (e sliceEnc) equal(o sliceEnc) bool {
	return e.valid && o.valid && bytes.Equal(e.rest, o.rest) && slices.EqualFunc(e.devs, o.devs, bytes.Equal)
}

// buildOptions are the inputs of buildView besides the snapshot.
type buildOptions struct {
	driver string // driver name: the attributes' domain and the taints' key prefix
	pool   string
	// disconnected is set while the agent cannot be reached: every device is then
	// published with a taint saying so.
	disconnected error
	// pci looks up the PCI attributes (nil: each build looks them up again in the
	// host's /sys).
	pci *pciAttributes
	// cache, when set, keeps each device as built from one snapshot to the next (see
	// viewCache); one goroutine's builds only.
	cache *viewCache
}

// viewCache keeps each device as the last build made it, with what it was made from,
// so that the next snapshot rebuilds and encodes again only the devices that changed:
// a Reserve changes one device's holder of the hundreds a MIG machine publishes. Not
// safe for concurrent builds: watchLoop's alone use it.
type viewCache struct {
	sets     string                   // the counter sets the devices were built against
	counters *counterSets             // as the last build made them
	groups   map[groupKey][]byte      // each group's input (see cachedDevice)
	devices  map[string]*cachedDevice // by agent device ID
	chunks   map[string]*cachedChunk  // the last build's slices of devices, by first device
	scratch  []byte                   // a device's input, encoded to be compared
}

// cachedChunk is a slice of devices as a build made it: of members' devices, in order.
type cachedChunk struct {
	members []*cachedDevice
	devs    []resourceapi.Device
	enc     sliceEnc
}

// counterSets are the agent's counter sets as DRA's, and their slices.
type counterSets struct {
	in       []*pb.CounterSet     // the messages they were built from
	names    map[[2]string]string // (plugin, set) -> DRA counter set name
	joined   string               // names as text, in order (to compare)
	problems []string
	slices   []resourceslice.Slice
	encs     []sliceEnc
}

// sameCounterSets reports whether the counter sets a and b make the same DRA counter
// sets: each the same message (client.WatchDevices gives an unchanged one so), or of
// the same plugin, name and capacity (what a Reserve changes of a GPU's set is what
// it uses, which DRA's counter sets do not say).
func sameCounterSets(a, b []*pb.CounterSet) bool {
	return slices.EqualFunc(a, b, func(x, y *pb.CounterSet) bool {
		return x == y || x.GetPlugin() == y.GetPlugin() && x.GetName() == y.GetName() && maps.Equal(x.GetCapacity(), y.GetCapacity())
	})
}

// buildCounterSets builds in as DRA's counter sets, sorted by name, in slices of
// maxCounterSetsPerSlice.
func buildCounterSets(in []*pb.CounterSet) *counterSets {
	cs := &counterSets{in: slices.Clone(in), names: make(map[[2]string]string, len(in))}
	var sets []resourceapi.CounterSet
	seen := make(map[string]bool, len(in))
	for _, c := range in {
		name := label(c.GetPlugin() + "-" + c.GetName())
		if seen[name] {
			cs.problems = append(cs.problems, fmt.Sprintf("counter set %s of plugin %s: its DRA name %s is taken; left out", c.GetName(), c.GetPlugin(), name))
			continue
		}
		seen[name] = true
		cs.names[[2]string{c.GetPlugin(), c.GetName()}] = name
		set := resourceapi.CounterSet{Name: name, Counters: make(map[string]resourceapi.Counter, len(c.GetCapacity()))}
		for k, n := range c.GetCapacity() {
			set.Counters[label(k)] = resourceapi.Counter{Value: *resource.NewQuantity(n, resource.DecimalSI)}
		}
		sets = append(sets, set)
	}
	slices.SortFunc(sets, func(a, b resourceapi.CounterSet) int { return strings.Compare(a.Name, b.Name) })
	lines := make([]string, 0, len(cs.names))
	for k, n := range cs.names {
		lines = append(lines, fmt.Sprintf("%q %q %q", k[0], k[1], n))
	}
	slices.Sort(lines) // a map's order is random: equal sets must read equal
	cs.joined = strings.Join(lines, "\n")
	for chunk := range slices.Chunk(sets, maxCounterSetsPerSlice) {
		s := resourceslice.Slice{SharedCounters: chunk}
		cs.slices = append(cs.slices, s)
		cs.encs = append(cs.encs, sliceEncoding(s, nil))
	}
	return cs
}

// cachedDevice is a device as built, the input it was built from (the agent's device,
// deterministically encoded; its group's, without devices, and whether the agent was
// reachable are in viewCache.groups), its encoding, and what building it found wrong.
type cachedDevice struct {
	src      *pb.Device // the message it was last found the same as
	in       []byte
	dev      resourceapi.Device
	enc      []byte
	problems []string
	ref      *deviceRef // as the last view has it
}

func newViewCache() *viewCache {
	return &viewCache{groups: make(map[groupKey][]byte), devices: make(map[string]*cachedDevice)}
}

// deterministic encodes the agent's messages for the cache's comparisons.
var deterministic = proto.MarshalOptions{Deterministic: true}

// taint keys, after the driver name and '/'.
const (
	taintUnhealthy = "unhealthy"
	taintHeld      = "held"
	taintBlocked   = "blocked"
	// taintCordoned: an operator took the device out of service (devicehost cordon);
	// NoExecute for a drain, so that Kubernetes evicts the pod that holds it.
	taintCordoned = "cordoned"
)

// buildView turns the agent's snapshot into the pool's ResourceSlices: every device
// with its attributes, capacities, counter consumption and taints, and the counter
// sets in slices of their own (DRA wants them apart from devices). problems lists
// what had to be left out, for the log.
func buildView(snap *pb.FingerprintResponse, o buildOptions) (v *view, problems []string) {
	snap, pools := poolShares(snap)
	total := 0
	for _, g := range snap.GetGroups() {
		total += len(g.GetDevices())
	}
	v = &view{pool: o.pool, devices: make(map[string]*deviceRef, total), order: make([]string, 0, total), disconnected: o.disconnected}
	if o.pci == nil {
		o.pci = &pciAttributes{}
	}
	cache, next := o.cache, map[string]*cachedDevice(nil)
	var cs *counterSets
	if cache != nil && cache.counters != nil && sameCounterSets(cache.counters.in, snap.GetCounterSets()) {
		cs = cache.counters // built as they were
		cs.in = slices.Clone(snap.GetCounterSets())
	} else {
		cs = buildCounterSets(snap.GetCounterSets())
	}
	problems = append(problems, cs.problems...)
	setNames := cs.names
	if cache != nil {
		if cs.joined != cache.sets {
			cache.sets, cache.devices = cs.joined, make(map[string]*cachedDevice)
		}
		cache.counters = cs
		next = make(map[string]*cachedDevice, total)
	}
	nextGroups := make(map[groupKey][]byte)
	var encs [][]byte       // the devices' encodings, in order, where cached
	var cds []*cachedDevice // and each device's cache entry (nil: none)
	if cache != nil {
		encs = make([][]byte, 0, total)
		cds = make([]*cachedDevice, 0, total)
	}

	groups := slices.Clone(snap.GetGroups())
	slices.SortFunc(groups, func(a, b *pb.DeviceGroup) int {
		return cmp.Or(strings.Compare(a.GetPlugin(), b.GetPlugin()), strings.Compare(a.GetVendor(), b.GetVendor()),
			strings.Compare(a.GetType(), b.GetType()), strings.Compare(a.GetName(), b.GetName()))
	})
	devices := make([]*resourceapi.Device, 0, total) // (a Device is large: not copied)
	for _, g := range groups {
		key := groupKey{g.GetVendor(), g.GetType(), g.GetName()}
		sameGroup := false
		if cache != nil {
			bare := &pb.DeviceGroup{Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName(), Plugin: g.GetPlugin(), Attributes: g.GetAttributes()}
			groupIn, err := deterministic.Marshal(bare)
			if err == nil {
				if o.disconnected != nil {
					groupIn = append(groupIn, o.disconnected.Error()...)
				}
				sameGroup = bytes.Equal(groupIn, cache.groups[key])
				nextGroups[key] = groupIn
			}
		}
		var common map[resourceapi.QualifiedName]resourceapi.DeviceAttribute
		var capacity map[resourceapi.QualifiedName]resourceapi.DeviceCapacity
		groupDone := false
		devs := slices.Clone(g.GetDevices())
		slices.SortFunc(devs, func(a, b *pb.Device) int { return strings.Compare(a.GetId(), b.GetId()) })
		for _, d := range devs {
			var in []byte
			var c *cachedDevice
			if cache != nil {
				c = cache.devices[d.GetId()]
			}
			cached := c != nil
			var name string
			if cached {
				name = c.dev.Name // the DRA name depends on the ID alone
			} else {
				name = DeviceName(d.GetId())
			}
			newRef := func() *deviceRef {
				return &deviceRef{name: name, group: key, id: d.GetId(), health: d.GetHealth(), reason: d.GetHealthReason(), pool: pools[d.GetId()]}
			}
			if _, dup := v.devices[name]; dup {
				problems = append(problems, fmt.Sprintf("device %s: its DRA name %s is taken; left out", d.GetId(), name))
				continue
			}
			if cache != nil {
				// The stream's decoder gives a device that did not change as the same
				// message (client.WatchDevices): no need to encode it to tell.
				reusable := cached && sameGroup
				same := reusable && c.src == d
				if !same {
					var err error
					cache.scratch, err = deterministic.MarshalAppend(cache.scratch[:0], d)
					if err == nil {
						same = reusable && bytes.Equal(c.in, cache.scratch)
						if !same {
							in = slices.Clone(cache.scratch)
						}
					}
				}
				if same {
					c.src = d
					problems = append(problems, c.problems...)
					devices = append(devices, &c.dev)
					encs = append(encs, c.enc)
					cds = append(cds, c)
					next[d.GetId()] = c
					if c.ref == nil || c.ref.pool != pools[d.GetId()] {
						c.ref = newRef()
					}
					v.devices[name] = c.ref
					v.order = append(v.order, name)
					continue
				}
			}
			if !groupDone {
				var gp []string
				common, capacity, gp = groupAttributes(g)
				problems = append(problems, gp...)
				groupDone = true
			}
			firstProblem := len(problems)
			dev := resourceapi.Device{Name: name, Attributes: make(map[resourceapi.QualifiedName]resourceapi.DeviceAttribute)}
			for k, a := range common {
				dev.Attributes[k] = a
			}
			if len(capacity) > 0 {
				dev.Capacity = make(map[resourceapi.QualifiedName]resourceapi.DeviceCapacity, len(capacity))
				for k, c := range capacity {
					dev.Capacity[k] = c
				}
			}
			dev.Attributes["id"] = str(d.GetId())
			if strings.HasPrefix(d.GetId(), "GPU-") || strings.HasPrefix(d.GetId(), "MIG-") {
				dev.Attributes["uuid"] = str(d.GetId())
			}
			// The device it divides (a MIG partition's or an MPS share's GPU, a static MIG
			// device's shares' instance): a claim's constraints can match it, so that its
			// MPS shares are of one GPU (matchAttribute: <driver>/parent).
			if c := d.GetConsumes(); len(c) == 1 && c[0].GetCounterSet() != d.GetId() {
				dev.Attributes["parent"] = str(c[0].GetCounterSet())
			}
			problems = append(problems, localityAttributes(dev.Attributes, d, o.pci)...)
			for _, c := range d.GetConsumes() {
				set, ok := setNames[[2]string{g.GetPlugin(), c.GetCounterSet()}]
				if !ok {
					problems = append(problems, fmt.Sprintf("device %s: consumes unknown counter set %s; consumption left out", d.GetId(), c.GetCounterSet()))
					continue
				}
				// Its compatibility groups, as the agent's ledger keeps them: the scheduler
				// then never puts a time-sliced claim and an MPS claim on one GPU (with
				// the DRADeviceCompatibilityGroups feature gate; without it the API
				// server drops them and the agent refuses such a Prepare instead).
				cc := resourceapi.DeviceCounterConsumption{CounterSet: set, Counters: make(map[string]resourceapi.Counter),
					CompatibilityGroups: slices.Clone(c.GetCompatibilityGroups())}
				for k, n := range c.GetCounters() {
					cc.Counters[label(k)] = resourceapi.Counter{Value: *resource.NewQuantity(n, resource.DecimalSI)}
				}
				dev.ConsumesCounters = append(dev.ConsumesCounters, cc)
			}
			slices.SortFunc(dev.ConsumesCounters, func(a, b resourceapi.DeviceCounterConsumption) int {
				return strings.Compare(a.CounterSet, b.CounterSet)
			})
			dev.Taints = taints(o.driver, d, o.disconnected)
			if p := pools[d.GetId()]; p != nil {
				p.consumable(&dev)
			}
			if n := len(dev.Attributes) + len(dev.Capacity); n > maxAttributesPerDevice {
				problems = append(problems, fmt.Sprintf("device %s: %d attributes and capacities, DRA allows %d; the group's attributes past the limit are left out", d.GetId(), n, maxAttributesPerDevice))
				trimAttributes(&dev)
			}
			ref := newRef()
			if cache == nil {
				devices = append(devices, &dev)
			} else {
				enc, err := dev.Marshal()
				if in == nil || err != nil {
					devices = append(devices, &dev)
					encs = append(encs, nil) // no cached encoding: the view's enc is not made
					cds = append(cds, nil)
				} else {
					c := &cachedDevice{src: d, in: in, dev: dev, enc: enc, problems: slices.Clone(problems[firstProblem:]), ref: ref}
					next[d.GetId()] = c
					devices = append(devices, &c.dev)
					encs = append(encs, enc)
					cds = append(cds, c)
				}
			}
			v.devices[name] = ref
			v.order = append(v.order, name)
		}
	}
	if cache != nil {
		cache.devices, cache.groups = next, nextGroups
	}
	v.slices = append(v.slices, cs.slices...)
	v.encs = append(v.encs, cs.encs...)
	// A slice of devices each the cache's as the last build made them, in the same
	// order, is that build's slice (a change of one GPU builds one slice again).
	var chunks map[string]*cachedChunk
	if cache != nil {
		chunks = make(map[string]*cachedChunk, len(cache.chunks))
	}
	for _, chunk := range sliceChunks(devices, maxDevicesPerSlice) {
		key := devices[chunk[0]].Name
		if cache != nil {
			// (A cached chunk's members are never nil: a device that is none is no
			// member's.)
			if cc := cache.chunks[key]; cc != nil &&
				slices.EqualFunc(cc.members, chunk, func(c *cachedDevice, i int) bool { return c == cds[i] }) {
				v.slices = append(v.slices, resourceslice.Slice{Devices: cc.devs})
				v.encs = append(v.encs, cc.enc)
				chunks[key] = cc
				continue
			}
		}
		devs := make([]resourceapi.Device, 0, len(chunk))
		var devEncs [][]byte
		var members []*cachedDevice
		for _, i := range chunk {
			devs = append(devs, *devices[i])
			if cache != nil {
				devEncs = append(devEncs, encs[i])
				members = append(members, cds[i])
			}
		}
		if slices.ContainsFunc(devEncs, func(b []byte) bool { return b == nil }) {
			devEncs = nil // not cached: encoded afresh
		}
		s := resourceslice.Slice{Devices: devs}
		enc := sliceEncoding(s, devEncs)
		v.slices = append(v.slices, s)
		v.encs = append(v.encs, enc)
		if cache != nil && !slices.Contains(members, nil) {
			chunks[key] = &cachedChunk{members: members, devs: devs, enc: enc}
		}
	}
	if cache != nil {
		cache.chunks = chunks
	}
	if len(v.slices) == 0 {
		// A pool with no devices is still published, empty, so the scheduler sees
		// the node has none rather than an old list.
		v.slices = []resourceslice.Slice{{}}
		v.encs = []sliceEnc{sliceEncoding(v.slices[0], nil)}
	}
	return v, problems
}

// sliceChunks packs devices into slices of at most max, as the indexes of each slice's
// devices: in their order, except that the devices consuming one counter set (a GPU,
// its MIG placements and MPS shares), where they are more than one, go together where
// the first of them is, in a slice of their own (slices, if more than one holds). A
// change of one GPU (a partition held, the placements it blocks tainted, the GPU
// itself) then changes one slice, which the publisher updates alone (a change spread
// over two slices makes it write every slice of the pool again, at a new generation,
// publish.go), and that slice holds that GPU's devices alone: the update encodes, and
// the API server and every watcher of slices decode, 29 devices of a DGX H100 with
// on-demand MIG rather than the 58 of two GPUs. Devices alone on their counter set,
// or on none, are packed together.
func sliceChunks(devices []*resourceapi.Device, max int) [][]int {
	type chunkKey struct {
		set  bool   // name is a counter set's; else the device's
		name string // (a device's name and a set's may be the same)
	}
	groupOf := make(map[chunkKey]int)
	var groups [][]int
	for i, d := range devices {
		key := chunkKey{name: d.Name}
		if len(d.ConsumesCounters) > 0 {
			key = chunkKey{set: true, name: d.ConsumesCounters[0].CounterSet}
		}
		g, ok := groupOf[key]
		if !ok {
			g = len(groups)
			groupOf[key] = g
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], i)
	}
	var out [][]int
	var cur []int
	for _, g := range groups {
		if len(g) > 1 { // a GPU and what divides it: slices of its own
			if len(cur) > 0 {
				out, cur = append(out, cur), nil
			}
			out = append(out, slices.Collect(slices.Chunk(g, max))...)
			continue
		}
		if len(cur) == max {
			out, cur = append(out, cur), nil
		}
		cur = append(cur, g...)
	}
	if len(cur) > 0 {
		out = append(out, cur)
	}
	return out
}

// sliceEncoding encodes s for the publisher's comparisons. It runs on every
// snapshot, one per Reserve and per Release at the agent, while a prepare may be
// waiting for the CPU: reflection's DeepEqual of two views took eight times as long as
// encoding one, and the view cache keeps each unchanged device's encoding (devEncs, in
// s.Devices' order; nil: encode them).
func sliceEncoding(s resourceslice.Slice, devEncs [][]byte) sliceEnc {
	rest := sliceSpec(s)
	rest.Devices = nil
	b, err := rest.Marshal()
	if err != nil {
		return sliceEnc{}
	}
	e := sliceEnc{valid: true, rest: b, devs: devEncs}
	if devEncs == nil {
		e.devs = make([][]byte, len(s.Devices))
		for i := range s.Devices {
			if e.devs[i], err = s.Devices[i].Marshal(); err != nil {
				return sliceEnc{}
			}
		}
	}
	return e
}

// sliceSpec carries every field of s (TestSliceSpecHasEveryField keeps it so).
func sliceSpec(s resourceslice.Slice) *resourceapi.ResourceSliceSpec {
	return &resourceapi.ResourceSliceSpec{
		Devices:                s.Devices,
		SharedCounters:         s.SharedCounters,
		PerDeviceNodeSelection: s.PerDeviceNodeSelection,
		PartitionTypeAttribute: s.PartitionTypeAttribute,
		SkipNodeOperations:     s.SkipNodeOperations,
	}
}

// groupAttributes converts a group's attributes (shared by its devices): vendor,
// type and product name, then the plugin's attributes, byte sizes ("memory" in MiB) as
// capacities, versions as versions where they parse as such.
func groupAttributes(g *pb.DeviceGroup) (map[resourceapi.QualifiedName]resourceapi.DeviceAttribute, map[resourceapi.QualifiedName]resourceapi.DeviceCapacity, []string) {
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		"vendor":      str(g.GetVendor()),
		"type":        str(g.GetType()),
		"productName": str(g.GetName()),
	}
	capacity := make(map[resourceapi.QualifiedName]resourceapi.DeviceCapacity)
	var problems []string
	keys := make([]string, 0, len(g.GetAttributes()))
	for k := range g.GetAttributes() {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		val := g.GetAttributes()[k]
		name := resourceapi.QualifiedName(attributeName(k))
		if name == "" {
			problems = append(problems, fmt.Sprintf("group %s: attribute %q has no DRA name; left out", g.GetName(), k))
			continue
		}
		if _, taken := attrs[name]; taken {
			continue
		}
		switch x := val.GetKind().(type) {
		case *pb.Value_IntValue:
			if shift, ok := byteUnits[val.GetUnit()]; ok {
				capacity[name] = resourceapi.DeviceCapacity{Value: *resource.NewQuantity(x.IntValue<<shift, resource.BinarySI)}
				continue
			}
			n := x.IntValue
			attrs[name] = resourceapi.DeviceAttribute{IntValue: &n}
		case *pb.Value_FloatValue:
			attrs[name] = str(strconv.FormatFloat(x.FloatValue, 'g', -1, 64))
		case *pb.Value_BoolValue:
			b := x.BoolValue
			attrs[name] = resourceapi.DeviceAttribute{BoolValue: &b}
		case *pb.Value_StringValue:
			if isVersionKey(k) {
				if ver, ok := version(x.StringValue); ok {
					attrs[name] = resourceapi.DeviceAttribute{VersionValue: &ver}
					continue
				}
			}
			attrs[name] = str(x.StringValue)
		}
	}
	return attrs, capacity, problems
}

// byteUnits are the units of byte sizes, by their shift from bytes.
var byteUnits = map[string]int{"B": 0, "KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40}

func isVersionKey(k string) bool {
	return strings.HasSuffix(k, "version") || strings.HasSuffix(k, "_capability")
}

// version turns "550.54.15", "535.104.05" or "9.0" into a semantic version
// ("535.104.5", "9.0.0"), as DRA's version attributes want.
func version(s string) (string, bool) {
	parts := strings.Split(s, ".")
	if len(parts) == 0 || len(parts) > 3 {
		return "", false
	}
	for i, p := range parts {
		if p == "" || strings.Trim(p, "0123456789") != "" {
			return "", false
		}
		if p = strings.TrimLeft(p, "0"); p == "" {
			p = "0"
		}
		parts[i] = p
	}
	for len(parts) < 3 {
		parts = append(parts, "0")
	}
	v := strings.Join(parts, ".")
	if _, err := semver.Parse(v); err != nil {
		return "", false
	}
	return v, true
}

// localityAttributes adds the standard resource.kubernetes.io attributes: pciBusID
// and pcieRoot from the device's PCI bus ID, numaNode where known.
func localityAttributes(attrs map[resourceapi.QualifiedName]resourceapi.DeviceAttribute, d *pb.Device, pci *pciAttributes) (problems []string) {
	loc := d.GetLocality()
	if bus := strings.ToLower(loc.GetPciBusId()); bus != "" {
		l := pci.lookup(bus)
		if l.busErr == nil {
			attrs[l.bus.Name] = l.bus.Value
		} else {
			problems = append(problems, fmt.Sprintf("device %s: pciBusID: %v", d.GetId(), l.busErr))
		}
		// No pcieRoot where /sys does not have the device (simulated GPUs): not a
		// problem worth a log line per snapshot.
		if l.rootOK {
			attrs[l.root.Name] = l.root.Value
		}
	}
	if loc != nil && loc.GetNumaNode() >= 0 {
		if a, err := deviceattribute.GetNUMANodeAttribute(int(loc.GetNumaNode()), deviceattribute.ScalarAttribute); err == nil {
			attrs[a.Name] = a.Value
		}
	}
	return problems
}

// maxPCIMemo bounds what pciAttributes keeps: a machine has a few hundred PCI
// functions at most; bus IDs past this many (a plugin inventing them) are looked up
// each time rather than kept.
const maxPCIMemo = 4096

// pciAttributes looks up the pciBusID and pcieRoot attributes of a bus ID once and
// keeps them: the library compiles a regular expression and reads /sys on every call,
// which every snapshot (one per Reserve and per Release at the agent) would pay again
// for every device, on the CPUs a prepare is waiting for. Where a bus ID sits in the
// PCIe tree does not change while the machine runs. Safe for concurrent use; the zero
// value reads the host's /sys.
type pciAttributes struct {
	sysfs []deviceattribute.MachineModifier // nil: the host's /sys

	mu   sync.Mutex
	memo map[string]pciLookup
}

// pciLookup is what the library said of one bus ID.
type pciLookup struct {
	bus    deviceattribute.DeviceAttribute
	busErr error
	root   deviceattribute.DeviceAttribute
	rootOK bool
}

func (p *pciAttributes) lookup(bus string) pciLookup {
	p.mu.Lock()
	l, ok := p.memo[bus]
	p.mu.Unlock()
	if ok {
		return l
	}
	l.bus, l.busErr = deviceattribute.GetPCIBusIDAttribute(bus)
	root, err := deviceattribute.GetPCIeRootAttributeByPCIBusID(bus, p.sysfs...)
	l.root, l.rootOK = root, err == nil
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.memo == nil {
		p.memo = make(map[string]pciLookup)
	}
	if len(p.memo) < maxPCIMemo {
		p.memo[bus] = l
	}
	return l
}

// taints says why the scheduler must not give d to a claim now: it is not healthy
// (or the agent cannot be reached), an operator cordoned it (NoExecute for a drain:
// its pod is evicted), a reservation of an owner outside DRA holds it, or such
// reservations use the shared capacity it needs.
func taints(driver string, d *pb.Device, disconnected error) []resourceapi.DeviceTaint {
	var out []resourceapi.DeviceTaint
	add := func(key, value string) {
		out = append(out, resourceapi.DeviceTaint{Key: driver + "/" + key, Value: value, Effect: resourceapi.DeviceTaintEffectNoSchedule})
	}
	switch {
	case disconnected != nil:
		add(taintUnhealthy, "agent-unreachable")
	case d.GetHealth() == pb.Health_HEALTH_UNHEALTHY:
		add(taintUnhealthy, labelValue(d.GetHealthReason(), "unhealthy"))
	case d.GetHealth() != pb.Health_HEALTH_HEALTHY:
		add(taintUnhealthy, labelValue(d.GetHealthReason(), "unknown"))
	}
	if c := d.GetCordon(); c != nil {
		add(taintCordoned, labelValue(c.GetReason(), "cordoned"))
		if c.GetDrain() {
			out[len(out)-1].Effect = resourceapi.DeviceTaintEffectNoExecute
		}
	}
	if h := d.GetHolder(); h != nil && !strings.HasPrefix(h.GetOwnerId(), ClaimOwnerPrefix) {
		add(taintHeld, labelValue(h.GetOwnerId(), "held"))
	}
	for _, b := range d.GetBlockedBy() {
		if !strings.HasPrefix(b.GetOwnerId(), ClaimOwnerPrefix) {
			add(taintBlocked, labelValue(b.GetOwnerId(), "blocked"))
			break
		}
	}
	return out
}

// trimAttributes drops attributes, in reverse name order, until the device fits
// DRA's limit; the identifying ones stay.
func trimAttributes(dev *resourceapi.Device) {
	keep := map[resourceapi.QualifiedName]bool{"id": true, "uuid": true, "parent": true, "productName": true, "vendor": true, "type": true}
	names := make([]resourceapi.QualifiedName, 0, len(dev.Attributes))
	for k := range dev.Attributes {
		if !keep[k] && !strings.Contains(string(k), "/") {
			names = append(names, k)
		}
	}
	slices.Sort(names)
	for len(dev.Attributes)+len(dev.Capacity) > maxAttributesPerDevice && len(names) > 0 {
		delete(dev.Attributes, names[len(names)-1])
		names = names[:len(names)-1]
	}
}

func str(s string) resourceapi.DeviceAttribute {
	if len(s) > maxStringValue {
		s = s[:maxStringValue]
	}
	return resourceapi.DeviceAttribute{StringValue: &s}
}
