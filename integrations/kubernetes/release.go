package kubernetes

import (
	"context"
	"slices"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	prapi "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

const (
	// podResourcesTimeout bounds one List of PodResources and one pass of the agent's
	// calls that follow it.
	podResourcesTimeout = 10 * time.Second
	// maxPodResourcesMsg bounds a PodResources answer (a node with hundreds of pods
	// of many containers stays far below).
	maxPodResourcesMsg = 16 << 20
)

// PodName is how the bridge names the container that holds a reservation's devices:
// "k8s/<namespace>/<pod>/<container>".
func PodName(namespace, pod, container string) string {
	return "k8s/" + namespace + "/" + pod + "/" + container
}

// dialPodResources returns a client of the kubelet's PodResources API on
// PodResourcesSocket (connected on first use) and a func that closes it.
func (b *Bridge) dialPodResources() (prapi.PodResourcesListerClient, func(), error) {
	conn, err := grpc.NewClient("unix://"+b.cfg.PodResourcesSocket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxPodResourcesMsg)))
	if err != nil {
		return nil, nil, err
	}
	return prapi.NewPodResourcesListerClient(conn), func() { _ = conn.Close() }, nil
}

// releaseLoop lists PodResources every PodResourcesInterval, records which pod holds
// each of the bridge's reservations and releases those no pod has held for
// ReleaseGrace, until ctx ends.
func (b *Bridge) releaseLoop(ctx context.Context, lister prapi.PodResourcesListerClient, tokens <-chan struct{}) {
	log := b.log.Named("release")
	p := &releasePass{b: b, lister: lister, log: log}
	t := time.NewTicker(b.cfg.PodResourcesInterval)
	defer t.Stop()
	for {
		p.run(ctx)
	wait:
		for {
			select {
			case <-ctx.Done():
				return
			case <-tokens: // live; keep waiting
			case <-t.C:
				break wait
			}
		}
	}
}

// releasePass is the release loop's state between passes. Owned by its goroutine.
type releasePass struct {
	b       *Bridge
	lister  prapi.PodResourcesListerClient
	log     hclog.Logger
	lastErr string // the last failure logged, so each is logged once
}

// run is one pass: PodResources, then the bridge's live reservations, then the
// decisions. Nothing is released when PodResources cannot be read (a kubelet that is
// restarting must not free the devices of running pods).
func (p *releasePass) run(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, podResourcesTimeout)
	defer cancel()
	// The answer may reflect any moment after this one: an Allocate from now on is too
	// late to be judged by it.
	listed := p.b.now()
	pods, err := p.lister.List(ctx, &prapi.ListPodResourcesRequest{})
	if err != nil {
		p.fail(ctx, "cannot list PodResources: releasing nothing until it answers", err)
		return
	}
	rs, err := p.b.c.Reservations(ctx, &pb.ListReservationsRequest{State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil {
		p.fail(ctx, "cannot list the agent's reservations", err)
		return
	}
	if p.lastErr != "" {
		p.log.Info("PodResources and the agent answer again")
		p.lastErr = ""
	}
	p.b.releaseUnheld(ctx, holders(pods), rs, listed)
}

func (p *releasePass) fail(ctx context.Context, what string, err error) {
	if ctx.Err() != nil {
		return // shutting down
	}
	if msg := what + ": " + err.Error(); msg != p.lastErr {
		p.log.Warn(what, "error", err)
		p.lastErr = msg
	}
}

// holders maps resource name and device ID to the container holding it, by
// PodResources.
func holders(resp *prapi.ListPodResourcesResponse) map[string]map[string]string {
	out := map[string]map[string]string{}
	for _, pod := range resp.GetPodResources() {
		for _, c := range pod.GetContainers() {
			for _, d := range c.GetDevices() {
				m := out[d.GetResourceName()]
				if m == nil {
					m = map[string]string{}
					out[d.GetResourceName()] = m
				}
				for _, id := range d.GetDeviceIds() {
					m[id] = PodName(pod.GetNamespace(), pod.GetName(), c.GetName())
				}
			}
		}
	}
	return out
}

// releaseUnheld goes through the live reservations rs, listed after the PodResources
// answer held, which was asked for at listed: a reservation of the bridge whose devices a pod
// holds is handed to that pod's container (Reown to PodName), so that the agent's
// ledger says which pod it serves; one whose devices no pod has held for ReleaseGrace
// is released. Runs under allocMu, so an Allocate that returns a reservation again
// (setting its freeSince) is never overtaken by a release decision made before it.
func (b *Bridge) releaseUnheld(ctx context.Context, held map[string]map[string]string, rs []*pb.Reservation, listed time.Time) {
	log := b.log.Named("release")
	resources := b.state.view().resources
	b.allocMu.Lock()
	defer b.allocMu.Unlock()
	now := b.now()
	live := map[string]bool{}
	for _, r := range rs {
		g := groupKey{r.GetVendor(), r.GetType(), r.GetName()}
		i := slices.IndexFunc(resources, func(res Resource) bool { return res.ownedBy(r.GetOwnerId(), g) })
		if i < 0 {
			continue // not the bridge's, or of a resource it no longer serves
		}
		resource := resources[i].Name
		id := r.GetReservationId()
		live[id] = true
		bk := b.bookingLocked(id)
		if bk.touched.After(listed) {
			// Allocated (again) since PodResources was asked: the answer may still
			// show the devices' previous pod, and cannot show the new one.
			continue
		}
		pod := ""
		for _, dev := range r.GetDeviceIds() {
			if pod = held[resource][dev]; pod != "" {
				break
			}
		}
		if pod != "" {
			bk.freeSince = time.Time{}
			if pod != r.GetOwnerId() {
				if _, err := b.c.Reown(ctx, id, r.GetOwnerId(), pod); err != nil {
					if pod != bk.pod {
						log.Warn("cannot record which pod a reservation serves; trying again next pass",
							"reservation", id, "pod", pod, "error", err)
						bk.pod = pod
					}
					continue
				}
				log.Info("reservation serves a pod", "reservation", id, "pod", pod, "resource", resource,
					"devices", r.GetDeviceIds(), "was_owner", r.GetOwnerId())
			}
			bk.pod = pod
			continue
		}
		if bk.freeSince.IsZero() {
			bk.freeSince = now
		}
		if now.Sub(bk.freeSince) < b.cfg.ReleaseGrace {
			continue
		}
		_, err := b.c.ReleaseReservation(ctx, id)
		if err != nil && !client.IsReservationNotFound(err) {
			log.Warn("cannot release a reservation no pod holds; trying again next pass", "reservation", id, "error", err)
			continue
		}
		log.Info("released a reservation no pod holds", "reservation", id, "resource", resource,
			"devices", r.GetDeviceIds(), "last_pod", bk.podOrNone(), "free_for", now.Sub(bk.freeSince).Round(time.Millisecond))
		delete(b.bookings, id)
		delete(live, id)
	}
	// Forget reservations no longer live, unless Allocate made them after the listing.
	for id, bk := range b.bookings {
		if !live[id] && !bk.touched.After(listed) {
			delete(b.bookings, id)
		}
	}
}
