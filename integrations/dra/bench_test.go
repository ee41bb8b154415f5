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
// their ratio.
func BenchmarkPrepare(b *testing.B) {
	r := newRig(b)
	r.startDriver(nil)
	k := r.kubelet()
	ids, group := gpus(r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 }))
	r.waitSlices("8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	ctx := context.Background()
	var reserve, prepare []time.Duration
	n := 0
	for b.Loop() {
		n++
		start := time.Now()
		// A claim's owner, so that the driver treats the reservation as one of its own
		// (no taint, no slice republished) as it does the prepare's.
		owner := claimRef{"bench", fmt.Sprintf("reserve-%d", n), fmt.Sprintf("uid-%d", n)}.owner()
		res, err := r.c.Reserve(ctx, &pb.ReserveRequest{OwnerId: owner, Vendor: group.GetVendor(),
			Type: group.GetType(), Name: group.GetName(), DeviceIds: ids[:2]})
		if err != nil {
			b.Fatal(err)
		}
		reserve = append(reserve, time.Since(start))
		if _, err := r.c.ReleaseReservation(ctx, res.GetReservationId()); err != nil {
			b.Fatal(err)
		}
		c := r.claim(fmt.Sprintf("bench-%d", n), DeviceName(ids[0]), DeviceName(ids[1]))
		start = time.Now()
		if p := k.prepare(b, c); p.GetError() != "" {
			b.Fatal(p.GetError())
		}
		prepare = append(prepare, time.Since(start))
		if e := k.unprepare(b, c); e != "" {
			b.Fatal(e)
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
}
