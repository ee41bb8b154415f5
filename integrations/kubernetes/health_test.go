package kubernetes_test

import (
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	dpapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/integrations/kubernetes"
	"github.com/devicehost/devicehost/integrations/kubernetes/kubelettest"
	"github.com/devicehost/devicehost/integrations/liveness/livenesstest"
)

func withHealthSocket(sock string, stall, agent time.Duration) func(*kubernetes.Config) {
	return func(c *kubernetes.Config) {
		c.HealthSocket, c.HealthStallTimeout, c.HealthAgentTimeout = sock, stall, agent
	}
}

// The health socket says SERVING while the bridge works, NOT_SERVING while its device
// watch is stuck handling an update, and SERVING again once it gets through.
func TestHealthSocketStuckWatch(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	sock := filepath.Join(shortTempDir(t, "hb"), "health.sock")
	var stuck atomic.Bool
	release := make(chan struct{})
	h := startBridgeWith(t, agent, func(b *kubernetes.Bridge) {
		kubernetes.SetBeforeUpdate(b, func() {
			if stuck.Load() {
				<-release
			}
		})
	}, withHealthSocket(sock, 200*time.Millisecond, time.Minute))
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))
	hw := livenesstest.NewWatch(t, ctx, sock)
	hw.Wait(t, "a working bridge", healthpb.HealthCheckResponse_SERVING)

	stuck.Store(true)
	agent.setHealth(gpuID(2), device.HealthUnhealthy, "XID 79") // an update the watch gets stuck on
	hw.Wait(t, "the device watch stuck", healthpb.HealthCheckResponse_NOT_SERVING)
	if !strings.Contains(h.logs.String(), "the device watch loop has made no progress") {
		t.Errorf("the bridge's log does not name the stuck loop:\n%s", h.logs.String())
	}
	stuck.Store(false)
	close(release)
	hw.Wait(t, "the device watch through", healthpb.HealthCheckResponse_SERVING)
	h.waitGPUs(t, ctx, "GPU 2 unhealthy", withHealth(8, gpuID(2), dpapi.Unhealthy))
}

// The health socket says NOT_SERVING once the agent has been unreachable for the
// agent timeout, and SERVING as soon as it is back; the socket is gone once the
// bridge stops.
func TestHealthSocketAgentGone(t *testing.T) {
	ctx := testContext(t)
	agent := startAgent(t, eightGPUs())
	sock := filepath.Join(shortTempDir(t, "hb"), "health.sock")
	h := startBridge(t, agent, withHealthSocket(sock, time.Minute, 300*time.Millisecond))
	h.waitGPUs(t, ctx, "8 healthy GPUs", kubelettest.AllHealth(8, dpapi.Healthy))
	hw := livenesstest.NewWatch(t, ctx, sock)
	hw.Wait(t, "a working bridge", healthpb.HealthCheckResponse_SERVING)

	agent.stop()
	hw.Wait(t, "the agent gone", healthpb.HealthCheckResponse_NOT_SERVING)
	if !strings.Contains(h.logs.String(), "the agent has been unreachable for") {
		t.Errorf("the bridge's log does not say the agent is unreachable:\n%s", h.logs.String())
	}
	agent.start(t)
	hw.Wait(t, "the agent back", healthpb.HealthCheckResponse_SERVING)

	if err := h.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("health socket after the bridge stopped: %v, want it gone", err)
	}
}

// A health socket path that cannot be bound stops the bridge at start, naming it.
func TestHealthSocketCannotListen(t *testing.T) {
	agent := startAgent(t, eightGPUs())
	dir := shortTempDir(t, "hb")
	notSocket := filepath.Join(dir, "file")
	if err := os.WriteFile(notSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	h := startBridge(t, agent, withHealthSocket(notSocket, 0, 0))
	select {
	case err := <-h.runErr:
		close(h.runErr)
		if err == nil || !strings.Contains(err.Error(), "health socket") || !strings.Contains(err.Error(), notSocket) {
			t.Errorf("Run: %v, want an error naming the health socket %s", err, notSocket)
		}
	case <-testContext(t).Done():
		t.Fatal("Run did not fail")
	}
}
