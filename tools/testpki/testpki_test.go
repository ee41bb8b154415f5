package testpki

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"testing"
)

// A server and a client of one CA complete a mutual TLS handshake; a client of another
// CA is refused.
func TestMutualTLS(t *testing.T) {
	ca := NewCA(t, "test CA")
	handshake := func(client Pair) error {
		s := ca.Server(t, "metrics.test", "127.0.0.1")
		sc, err := tls.X509KeyPair(s.Cert, s.Key)
		if err != nil {
			t.Fatal(err)
		}
		cc, err := tls.X509KeyPair(client.Cert, client.Key)
		if err != nil {
			t.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(ca.PEM)
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer lis.Close()
		done := make(chan error, 1)
		go func() {
			c, err := lis.Accept()
			if err != nil {
				done <- err
				return
			}
			defer c.Close()
			srv := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{sc}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert})
			done <- srv.Handshake()
		}()
		conn, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		cli := tls.Client(conn, &tls.Config{Certificates: []tls.Certificate{cc}, RootCAs: pool, ServerName: "metrics.test"})
		cerr := cli.Handshake()
		if serr := <-done; serr != nil {
			return serr
		}
		return cerr
	}
	if err := handshake(ca.Client(t, "scraper")); err != nil {
		t.Fatalf("a client of the CA: %v", err)
	}
	if err := handshake(NewCA(t, "other CA").Client(t, "stranger")); err == nil {
		t.Fatal("a client of another CA was let in")
	}
}
