package dra

import (
	"context"
	"fmt"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/protobuf/encoding/protojson"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

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
// problems a driver logs).
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
	v, problems := buildView(snap, buildOptions{driver: driver, pool: node})
	p := newPublisher(kube, nil, rc, driver, node, log)
	p.store = cache.NewStore(cache.MetaNamespaceKeyFunc) // empty: the pool is new
	writes, err = p.sync(ctx, v)
	return writes, problems, err
}
