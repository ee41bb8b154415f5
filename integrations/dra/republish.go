package dra

import (
	"context"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
)

// republishDelay is how long after the last deletion of one of the pool's slices the
// driver publishes the pool again: long enough for the helper's own informer to have
// seen the deletions too (it compares what it wants with what its cache holds), far
// shorter than the 30 s the helper's controller waits by itself.
const republishDelay = 500 * time.Millisecond

// sliceGoneLoop watches this node's ResourceSlices and, once one of this driver's is
// deleted by someone else, asks the publish loop to publish the pool again after
// republishDelay. The kubelet deletes every ResourceSlice of its node when it starts;
// left to itself, the helper's controller republishes them 30 s after the deletions it
// saw (14 s measured on the real node), and until then the scheduler places no claim
// on this node. Deletions in a burst give one republish.
func (d *Driver) sliceGoneLoop(ctx context.Context) error {
	factory := informers.NewSharedInformerFactoryWithOptions(d.cfg.Kube, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = resourceapi.ResourceSliceSelectorNodeName + "=" + d.cfg.NodeName
		}))
	inf := factory.Resource().V1().ResourceSlices().Informer()
	gone := make(chan struct{}, 1)
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if s, ok := obj.(*resourceapi.ResourceSlice); ok && d.ours(s) {
				select {
				case gone <- struct{}{}:
				default:
				}
			}
		},
	}); err != nil {
		return err
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()

	timer := time.NewTimer(republishDelay)
	timer.Stop() // armed by the first deletion; since Go 1.23 a stopped timer sends nothing
	defer timer.Stop()
	for {
		select {
		case <-gone:
			timer.Reset(republishDelay) // a later deletion of the burst pushes it back
		case <-timer.C:
			d.log.Info("ResourceSlices of the pool deleted by someone else (the kubelet does at its start): publishing them again")
			select {
			case d.republish <- struct{}{}:
			default: // one is already asked for
			}
		case <-ctx.Done():
			return nil
		}
	}
}

// ours reports whether s is a slice of this driver's pool on this node. (The fake
// clientset of the tests does not apply field selectors: the node is checked here too.)
func (d *Driver) ours(s *resourceapi.ResourceSlice) bool {
	return s.Spec.Driver == d.cfg.DriverName && s.Spec.Pool.Name == d.cfg.NodeName &&
		s.Spec.NodeName != nil && *s.Spec.NodeName == d.cfg.NodeName
}
