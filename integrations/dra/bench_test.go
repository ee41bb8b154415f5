package dra

import (
	"context"
	"fmt"
	"testing"

	resourceapi "k8s.io/api/resource/v1"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// BenchmarkPrepare compares NodePrepareResources of one claim for 2 GPUs, through the
// helper's socket as the kubelet calls it, with the agent's Reserve of the same 2
// GPUs (the target: at most 1.3×). Each iteration uses a fresh claim (or
// owner); its unprepare (or release) is not timed.
func BenchmarkPrepare(b *testing.B) {
	r := newRig(b)
	r.startDriver(nil)
	k := r.kubelet()
	ids, group := gpus(r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 }))
	r.waitSlices("8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	ctx := context.Background()
	n := 0 // owners and claim names stay unique over every run of the sub-benchmarks

	b.Run("reserve", func(b *testing.B) {
		for b.Loop() {
			n++
			res, err := r.c.Reserve(ctx, &pb.ReserveRequest{OwnerId: fmt.Sprintf("bench/%d", n), Vendor: group.GetVendor(),
				Type: group.GetType(), Name: group.GetName(), DeviceIds: ids[:2]})
			if err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			if _, err := r.c.ReleaseReservation(ctx, res.GetReservationId()); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
		}
	})
	b.Run("node-prepare", func(b *testing.B) {
		for b.Loop() {
			n++
			b.StopTimer()
			c := r.claim(fmt.Sprintf("bench-%d", n), DeviceName(ids[0]), DeviceName(ids[1]))
			b.StartTimer()
			if p := k.prepare(b, c); p.GetError() != "" {
				b.Fatal(p.GetError())
			}
			b.StopTimer()
			if e := k.unprepare(b, c); e != "" {
				b.Fatal(e)
			}
			b.StartTimer()
		}
	})
}
