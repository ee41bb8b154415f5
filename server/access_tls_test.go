package server_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
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
	"github.com/devicehost/devicehost/tools/testpki"
)

// Identity grants match a verified client certificate's SANs or common name, on a
// mutual-TLS listener served beside others by the same server.
func TestIdentityGrants(t *testing.T) {
	ca := testpki.NewCA(t, "devicehost test CA")
	spiffe, _ := url.Parse("spiffe://node/dra-driver")
	serverCert := ca.Server(t, "127.0.0.1").TLS(t)
	clients := map[string]tls.Certificate{
		"uri":   ca.ClientWith(t, x509.Certificate{URIs: []*url.URL{spiffe}}).TLS(t),
		"cn":    ca.Client(t, "monitoring").TLS(t),
		"other": ca.ClientWith(t, x509.Certificate{Subject: pkix.Name{CommonName: "someone"}, DNSNames: []string{"someone.example"}}).TLS(t),
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
	serverTLS := &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientCAs: ca.Pool(), ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13}
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
		creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: ca.Pool(), MinVersion: tls.VersionTLS13})
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
