package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/metrics"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/logtest"
)

// fixturePluginDir returns the dir the fixture plugin was built into (once per test
// run; removed by cleanupE2E), which passes the agent's trust check.
func fixturePluginDir(t *testing.T) string {
	t.Helper()
	fixturePlugin(t)
	return fixtureBuild.dir
}

// metricsAgent is serveAgent running in-process on the real manager, with metrics on a
// unix socket.
type metricsAgent struct {
	client  pb.DeviceHostClient
	scraper *http.Client
	pidFile string
}

// startMetricsAgent runs serveAgent with the real manager and the fixture plugin
// configured by fc, metrics on, and waits until its health is SERVING.
func startMetricsAgent(t *testing.T, ctx context.Context, fc fixtureplugin.Config) *metricsAgent {
	t.Helper()
	dir := tempDir(t, "dhmx")
	pidFile := filepath.Join(dir, "plugin.pid")
	cfg := defaultAgentConfig()
	cfg.Listen = "unix://" + filepath.Join(dir, "api.sock")
	cfg.MetricsListen = "unix://" + filepath.Join(dir, "metrics.sock")
	cfg.PluginDir = fixturePluginDir(t)
	cfg.StateDir = filepath.Join(dir, "state")
	cfg.StatsInterval = 100 * time.Millisecond
	cfg.Plugins[fixtureplugin.Name] = pluginSettings{ConfigJSON: fc.JSON(), Env: []string{"FIXTURE_PID_FILE=" + pidFile}}

	logs := &logtest.Recorder{}
	log := hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Debug, JSONFormat: true})
	mx, err := metrics.New(metrics.Options{Logger: log.Named("metrics"), Hostname: "test-node"})
	if err != nil {
		t.Fatal(err)
	}
	actx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- serveAgent(actx, cfg, log, (&realManager{cfg: cfg, onCommit: mx.ObserveLedgerCommit}).factory, mx, nil, reloadHook{})
	}()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("serveAgent: %v", err)
		}
		if t.Failed() {
			t.Logf("agent log:\n%s", logs.String())
		}
	})

	conn, err := endpoint.Dial(endpoint.Address{Network: "unix", Path: filepath.Join(dir, "api.sock")}, endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	watch, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{Service: server.ServiceName}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	for {
		resp, err := watch.Recv()
		if err != nil {
			t.Fatalf("waiting for SERVING: %v", err)
		}
		if resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			break
		}
	}
	sock := filepath.Join(dir, "metrics.sock")
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}
	t.Cleanup(tr.CloseIdleConnections)
	return &metricsAgent{client: pb.NewDeviceHostClient(conn), scraper: &http.Client{Transport: tr, Timeout: 20 * time.Second}, pidFile: pidFile}
}

// scrapeFamilies GETs /metrics from c and parses it with Prometheus' text parser, held
// to the classic name charset.
func scrapeFamilies(t *testing.T, c *http.Client, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %d %v\n%s", resp.StatusCode, err, body)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	mfs, err := p.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		t.Fatalf("parse the scrape: %v\n%s", err, body)
	}
	return mfs
}

func (a *metricsAgent) scrape(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	return scrapeFamilies(t, a.scraper, "http://metrics/metrics")
}

// seriesWith returns the series of family name in mfs whose labels include want.
func seriesWith(mfs map[string]*dto.MetricFamily, name string, want map[string]string) []*dto.Metric {
	var out []*dto.Metric
	for _, m := range mfs[name].GetMetric() {
		labels := labelMap(m)
		ok := true
		for k, v := range want {
			if l, has := labels[k]; !has || l != v {
				ok = false
			}
		}
		if ok {
			out = append(out, m)
		}
	}
	return out
}

// valueOf returns the value of the one series of name with labels want (a histogram's
// count), failing the test unless there is exactly one.
func valueOf(t *testing.T, mfs map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	t.Helper()
	s := seriesWith(mfs, name, want)
	if len(s) != 1 {
		t.Fatalf("%s%v: %d series, want 1; the family: %v", name, want, len(s), mfs[name])
	}
	m := s[0]
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Histogram != nil:
		return float64(m.GetHistogram().GetSampleCount())
	}
	return m.GetUntyped().GetValue()
}

// waitDevice reads stream until device id has health h.
func waitDevice(t *testing.T, stream grpc.ServerStreamingClient[pb.FingerprintResponse], id string, h pb.Health) {
	t.Helper()
	for {
		fp, err := stream.Recv()
		if err != nil {
			t.Fatalf("waiting for %s to be %v: %v", id, h, err)
		}
		for _, g := range fp.GetGroups() {
			for _, d := range g.GetDevices() {
				if d.GetId() == id && d.GetHealth() == h {
					return
				}
			}
		}
	}
}

// A real agent's /metrics, scraped over HTTP: the fixture plugin's stats (hostile
// names sanitized or dropped, never breaking the scrape), as many scrapes as one likes
// at the cost of no plugin Stats stream, the holder after a Reserve, health after the
// plugin is SIGKILLed, the call and ledger histograms, the open streams and the gRPC
// metrics.
func TestAgentMetrics(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a := startMetricsAgent(t, ctx, fixtureplugin.Config{
		// A relaunched plugin takes this long to fingerprint: the devices stay
		// unhealthy at least that long after a kill, so a scrape can see it.
		FingerprintDelay: fixtureplugin.Duration(2 * time.Second),
		StatsValues: map[string]fixtureplugin.StatValue{
			"temp °C": {Value: 41, Unit: "C"},
			"a-b":     {Value: 1},
			"a_b":     {Value: 2},
			"healthy": {Value: 0},
			"load":    {Value: 50, Unit: "%"},
		},
	})
	w0 := map[string]string{"plugin": "fixture", "vendor": "fixture", "type": "widget", "name": "Widget 1000", "device": "w0"}

	// Once a Stats stream has a sample, so does a scrape: both read what the manager
	// holds.
	stats, err := a.client.Stats(ctx, &pb.StatsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	sampleW0 := func(ok func(v map[string]*pb.Value) bool) {
		t.Helper()
		for {
			resp, err := stats.Recv()
			if err != nil {
				t.Fatalf("Stats: %v", err)
			}
			for _, g := range resp.GetGroups() {
				for _, d := range g.GetDevices() {
					if d.GetDeviceId() == "w0" && ok(d.GetValues()) {
						return
					}
				}
			}
		}
	}
	sampleW0(func(map[string]*pb.Value) bool { return true })
	mfs := a.scrape(t)
	for name, want := range map[string]float64{
		"devicehost_device_temperature_celsius": 40,
		"devicehost_device_temp_c_celsius":      41,
		"devicehost_device_a_b":                 1, // "a-b" sorts before "a_b"
		"devicehost_device_load_ratio":          0.5,
		"devicehost_device_healthy":             1, // the device's health, not the stat named healthy
	} {
		if got := valueOf(t, mfs, name, w0); got != want {
			t.Errorf("%s{w0} = %v, want %v", name, got, want)
		}
	}
	for reason, want := range map[string]float64{"duplicate": 2, "reserved": 2} { // per device: a_b, healthy
		if got := valueOf(t, mfs, "devicehost_metrics_series_dropped", map[string]string{"plugin": "fixture", "reason": reason}); got != want {
			t.Errorf("dropped{%s} = %v, want %v", reason, got, want)
		}
	}

	// 50 scrapes cost the plugin nothing: it still serves the manager's one stream,
	// samples taken after the scrapes included.
	var lastSeq float64
	for range 50 {
		lastSeq = valueOf(t, a.scrape(t), "devicehost_device_seq", w0)
	}
	sampleW0(func(v map[string]*pb.Value) bool {
		if float64(v["seq"].GetIntValue()) < lastSeq+2 {
			return false
		}
		if got := v["stats_streams"].GetIntValue(); got != 1 {
			t.Errorf("the plugin has seen %d Stats streams after 50 scrapes, want 1", got)
		}
		return true
	})
	mfs = a.scrape(t)
	if got := valueOf(t, mfs, "devicehost_device_stats_streams", w0); got != 1 {
		t.Errorf("devicehost_device_stats_streams{w0} = %v, want 1", got)
	}
	if got := valueOf(t, mfs, "devicehost_api_open_streams", nil); got != 1 {
		t.Errorf("open streams with one Stats stream = %v, want 1", got)
	}
	if got := valueOf(t, mfs, "grpc_server_started_total", map[string]string{"grpc_method": "Stats"}); got != 1 {
		t.Errorf("started{Stats} = %v, want 1", got)
	}

	// Reserve: the holder shows, the call and its commit are counted.
	if _, err := a.client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "job-1", Vendor: "fixture", Type: "widget", Name: "Widget 1000", DeviceIds: []string{"w0"}}); err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	mfs = a.scrape(t)
	held := map[string]string{"device": "w0", "owner": "job-1"}
	if got := valueOf(t, mfs, "devicehost_device_reserved", held); got != 1 {
		t.Errorf("reserved{w0, job-1} = %v, want 1", got)
	}
	if got := valueOf(t, mfs, "devicehost_device_reserved", map[string]string{"device": "w1", "owner": ""}); got != 0 {
		t.Errorf("reserved{w1} = %v, want 0", got)
	}
	if got := valueOf(t, mfs, "devicehost_reserve_duration_seconds", map[string]string{"result": "ok"}); got != 1 {
		t.Errorf("reserve durations{ok} counted %v, want 1", got)
	}
	if got := valueOf(t, mfs, "devicehost_ledger_commit_duration_seconds", nil); got < 1 {
		t.Errorf("ledger commits counted %v, want at least 1 (the Reserve's)", got)
	}
	if got := valueOf(t, mfs, "grpc_server_handled_total", map[string]string{"grpc_method": "Reserve", "grpc_code": "OK"}); got != 1 {
		t.Errorf("handled{Reserve, OK} = %v, want 1", got)
	}

	// SIGKILL the plugin: its devices are down in the next scrape (the relaunched plugin
	// takes FingerprintDelay to report), still held; then back, the restart counted.
	fp, err := a.client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	waitDevice(t, fp, "w0", pb.Health_HEALTH_HEALTHY)
	raw, err := os.ReadFile(a.pidFile)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitDevice(t, fp, "w0", pb.Health_HEALTH_UNHEALTHY)
	mfs = a.scrape(t)
	if got := valueOf(t, mfs, "devicehost_device_healthy", w0); got != 0 {
		t.Errorf("healthy{w0} after the plugin was killed = %v, want 0", got)
	}
	if got := valueOf(t, mfs, "devicehost_device_reserved", held); got != 1 {
		t.Errorf("reserved{w0, job-1} after the plugin was killed = %v, want 1 (reservations outlive plugins)", got)
	}
	waitDevice(t, fp, "w0", pb.Health_HEALTH_HEALTHY)
	mfs = a.scrape(t)
	if got := valueOf(t, mfs, "devicehost_device_healthy", w0); got != 1 {
		t.Errorf("healthy{w0} after the restart = %v, want 1", got)
	}
	if got := valueOf(t, mfs, "devicehost_plugin_status", map[string]string{"plugin": "fixture", "status": "running"}); got != 1 {
		t.Errorf("plugin_status{running} after the restart = %v, want 1", got)
	}
	if got := valueOf(t, mfs, "devicehost_plugin_restarts_total", map[string]string{"plugin": "fixture"}); got != 1 {
		t.Errorf("restarts{fixture} = %v, want 1", got)
	}
	if got := valueOf(t, mfs, "devicehost_plugin_last_error_timestamp_seconds", map[string]string{"plugin": "fixture"}); got < float64(time.Now().Add(-time.Minute).Unix()) {
		t.Errorf("last error time{fixture} = %v, want the kill's", got)
	}
	if got := valueOf(t, mfs, "devicehost_api_open_streams", nil); got != 2 {
		t.Errorf("open streams with a Stats and a Fingerprint stream = %v, want 2", got)
	}
}

// loggedMetricsURL returns the /metrics URL an agent started with -log-json and
// -metrics-listen tcp://127.0.0.1:0 logs.
func loggedMetricsURL(t *testing.T, ctx context.Context, agent *agentProcess) string {
	t.Helper()
	line, err := agent.Stderr.Wait(ctx, func(l string) bool { return strings.Contains(l, `"serving metrics"`) })
	if err != nil {
		t.Fatalf("no log line saying where the metrics are: %v", err)
	}
	var logged struct {
		URL string `json:"url"`
	}
	if err := json.Unmarshal([]byte(line), &logged); err != nil || !strings.HasPrefix(logged.URL, "http://127.0.0.1:") {
		t.Fatalf("metrics line %s: url %q (%v), want http://127.0.0.1:<port>/metrics", line, logged.URL, err)
	}
	return logged.URL
}

// startDevMetricsAgent runs `agent -dev -metrics-listen tcp://127.0.0.1:0` with config as
// its config file, in a fresh directory named after prefix, and returns it, a client of
// its API and the /metrics URL it logged.
func startDevMetricsAgent(t *testing.T, ctx context.Context, prefix, config string) (*agentProcess, pb.DeviceHostClient, string) {
	t.Helper()
	dir := tempDir(t, prefix)
	conf := filepath.Join(dir, "devicehost.hcl")
	if err := os.WriteFile(conf, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := endpoint.Address{Network: "unix", Path: filepath.Join(dir, "devicehost.sock")}
	agent := startAgentProcess(t, addr, "agent", "-dev", "-log-json", "-listen", addr.String(),
		"-config", conf, "-metrics-listen", "tcp://127.0.0.1:0")
	return agent, agent.client(t, ctx), loggedMetricsURL(t, ctx, agent)
}

// `agent -dev -metrics-listen`: the 8 simulated H100s under dcgm-exporter's names and
// labels, with the values of the sample the Stats API serves (the sampling interval is
// an hour, so both read the same sample), and the plugin's restart after a SIGKILL.
func TestDevAgentServesDCGMMetrics(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	agent, client, url := startDevMetricsAgent(t, ctx, "dhdm", "stats_interval = \"1h\"\n")
	scraper := &http.Client{Timeout: 20 * time.Second}
	scrape := func() map[string]*dto.MetricFamily { return scrapeFamilies(t, scraper, url) }
	// The plugin's first sample reaches the manager soon after it fingerprints; the
	// next one is an hour away, so wait for the first rather than for a tick.
	waitGPUs := func(what string) map[string]*dto.MetricFamily {
		t.Helper()
		for {
			mfs := scrape()
			if len(seriesWith(mfs, "DCGM_FI_DEV_GPU_UTIL", nil)) == 8 {
				return mfs
			}
			select {
			case <-ctx.Done():
				t.Fatalf("%s: no DCGM_FI_DEV_GPU_UTIL for 8 GPUs; last scrape: %v", what, mfs["DCGM_FI_DEV_GPU_UTIL"])
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	mfs := waitGPUs("at start")

	fps, err := client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	fp := waitFingerprint(t, "8 healthy GPUs", fps, func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)) == 8
	})
	busID := map[string]string{}
	model := fp.GetGroups()[0].GetName()
	for _, d := range fp.GetGroups()[0].GetDevices() {
		busID[d.GetId()] = d.GetLocality().GetPciBusId()
	}
	stats, err := client.Stats(ctx, &pb.StatsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	sample, err := stats.Recv()
	if err != nil {
		t.Fatal(err)
	}
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	number := func(v *pb.Value) float64 {
		if f, ok := v.GetKind().(*pb.Value_FloatValue); ok {
			return f.FloatValue
		}
		return float64(v.GetIntValue())
	}
	checked := 0
	for _, g := range sample.GetGroups() {
		for _, d := range g.GetDevices() {
			v := d.GetValues()
			index := strconv.FormatInt(v["index"].GetIntValue(), 10)
			var bus uint64
			var dom, dev, fn uint64
			if _, err := fmt.Sscanf(busID[d.GetDeviceId()], "%x:%x:%x.%x", &dom, &bus, &dev, &fn); err != nil {
				t.Fatalf("PCI bus ID %q of %s: %v", busID[d.GetDeviceId()], d.GetDeviceId(), err)
			}
			labels := map[string]string{"gpu": index, "UUID": d.GetDeviceId(), "device": "nvidia" + index,
				"modelName": model, "pci_bus_id": fmt.Sprintf("%08X:%02X:%02X.%X", dom, bus, dev, fn), "Hostname": host}
			for stat, name := range map[string]string{
				"gpu_utilization": "DCGM_FI_DEV_GPU_UTIL", "memory_utilization": "DCGM_FI_DEV_MEM_COPY_UTIL",
				"memory_used": "DCGM_FI_DEV_FB_USED", "memory_free": "DCGM_FI_DEV_FB_FREE",
				"temperature": "DCGM_FI_DEV_GPU_TEMP", "power": "DCGM_FI_DEV_POWER_USAGE",
				"sm_clock": "DCGM_FI_DEV_SM_CLOCK", "memory_clock": "DCGM_FI_DEV_MEM_CLOCK",
				"last_xid": "DCGM_FI_DEV_XID_ERRORS",
			} {
				if got, want := valueOf(t, mfs, name, labels), number(v[stat]); got != want {
					t.Errorf("%s%v = %v, want %v (%s in the Stats sample)", name, labels, got, want, stat)
				}
				checked++
			}
		}
	}
	if checked != 8*9 {
		t.Errorf("checked %d values, want 72 (9 for each of 8 GPUs)", checked)
	}

	// SIGKILL the plugin: it is restarted, counted, and its GPUs report again.
	pluginPID := childPID(t, agent.Cmd.Process.Pid, "plugin", devPluginName)
	if err := syscall.Kill(pluginPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFingerprint(t, "8 unhealthy GPUs after the kill", fps, func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_UNHEALTHY)) == 8
	})
	waitFingerprint(t, "8 healthy GPUs after the restart", fps, func(fp *pb.FingerprintResponse) bool {
		return len(devicesWithHealth(fp, pb.Health_HEALTH_HEALTHY)) == 8
	})
	mfs = waitGPUs("after the restart")
	if got := valueOf(t, mfs, "devicehost_plugin_restarts_total", map[string]string{"plugin": devPluginName}); got != 1 {
		t.Errorf("restarts{%s} = %v, want 1", devPluginName, got)
	}
	if got := len(seriesWith(mfs, "devicehost_device_healthy", map[string]string{"plugin": devPluginName})); got != 8 {
		t.Errorf("devicehost_device_healthy has %d series of %s, want 8", got, devPluginName)
	}
	if got := valueOf(t, mfs, "devicehost_api_open_streams", nil); got != 2 {
		t.Errorf("open streams = %v, want 2 (a Fingerprint and a Stats stream)", got)
	}
	if got := valueOf(t, mfs, "grpc_server_started_total", map[string]string{"grpc_method": "Fingerprint"}); got != 1 {
		t.Errorf("started{Fingerprint} = %v, want 1", got)
	}
}
