package client_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

func dev(id string, h pb.Health, why string) *pb.Device {
	return &pb.Device{Id: id, Health: h, HealthReason: why}
}

// Each device once, sorted, with why; a filter keeps its groups only.
func TestHealthOf(t *testing.T) {
	fp := &pb.FingerprintResponse{Groups: []*pb.DeviceGroup{
		{Vendor: "nvidia", Type: "gpu", Devices: []*pb.Device{
			dev("GPU-3", pb.Health_HEALTH_UNHEALTHY, "XID 79"),
			dev("GPU-1", pb.Health_HEALTH_UNKNOWN, ""),
			dev("GPU-2", pb.Health_HEALTH_HEALTHY, ""),
		}},
		// The same ID listed again: counted once.
		{Vendor: "nvidia", Type: "gpu.shared", Devices: []*pb.Device{dev("GPU-3", pb.Health_HEALTH_UNHEALTHY, "XID 79")}},
		{Vendor: "hostdev", Type: "fuse", Devices: []*pb.Device{dev("fuse-0", pb.Health_HEALTH_UNHEALTHY, "")}},
	}}
	h := client.HealthOf(fp, nil)
	if got, want := h.Line(16, 512), "3 of 4 devices unhealthy: GPU-1 (unknown), GPU-3 (XID 79), fuse-0 (unhealthy)"; got != want {
		t.Errorf("all groups: %q, want %q", got, want)
	}
	h = client.HealthOf(fp, func(g *pb.DeviceGroup) bool { return g.GetVendor() == "hostdev" })
	if got, want := h.Line(16, 512), "1 of 1 devices unhealthy: fuse-0 (unhealthy)"; got != want {
		t.Errorf("hostdev only: %q, want %q", got, want)
	}
	h = client.HealthOf(fp, func(g *pb.DeviceGroup) bool { return g.GetType() == "none" })
	if got := h.Line(16, 512); got != "0 devices healthy" {
		t.Errorf("no group kept: %q", got)
	}
}

// A hostile plugin's IDs and reasons cannot make the line long, multi-line or
// terminal-controlling: each part is cut and escaped, the devices named are bounded.
func TestHealthLineBounded(t *testing.T) {
	var devs []*pb.Device
	for i := range 1000 {
		devs = append(devs, dev(fmt.Sprintf("GPU-%04d\x1b[31m\n%s", i, strings.Repeat("x", 100)), pb.Health_HEALTH_UNHEALTHY, "bad\r\nline "+strings.Repeat("y", 1000)))
	}
	h := client.HealthOf(&pb.FingerprintResponse{Groups: []*pb.DeviceGroup{{Devices: devs}}}, nil)
	line := h.Line(16, 1024)
	if len(line) > 1024 || strings.ContainsAny(line, "\x1b\n\r") {
		t.Fatalf("line of %d bytes, escapes or breaks kept: %q", len(line), line)
	}
	if !strings.HasPrefix(line, "1000 of 1000 devices unhealthy: GPU-0000") {
		t.Errorf("line starts %q", line[:60])
	}
	line = h.Line(2, 4096)
	if !strings.HasSuffix(line, ", and 998 more") || strings.Count(line, "GPU-") != 2 {
		t.Errorf("two named: %q", line)
	}
}
