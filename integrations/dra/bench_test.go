package dra

import (
	"context"
	"fmt"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// BenchmarkPrepare compares NodePrepareResources of one claim for 2 GPUs, through the
// helper's socket as the kubelet calls it, with the agent's Reserve of the same 2
// GPUs (target: at most 1.3×). Each iteration does one of each, taking
// turns, so that the machine's load weighs on both alike; each uses a fresh claim (or
// claim owner), and its unprepare (or release) is not timed. It reports the p50 of each and
// their ratio, and two parts of the prepare:
//   - driver: the driver's own part, PrepareResourceClaims with the claim in hand (as
//     the helper calls it after reading the claim from the API server), against Reserve;
//   - helper: NodePrepareResources of a claim with no device of this driver, the same
//     way: the kubelet's gRPC call and the helper's read of the claim, with no Reserve
//     and no CDI spec. floor is (Reserve + helper) / Reserve, the least prepare/reserve
//     any driver built on the helper could show on this machine.
//
// The claims' CDI specs go to a tmpfs where the machine has one, as on a node:
// /var/run/cdi is a tmpfs there (the reboot the driver repairs), and a spec written to
// a disk costs three times as much.
func BenchmarkPrepare(b *testing.B) {
	r := newRig(b)
	r.cdiDir = tmpfsDir(b)
	drv := r.startDriver(nil)
	k := r.kubelet()
	ids, group := gpus(r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 }))
	r.waitSlices("8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	ctx := context.Background()
	var reserve, prepare, own, helper []time.Duration
	n := 0
	for b.Loop() {
		n++
		// Every claim of the iteration is made first: making one (on the fake
		// clientset) wakes the helper's and the driver's informers, work that must not
		// fall on one side only. The three then run in an order that turns with n.
		cPrep := r.claim(fmt.Sprintf("bench-%d", n), DeviceName(ids[0]), DeviceName(ids[1]))
		cOwn := r.claim(fmt.Sprintf("bench-own-%d", n), DeviceName(ids[0]), DeviceName(ids[1]))
		cNone := r.claim(fmt.Sprintf("bench-none-%d", n))
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
			func() {
				start := time.Now()
				if p := k.prepare(b, cNone); p.GetError() != "" || len(p.GetDevices()) != 0 {
					b.Fatal(p.GetError(), p.GetDevices())
				}
				helper = append(helper, time.Since(start))
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
	hp := p50(helper)
	b.ReportMetric(float64(hp.Microseconds()), "helper-p50-µs")
	b.ReportMetric(float64(rp+hp)/float64(rp), "floor")
}

// tmpfsDir is a new directory on /dev/shm when that is a tmpfs, removed at the end,
// else one under the test's temporary directory.
func tmpfsDir(b *testing.B) string {
	var st syscall.Statfs_t
	if err := syscall.Statfs("/dev/shm", &st); err != nil || st.Type != tmpfsMagic {
		b.Logf("CDI specs on disk: /dev/shm is not a tmpfs (%v)", err)
		return b.TempDir()
	}
	dir, err := os.MkdirTemp("/dev/shm", "devicehost-dra-bench-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// tmpfsMagic is statfs's f_type of a tmpfs (linux/magic.h).
const tmpfsMagic = 0x01021994
