package kubernetes

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/testwait"
)

// metricsSocket is where the agent serves /metrics in the MPS cases, inside its
// container (beside its API socket, so the same host directory).
const metricsSocket = "/run/devicehost/metrics.sock"

// withMetrics returns c with a copy of its config that also serves the agent's metrics
// on metricsSocket.
func withMetrics(t *testing.T, c hostContainer) hostContainer {
	t.Helper()
	sock, mapped := c.hostPath(metricsSocket) // the agent's config holds host paths
	if !mapped {
		t.Fatalf("agent container: %s is in none of its mounts", metricsSocket)
	}
	const anchor = "log_json   = true"
	return configVariant(t, c, "metrics", anchor, anchor+"\nmetrics_listen = \"unix://"+sock+"\"")
}

// dcgmSeries waits until the agent's metrics show a series of metric for GPU uuid with
// every label of want and a value ok accepts (nil: any), and returns that series' line.
// The stats of a device come every few seconds, and its holder labels with the first
// stats after the Reserve.
func (d *draStack) dcgmSeries(t *testing.T, metric, uuid string, want map[string]string, ok func(float64) bool, limit time.Duration) string {
	t.Helper()
	sock, mapped := d.agent.c.hostPath(metricsSocket)
	if !mapped {
		t.Fatalf("agent container: %s is in none of its mounts", metricsSocket)
	}
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}}
	defer hc.CloseIdleConnections()
	var found string
	testwait.Until(t, limit, fmt.Sprintf("a %s series of %s with %v", metric, uuid, want), func() (bool, string) {
		resp, err := hc.Get("http://agent/metrics")
		if err != nil {
			return false, err.Error()
		}
		body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			return false, fmt.Sprintf("status %d, %v", resp.StatusCode, err)
		}
		var seen []string
		for _, line := range strings.Split(string(body), "\n") {
			if !strings.HasPrefix(line, metric+"{") || !strings.Contains(line, `UUID="`+uuid+`"`) {
				continue
			}
			seen = append(seen, line)
			labels := seriesLabels(line)
			all := true
			for k, v := range want {
				all = all && labels[k] == v
			}
			if v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64); all && err == nil && (ok == nil || ok(v)) {
				found = line
				return true, ""
			}
		}
		return false, fmt.Sprintf("series of %s: %q", uuid, seen)
	})
	return found
}

var labelPair = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

// seriesLabels reads the labels of one line of Prometheus' text format.
func seriesLabels(line string) map[string]string {
	out := map[string]string{}
	if i, j := strings.IndexByte(line, '{'), strings.LastIndexByte(line, '}'); i >= 0 && j > i {
		for _, m := range labelPair.FindAllStringSubmatch(line[i+1:j], -1) {
			out[m[1]] = m[2]
		}
	}
	return out
}

// simFBUsedMiB is what each process of the MPS cases' pods uses of its simulated GPU
// (the nvidia-example plugin's DEVICEHOST_SIM_FB_USED_MIB): the agent's metrics show a
// pod's DCGM_FI_DEV_FB_USED as a multiple of it (its shell and its sleep), the GPU's
// other holders' processes apart.
const simFBUsedMiB = 1234

// usesSimMemory says whether a DCGM_FI_DEV_FB_USED value is the memory of one or more
// processes of a pod of the MPS cases.
func usesSimMemory(v float64) bool { return v > 0 && int64(v)%simFBUsedMiB == 0 }
