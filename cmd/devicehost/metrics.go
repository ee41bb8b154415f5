package main

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"

	"github.com/devicehost/devicehost/endpoint"
)

// metricsTLS is the transport policy of the metrics endpoint at a: the API's
// (endpoint.TLS.Check), except that plain HTTP needs no "insecure" of its own: a tcp
// address without TLS files is plaintext, which the policy allows on loopback only.
func metricsTLS(cfg agentConfig, a endpoint.Address) endpoint.TLS {
	t := cfg.MetricsTLS
	t.Insecure = a.Network == "tcp" && t.Cert == "" && t.Key == "" && t.CA == ""
	return t
}

// checkMetrics checks metrics_listen and its TLS settings without reading any file.
func checkMetrics(cfg agentConfig) error {
	t := cfg.MetricsTLS
	if cfg.MetricsListen == "" {
		if t.Cert != "" || t.Key != "" || t.CA != "" {
			return errors.New("metrics_tls_cert, metrics_tls_key and metrics_tls_ca need metrics_listen (or -metrics-listen)")
		}
		return nil
	}
	a, err := endpoint.Parse(cfg.MetricsListen)
	if err != nil {
		return fmt.Errorf("metrics_listen: %w", err)
	}
	if err := metricsTLS(cfg, a).Check(a); err != nil {
		if a.Network == "tcp" {
			return fmt.Errorf("metrics_listen: %w (plain HTTP is served on loopback addresses only; elsewhere set metrics_tls_cert, metrics_tls_key and metrics_tls_ca: scrapers then need a client certificate from that CA)", err)
		}
		return fmt.Errorf("metrics_listen: %w", err)
	}
	return nil
}

// listenMetrics opens metrics_listen under the policy of metricsTLS: a unix socket as
// the API's (mode 0660), plain tcp on loopback, or mutual TLS. It returns the listener
// for HTTP (TLS already wrapped around it) and the address, with the port chosen for
// port 0.
func listenMetrics(cfg agentConfig) (net.Listener, endpoint.Address, error) {
	a, err := endpoint.Parse(cfg.MetricsListen)
	if err != nil {
		return nil, endpoint.Address{}, fmt.Errorf("metrics_listen: %w", err)
	}
	l, err := endpoint.Listen(a, metricsTLS(cfg, a))
	if err != nil {
		return nil, endpoint.Address{}, fmt.Errorf("metrics_listen: %w", err)
	}
	if c := l.TLSConfig(); c != nil {
		return tls.NewListener(l, c), l.Address, nil
	}
	return l, l.Address, nil
}

// metricsURL is where a scraper finds the metrics at a, for the log.
func metricsURL(a endpoint.Address, tlsOn bool) string {
	if a.Network == "unix" {
		return a.String() + " (HTTP, GET /metrics)"
	}
	scheme := "http"
	if tlsOn {
		scheme = "https"
	}
	return scheme + "://" + a.Host + "/metrics"
}
