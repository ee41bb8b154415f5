package kubernetes

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"strings"
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
	v := b.state.view() // one view of the agent's devices for the releases and the adoptions
	resources := v.resources
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
	b.adoptLocked(ctx, v, held, rs)
}

// adoptLocked reserves, for the container that holds them, the devices of the bridge's
// resources that PodResources says a container holds and no reservation of rs (of any
// owner) holds: devices another device plugin allocated before the bridge served its
// resource (a node moving from NVIDIA's device plugin), or a reservation the ledger no
// longer has. Each becomes a reservation owned by that container (PodName), released
// when it goes as the bridge's own are; without it the agent would hand the devices of
// running pods out again. A device the agent does not serve, or holds for another
// owner, is logged (once) and left alone. Called with allocMu, after releaseUnheld.
func (b *Bridge) adoptLocked(ctx context.Context, v view, held map[string]map[string]string, rs []*pb.Reservation) {
	reservedBy := map[string]*pb.Reservation{}
	for _, r := range rs {
		for _, id := range r.GetDeviceIds() {
			reservedBy[id] = r
		}
	}
	if v.snap == nil || !v.connected {
		return // which devices the agent serves is not known yet: the next pass adopts
	}
	log := b.log.Named("adopt")
	seen := map[string]bool{} // the failures of this pass
	type want struct{ resource, pod string }
	adopt := map[want][]string{}
	for _, r := range v.resources {
		for id, pod := range held[r.Name] {
			h := reservedBy[id]
			if h == nil {
				adopt[want{r.Name, pod}] = append(adopt[want{r.Name, pod}], id)
				continue
			}
			if r.ownedBy(h.GetOwnerId(), groupKey{h.GetVendor(), h.GetType(), h.GetName()}) {
				continue // the bridge's: releaseUnheld hands it to the pod
			}
			key := r.Name + " " + pod + " " + id + " " + h.GetReservationId()
			seen[key] = true
			if !b.adoptFailed[key] {
				log.Warn("the kubelet says a container holds a device that another owner holds at the agent; two workloads may be using it",
					"pod", pod, "resource", r.Name, "device", id, "holder", h.GetOwnerId(), "reservation", h.GetReservationId())
			}
		}
	}
	for _, w := range slices.SortedFunc(maps.Keys(adopt), func(a, b want) int {
		return cmp.Or(strings.Compare(a.resource, b.resource), strings.Compare(a.pod, b.pod))
	}) {
		ids := adopt[w]
		slices.Sort(ids)
		key := w.resource + " " + w.pod + " " + strings.Join(ids, ",")
		r, _ := v.resource(w.resource)
		g, err := v.groupOf(r, ids)
		if err == nil {
			var res *pb.ReserveResponse
			res, err = b.c.Reserve(ctx, &pb.ReserveRequest{OwnerId: w.pod, Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName(), DeviceIds: ids})
			if err == nil {
				log.Info("adopted devices a container held before the bridge served them (another device plugin's allocation, or a reservation the ledger lost)",
					"pod", w.pod, "resource", w.resource, "devices", ids, "reservation", res.GetReservationId())
				b.bookingLocked(res.GetReservationId()).pod = w.pod
				continue
			}
		}
		seen[key] = true
		if !b.adoptFailed[key] {
			log.Warn("the kubelet says a container holds devices the agent cannot reserve for it; they stay as they are",
				"pod", w.pod, "resource", w.resource, "devices", ids, "error", err)
		}
	}
	b.adoptFailed = seen // a failure is logged again only after it has stopped
}
