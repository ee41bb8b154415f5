package dra

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// BenchmarkPrepare compares NodePrepareResources of one claim for 2 GPUs, through the
// helper's socket as the kubelet calls it, with the agent's Reserve of the same 2
// GPUs (the target: at most 1.3×). Each iteration does one of each, taking
// turns, so that the machine's load weighs on both alike; each uses a fresh claim (or
// claim owner), and its unprepare (or release) is not timed. It reports the p50 of each and
// their ratio, and the driver's own part (PrepareResourceClaims with the claim in hand,
// as the helper calls it after reading the claim from the API server) against Reserve.
func BenchmarkPrepare(b *testing.B) {
	r := newRig(b)
	drv := r.startDriver(nil)
	k := r.kubelet()
	ids, group := gpus(r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 }))
	r.waitSlices("8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	ctx := context.Background()
	var reserve, prepare, own []time.Duration
	n := 0
	for b.Loop() {
		n++
		// Every claim of the iteration is made first: making one (on the fake
		// clientset) wakes the helper's and the driver's informers, work that must not
		// fall on one side only. The three then run in an order that turns with n.
		cPrep := r.claim(fmt.Sprintf("bench-%d", n), DeviceName(ids[0]), DeviceName(ids[1]))
		cOwn := r.claim(fmt.Sprintf("bench-own-%d", n), DeviceName(ids[0]), DeviceName(ids[1]))
		steps := []func(){
			func() {
				// A claim's owner, so that the driver treats the reservation as one of its
				// own (no taint, no slice republished) as it does the prepare's.
				owner := claimRef{"bench", fmt.Sprintf("reserve-%d", n), fmt.Sprintf("uid-%d", n)}.owner()
				start := time.Now()
				res, err := r.c.Reserve(ctx, &pb.ReserveRequest{OwnerId: owner, Vendor: group.GetVendor(),
					Type: group.GetType(), Name: group.GetName(), DeviceIds: ids[:2]})
				if err != nil {
					b.Fatal(err)
				}
				reserve = append(reserve, time.Since(start))
				if _, err := r.c.ReleaseReservation(ctx, res.GetReservationId()); err != nil {
					b.Fatal(err)
				}
			},
			func() {
				start := time.Now()
				if p := k.prepare(b, cPrep); p.GetError() != "" {
					b.Fatal(p.GetError())
				}
				prepare = append(prepare, time.Since(start))
				if e := k.unprepare(b, cPrep); e != "" {
					b.Fatal(e)
				}
			},
			func() {
				// The driver's own part: PrepareResourceClaims as the helper calls it, with
				// the claim in hand (no gRPC hop, no read of the claim from the API server).
				start := time.Now()
				got, err := drv.d.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{cOwn})
				if err != nil || got[cOwn.UID].Err != nil {
					b.Fatal(err, got[cOwn.UID].Err)
				}
				own = append(own, time.Since(start))
				if e := k.unprepare(b, cOwn); e != "" {
					b.Fatal(e)
				}
			},
		}
		for i := range steps {
			steps[(i+n)%len(steps)]()
		}
	}
	p50 := func(ds []time.Duration) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[len(s)/2]
	}
	rp, pp := p50(reserve), p50(prepare)
	b.ReportMetric(float64(rp.Microseconds()), "reserve-p50-µs")
	b.ReportMetric(float64(pp.Microseconds()), "prepare-p50-µs")
	b.ReportMetric(float64(pp)/float64(rp), "prepare/reserve")
	op := p50(own)
	b.ReportMetric(float64(op.Microseconds()), "driver-p50-µs")
	b.ReportMetric(float64(op)/float64(rp), "driver/reserve")
}
