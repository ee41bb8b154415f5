package metrics_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/goleak"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/metrics"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// fakeManager is devicetest.Fake whose Snapshot and LatestStats (what the collector
// reads) return what the test set, counting the LatestStats calls. Safe for concurrent
// use.
type fakeManager struct {
	devicetest.Fake

	mu         sync.Mutex
	snap       device.Snapshot
	stats      device.StatsSnapshot
	statsCalls atomic.Int64
}

func (f *fakeManager) set(snap device.Snapshot, stats device.StatsSnapshot) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.snap, f.stats = snap, stats
}

func (f *fakeManager) Snapshot() device.Snapshot {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.snap
}

func (f *fakeManager) LatestStats() device.StatsSnapshot {
	f.statsCalls.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stats
}

// served is a Metrics serving on a loopback port.
type served struct {
	m   *metrics.Metrics
	url string
}

// serve makes a Metrics with opts, collecting mgr when it is not nil, serves it on
// 127.0.0.1 and shuts it down in Cleanup.
func serve(t *testing.T, opts metrics.Options, mgr device.Manager) *served {
	t.Helper()
	if opts.Hostname == "" {
		opts.Hostname = "node-7"
	}
	m, err := metrics.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	if mgr != nil {
		if err := m.CollectManager(mgr); err != nil {
			t.Fatal(err)
		}
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- m.Serve(lis) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		m.Shutdown(ctx)
		if err := <-done; err != nil {
			t.Errorf("Serve: %v, want nil after Shutdown", err)
		}
	})
	return &served{m: m, url: "http://" + lis.Addr().String() + "/metrics"}
}

// scrapeHandler scrapes m's Handler in-process and parses the answer like scrape.
func scrapeHandler(t *testing.T, m *metrics.Metrics) families {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("GET /metrics: %d %s", rec.Code, rec.Body)
	}
	return parse(t, rec.Body.String())
}

// get fetches url and returns the status and body.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	c := &http.Client{Timeout: 20 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: reading the body: %v", url, err)
	}
	return resp.StatusCode, string(body)
}

// scrape GETs /metrics and parses it with Prometheus' own text parser, held to the
// classic (legacy) name charset, which every scraper accepts.
func (s *served) scrape(t *testing.T) families {
	t.Helper()
	code, body := get(t, s.url)
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", s.url, code, body)
	}
	return parse(t, body)
}

func parse(t *testing.T, body string) families {
	t.Helper()
	p := expfmt.NewTextParser(model.LegacyValidation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse the scrape: %v\n%s", err, body)
	}
	return mfs
}

// families is a parsed scrape.
type families map[string]*dto.MetricFamily

// series returns the series of family name whose labels include want.
func (f families) series(name string, want map[string]string) []*dto.Metric {
	var out []*dto.Metric
	for _, m := range f[name].GetMetric() {
		if hasLabels(m, want) {
			out = append(out, m)
		}
	}
	return out
}

// byPod returns the gauge values of family name by their pod label (empty for none),
// of the series whose UUID label is uuid, or of every series when uuid is empty.
func (f families) byPod(name, uuid string) map[string]float64 {
	out := map[string]float64{}
	for _, m := range f[name].GetMetric() {
		l := map[string]string{}
		for _, p := range m.GetLabel() {
			l[p.GetName()] = p.GetValue()
		}
		if uuid == "" || l["UUID"] == uuid {
			out[l["pod"]] = m.GetGauge().GetValue()
		}
	}
	return out
}

// value returns the one series of name with labels want (a gauge's, counter's or
// untyped value, or a histogram's count), failing the test unless there is exactly one.
func (f families) value(t *testing.T, name string, want map[string]string) float64 {
	t.Helper()
	s := f.series(name, want)
	if len(s) != 1 {
		t.Fatalf("%s%v: %d series, want 1; the family: %v", name, want, len(s), f[name])
	}
	return metricValue(s[0])
}

func metricValue(m *dto.Metric) float64 {
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Histogram != nil:
		return float64(m.GetHistogram().GetSampleCount())
	default:
		return m.GetUntyped().GetValue()
	}
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	got := labels(m)
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}

func labels(m *dto.Metric) map[string]string {
	out := make(map[string]string)
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// labelNames returns the sorted label names of m.
func labelNames(m *dto.Metric) []string {
	var out []string
	for _, l := range m.GetLabel() {
		out = append(out, l.GetName())
	}
	sort.Strings(out)
	return out
}

// names returns the sorted family names that start with prefix.
func (f families) names(prefix string) []string {
	var out []string
	for n := range f {
		if strings.HasPrefix(n, prefix) {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

func intValue(n int64, unit string) device.Value {
	return device.Value{Kind: device.KindInt, Int: n, Unit: unit}
}

func floatValue(x float64, unit string) device.Value {
	return device.Value{Kind: device.KindFloat, Float: x, Unit: unit}
}
