package dra

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

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
	// The claims' device status writes (after each prepare, off its answer, and the
	// clear at each unprepare) are counted by a reactor that answers them: the fake
	// clientset would run the API server's server-side apply in this process, which a
	// node does not pay. The driver's side of each write (the apply configuration, its
	// JSON) stays in the figures.
	var statusWrites atomic.Int64
	written := make(chan string, 64) // names of claims whose device status was written
	r.kube.PrependReactor("patch", "resourceclaims", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "status" {
			return false, nil, nil
		}
		statusWrites.Add(1)
		if p, ok := a.(k8stesting.PatchAction); ok && bytes.Contains(p.GetPatch(), []byte(`"devices"`)) {
			written <- p.GetName()
		}
		return true, &resourceapi.ResourceClaim{}, nil
	})
	// A prepared claim's device status is written after the answer, once the kubelet
	// waits on nothing: each step waits for it before the unprepare (a claim lives
	// longer than that), so that every prepare's status write is made and counted.
	waitStatus := func(name string) {
		timeout := time.After(10 * time.Second)
		for {
			select {
			case n := <-written:
				if n == name {
					return
				}
			case <-timeout:
				b.Fatalf("claim %s: no device status written in 10 s", name)
			}
		}
	}
	drv := r.startDriver(nil)
	k := r.kubelet()
	ids, group := r.waitGPUs()
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
				waitStatus(cPrep.Name)
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
				waitStatus(cOwn.Name)
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
	b.ReportMetric(float64(statusWrites.Load())/float64(n), "status-writes/op")
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

// BenchmarkSliceChange measures what one change of the agent's devices costs the driver
// on a DGX H100 with on-demand MIG (8 GPUs, every placement of every MIG profile, 8
// counter sets: 5 slices): a partition held by a hand reservation (the driver taints it
// devicehost.io/held) and released again, each a change the driver turns into an
// update of one slice. cpu-ms/change is the CPU of this whole test process per change
// (target: the driver's at most 5 ms), so it counts, besides the driver, the fake API
// server and the test's own client: an upper bound of the driver's part. The agent is
// a process of its own, not counted.
func BenchmarkSliceChange(b *testing.B) {
	r := newRigArgs(b, "-config", onDemandAgentConfig(b))
	snap := r.waitDevices("GPUs and MIG partitions", func(s *pb.FingerprintResponse) bool { return len(s.GetCounterSets()) == 8 })
	var part *pb.DeviceGroup
	total := 0
	for _, g := range snap.GetGroups() {
		total += len(g.GetDevices())
		if g.GetType() == "mig" && g.GetName() == "1g.10gb" {
			part = g
		}
	}
	if part == nil {
		b.Fatal("no 1g.10gb partitions")
	}
	id := part.GetDevices()[0].GetId()
	name := DeviceName(id)
	r.startDriver(nil)
	r.waitSlices("every device", func(d []resourceapi.Device) bool { return len(d) == total })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	w, err := r.kube.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()
	// waitTaint waits for the slice update that says the partition is held (or not).
	waitTaint := func(held bool) {
		for {
			select {
			case ev := <-w.ResultChan():
				s, ok := ev.Object.(*resourceapi.ResourceSlice)
				if !ok {
					continue
				}
				for _, d := range s.Spec.Devices {
					if d.Name != name {
						continue
					}
					has := slices.ContainsFunc(d.Taints, func(t resourceapi.DeviceTaint) bool { return t.Key == testDriver+"/held" })
					if has == held {
						return
					}
				}
			case <-ctx.Done():
				b.Fatalf("partition %s held=%v: no such slice update", id, held)
			}
		}
	}
	var cpu, wall []time.Duration
	measure := func(change func()) {
		c0, t0 := processCPU(b), time.Now()
		change()
		wall = append(wall, time.Since(t0))
		cpu = append(cpu, processCPU(b)-c0)
	}
	for b.Loop() {
		var resID string
		measure(func() {
			res, err := r.c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "bench/hand", Vendor: part.GetVendor(), Type: part.GetType(), Name: part.GetName(), DeviceIds: []string{id}})
			if err != nil {
				b.Fatal(err)
			}
			resID = res.GetReservationId()
			waitTaint(true)
		})
		measure(func() {
			if _, err := r.c.ReleaseReservation(ctx, resID); err != nil {
				b.Fatal(err)
			}
			waitTaint(false)
		})
	}
	p50 := func(ds []time.Duration) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[len(s)/2]
	}
	var sum time.Duration
	for _, c := range cpu {
		sum += c
	}
	b.ReportMetric(float64(sum.Microseconds())/1000/float64(len(cpu)), "cpu-ms/change")
	b.ReportMetric(float64(p50(wall).Microseconds())/1000, "p50-ms/change")
	b.ReportMetric(float64(total), "devices")
}

// processCPU is the CPU time (user and system) this process has used.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkViewChange is the driver's own work for one change of a large pool: the
// agent's snapshot of a DGX H100 with on-demand MIG (232 devices, 8 counter sets) with
// one partition's holder changed, turned into the view (buildView) and compared with
// the last publish (its encoding), as watchLoop and the publisher do. The write to the
// API server comes after, and is not in it.
func BenchmarkViewChange(b *testing.B) {
	r := newRigArgs(b, "-config", onDemandAgentConfig(b))
	snap := r.waitDevices("GPUs and MIG partitions", func(s *pb.FingerprintResponse) bool { return len(s.GetCounterSets()) == 8 })
	// The snapshot with the partition held, as the stream's decoder gives it
	// (client.WatchDevices): the devices that did not change are the same messages.
	held := &pb.FingerprintResponse{Timestamp: snap.GetTimestamp(), CounterSets: snap.GetCounterSets()}
	changed := false
	for _, g := range snap.GetGroups() {
		g2 := &pb.DeviceGroup{Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName(), Plugin: g.GetPlugin(),
			Attributes: g.GetAttributes(), Devices: slices.Clone(g.GetDevices())}
		if g.GetType() == "mig" && !changed {
			part := proto.Clone(g2.Devices[0]).(*pb.Device)
			part.Holder = &pb.Holder{ReservationId: "res-1", OwnerId: "bench/hand"}
			g2.Devices[0], changed = part, true
		}
		held.Groups = append(held.Groups, g2)
	}
	snaps := []*pb.FingerprintResponse{snap, held}
	o := buildOptions{driver: testDriver, pool: testNode, pci: &pciAttributes{}, cache: newViewCache()}
	var last *view
	publishes := 0
	for i := 0; b.Loop(); i++ {
		v, _ := buildView(snaps[i%2], o)
		if changedSlices(last, v) > 0 {
			publishes++
		}
		last = v
	}
	b.ReportMetric(float64(publishes)/float64(b.N), "publishes/op")
}

// changedSlices counts the slices of v that the publisher would write after last's
// (all of them if last is nil or of another shape), comparing them as it does.
func changedSlices(last, v *view) int {
	if last == nil || len(last.encs) != len(v.encs) {
		return len(v.encs)
	}
	n := 0
	for i := range v.encs {
		if !v.encs[i].equal(last.encs[i]) {
			n++
		}
	}
	return n
}

// onDemandAgentConfig is an agent config whose nvidia-example plugin simulates a DGX
// H100 with on-demand MIG: 8 GPUs, every placement of every profile, 8 counter sets.
func onDemandAgentConfig(b *testing.B) string {
	b.Helper()
	cfg := filepath.Join(b.TempDir(), "agent.hcl")
	if err := os.WriteFile(cfg, []byte(`plugin "nvidia-example" {
  config {
    simulate = "dgxh100"
    mig      = "on-demand"
  }
}
`), 0o644); err != nil {
		b.Fatal(err)
	}
	return cfg
}
