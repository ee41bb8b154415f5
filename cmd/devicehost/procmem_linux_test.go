package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Per-workload GPU memory and utilization through a real agent: two workloads hold MPS
// shares of one simulated GPU, and each runs a process started with its reservation's
// environment (as its container would be), using 300 and 700 MiB of the simulated GPU
// and keeping 30 and 12 % of its SMs busy; a third holds a share and runs nothing. The
// agent's metrics show the GPU's DCGM_FI_DEV_FB_USED and DCGM_FI_DEV_GPU_UTIL once per
// workload with its own processes' figures, found by the reservation each process's
// environment names: utilization 30, 12 and 0, adding up to the GPU's 42.
func TestAgentFBUsedPerHolder(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sock := filepath.Join(tempDir(t, "metrics"), "m.sock")
	setup, _ := newMPSAgentSetup(t, fmt.Sprintf(`metrics_listen = "unix://%s"
stats_interval = "200ms"`, sock), "    replicas       = 4")
	agent := setup.start(t)
	defer agent.kill(t, ctx)
	c := agent.client(t, ctx)
	var shares *pb.DeviceGroup
	currentFingerprint(t, ctx, c, "healthy MPS shares", func(fp *pb.FingerprintResponse) bool {
		for _, g := range fp.GetGroups() {
			if g.GetType() == "gpu.mps" && len(devicesWithHealth(&pb.FingerprintResponse{Groups: []*pb.DeviceGroup{g}}, pb.Health_HEALTH_HEALTHY)) == 32 {
				shares = g
				return true
			}
		}
		return false
	})
	gpu := strings.TrimSuffix(shares.GetDevices()[0].GetId(), "::mps::0")
	run := func(owner string, mib, util int, ids ...string) {
		t.Helper()
		r, err := c.Reserve(ctx, reserveRequest(shares, owner, ids...))
		if err != nil {
			t.Fatalf("Reserve for %s: %v", owner, err)
		}
		if mib < 0 {
			return // a holder that runs nothing
		}
		cmd := exec.Command("sleep", "120")
		cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "DEVICEHOST_SIM_FB_USED_MIB=" + strconv.Itoa(mib), "DEVICEHOST_SIM_SM_UTIL=" + strconv.Itoa(util)}
		for k, v := range r.GetReservation().GetEnvs() {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	run("k8s/ml/p1/main", 300, 30, gpu+"::mps::0", gpu+"::mps::1")
	run("k8s/ml/p2/main", 700, 12, gpu+"::mps::2")
	run("k8s/ml/p3/main", -1, 0, gpu+"::mps::3")

	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}}
	defer hc.CloseIdleConnections()
	want := map[string]string{"DCGM_FI_DEV_FB_USED p1": "300", "DCGM_FI_DEV_FB_USED p2": "700", "DCGM_FI_DEV_FB_USED p3": "0",
		"DCGM_FI_DEV_GPU_UTIL p1": "30", "DCGM_FI_DEV_GPU_UTIL p2": "12", "DCGM_FI_DEV_GPU_UTIL p3": "0"}
	var got map[string]string
	series := regexp.MustCompile(`^(DCGM_FI_DEV_FB_USED|DCGM_FI_DEV_GPU_UTIL)\{(.*)\} (\S+)$`)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		got = map[string]string{}
		if resp, err := hc.Get("http://agent/metrics"); err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			for _, line := range strings.Split(string(body), "\n") {
				m := series.FindStringSubmatch(line)
				if m == nil || !strings.Contains(m[2], `UUID="`+gpu+`"`) {
					continue
				}
				pod := regexp.MustCompile(`\bpod="([^"]*)"`).FindStringSubmatch(m[2])
				if pod == nil {
					got[m[1]+" "] = m[3]
				} else {
					got[m[1]+" "+pod[1]] = m[3]
				}
			}
		}
		if maps.Equal(got, want) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s's DCGM_FI_DEV_FB_USED (MiB) and DCGM_FI_DEV_GPU_UTIL (%%) by pod: %v, want %v", gpu, got, want)
		}
	}
	// The GPU's own figure, as the agent's Stats stream has it: what the workloads' add up to.
	stats, err := c.Stats(ctx, &pb.StatsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for {
		sample, err := stats.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, g := range sample.GetGroups() {
			for _, d := range g.GetDevices() {
				if d.GetDeviceId() != gpu {
					continue
				}
				if u := d.GetValues()["gpu_utilization"].GetIntValue(); u != 42 {
					t.Errorf("%s's gpu_utilization %d, want 42: what its workloads' add up to", gpu, u)
				}
				t.Logf("%s per workload: %v; the GPU's utilization 42", gpu, got)
				return
			}
		}
	}
}
