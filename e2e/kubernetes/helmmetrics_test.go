package kubernetes

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/testpki"
	"github.com/devicehost/devicehost/tools/testwait"
)

// The chart's metrics for a scraper in the cluster: installed with metrics.enabled and a
// TLS Secret, the node's agent serves /metrics on its pod's port with mutual TLS, named
// by the headless Service's endpoint: a scraper holding a client certificate of the CA
// gets the GPU series there, one without is refused.
func (h *helmStack) caseMetrics(t *testing.T) {
	ca := testpki.NewCA(t, "devicehost e2e metrics CA")
	server, client := ca.Server(t, "devicehost-metrics"), ca.Client(t, "e2e-scraper")
	dir := t.TempDir()
	files := map[string][]byte{"tls.crt": server.Cert, "tls.key": server.Key, "ca.crt": ca.PEM}
	args := []string{"-n", helmNamespace, "create", "secret", "generic", "devicehost-metrics-tls"}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
		args = append(args, "--from-file="+name+"="+filepath.Join(dir, name))
	}
	if _, err := h.n.kubectl(nil, args...); err != nil {
		t.Fatal(err)
	}
	defer h.n.kubectl(nil, "-n", helmNamespace, "delete", "secret", "devicehost-metrics-tls", "--ignore-not-found")
	if _, err := h.run(append(h.installArgs("install", "devicePlugin", h.images[0].tag),
		"--set", "metrics.enabled=true", "--set", "metrics.tls.secretName=devicehost-metrics-tls")...); err != nil {
		t.Fatal(err)
	}
	h.waitReady(t, h.image(0), 3*time.Minute)
	h.s.waitAgentHealthy(t, 60*time.Second)

	// The Service's endpoint: the pod's address and the metrics port.
	var addr string
	testwait.Until(t, 60*time.Second, "an endpoint of the devicehost-metrics Service", func() (bool, string) {
		var slices struct {
			Items []struct {
				Endpoints []struct {
					Addresses []string `json:"addresses"`
				} `json:"endpoints"`
				Ports []struct {
					Name string `json:"name"`
					Port int    `json:"port"`
				} `json:"ports"`
			} `json:"items"`
		}
		if err := h.n.kubectlJSON(&slices, "-n", helmNamespace, "get", "endpointslices", "-l", "kubernetes.io/service-name=devicehost-metrics"); err != nil {
			return false, err.Error()
		}
		for _, s := range slices.Items {
			for _, e := range s.Endpoints {
				for _, p := range s.Ports {
					if p.Name == "metrics" && len(e.Addresses) > 0 {
						addr = net.JoinHostPort(e.Addresses[0], strconv.Itoa(p.Port))
						return true, ""
					}
				}
			}
		}
		return false, fmt.Sprintf("%d slices, none with an address", len(slices.Items))
	})
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.PEM)
	cert, err := tls.X509KeyPair(client.Cert, client.Key)
	if err != nil {
		t.Fatal(err)
	}
	get := func(certs []tls.Certificate) (string, error) {
		c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{
			RootCAs: pool, ServerName: "devicehost-metrics", Certificates: certs}}}
		defer c.CloseIdleConnections()
		resp, err := c.Get("https://" + addr + "/metrics")
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
		if resp.StatusCode != http.StatusOK {
			return "", fmt.Errorf("%s: %s", resp.Status, body)
		}
		return string(body), err
	}
	var body string
	testwait.Until(t, 30*time.Second, "the GPU series through the Service's endpoint "+addr, func() (bool, string) {
		var err error
		body, err = get([]tls.Certificate{cert})
		if err != nil {
			return false, err.Error()
		}
		return strings.Count(body, "\nDCGM_FI_DEV_GPU_UTIL{") == 8, fmt.Sprintf("%d DCGM_FI_DEV_GPU_UTIL series", strings.Count(body, "\nDCGM_FI_DEV_GPU_UTIL{"))
	})
	t.Logf("https://%s/metrics with the scraper's client certificate: %d bytes, 8 DCGM_FI_DEV_GPU_UTIL series", addr, len(body))
	if _, err := get(nil); err == nil {
		t.Error("a scraper without a client certificate got the metrics")
	} else {
		t.Logf("without a client certificate: %v", err)
	}
	h.uninstall(t)
}
