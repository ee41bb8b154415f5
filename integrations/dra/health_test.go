package dra

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/liveness/livenesstest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// watchProbe follows the driver's health socket as a liveness probe asks it, until
// the test ends.
func watchProbe(t *testing.T, sock string) *livenesstest.Watch {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	t.Cleanup(cancel)
	return livenesstest.NewWatch(t, ctx, sock)
}

func withHealth(sock string, stall, agent time.Duration) func(*Config) {
	return func(c *Config) { c.HealthSocket, c.HealthStallTimeout, c.HealthAgentTimeout = sock, stall, agent }
}

// The health socket says SERVING while the driver follows the agent, NOT_SERVING
// while its agent watch is stuck handling an update, and SERVING once it gets through.
func TestHealthSocketStuckWatch(t *testing.T) {
	r := newRig(t)
	sock := filepath.Join(r.dir, "health.sock")
	var stuck atomic.Bool
	release := make(chan struct{})
	r.updateHook = func() {
		if stuck.Load() {
			<-release
		}
	}
	rd := r.startDriver(withHealth(sock, 200*time.Millisecond, time.Minute))
	p := watchProbe(t, sock)
	p.Wait(t, "a working driver", healthpb.HealthCheckResponse_SERVING)

	stuck.Store(true)
	r.agent.Kill() // the disconnection is an update the watch gets stuck on
	p.Wait(t, "the agent watch stuck", healthpb.HealthCheckResponse_NOT_SERVING)
	if !strings.Contains(rd.log.String(), "the agent watch loop has made no progress") {
		t.Errorf("the driver's log does not name the stuck loop:\n%s", rd.log)
	}
	stuck.Store(false)
	close(release)
	p.Wait(t, "the agent watch through", healthpb.HealthCheckResponse_SERVING)
}

// The health socket says NOT_SERVING once the agent has been unreachable for the
// agent timeout and SERVING as soon as it is back; it is gone once the driver stops.
func TestHealthSocketAgentGone(t *testing.T) {
	r := newRig(t)
	sock := filepath.Join(r.dir, "health.sock")
	rd := r.startDriver(withHealth(sock, time.Minute, 300*time.Millisecond))
	p := watchProbe(t, sock)
	p.Wait(t, "a working driver", healthpb.HealthCheckResponse_SERVING)

	r.agent.Kill()
	p.Wait(t, "the agent gone", healthpb.HealthCheckResponse_NOT_SERVING)
	if !strings.Contains(rd.log.String(), "the agent has been unreachable for") {
		t.Errorf("the driver's log does not say the agent is unreachable:\n%s", rd.log)
	}
	r.startAgent()
	p.Wait(t, "the agent back", healthpb.HealthCheckResponse_SERVING)

	rd.stop(t)
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("health socket after the driver stopped: %v, want it gone", err)
	}
}

// Health timeouts that cannot work are refused by New.
func TestHealthConfigRefused(t *testing.T) {
	agent := unreachableAgent(t)
	_, err := New(Config{Agent: agent, Kube: newKube(), NodeName: testNode, CDIDir: t.TempDir(), HealthStallTimeout: -time.Second})
	if err == nil || !strings.Contains(err.Error(), "stall timeout -1s is negative") {
		t.Errorf("New with a negative stall timeout: %v", err)
	}
}

// The kubelet gets a health report when what it says changes (a device's health or
// reason, the agent's reachability, a device more), not for each change of the pool
// that says nothing of health (a holder, a taint): each report is every device.
func TestHealthReportOnlyWhenHealthChanges(t *testing.T) {
	build := func(change func(*pb.FingerprintResponse), lost error) *view {
		snap := onDemandSnapshot(2, 7)
		if change != nil {
			change(snap)
		}
		v, _ := buildView(snap, buildOptions{driver: testDriver, pool: testNode, pci: &pciAttributes{}, disconnected: lost})
		return v
	}
	base := build(nil, nil).healthReport(time.Now())
	if !build(nil, nil).reportedIn(base) {
		t.Fatal("the same snapshot: taken as not reported")
	}
	if !build(holdPartition(1), nil).reportedIn(base) {
		t.Error("a partition held (holder and taints): a report sent, want none")
	}
	changes := map[string]*view{
		"unhealthy": build(func(s *pb.FingerprintResponse) { s.Groups[0].Devices[1].Health = pb.Health_HEALTH_UNHEALTHY }, nil),
		"reason": build(func(s *pb.FingerprintResponse) {
			s.Groups[1].Devices[0].HealthReason = "XID 48"
		}, nil),
		"agent lost": build(nil, errors.New("connection refused")),
		"a device more": build(func(s *pb.FingerprintResponse) {
			s.Groups[1].Devices = append(s.Groups[1].Devices, &pb.Device{Id: "GPU-1-mig-1g.10gb-9"})
		}, nil),
	}
	for what, v := range changes {
		if v.reportedIn(base) {
			t.Errorf("%s: no report sent, want one", what)
		}
		if r := v.healthReport(time.Now()); !v.reportedIn(r) {
			t.Errorf("%s: its own report taken as not reported", what)
		}
	}
}

// A fake clientset has no REST client for the slices' updates: New says what to give
// rather than the first update panicking.
func TestNewWantsAResourceRESTBesideAFake(t *testing.T) {
	agent := unreachableAgent(t)
	kube := newKube()
	if _, err := New(Config{Agent: agent, Kube: kube, NodeName: testNode, CDIDir: t.TempDir()}); err == nil || !strings.Contains(err.Error(), "Config.ResourceREST is required") {
		t.Errorf("New with a fake clientset and no ResourceREST: %v", err)
	}
	if _, err := New(Config{Agent: agent, Kube: kube, ResourceREST: resourceREST(t, kube), NodeName: testNode, CDIDir: t.TempDir()}); err != nil {
		t.Errorf("New with a fake clientset and a ResourceREST: %v", err)
	}
}

// unreachableAgent is a client of an agent that is not there, for a New that is
// refused before it would dial; closed when t ends.
func unreachableAgent(t *testing.T) *client.Client {
	t.Helper()
	agent, err := client.Dial(context.Background(), "unix:///nonexistent/dh.sock", client.WithoutReachCheck())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { agent.Close() })
	return agent
}
