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

// partition is the partition scenario (see the package doc): on an agent whose
// simulated DGX H100 is partitionable on demand, Reserve+Release p50 of a whole GPU
// and of a 1g.10gb partition (the plugin creates its MIG instance in Reserve), the
// partition's again with every other GPU cut into 7 held 1g.10gb partitions, and the
// size of the fully partitionable Fingerprint.
func (b *bench) partition(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "hostbench-mig")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cfg := filepath.Join(dir, "mig.hcl")
	if err := os.WriteFile(cfg, []byte(partitionConfig), 0o600); err != nil {
		return err
	}
	a, err := b.start(ctx, 0, "-config", cfg)
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
	stream, err := c.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		return err
	}
	fp, err := stream.Recv()
	if err != nil {
		return err
	}
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
	for range 30 { // warm up both
		if err := cycle(ctx, c, wholeDev); err != nil {
			return err
		}
		if err := cycle(ctx, c, partDev); err != nil {
			return err
		}
	}
	wholeP50, nw, err := b.p50Cycle(ctx, c, wholeDev)
	if err != nil {
		return err
	}
	cpu0, err := a.cpu()
	if err != nil {
		return err
	}
	partP50, np, err := b.p50Cycle(ctx, c, partDev)
	if err != nil {
		return err
	}
	cpu1, err := a.cpu()
	if err != nil {
		return err
	}
	fmt.Printf("%-44s %s whole GPU (%d cycles), %s 1g.10gb partition (%d cycles): x%.2f\n",
		"Reserve+Release p50, on-demand MIG", ms(wholeP50), nw, ms(partP50), np, float64(partP50)/float64(wholeP50))

	held := 0
	for i, gpu := range gpus[:len(gpus)-1] {
		for j, p := range partsOf(gpu) {
			if _, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: fmt.Sprintf("held-%d-%d", i, j), Vendor: mig.GetVendor(), Type: mig.GetType(), Name: mig.GetName(), DeviceIds: []string{p}}); err != nil {
				return fmt.Errorf("hold %s: %w", p, err)
			}
			held++
		}
	}
	profiling := b.cpuProfile != "" || b.trace != ""
	if profiling {
		if err := a.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
			return err
		}
	}
	cpu2, err := a.cpu()
	if err != nil {
		return err
	}
	fullP50, nf, err := b.p50Cycle(ctx, c, partDev)
	if err != nil {
		return err
	}
	cpu3, err := a.cpu()
	if err != nil {
		return err
	}
	if profiling {
		if err := a.stopProfiles(b.cpuProfile, b.trace); err != nil {
			return err
		}
	}
	fmt.Printf("%-44s %s with none held, %s with %d partitions held on 7 GPUs (%d cycles): x%.2f\n",
		"Reserve+Release p50, 1g.10gb partition", ms(partP50), ms(fullP50), held, nf, float64(fullP50)/float64(partP50))
	// The agent's CPU per cycle reads steadier than wall time on a busy machine.
	perNone, perHeld := (cpu1-cpu0)/time.Duration(np), (cpu3-cpu2)/time.Duration(nf)
	fmt.Printf("%-44s %d µs with none held, %d µs with %d held: x%.2f\n",
		"  the agent's CPU per cycle", perNone.Microseconds(), perHeld.Microseconds(), held, float64(perHeld)/float64(perNone))
	return nil
}
