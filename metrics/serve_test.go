package metrics_test

import (
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/devicehost/devicehost/metrics"
)

func TestLedgerCommitHistograms(t *testing.T) {
	s := serve(t, metrics.Options{}, nil)
	s.m.ObserveLedgerCommit(3*time.Millisecond, 1)
	s.m.ObserveLedgerCommit(5*time.Millisecond, 64)
	f := s.scrape(t)
	took := f["devicehost_ledger_commit_duration_seconds"].GetMetric()[0].GetHistogram()
	if took.GetSampleCount() != 2 || math.Abs(took.GetSampleSum()-0.008) > 1e-12 {
		t.Errorf("commit duration: %d samples summing %v, want 2 summing 0.008", took.GetSampleCount(), took.GetSampleSum())
	}
	writes := f["devicehost_ledger_commit_writes"].GetMetric()[0].GetHistogram()
	if writes.GetSampleCount() != 2 || writes.GetSampleSum() != 65 {
		t.Errorf("commit writes: %d samples summing %v, want 2 summing 65", writes.GetSampleCount(), writes.GetSampleSum())
	}
	for _, b := range writes.GetBucket() {
		if b.GetUpperBound() == 32 && b.GetCumulativeCount() != 1 {
			t.Errorf("commits of at most 32 writes = %d, want 1", b.GetCumulativeCount())
		}
	}
	// The process and Go runtime are there too.
	for _, name := range []string{"go_goroutines", "process_resident_memory_bytes"} {
		if f[name] == nil {
			t.Errorf("no %s", name)
		}
	}
}

// blocking is a collector whose Collect waits until release is closed, telling entered
// first: a scrape that takes as long as the test wants.
type blocking struct {
	entered chan struct{}
	release chan struct{}
}

func (b *blocking) Describe(chan<- *prometheus.Desc) {}
func (b *blocking) Collect(chan<- prometheus.Metric) {
	select {
	case b.entered <- struct{}{}:
	default:
	}
	<-b.release
}

// Scrapes beyond MaxScrapes are refused at once rather than queued, so scrapers cannot
// pile up work in the agent; other paths are not found.
func TestScrapesAreBounded(t *testing.T) {
	s := serve(t, metrics.Options{MaxScrapes: 1}, nil)
	b := &blocking{entered: make(chan struct{}, 1), release: make(chan struct{})}
	s.m.Registry().MustRegister(b)

	first := make(chan int, 1)
	go func() {
		resp, err := http.Get(s.url)
		if err != nil {
			first <- 0
			return
		}
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	<-b.entered // the first scrape is gathering
	code, body := get(t, s.url)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "Limit of concurrent requests reached (1)") {
		t.Errorf("a second scrape at once: %d %q, want 503 naming the limit", code, body)
	}
	close(b.release)
	if code := <-first; code != http.StatusOK {
		t.Errorf("the first scrape: %d, want 200", code)
	}
	if code, _ := get(t, strings.TrimSuffix(s.url, "/metrics")+"/debug/pprof/"); code != http.StatusNotFound {
		t.Errorf("GET /debug/pprof/: %d, want 404 (only /metrics is served)", code)
	}
}
