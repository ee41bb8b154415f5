package dra

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/watchlist"
	"k8s.io/dynamic-resource-allocation/resourceslice"
)

// republishDelay is how long after the last change that someone else made to the
// pool's slices (a deletion, an edit) the driver writes them again: the kubelet
// deletes every ResourceSlice of its node when it starts, one by one, and the burst
// gives one republish.
const republishDelay = 500 * time.Millisecond

// Naming of the slices, as the kubeletplugin helper names them, so that a driver
// taking over from one that published through the helper (an upgrade) adopts its
// slices: "<index in hex, at least 5 digits>-<driver>-<node>-<random>".
const (
	sliceIndexMinDigits = 5
	sliceNameSeparator  = "-"
)

// publisher writes the pool's ResourceSlices, and writes again the ones someone else
// changes or deletes. It does the job of the kubeletplugin helper's ResourceSlice
// controller (and follows its rules: one slice changed is updated in place, more
// than one, a slice more or fewer, are written at a new generation of the pool), but
// tells what changed by comparing each slice's encoding with the one it last wrote,
// device by device, the unchanged devices' encodings the view cache's own bytes. The
// helper compares every device of the pool with reflection on every change, and
// copies the whole pool first: 232 devices of 8 GPUs with on-demand MIG took it 8 ms
// of CPU per change, half the driver's (BenchmarkSliceChange, docs/benchmarks.md).
//
// sync is for one goroutine (the publish loop); the informer's handler (observe)
// runs on another.
type publisher struct {
	kube   kubernetes.Interface
	meta   sliceMeta      // the slices' metadata, for the informer
	rest   rest.Interface // resource.k8s.io/v1, for updates as bytes
	driver string
	node   string
	log    hclog.Logger
	store  cache.Store // the informer's: the metadata of this driver's slices on this node
	// foreign says that someone else changed or deleted one of the pool's slices.
	foreign chan struct{}
	owner   *metav1.OwnerReference // the node; nil until the first sync reads it

	// mu is held across each write's API call: observe sees every write recorded.
	mu sync.Mutex
	// sent are this process's last writes, and the slices it found as it would write
	// them, by slice name; an entry goes when the informer shows someone else's
	// change or deletion of the slice.
	sent map[string]*sentSlice
	// others are the slices of this driver on this node that the last list showed of
	// another pool than the node's (none of this publisher's business), by name, at
	// the resourceVersion listed: not listed again until they change.
	others map[string]string
}

// sentSlice is one slice as this process last wrote it.
type sentSlice struct {
	enc sliceEnc                   // sliceEncoding of what was written
	obj *resourceapi.ResourceSlice // the API server's answer
	// seen: the informer has shown obj's resourceVersion. A later one is someone
	// else's; before, the informer is behind (what it holds is older than obj).
	seen bool
}

// newPublisher returns a publisher of the pool of driver on node. The informer of its
// slices watches their metadata alone through meta (the API server sends each event
// as the slice's name and resourceVersion, not its 29 devices with their attributes,
// which the driver would decode only to see its own write again); nil meta: through
// kube, decoding each slice (a fake clientset's tests). Updates go through rc
// (Config.ResourceREST).
func newPublisher(kube kubernetes.Interface, meta metadata.Interface, rc rest.Interface, driver, node string, log hclog.Logger) *publisher {
	p := &publisher{kube: kube, rest: rc, driver: driver, node: node, log: log,
		foreign: make(chan struct{}, 1), sent: make(map[string]*sentSlice), others: make(map[string]string)}
	if meta != nil {
		p.meta = meta.Resource(resourceapi.SchemeGroupVersion.WithResource("resourceslices"))
	} else {
		p.meta = typedSliceMeta{p}
	}
	return p
}

// ours reports whether s is a slice of this driver's pool on this node. (The fake
// clientset of the tests does not apply field selectors: the node is checked here too.)
func (p *publisher) ours(s *resourceapi.ResourceSlice) bool {
	return p.selects(s) && s.Spec.Pool.Name == p.node
}

// selects reports whether selector selects s.
func (p *publisher) selects(s *resourceapi.ResourceSlice) bool {
	return s.Spec.Driver == p.driver && s.Spec.NodeName != nil && *s.Spec.NodeName == p.node
}

// selector selects this driver's slices on this node.
func (p *publisher) selector() string {
	return fields.AndSelectors(
		fields.OneTermEqualSelector(resourceapi.ResourceSliceSelectorNodeName, p.node),
		fields.OneTermEqualSelector(resourceapi.ResourceSliceSelectorDriver, p.driver)).String()
}

// informer returns the informer of the metadata of this driver's slices on this node,
// its events going to observe; run runs it. (Other drivers' slices on the node, a
// device plugin's neighbour's, are none of its business.)
func (p *publisher) informer() (cache.SharedIndexInformer, error) {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = p.selector()
			return p.meta.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = p.selector()
			return p.meta.Watch(ctx, o)
		},
	}
	inf := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, p.meta),
		&metav1.PartialObjectMetadata{}, 0, cache.Indexers{})
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { p.observe(obj, false) },
		UpdateFunc: func(_, obj any) { p.observe(obj, false) },
		DeleteFunc: func(obj any) { p.observe(obj, true) },
	})
	if err != nil {
		return nil, err
	}
	p.store = inf.GetStore()
	return inf, nil
}

// run runs inf until stop is called, which returns once it has stopped.
func run(ctx context.Context, inf cache.SharedIndexInformer) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		inf.RunWithContext(ctx)
	}()
	return func() { cancel(); <-done }
}

// sliceMeta lists and watches the metadata of ResourceSlices (metadata.ResourceInterface).
type sliceMeta interface {
	List(ctx context.Context, opts metav1.ListOptions) (*metav1.PartialObjectMetadataList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// typedSliceMeta is a sliceMeta that reads the slices whole through the publisher's
// kube and gives their metadata, of the slices the publisher's selector selects alone
// (a fake clientset applies no field selector). It keeps the typed client's word on
// watch lists.
type typedSliceMeta struct{ p *publisher }

func (m typedSliceMeta) List(ctx context.Context, opts metav1.ListOptions) (*metav1.PartialObjectMetadataList, error) {
	l, err := m.p.kube.ResourceV1().ResourceSlices().List(ctx, opts)
	if err != nil {
		return nil, err
	}
	out := &metav1.PartialObjectMetadataList{ListMeta: l.ListMeta}
	for i := range l.Items {
		if m.p.selects(&l.Items[i]) {
			out.Items = append(out.Items, metav1.PartialObjectMetadata{ObjectMeta: l.Items[i].ObjectMeta})
		}
	}
	return out, nil
}

func (m typedSliceMeta) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	w, err := m.p.kube.ResourceV1().ResourceSlices().Watch(ctx, opts)
	if err != nil {
		return nil, err
	}
	// (Not watch.Filter: its goroutine stays blocked on a send once stopped.)
	ch := make(chan watch.Event)
	out := watch.NewProxyWatcher(ch)
	go func() {
		defer close(ch)
		defer w.Stop()
		for {
			var e watch.Event
			select {
			case ev, ok := <-w.ResultChan():
				if !ok {
					return
				}
				e = ev
			case <-out.StopChan():
				return
			}
			if s, ok := e.Object.(*resourceapi.ResourceSlice); ok {
				if e.Type != watch.Bookmark && !m.p.selects(s) {
					continue
				}
				e.Object = &metav1.PartialObjectMetadata{ObjectMeta: s.ObjectMeta}
			}
			select {
			case ch <- e:
			case <-out.StopChan():
				return
			}
		}
	}()
	return out, nil
}

func (m typedSliceMeta) IsWatchListSemanticsUnSupported() bool {
	return watchlist.DoesClientNotSupportWatchListSemantics(m.p.kube)
}

// observe takes in one informer event: a slice of the pool that this process did not
// write as it now is (someone else's edit or deletion, one an earlier process wrote)
// is foreign; one that shows this process's last write marks it seen.
func (p *publisher) observe(obj any, deleted bool) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	s, ok := obj.(*metav1.PartialObjectMetadata)
	if !ok {
		return
	}
	p.mu.Lock()
	e := p.sent[s.Name]
	foreign := false
	switch {
	case deleted:
		delete(p.sent, s.Name)
		delete(p.others, s.Name)
		foreign = true
	case e == nil:
		foreign = p.others[s.Name] != s.ResourceVersion
	case s.ResourceVersion == e.obj.ResourceVersion:
		e.seen = true
	case e.seen:
		delete(p.sent, s.Name)
		foreign = true
	}
	p.mu.Unlock()
	if foreign {
		select {
		case p.foreign <- struct{}{}:
		default:
		}
	}
}

// candidate is a slice of the pool the API server has, and its encoding where known.
type candidate struct {
	obj *resourceapi.ResourceSlice
	enc *sliceEnc // nil: not written by this process as it is; encoded when compared
}

// sync makes the API server's slices of the pool say what v's do. It writes only the
// slices that differ: one in place, at the pool's generation; more (or a slice more or
// fewer), every slice at the next generation, then it deletes the ones left over. An
// error leaves the rest for the next sync. writes counts the slices written and
// deleted.
func (p *publisher) sync(ctx context.Context, v *view) (writes int, err error) {
	if p.owner == nil {
		node, err := p.kube.CoreV1().Nodes().Get(ctx, p.node, metav1.GetOptions{})
		if err != nil {
			return 0, fmt.Errorf("read the node that owns the slices: %w", err)
		}
		p.owner = &metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID, Controller: new(true)}
	}
	n := len(v.slices)
	digits := max(sliceIndexMinDigits, len(strconv.FormatInt(int64(n-1), 16)))

	// What the server has: this process's writes, and for the rest what a list says
	// (only when the informer holds a slice this process did not write as it is).
	var all []candidate
	unknown := false
	p.mu.Lock()
	for _, e := range p.sent {
		all = append(all, candidate{obj: e.obj, enc: &e.enc})
	}
	for _, o := range p.store.List() {
		m, ok := o.(*metav1.PartialObjectMetadata)
		if ok && p.sent[m.Name] == nil && p.others[m.Name] != m.ResourceVersion {
			unknown = true
		}
	}
	p.mu.Unlock()
	if unknown {
		list, err := p.kube.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: p.selector()})
		if err != nil {
			return 0, fmt.Errorf("list the pool's ResourceSlices: %w", err)
		}
		p.mu.Lock()
		clear(p.others)
		for i := range list.Items {
			s := &list.Items[i]
			switch {
			case !p.ours(s):
				p.others[s.Name] = s.ResourceVersion
			case p.sent[s.Name] == nil:
				all = append(all, candidate{obj: s})
			}
		}
		p.mu.Unlock()
	}
	var gen int64
	for _, c := range all {
		gen = max(gen, c.obj.Spec.Pool.Generation)
	}
	have := make([]*candidate, n)
	var obsolete []*resourceapi.ResourceSlice
	sameGenObsolete := false
	for i := range all {
		c := &all[i]
		idx, ok := sliceIndex(c.obj.Name, digits)
		switch {
		case c.obj.Spec.Pool.Generation < gen:
			obsolete = append(obsolete, c.obj)
		case !ok || idx >= n || have[idx] != nil:
			obsolete = append(obsolete, c.obj)
			sameGenObsolete = true
		default:
			have[idx] = c
		}
	}
	var changed []int
	missing := false
	for i, c := range have {
		if c == nil {
			missing = true
			changed = append(changed, i)
			continue
		}
		adopt := c.enc == nil
		if adopt {
			stored := storedEncoding(c.obj, nil)
			c.enc = &stored
		}
		switch {
		case c.obj.Spec.Pool.ResourceSliceCount != int64(n) || !c.enc.equal(v.encs[i]):
			changed = append(changed, i)
		case adopt:
			// A slice an earlier process wrote, as this one would: taken as this
			// process's own write, so that the next sync does not encode it again.
			p.mu.Lock()
			if p.sent[c.obj.Name] == nil {
				p.sent[c.obj.Name] = &sentSlice{enc: v.encs[i], obj: c.obj, seen: true}
			}
			p.mu.Unlock()
		}
	}
	if len(changed) == 0 && len(obsolete) == 0 {
		return 0, nil
	}
	if gen == 0 || missing || sameGenObsolete || len(changed) > 1 {
		gen++
		changed = changed[:0]
		for i := range n {
			changed = append(changed, i)
		}
	}
	pool := resourceapi.ResourcePool{Name: p.node, Generation: gen, ResourceSliceCount: int64(n)}
	for _, i := range changed {
		var old *resourceapi.ResourceSlice
		if have[i] != nil {
			old = have[i].obj
		}
		if err := p.write(ctx, pool, i, digits, v.slices[i], v.encs[i], old); err != nil {
			return writes, err
		}
		writes++
	}
	for _, s := range obsolete {
		if err := p.remove(ctx, s); err != nil {
			return writes, err
		}
		writes++
	}
	return writes, nil
}

// write writes the pool's slice i: an update of old, or a new slice where old is nil.
func (p *publisher) write(ctx context.Context, pool resourceapi.ResourcePool, i, digits int, s resourceslice.Slice, enc sliceEnc, old *resourceapi.ResourceSlice) error {
	obj := &resourceapi.ResourceSlice{
		Spec: resourceapi.ResourceSliceSpec{
			Driver:                 p.driver,
			Pool:                   pool,
			NodeName:               new(p.node),
			Devices:                keepTaintTimes(s.Devices, old),
			SharedCounters:         s.SharedCounters,
			PerDeviceNodeSelection: s.PerDeviceNodeSelection,
			PartitionTypeAttribute: s.PartitionTypeAttribute,
			SkipNodeOperations:     s.SkipNodeOperations,
		},
	}
	slices := p.kube.ResourceV1().ResourceSlices()
	var (
		got *resourceapi.ResourceSlice
		err error
	)
	// Held across the call, so that the informer's event of this write (or of a
	// deletion right after it) is observed after the write is recorded.
	p.mu.Lock()
	defer p.mu.Unlock()
	var known [][]byte // the devices stored as the view's encodings say
	if old != nil {
		// Labels, annotations and the like that someone else set stay.
		obj.ObjectMeta = *old.ObjectMeta.DeepCopy()
		obj.ManagedFields = nil
		got, known, err = p.update(ctx, obj, enc)
	} else {
		obj.GenerateName = fmt.Sprintf("%0*x", digits, i) + sliceNameSeparator + p.driver + sliceNameSeparator + p.node + sliceNameSeparator
		obj.OwnerReferences = []metav1.OwnerReference{*p.owner}
		got, err = slices.Create(ctx, obj, metav1.CreateOptions{})
	}
	if err != nil {
		if old != nil {
			delete(p.sent, old.Name) // read it again from the informer next time
		}
		verb := "update"
		if old == nil {
			verb = "create"
		}
		return fmt.Errorf("%s ResourceSlice %d of %d: %w", verb, i+1, pool.ResourceSliceCount, err)
	}
	p.sent[got.Name] = &sentSlice{enc: enc, obj: got}
	if enc.valid {
		if !storedEncoding(got, known).equal(enc) {
			// Compared with what was sent, not with what the server kept: the next sync
			// does not write it again, in a loop.
			p.log.Warn("the API server did not store the ResourceSlice as written (fields dropped: a feature gate off?)",
				"slice", got.Name)
		}
	}
	return nil
}

// remove deletes a slice left over, unless it changed since it was read.
func (p *publisher) remove(ctx context.Context, s *resourceapi.ResourceSlice) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	err := p.kube.ResourceV1().ResourceSlices().Delete(ctx, s.Name, metav1.DeleteOptions{
		Preconditions: &metav1.Preconditions{UID: &s.UID, ResourceVersion: &s.ResourceVersion}})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete ResourceSlice %s left over: %w", s.Name, err)
	}
	delete(p.sent, s.Name)
	return nil
}

// sliceIndex is the index that name gives a slice of a pool of slices named with
// digits hex digits; ok false if it gives none.
func sliceIndex(name string, digits int) (int, bool) {
	prefix, _, found := strings.Cut(name, sliceNameSeparator)
	if !found || len(prefix) != digits {
		return 0, false
	}
	i, err := strconv.ParseUint(prefix, 16, 31)
	return int(i), err == nil
}

// storedEncoding is the sliceEncoding of a slice as the API server has it, without
// the times the server gave its taints (the driver sends none of its own: what it
// compares carries none), taking known[i] (where there is one) as device i's encoding
// rather than encoding it. Not valid if it would not encode.
func storedEncoding(s *resourceapi.ResourceSlice, known [][]byte) sliceEnc {
	rest := resourceslice.Slice{
		SharedCounters:         s.Spec.SharedCounters,
		PerDeviceNodeSelection: s.Spec.PerDeviceNodeSelection,
		PartitionTypeAttribute: s.Spec.PartitionTypeAttribute,
		SkipNodeOperations:     s.Spec.SkipNodeOperations,
	}
	e := sliceEncoding(rest, nil)
	if !e.valid {
		return e
	}
	e.devs = make([][]byte, len(s.Spec.Devices))
	for i := range s.Spec.Devices {
		if i < len(known) && known[i] != nil {
			e.devs[i] = known[i]
			continue
		}
		d := &s.Spec.Devices[i]
		if hasTaintTime(d) {
			c := *d
			c.Taints = slices.Clone(d.Taints)
			for j := range c.Taints {
				c.Taints[j].TimeAdded = nil
			}
			d = &c
		}
		var err error
		if e.devs[i], err = d.Marshal(); err != nil {
			return sliceEnc{}
		}
	}
	return e
}

// hasTaintTime reports whether a taint of d has the time the API server gave it.
func hasTaintTime(d *resourceapi.Device) bool {
	return slices.ContainsFunc(d.Taints, func(t resourceapi.DeviceTaint) bool { return t.TimeAdded != nil })
}

// update writes obj, an update of a slice, as bytes (sliceBody), each device that is
// the view's as enc's encoding of it: the slice as the API server stored it, and
// known, for each of its devices that was stored as those bytes, enc's encoding of it
// (nil for the others; all nil where the answer came in another encoding).
func (p *publisher) update(ctx context.Context, obj *resourceapi.ResourceSlice, enc sliceEnc) (*resourceapi.ResourceSlice, [][]byte, error) {
	var devs [][]byte
	if enc.valid && len(enc.devs) == len(obj.Spec.Devices) {
		devs = make([][]byte, len(enc.devs))
		for i := range devs {
			// A taint that kept the time the server gave it (keepTaintTimes): not the
			// view's device.
			if !hasTaintTime(&obj.Spec.Devices[i]) {
				devs[i] = enc.devs[i]
			}
		}
	}
	body, written, err := sliceBody(obj, devs)
	if err != nil {
		return nil, nil, err
	}
	res := p.rest.Put().Resource("resourceslices").Name(obj.Name).
		SetHeader("Content-Type", runtime.ContentTypeProtobuf).Body(body).Do(ctx)
	answer, err := res.Raw()
	if err != nil {
		return nil, nil, err
	}
	got, same, err := readSlice(answer, obj, written)
	if errors.Is(err, errNotProtobuf) {
		got = &resourceapi.ResourceSlice{}
		if err := res.Into(got); err != nil {
			return nil, nil, fmt.Errorf("the API server's answer: %w", err)
		}
		return got, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("the API server's answer: %w", err)
	}
	known := make([][]byte, len(same))
	for i := range same {
		if same[i] && i < len(devs) {
			known[i] = devs[i] // nil where the device was not the view's
		}
	}
	return got, known, nil
}

// keepTaintTimes returns devs with the time the API server gave each taint that old's
// device of that name already had (same key, value and effect), so that a taint that
// stays keeps its time: a NoExecute toleration's seconds count from it. devs is not
// changed.
func keepTaintTimes(devs []resourceapi.Device, old *resourceapi.ResourceSlice) []resourceapi.Device {
	if old == nil {
		return devs
	}
	var before map[string][]resourceapi.DeviceTaint
	for _, d := range old.Spec.Devices {
		if len(d.Taints) > 0 {
			if before == nil {
				before = make(map[string][]resourceapi.DeviceTaint)
			}
			before[d.Name] = d.Taints
		}
	}
	out := devs
	for i, d := range devs {
		prev := before[d.Name]
		if len(prev) == 0 || len(d.Taints) == 0 {
			continue
		}
		for j, t := range d.Taints {
			k := slices.IndexFunc(prev, func(o resourceapi.DeviceTaint) bool {
				return o.Key == t.Key && o.Value == t.Value && o.Effect == t.Effect && o.TimeAdded != nil
			})
			if k < 0 || t.TimeAdded != nil {
				continue
			}
			if &out[0] == &devs[0] {
				out = slices.Clone(devs)
			}
			if &out[i].Taints[0] == &devs[i].Taints[0] {
				out[i].Taints = slices.Clone(d.Taints)
			}
			out[i].Taints[j].TimeAdded = prev[k].TimeAdded.DeepCopy()
		}
	}
	return out
}
