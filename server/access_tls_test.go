package server_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
)

// testCA signs the certificates of a test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pool *x509.CertPool
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &testCA{cert: cert, key: key, pool: pool}
}

// issue makes a certificate for tmpl's names, signed by the CA.
func (ca *testCA) issue(t *testing.T, tmpl *x509.Certificate, usage x509.ExtKeyUsage) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl.SerialNumber = big.NewInt(time.Now().UnixNano())
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(time.Hour)
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{usage}
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// Identity grants match a verified client certificate's SANs or common name, on a
// mutual-TLS listener served beside others by the same server.
func TestIdentityGrants(t *testing.T) {
	ca := newTestCA(t)
	spiffe, _ := url.Parse("spiffe://node/dra-driver")
	serverCert := ca.issue(t, &x509.Certificate{IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}}, x509.ExtKeyUsageServerAuth)
	clients := map[string]tls.Certificate{
		"uri":   ca.issue(t, &x509.Certificate{URIs: []*url.URL{spiffe}}, x509.ExtKeyUsageClientAuth),
		"cn":    ca.issue(t, &x509.Certificate{Subject: pkix.Name{CommonName: "monitoring"}}, x509.ExtKeyUsageClientAuth),
		"other": ca.issue(t, &x509.Certificate{Subject: pkix.Name{CommonName: "someone"}, DNSNames: []string{"someone.example"}}, x509.ExtKeyUsageClientAuth),
	}
	srv, err := server.New(server.Config{
		Manager: &devicetest.Fake{ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
			return device.Reservation{ID: "r"}, nil
		}},
		PeerGrants: []server.PeerGrant{
			{Identity: spiffe.String(), Allow: grants(t, "reserve:k8s-claim/")},
			{Identity: "monitoring", Allow: grants(t, "read")},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	serverTLS := &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientCAs: ca.pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		srv.ServeListener(lis, server.Listener{Name: "tcp", Allow: server.Allow{}, TLS: serverTLS})
	}()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		wg.Wait()
	})
	dial := func(cert tls.Certificate) pb.DeviceHostClient {
		creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: ca.pool, MinVersion: tls.VersionTLS13})
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(creds))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return pb.NewDeviceHostClient(conn)
	}
	ctx := testContext(t)
	reserve := func(c pb.DeviceHostClient) error {
		_, err := c.Reserve(ctx, reserveReq("k8s-claim/ns/claim/uid"))
		return err
	}
	list := func(c pb.DeviceHostClient) error {
		_, err := c.ListPlugins(ctx, &pb.ListPluginsRequest{})
		return err
	}
	for _, tt := range []struct {
		client           string
		reserve, readErr codes.Code
	}{
		{"uri", codes.OK, codes.PermissionDenied},
		{"cn", codes.PermissionDenied, codes.OK},
		{"other", codes.PermissionDenied, codes.PermissionDenied},
	} {
		c := dial(clients[tt.client])
		if err := reserve(c); status.Code(err) != tt.reserve {
			t.Errorf("%s: Reserve: %v, want %s", tt.client, err, tt.reserve)
		}
		err := list(c)
		if status.Code(err) != tt.readErr {
			t.Errorf("%s: ListPlugins: %v, want %s", tt.client, err, tt.readErr)
		}
		if tt.client == "other" {
			if msg := status.Convert(err).Message(); !strings.Contains(msg, `(certificate "someone.example")`) || !strings.Contains(msg, `listener "tcp"`) {
				t.Errorf("refusal %q does not name the listener and the certificate", msg)
			}
		}
	}
}
