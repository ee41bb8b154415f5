package fanout_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/server/servertest"
	"github.com/devicehost/devicehost/tools/rawgrpc"
)

// BenchmarkFingerprintFanout measures a Fingerprint change going to many watchers of the
// real server over real gRPC on a Unix socket, the streams spread over 100 connections like
// tools/hostbench's: each iteration publishes one snapshot and waits until every
// watcher has received it. It reports the p50, p99 and max of (received - published);
// the server's CPU is read from -cpuprofile (the clients run in the same process). Run
// with -benchtime=20x or so: an iteration is one change.
func BenchmarkFingerprintFanout(b *testing.B) {
	for _, n := range []int{1000, 5000} {
		b.Run(fmt.Sprintf("watchers=%d", n), func(b *testing.B) { benchFanout(b, n, 100) })
	}
}

// benchSnapshot is an 8-device inventory of about the size of agent -dev's (900 bytes
// encoded), held by owner when it is not empty.
func benchSnapshot(seq uint64, owner string) device.Snapshot {
	g := device.Group{
		GroupKey: device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3"},
		Plugin:   "nvidia",
		Attributes: map[string]device.Value{
			"memory":        {Kind: device.KindInt, Int: 81559, Unit: "MiB"},
			"driver":        {Kind: device.KindString, Str: "550.54"},
			"clock":         {Kind: device.KindFloat, Float: 1.98, Unit: "GHz"},
			"mig_supported": {Kind: device.KindBool, Bool: true},
		},
	}
	for i := range 8 {
		g.Devices = append(g.Devices, device.DeviceInfo{
			ID:       fmt.Sprintf("GPU-%08x-0000-0000-0000-%012x", i, i),
			Locality: device.Locality{PCIBusID: fmt.Sprintf("0000:%02x:00.0", i), NUMANode: i / 4},
		})
	}
	st := device.State{Devices: map[string]device.DeviceState{}}
	for _, d := range g.Devices {
		st.Devices[d.ID] = device.DeviceState{Health: device.HealthHealthy, Reason: "ok"}
	}
	if owner != "" {
		id := g.Devices[0].ID
		st.Devices[id] = device.DeviceState{Health: device.HealthHealthy, Holder: &device.Holder{ReservationID: "r-1", OwnerID: owner}}
	}
	return device.Snapshot{Seq: seq, Time: time.Now(), Inventory: device.Inventory{Groups: []device.Group{g}}, State: st}
}

func benchFanout(b *testing.B, n, conns int) {
	snaps := make(chan device.Snapshot, 1) // the server's one Manager watch
	agent := servertest.Serve(b, servertest.SocketPath(b), server.Config{
		Manager:           &devicetest.Fake{WatchFunc: func(context.Context) <-chan device.Snapshot { return snaps }},
		MaxStreams:        n,
		MaxStreamsPerConn: (n + conns - 1) / conns,
	})
	snaps <- benchSnapshot(0, "")

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	var mu sync.Mutex
	var lat []time.Duration
	var received atomic.Int64
	var measuring atomic.Bool
	errs := make(chan error, n)
	desc := &grpc.StreamDesc{ServerStreams: true}
	var cs []*grpc.ClientConn
	for i := range n {
		if i < conns {
			c, err := endpoint.Dial(agent.Addr, endpoint.TLS{})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { c.Close() })
			cs = append(cs, c)
		}
		conn := cs[i%conns]
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := conn.NewStream(ctx, desc, "/devicehost.v1.DeviceHost/Fingerprint", grpc.ForceCodecV2(rawgrpc.Codec{}))
			if err == nil {
				empty := []byte{}
				err = errors.Join(s.SendMsg(&empty), s.CloseSend())
			}
			errs <- err
			if err != nil {
				return
			}
			for {
				var msg []byte
				if err := s.RecvMsg(&msg); err != nil {
					return
				}
				at := time.Now()
				if measuring.Load() {
					ts, err := rawgrpc.FingerprintTime(msg)
					if err != nil {
						panic(err)
					}
					mu.Lock()
					lat = append(lat, at.Sub(ts))
					mu.Unlock()
				}
				received.Add(1)
			}
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			b.Fatal(err)
		}
	}
	waitFor := func(total int64) {
		deadline := time.Now().Add(time.Minute)
		for received.Load() < total {
			if time.Now().After(deadline) {
				b.Fatalf("after 1m, %d of %d messages received", received.Load(), total)
			}
			time.Sleep(100 * time.Microsecond) // polling a counter; not a test
		}
	}
	waitFor(int64(n))
	measuring.Store(true)
	b.ResetTimer()
	for i := range b.N {
		time.Sleep(50 * time.Millisecond) // isolated changes, as in hostbench
		owner := ""
		if i%2 == 0 {
			owner = "bench"
		}
		snaps <- benchSnapshot(uint64(i+1), owner)
		waitFor(int64(n) * int64(i+2))
	}
	b.StopTimer()
	mu.Lock()
	defer mu.Unlock()
	slices.Sort(lat)
	pct := func(p int) float64 { return float64(lat[max((len(lat)*p+99)/100-1, 0)]) / float64(time.Microsecond) }
	b.ReportMetric(pct(50), "p50-µs")
	b.ReportMetric(pct(99), "p99-µs")
	b.ReportMetric(float64(lat[len(lat)-1])/float64(time.Microsecond), "max-µs")
}
