package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/calltrace"
)

// partitionConfig turns on on-demand MIG for the dev agent's simulated DGX H100. The
// simulated machine keeps its MIG state in memory: the state file's fsyncs stand in for
// hardware that real NVML would drive instead, and are not the host's to measure.
const partitionConfig = `plugin "nvidia-example" {
  config {
    simulate       = "dgxh100"
    mig            = "on-demand"
    sim_state_file = ""
  }
}
`

// partition is the partition scenario (see docs/benchmarks.md#hostbench): on an agent
// whose simulated DGX H100 is partitionable on demand, Reserve+Release p50 of a whole GPU
// and of a 1g.10gb partition (the plugin creates its MIG instance in Reserve), the
// partition's again with every other GPU cut into 7 held 1g.10gb partitions, and the size
// of the fully partitionable Fingerprint.
func (b *bench) partition(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "hostbench-mig")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	a, c, fp, stop, err := b.startConfigured(ctx, dir, partitionConfig)
	if err != nil {
		return err
	}
	defer stop()
	var whole *pb.DeviceGroup
	var mig *pb.DeviceGroup
	devices := 0
	for _, g := range fp.GetGroups() {
		devices += len(g.GetDevices())
		switch {
		case g.GetType() == "gpu":
			whole = g
		case g.GetType() == "mig" && g.GetName() == "1g.10gb":
			mig = g
		}
	}
	if whole == nil || mig == nil || len(whole.GetDevices()) != 8 {
		return fmt.Errorf("no on-demand MIG inventory (groups %d)", len(fp.GetGroups()))
	}
	fmt.Printf("%-44s %d bytes, %d devices in %d groups, %d counter sets\n",
		"Fingerprint, fully partitionable DGX H100", proto.Size(fp), devices, len(fp.GetGroups()), len(fp.GetCounterSets()))

	gpus := make([]string, len(whole.GetDevices()))
	for i, d := range whole.GetDevices() {
		gpus[i] = d.GetId()
	}
	slices.Sort(gpus)
	partsOf := func(gpu string) []string {
		var out []string
		for _, d := range mig.GetDevices() {
			if strings.HasPrefix(d.GetId(), gpu+"-mig-") {
				out = append(out, d.GetId())
			}
		}
		slices.Sort(out)
		return out
	}
	last := gpus[len(gpus)-1]
	wholeDev := device{group: whole, id: last}
	partDev := device{group: mig, id: partsOf(last)[0]}
	// A whole GPU against a partition, and then none held against 49 held, each in
	// alternating rounds, so that a machine's load moving during the run weighs on
	// both sides alike.
	const rounds = 6
	perRound := max(b.cycles/rounds, 10)
	wholeDs, partDs, err := b.alternate(ctx, a, c, wholeDev, partDev, rounds, perRound)
	if err != nil {
		return err
	}
	wholeP50, partP50 := calltrace.Percentile(wholeDs, 50), calltrace.Percentile(partDs, 50)
	row("partition Reserve+Release p50, whole GPU", float64(wholeP50)/1e3, "µs")
	row("partition Reserve+Release p50, 1g.10gb", float64(partP50)/1e3, "µs")
	fmt.Printf("%-44s %s whole GPU, %s 1g.10gb partition (%d rounds of %d cycles each): x%.2f\n",
		"Reserve+Release p50, on-demand MIG", ms(wholeP50), ms(partP50), rounds, perRound, float64(partP50)/float64(wholeP50))

	// The 49 are reserved before each held round and released after it.
	var holds []string
	for _, gpu := range gpus[:len(gpus)-1] {
		holds = append(holds, partsOf(gpu)...)
	}
	var none, full []time.Duration
	var cpuNone, cpuFull time.Duration
	profiling := b.cpuProfile != "" || b.trace != ""
	for round := range rounds {
		ds, cpu, err := b.cyclesCPU(ctx, a, c, partDev, perRound)
		if err != nil {
			return err
		}
		none, cpuNone = append(none, ds...), cpuNone+cpu
		var ids []string
		for j, p := range holds {
			r, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: fmt.Sprintf("held-%d-%d", round, j), Vendor: mig.GetVendor(), Type: mig.GetType(), Name: mig.GetName(), DeviceIds: []string{p}})
			if err != nil {
				return fmt.Errorf("hold %s: %w", p, err)
			}
			ids = append(ids, r.GetReservationId())
		}
		if profiling && round == rounds-1 {
			if err := a.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
				return err
			}
		}
		ds, cpu, err = b.cyclesCPU(ctx, a, c, partDev, perRound)
		if err != nil {
			return err
		}
		full, cpuFull = append(full, ds...), cpuFull+cpu
		if profiling && round == rounds-1 {
			if err := a.stopProfiles(b.cpuProfile, b.trace); err != nil {
				return err
			}
		}
		for _, id := range ids {
			if _, err := c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: id}}); err != nil {
				return fmt.Errorf("release %s: %w", id, err)
			}
		}
	}
	noneP50, fullP50 := calltrace.Percentile(none, 50), calltrace.Percentile(full, 50)
	fmt.Printf("%-44s %s with none held, %s with %d partitions held on 7 GPUs (%d rounds of %d cycles each): x%.2f\n",
		"Reserve+Release p50, 1g.10gb partition", ms(noneP50), ms(fullP50), len(holds), rounds, perRound, float64(fullP50)/float64(noneP50))
	// The agent's CPU per cycle reads steadier than wall time on a busy machine.
	perNone, perHeld := cpuNone/time.Duration(len(none)), cpuFull/time.Duration(len(full))
	row("partition Reserve+Release p50, 1g.10gb with 49 held", float64(fullP50)/1e3, "µs")
	row("partition agent CPU per cycle with 49 held", float64(perHeld)/1e3, "µs")
	fmt.Printf("%-44s %d µs with none held, %d µs with %d held: x%.2f\n",
		"  the agent's CPU per cycle", perNone.Microseconds(), perHeld.Microseconds(), len(holds), float64(perHeld)/float64(perNone))
	return nil
}

// startConfigured starts an agent with config (written to dir), connects to it and
// reads its first Fingerprint; stop closes the connection and stops the agent.
func (b *bench) startConfigured(ctx context.Context, dir, config string) (a *agent, c pb.DeviceHostClient, fp *pb.FingerprintResponse, stop func(), err error) {
	cfg := filepath.Join(dir, "agent.hcl")
	if err := os.WriteFile(cfg, []byte(config), 0o600); err != nil {
		return nil, nil, nil, nil, err
	}
	if a, err = b.start(ctx, 0, "-config", cfg); err != nil {
		return nil, nil, nil, nil, err
	}
	conn, err := a.dial()
	if err != nil {
		a.stop()
		return nil, nil, nil, nil, err
	}
	stop = func() { conn.Close(); a.stop() }
	c = pb.NewDeviceHostClient(conn)
	stream, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err == nil {
		fp, err = stream.Recv()
	}
	if err != nil {
		stop()
		return nil, nil, nil, nil, err
	}
	return a, c, fp, stop, nil
}

// alternate warms x and y up (30 cycles each), then runs rounds of perRound
// Reserve+Release cycles of x and of y, taking turns, so that a machine's load moving
// during the run weighs on both alike; it returns each side's cycle times.
func (b *bench) alternate(ctx context.Context, a *agent, c pb.DeviceHostClient, x, y device, rounds, perRound int) (xs, ys []time.Duration, err error) {
	for range 30 {
		if err := cycle(ctx, c, x); err != nil {
			return nil, nil, err
		}
		if err := cycle(ctx, c, y); err != nil {
			return nil, nil, err
		}
	}
	for range rounds {
		ds, _, err := b.cyclesCPU(ctx, a, c, x, perRound)
		if err != nil {
			return nil, nil, err
		}
		xs = append(xs, ds...)
		if ds, _, err = b.cyclesCPU(ctx, a, c, y, perRound); err != nil {
			return nil, nil, err
		}
		ys = append(ys, ds...)
	}
	return xs, ys, nil
}

// cyclesCPU runs n Reserve+Release cycles of d and returns each one's time and the
// agent's CPU over all of them.
func (b *bench) cyclesCPU(ctx context.Context, a *agent, c pb.DeviceHostClient, d device, n int) ([]time.Duration, time.Duration, error) {
	cpu0, err := a.cpu()
	if err != nil {
		return nil, 0, err
	}
	ds := make([]time.Duration, 0, n)
	for range n {
		start := time.Now()
		if err := cycle(ctx, c, d); err != nil {
			return nil, 0, err
		}
		ds = append(ds, time.Since(start))
	}
	cpu1, err := a.cpu()
	if err != nil {
		return nil, 0, err
	}
	return ds, cpu1 - cpu0, nil
}
