package kubernetes_test

import (
	"context"
	"slices"
	"testing"
	"time"

	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/integrations/kubernetes/kubelettest"
)

// BenchmarkHealthPropagation measures how long a device's health change at the agent
// takes to reach the kubelet's ListAndWatch stream: from the agent publishing the
// snapshot, through its Fingerprint stream, the bridge, to the stand-in kubelet
// receiving the message. It reports the median and the 99th percentile.
func BenchmarkHealthPropagation(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	agent := startAgent(b, eightGPUs())
	h := startBridge(b, agent)
	if _, err := h.kubelet.WaitDevices(ctx, gpuResource, kubelettest.AllHealth(8, dpapi.Healthy)); err != nil {
		b.Fatal(err)
	}
	var lat []time.Duration
	healthy := true
	for b.Loop() {
		healthy = !healthy
		health, want := device.HealthUnhealthy, dpapi.Unhealthy
		if healthy {
			health, want = device.HealthHealthy, dpapi.Healthy
		}
		start := time.Now()
		agent.setHealth(gpuID(0), health, "bench")
		u, err := h.kubelet.WaitDevices(ctx, gpuResource, withHealth(8, gpuID(0), want))
		if err != nil {
			b.Fatal(err)
		}
		lat = append(lat, u.At.Sub(start))
	}
	reportPercentiles(b, lat)
}

// reportPercentiles reports the median and 99th percentile of lat.
func reportPercentiles(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}
