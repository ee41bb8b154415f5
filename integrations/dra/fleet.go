package dra

import (
	"context"
	"fmt"
	"os"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/encoding/protojson"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/deviceattribute"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// PublishPool writes, once, the ResourceSlices the driver publishes as node's pool for
// fingerprint (the agent's snapshot as protojson, what `devicehost devices -json`
// prints): built by the driver's slice code (buildView) and written by its publisher,
// as a driver on that node would.
//
// It is the hook of the fleet bench (cmd/devicehost-fleet, scripts/fleet), which
// serves many simulated nodes from one process, and of nothing else: it runs no
// informer of the pool's slices, so it is for a pool that nobody else writes, and it
// starts nothing that outlives the call. kube and rc are as in Config (Kube,
// ResourceREST; nil rc: kube's); log gets the publisher's warnings (nil: none). It
// returns the number of slices written and what buildView left out or changed (the
// problems a driver logs). The devices' PCI attributes are their bus IDs alone
// (simulatedPCI).
func PublishPool(ctx context.Context, kube kubernetes.Interface, rc rest.Interface, driver, node string, fingerprint []byte, log hclog.Logger) (writes int, problems []string, err error) {
	snap := &pb.FingerprintResponse{}
	if err := protojson.Unmarshal(fingerprint, snap); err != nil {
		return 0, nil, fmt.Errorf("fingerprint: %w", err)
	}
	if rc == nil {
		rc = kube.ResourceV1().RESTClient()
	}
	if log == nil {
		log = hclog.NewNullLogger()
	}
	v, problems := buildView(snap, buildOptions{driver: driver, pool: node, pci: simulatedPCI()})
	p := newPublisher(kube, nil, rc, driver, node, log)
	p.store = cache.NewStore(cache.MetaNamespaceKeyFunc) // empty: the pool is new
	writes, err = p.sync(ctx, v)
	return writes, problems, err
}

// RunPool runs node's pool as the driver on that node does, with the snapshots that
// arrive on snaps in place of the agent's stream: each is built into the pool's view by
// the driver's slice code with the watch loop's view cache (watchLoop), and the
// driver's publish loop writes it (publishLoop: the informer of the pool's slices, the
// republish of someone else's changes, the retries with backoff). It returns nil when
// ctx ends or snaps is closed, once everything it started has stopped; the pool's
// slices stay.
//
// It is the fleet bench's hook for the driver's writes at rest and under churn (a
// node's reservations coming and going, as snapshots that differ in their holders),
// as PublishPool is for one publish; the agent, the kubelet's calls and the claims'
// status are not in it. kube, meta, rc and log are as in Config (Kube, Meta,
// ResourceREST, Logger); nil rc: kube's. The devices' PCI attributes are their bus IDs
// alone (simulatedPCI).
func RunPool(ctx context.Context, kube kubernetes.Interface, meta metadata.Interface, rc rest.Interface, driver, node string, snaps <-chan *pb.FingerprintResponse, log hclog.Logger) error {
	if rc == nil {
		rc = kube.ResourceV1().RESTClient()
	}
	if log == nil {
		log = hclog.NewNullLogger()
	}
	d := &Driver{
		cfg:     Config{Kube: kube, Meta: meta, ResourceREST: rc, NodeName: node, DriverName: driver},
		log:     log,
		changed: make(chan struct{}),
		pci:     simulatedPCI(),
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return d.publishLoop(gctx) })
	g.Go(func() error {
		defer cancel() // snaps closed: the publish loop ends too
		cache := newViewCache()
		for {
			select {
			case snap, ok := <-snaps:
				if !ok {
					return nil
				}
				v, _ := buildView(snap, buildOptions{driver: driver, pool: node, pci: d.pci, cache: cache})
				d.setView(v)
			case <-gctx.Done():
				return nil
			}
		}
	})
	return g.Wait()
}

// simulatedPCI looks up the PCI attributes of a simulated node's devices without this
// host's /sys: their pciBusID, and no pcieRoot. A recorded machine's bus ID may be one of
// this host's, whose PCIe root is not the recorded device's.
func simulatedPCI() *pciAttributes {
	return &pciAttributes{sysfs: []deviceattribute.MachineModifier{deviceattribute.WithFSFromRoot(os.DevNull)}}
}
