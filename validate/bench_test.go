package validate_test

import (
	"fmt"
	"testing"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

// BenchmarkStats measures the check the manager runs on every stats message: eight
// GPUs with twenty values each.
func BenchmarkStats(b *testing.B) {
	resp := &pb.StatsResponse{}
	ids := make([]string, 8)
	for i := range ids {
		ids[i] = fmt.Sprint("GPU-", i)
		values := make(map[string]*pb.Value)
		for j := range 20 {
			values[fmt.Sprint("metric_", j)] = &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: float64(j)}, Unit: "W"}
		}
		resp.Devices = append(resp.Devices, &pb.DeviceStats{DeviceId: ids[i], Values: values})
	}
	known := knownIDs(ids...)
	for b.Loop() {
		if err := validate.Stats(resp, known); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFingerprint measures the check of a fingerprint of eight GPUs.
func BenchmarkFingerprint(b *testing.B) {
	resp := goodFingerprint()
	resp.Groups[0].Devices = devices("H100-", 8)
	for b.Loop() {
		if err := validate.Fingerprint(resp); err != nil {
			b.Fatal(err)
		}
	}
}
