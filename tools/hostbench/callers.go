package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

// callersDevices is the fixture plugin's device count in the callers scenario: two for
// each of 64 callers.
const callersDevices = 128

// callers is the concurrency scenario: an agent (not -dev) running the fixture plugin
// (built from this tree) with callersDevices devices and a state dir, and Reserve+Release
// cycles from 1 caller, then from 64, each a goroutine of this process on one shared
// connection, taking turns over two devices of its own (no conflicts, and a Reserve never
// waits for the plugin's cleanup of the device its caller released the moment before).
// Each count runs for b.callersTime after a warm-up of the same length; the rows are the
// cycles per second and the ratio of 64 callers over 1 (goal >= 5). With -cpuprofile or
// -trace (an agent built with -tags cpuprofile) the agent profiles the 64 callers' run.
func (b *bench) callers(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "hostbench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	plugins := filepath.Join(dir, "plugins")
	if err := os.Mkdir(plugins, 0o755); err != nil {
		return err
	}
	if _, err := fixtureplugin.Build(plugins); err != nil {
		return err
	}
	ids := make([]string, callersDevices)
	for i := range ids {
		ids[i] = fmt.Sprintf("%q", fmt.Sprintf("w%d", i))
	}
	cfg := filepath.Join(dir, "devicehost.hcl")
	body := fmt.Sprintf("plugin %q {\n  config {\n    groups = [{ vendor = \"fixture\", type = \"widget\", name = \"w\", ids = [%s] }]\n  }\n}\n",
		fixtureplugin.Name, strings.Join(ids, ", "))
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		return err
	}
	a, err := b.startIn(ctx, dir, 0, "-config", cfg, "-plugin-dir", plugins, "-state-dir", filepath.Join(dir, "state"))
	if err != nil {
		return err
	}
	defer a.stop()
	conn, err := a.dial()
	if err != nil {
		return err
	}
	defer conn.Close()
	c := pb.NewDeviceHostClient(conn)
	devs, err := firstDevices(ctx, c, callersDevices)
	if err != nil {
		return err
	}
	if len(devs) < callersDevices {
		return fmt.Errorf("the fixture plugin reports %d devices, want %d", len(devs), callersDevices)
	}
	// run has n callers cycle for d and returns the cycles they completed.
	run := func(n int, d time.Duration) (int64, error) {
		var done atomic.Int64
		var firstErr error
		var once sync.Once
		end := time.Now().Add(d)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				mine := [2]device{devs[2*i], devs[2*i+1]}
				owner := fmt.Sprintf("hostbench-caller-%d", i)
				for turn := 0; time.Now().Before(end); turn++ {
					dev := mine[turn%2]
					r, err := c.Reserve(ctx, &pb.ReserveRequest{
						OwnerId: owner, Vendor: dev.group.GetVendor(), Type: dev.group.GetType(), Name: dev.group.GetName(),
						DeviceIds: []string{dev.id},
					})
					if err == nil {
						_, err = c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: r.GetReservationId()}})
					}
					if err != nil {
						once.Do(func() { firstErr = fmt.Errorf("caller %d: %w", i, err) })
						return
					}
					done.Add(1)
				}
			})
		}
		wg.Wait()
		return done.Load(), firstErr
	}
	rates := map[int]float64{}
	for _, n := range []int{1, 64} {
		if _, err := run(n, b.callersTime); err != nil { // warm-up
			return err
		}
		profiling := n == 64 && (b.cpuProfile != "" || b.trace != "")
		if profiling {
			if err := a.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
				return err
			}
		}
		cycles, err := run(n, b.callersTime)
		if err != nil {
			return err
		}
		if profiling {
			if err := a.stopProfiles(b.cpuProfile, b.trace); err != nil {
				return err
			}
		}
		rates[n] = float64(cycles) / b.callersTime.Seconds()
		row(fmt.Sprintf("Reserve+Release cycles/s, %d callers", n), rates[n], "/s")
	}
	ratio := rates[64] / rates[1]
	row("64 callers over 1, cycles/s", ratio, "x")
	fmt.Printf("callers:     Reserve+Release cycles/s end to end (fixture plugin, %d devices): 1 caller %.0f, 64 callers %.0f: x%.2f (goal >= 5)\n",
		callersDevices, rates[1], rates[64], ratio)
	return nil
}
