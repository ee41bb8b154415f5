package endpoint_test

import (
	"crypto/tls"
	"crypto/x509"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/devicehost/devicehost/endpoint"
)

// A server that is not gRPC (the metrics endpoint's HTTP) gets the same policy through
// TLSConfig: mutual TLS on tcp with files, plaintext (nil) on unix and insecure tcp.
func TestTLSConfigServesHTTPWithMutualTLS(t *testing.T) {
	for _, tt := range []struct {
		addr string
		tls  endpoint.TLS
	}{
		{"unix://" + filepath.Join(socketDir(t), "m.sock"), endpoint.TLS{}},
		{"tcp://127.0.0.1:0", endpoint.TLS{Insecure: true}},
	} {
		a, err := endpoint.Parse(tt.addr)
		if err != nil {
			t.Fatal(err)
		}
		if got := listen(t, a, tt.tls).TLSConfig(); got != nil {
			t.Errorf("%s: TLSConfig = %v, want nil (plaintext)", tt.addr, got)
		}
	}

	files := writeTestPKI(t)
	a, err := endpoint.Parse("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := listen(t, a, endpoint.TLS{Cert: files.serverCert, Key: files.serverKey, CA: files.ca})
	cfg := l.TLSConfig()
	if cfg == nil || cfg.ClientAuth != tls.RequireAndVerifyClientCert || cfg.MinVersion != tls.VersionTLS13 {
		t.Fatalf("TLSConfig = %+v, want mutual TLS 1.3", cfg)
	}
	cfg.MinVersion = tls.VersionTLS10 // a copy: the listener's own must not change
	if l.TLSConfig().MinVersion != tls.VersionTLS13 {
		t.Error("changing the returned config changed the listener's")
	}

	srv := &http.Server{
		Handler:           http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }),
		ReadHeaderTimeout: 5 * time.Second,
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(tls.NewListener(l, l.TLSConfig())) }()
	t.Cleanup(func() {
		srv.Close()
		<-served
	})

	get := func(clientCert, clientKey string) error {
		caPEM, err := os.ReadFile(files.ca)
		if err != nil {
			t.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(caPEM)
		tc := &tls.Config{RootCAs: pool}
		if clientCert != "" {
			c, err := tls.LoadX509KeyPair(clientCert, clientKey)
			if err != nil {
				t.Fatal(err)
			}
			tc.Certificates = []tls.Certificate{c}
		}
		tr := &http.Transport{TLSClientConfig: tc}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Get("https://" + l.Address.Host + "/")
		if err != nil {
			return err
		}
		resp.Body.Close()
		return nil
	}
	if err := get(files.clientCert, files.clientKey); err != nil {
		t.Errorf("GET with a client certificate from the CA: %v", err)
	}
	if err := get("", ""); err == nil {
		t.Error("GET without a client certificate succeeded, want it refused")
	}
	if err := get(files.strangerCert, files.strangerKey); err == nil {
		t.Error("GET with a certificate from another CA succeeded, want it refused")
	}
}
