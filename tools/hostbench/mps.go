package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/calltrace"
)

// mpsConfig offers the dev agent's simulated DGX H100 as 4 MPS shares per GPU, one
// control daemon per GPU (the agent's own binary, simulated), under dir.
const mpsConfig = `plugin "nvidia-example" {
  config {
    simulate       = "dgxh100"
    sim_state_file = ""
    replicas       = 4
    sharing        = "mps"
    mps_dir        = %q
  }
}
`

// mps is the MPS scenario (see docs/benchmarks.md#hostbench): Reserve+Release p50 of an
// MPS share whose GPU's control daemon already runs (another holder keeps it up)
// against a whole GPU's, in alternating rounds; then the Reserve of a GPU's first share,
// which starts its daemon before it answers, apart.
func (b *bench) mps(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "hb-mps")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	a, c, fp, stop, err := b.startConfigured(ctx, dir, fmt.Sprintf(mpsConfig, filepath.Join(dir, "d")))
	if err != nil {
		return err
	}
	defer stop()
	var whole, shares *pb.DeviceGroup
	for _, g := range fp.GetGroups() {
		switch g.GetType() {
		case "gpu":
			whole = g
		case "gpu.mps":
			shares = g
		}
	}
	if whole == nil || shares == nil || len(whole.GetDevices()) != 8 {
		return fmt.Errorf("no MPS inventory (groups %d)", len(fp.GetGroups()))
	}
	gpus := make([]string, len(whole.GetDevices()))
	for i, d := range whole.GetDevices() {
		gpus[i] = d.GetId()
	}
	slices.Sort(gpus)
	share := func(gpu string, k int) device { return device{group: shares, id: fmt.Sprintf("%s::mps::%d", gpu, k)} }

	// The holder that keeps GPU 7's daemon up.
	if _, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: "hostbench-mps-holder", Vendor: shares.GetVendor(), Type: shares.GetType(),
		Name: shares.GetName(), DeviceIds: []string{share(gpus[7], 0).id}}); err != nil {
		return fmt.Errorf("reserve the daemon's holder: %w", err)
	}
	wholeDev, shareDev := device{group: whole, id: gpus[6]}, share(gpus[7], 1)
	const rounds = 6
	perRound := max(b.cycles/rounds, 10)
	wholeDs, shareDs, err := b.alternate(ctx, a, c, wholeDev, shareDev, rounds, perRound)
	if err != nil {
		return err
	}
	wholeP50, shareP50 := calltrace.Percentile(wholeDs, 50), calltrace.Percentile(shareDs, 50)
	row("mps Reserve+Release p50, whole GPU", float64(wholeP50)/1e3, "µs")
	row("mps Reserve+Release p50, share, daemon running", float64(shareP50)/1e3, "µs")
	fmt.Printf("%-44s %s whole GPU, %s share with its daemon running (%d rounds of %d cycles each): x%.2f (goal <= 1.3)\n",
		"Reserve+Release p50, MPS", ms(wholeP50), ms(shareP50), rounds, perRound, float64(shareP50)/float64(wholeP50))

	// A first share: its Reserve starts the daemon; its Release (the plugin's part runs
	// after the answer) stops it, which is waited for before the next one.
	var firsts []time.Duration
	first := share(gpus[5], 0)
	for range 10 {
		start := time.Now()
		r, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: benchOwner, Vendor: shares.GetVendor(), Type: shares.GetType(),
			Name: shares.GetName(), DeviceIds: []string{first.id}})
		if err != nil {
			return fmt.Errorf("first share: %w", err)
		}
		firsts = append(firsts, time.Since(start))
		if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: r.GetReservationId()}}); err != nil {
			return err
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			files, _ := filepath.Glob(filepath.Join(dir, "d", "*", "daemon.json"))
			if len(files) == 1 { // the holder's daemon only
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("first share's daemon not stopped 10 s after its Release (%d daemons)", len(files))
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	firstP50 := calltrace.Percentile(firsts, 50)
	row("mps Reserve p50, first share (daemon start)", float64(firstP50)/1e3, "µs")
	fmt.Printf("%-44s %s (%d Reserves, each starting the GPU's control daemon)\n", "Reserve p50, MPS first share", ms(firstP50), len(firsts))
	return nil
}
