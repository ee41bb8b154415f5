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

// Per-workload GPU memory through a real agent: two workloads hold MPS shares of one
// simulated GPU, and each runs a process started with its reservation's environment
// (as its container would be), using 300 and 700 MiB of the simulated GPU. The agent's
// metrics show the GPU's DCGM_FI_DEV_FB_USED once per workload with its own processes'
// memory, found by the reservation each process's environment names.
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
	run := func(owner string, mib int, ids ...string) {
		t.Helper()
		r, err := c.Reserve(ctx, reserveRequest(shares, owner, ids...))
		if err != nil {
			t.Fatalf("Reserve for %s: %v", owner, err)
		}
		cmd := exec.Command("sleep", "120")
		cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "DEVICEHOST_SIM_FB_USED_MIB=" + strconv.Itoa(mib)}
		for k, v := range r.GetReservation().GetEnvs() {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	run("k8s/ml/p1/main", 300, gpu+"::mps::0", gpu+"::mps::1")
	run("k8s/ml/p2/main", 700, gpu+"::mps::2")

	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}}
	defer hc.CloseIdleConnections()
	want := map[string]string{"p1": "300", "p2": "700"}
	var got map[string]string
	series := regexp.MustCompile(`^DCGM_FI_DEV_FB_USED\{(.*)\} (\S+)$`)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		got = map[string]string{}
		if resp, err := hc.Get("http://agent/metrics"); err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			for _, line := range strings.Split(string(body), "\n") {
				m := series.FindStringSubmatch(line)
				if m == nil || !strings.Contains(m[1], `UUID="`+gpu+`"`) {
					continue
				}
				pod := regexp.MustCompile(`\bpod="([^"]*)"`).FindStringSubmatch(m[1])
				if pod == nil {
					got[""] = m[2]
				} else {
					got[pod[1]] = m[2]
				}
			}
		}
		if maps.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s's DCGM_FI_DEV_FB_USED by pod: %v, want %v (MiB)", gpu, got, want)
		}
	}
}
