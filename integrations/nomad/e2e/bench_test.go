package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/nomad/structs"

	"github.com/devicehost/devicehost/integrations/nomad/shim"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// BenchmarkReserve compares a Reserve through Nomad's client device manager (the path
// of a Nomad task's device hook: devicemanager → nomad-device-devicehost over
// go-plugin gRPC → client/ → agent → nvidia-example plugin, fsynced ledger) with our
// own Reserve through client/ (→ agent → plugin). Each op gives one GPU to a new owner
// and ends the previous owner's hold on it: by Release for the client (a Reserve and a
// Release, two ledger commits), by the shim's take-over for Nomad (which never
// releases: one Reserve that releases the previous holder in its own commit), plus the
// extra hops on Nomad's path. scripts/bench prints the ratio.
func BenchmarkReserve(b *testing.B) {
	bins := build(b)
	tmp := tempDir(b, "dhnb")
	address := "unix://" + filepath.Join(tmp, "dh.sock")
	startAgent(b, bins[agentName], tmp, "agent", "-dev", "-listen", address, "-log-level", "warn")
	c := dial(b, address)
	n := startNomadDevices(b, bins[shim.BinaryName], address, hclog.Warn)
	node := n.node.wait(b, "8 healthy H100s", eightH100s(func(d *structs.NodeDevice) bool { return d.Healthy }))
	var ids []string
	for _, d := range h100s(node).Instances {
		ids = append(ids, d.ID)
	}
	slices.Sort(ids)
	ctx := context.Background()

	b.Run("client", func(b *testing.B) {
		for i := 0; b.Loop(); i++ {
			res, err := c.Reserve(ctx, &pb.ReserveRequest{OwnerId: fmt.Sprintf("bench/%d", i), Vendor: "nvidia", Type: "gpu", Name: h100, DeviceIds: ids[:1]})
			if err != nil {
				b.Fatal(err)
			}
			if _, err := c.ReleaseReservation(ctx, res.GetReservationId()); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("nomad-devicemanager", func(b *testing.B) {
		for b.Loop() {
			if _, err := n.reserve(ids[1]); err != nil {
				b.Fatal(err)
			}
		}
	})
}
