// Package metrics exports the agent's state as Prometheus metrics on its own registry
// and serves them over HTTP at /metrics: device stats from the sample the manager
// already holds (a scrape asks no plugin for anything), device health and holders,
// plugin status, API and ledger latencies, and the Go runtime's. Stat names come from
// plugins, so they are made safe and bounded per plugin: no plugin can break a scrape.
// It depends on the manager's contract (package device) only.
//
// See docs/metrics.md for every metric, the name mapping and the limits.
package metrics

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/net/netutil"

	"github.com/devicehost/devicehost/device"
)

// Defaults of Options.
const (
	// DefaultMaxSeriesPerPlugin bounds the stat series one plugin adds to a scrape: 256
	// devices with 16 stats each. Past it a plugin's further stats are left out (and
	// counted in devicehost_metrics_series_dropped{reason="limit"}).
	DefaultMaxSeriesPerPlugin = 4096
	// DefaultMaxScrapes is how many scrapes are gathered at once; one more is answered
	// 503 at once.
	DefaultMaxScrapes = 4
)

// HTTP limits of the metrics endpoint: a scraper, or anything else that connects,
// cannot hold the agent's resources for long.
const (
	// maxConns bounds the connections open at once; further ones wait to be accepted.
	maxConns          = 64
	readHeaderTimeout = 5 * time.Second
	readTimeout       = 10 * time.Second
	writeTimeout      = 30 * time.Second
	idleTimeout       = 2 * time.Minute
	maxHeaderBytes    = 16 << 10
	// gatherTimeout bounds one scrape's gathering; past it the scrape is answered 503.
	gatherTimeout = 10 * time.Second
)

// Options configures New. The zero value is usable; New does not modify it.
type Options struct {
	// Logger receives scrape errors and the HTTP server's own (at DEBUG: a port scan
	// must not flood the log). Nil discards them.
	Logger hclog.Logger
	// Hostname is the Hostname label of the dcgm-exporter series. Empty means
	// os.Hostname().
	Hostname string
	// MaxSeriesPerPlugin bounds the stat series of one plugin in a scrape. Zero means
	// DefaultMaxSeriesPerPlugin.
	MaxSeriesPerPlugin int
	// MaxScrapes bounds the scrapes gathered at once. Zero means DefaultMaxScrapes.
	MaxScrapes int
	// NoHolderLabels leaves the holder labels (pod, namespace, container; the DRA
	// claim's; the Nomad allocation's) off the dcgm-exporter series of held devices:
	// one series per device whoever holds it, at the price of not seeing which
	// workload a GPU's figures are for.
	NoHolderLabels bool
	// ProcessReservation says which reservation a process on a device belongs to (""
	// for none; visible false when the agent cannot see the process), for the
	// per-workload DCGM_FI_DEV_FB_USED of shared devices. Nil reads
	// device.ReservationEnv from /proc/<pid>/environ.
	ProcessReservation func(pid uint32) (reservation string, visible bool)
}

// Metrics is the agent's metrics registry and its HTTP endpoint.
//
// Make one with New before the manager (ObserveLedgerCommit goes into its config), then
// CollectManager, Instrument and ServerOptions for the API server, CollectServer once
// the server exists, and Serve. All methods are safe for concurrent use. Serve runs
// until Shutdown; Metrics starts no other goroutine.
type Metrics struct {
	log       hclog.Logger
	reg       *prometheus.Registry
	hostname  string
	maxSeries int
	// noHolderLabels is Options.NoHolderLabels.
	noHolderLabels bool
	// reservationOf is Options.ProcessReservation.
	reservationOf func(pid uint32) (string, bool)

	reserve      *prometheus.HistogramVec
	release      *prometheus.HistogramVec
	commitTook   prometheus.Histogram
	commitWrites prometheus.Histogram
	grpc         *grpcMetrics

	handler http.Handler
	srv     *http.Server

	mu           sync.Mutex
	haveManager  bool
	haveServer   bool
	serveStarted bool
}

// New makes the registry with the Go runtime's and the process's collectors, the
// latency histograms and the gRPC server metrics. Nothing is served until Serve.
func New(opts Options) (*Metrics, error) {
	if opts.MaxSeriesPerPlugin < 0 || opts.MaxScrapes < 0 {
		return nil, fmt.Errorf("metrics: negative limit in Options (MaxSeriesPerPlugin %d, MaxScrapes %d)", opts.MaxSeriesPerPlugin, opts.MaxScrapes)
	}
	log := opts.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	host := opts.Hostname
	if host == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("metrics: hostname for the Hostname label: %w", err)
		}
		host = h
	}
	m := &Metrics{
		log:       log,
		reg:       prometheus.NewRegistry(),
		hostname:  host,
		maxSeries: cmp.Or(opts.MaxSeriesPerPlugin, DefaultMaxSeriesPerPlugin),

		noHolderLabels: opts.NoHolderLabels,
		reservationOf:  opts.ProcessReservation,
		reserve: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "devicehost_reserve_duration_seconds",
			Help:    "Time the device manager took to answer Reserve (plugin call and durable commit included), by result.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16), // 0.5 ms to 16 s
		}, []string{"result"}),
		release: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "devicehost_release_duration_seconds",
			Help:    "Time the device manager took to answer Release (durable commit included), by result.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{"result"}),
		commitTook: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "devicehost_ledger_commit_duration_seconds",
			Help:    "Time one commit of the reservation ledger took to be durable: one bbolt transaction, its fdatasyncs included.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16), // 0.1 ms to 3.3 s
		}),
		commitWrites: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "devicehost_ledger_commit_writes",
			Help: "Writes that shared one commit of the reservation ledger (group commit).",
			// 1 to 1024: a batch carries up to store.MaxBatch (256) requests, some of which
			// write more than one record, and the deferred writes then due (769 seen).
			Buckets: prometheus.ExponentialBuckets(1, 2, 11),
		}),
		grpc: newGRPCMetrics(),
	}
	m.reserve.WithLabelValues(resultOK)
	m.release.WithLabelValues(resultOK)
	for _, c := range []prometheus.Collector{
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.reserve, m.release, m.commitTook, m.commitWrites, m.grpc.prom,
	} {
		if err := m.reg.Register(c); err != nil {
			return nil, fmt.Errorf("metrics: register: %w", err)
		}
	}

	h := promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		ErrorLog:            promLogger{log},
		ErrorHandling:       promhttp.ContinueOnError,
		Registry:            m.reg, // promhttp_metric_handler_errors_total
		MaxRequestsInFlight: cmp.Or(opts.MaxScrapes, DefaultMaxScrapes),
		Timeout:             gatherTimeout,
	})
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.InstrumentMetricHandler(m.reg, h))
	m.handler = mux
	m.srv = &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          log.StandardLogger(&hclog.StandardLoggerOptions{ForceLevel: hclog.Debug}),
	}
	return m, nil
}

// Registry returns the registry the metrics are on (not Prometheus' global one).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler returns the HTTP handler Serve serves: /metrics, and 404 for anything else.
func (m *Metrics) Handler() http.Handler { return m.handler }

// Serve serves Handler on lis until Shutdown, with bounded connections, header and
// body timeouts, and at most Options.MaxScrapes scrapes gathered at once; it closes lis
// when it returns, and returns nil after Shutdown. Call it once. For TLS, pass a
// tls.NewListener.
func (m *Metrics) Serve(lis net.Listener) error {
	m.mu.Lock()
	if m.serveStarted {
		m.mu.Unlock()
		lis.Close()
		return errors.New("metrics: Serve called twice")
	}
	m.serveStarted = true
	m.mu.Unlock()
	err := m.srv.Serve(netutil.LimitListener(lis, maxConns))
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Shutdown stops Serve: it stops accepting connections and waits for the scrapes in
// progress until ctx ends, then closes what is left. Safe to call more than once, and
// before Serve (Serve then returns at once).
func (m *Metrics) Shutdown(ctx context.Context) {
	if err := m.srv.Shutdown(ctx); err != nil {
		m.srv.Close()
	}
}

// ObserveLedgerCommit records one commit of the reservation ledger: how long it took
// and how many writes shared it. It has the signature of manager.Config.OnLedgerCommit
// and is as quick as that needs.
func (m *Metrics) ObserveLedgerCommit(took time.Duration, writes int) {
	m.commitTook.Observe(took.Seconds())
	m.commitWrites.Observe(float64(writes))
}

// CollectManager exports mgr's devices, plugins and stats at every scrape (see
// collector), from what device.Manager promises every manager has: its Snapshot and
// LatestStats. Call it once; a nil mgr is refused.
func (m *Metrics) CollectManager(mgr device.Manager) error {
	if mgr == nil {
		return errors.New("metrics: CollectManager: the manager is nil")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.haveManager {
		return errors.New("metrics: CollectManager called twice")
	}
	if err := m.reg.Register(newCollector(mgr, m.hostname, m.maxSeries, !m.noHolderLabels, m.reservationOf)); err != nil {
		return fmt.Errorf("metrics: register the device collector: %w", err)
	}
	m.haveManager = true
	return nil
}

// promLogger sends promhttp's errors (a collector that failed in a scrape) to the log.
type promLogger struct{ log hclog.Logger }

func (l promLogger) Println(v ...any) { l.log.Warn("metrics scrape: " + fmt.Sprint(v...)) }
