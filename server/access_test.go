package server_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
)

// accessHost is a server with several listeners, on a manager that records the calls
// that reach it.
type accessHost struct {
	srv   *server.Server
	logs  *logRecorder
	addrs map[string]endpoint.Address // by listener name
	dir   string

	mu      sync.Mutex
	reached []string // "Reserve owner", "Release ...": what reached the manager
}

func (h *accessHost) reach(s string) {
	h.mu.Lock()
	h.reached = append(h.reached, s)
	h.mu.Unlock()
}

func (h *accessHost) takeReached() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := h.reached
	h.reached = nil
	return out
}

// ownerOf is the fake ledger's owner of each reservation ID.
var ownerOf = map[string]string{"r-k8s": "k8s/ns/pod/c", "r-nomad": "nomad/default/job/a/t"}

func grants(t testing.TB, words ...string) server.Allow {
	t.Helper()
	a, err := server.ParseAllow(words)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// startAccessHost serves a recording fake on one unix socket per listener of ls (by
// name), with peer grants pg.
func startAccessHost(t *testing.T, ls map[string]server.Allow, pg []server.PeerGrant) *accessHost {
	t.Helper()
	dir, err := os.MkdirTemp("", "dhacc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	h := &accessHost{logs: &logRecorder{}, addrs: map[string]endpoint.Address{}, dir: dir}
	snap := device.Snapshot{Inventory: device.Inventory{}, State: device.State{}}
	mgr := &devicetest.Fake{
		WatchFunc: func(ctx context.Context) <-chan device.Snapshot {
			ch := make(chan device.Snapshot, 1)
			ch <- snap
			return ch
		},
		WatchStatsFunc: func(ctx context.Context, _ time.Duration) <-chan device.StatsSnapshot {
			ch := make(chan device.StatsSnapshot, 1)
			ch <- device.StatsSnapshot{}
			return ch
		},
		ReserveFunc: func(_ context.Context, req device.ReserveRequest) (device.Reservation, error) {
			h.reach("Reserve " + req.OwnerID)
			return device.Reservation{ID: "r-new", OwnerID: req.OwnerID}, nil
		},
		ReleaseFunc: func(_ context.Context, req device.ReleaseRequest) (device.ReleaseResult, error) {
			if req.ReservationID != "" {
				owner := ownerOf[req.ReservationID]
				if !device.OwnerUnder(owner, req.OwnerPrefixes) {
					// What the ledger answers (manager/ledger's test proves it does).
					return device.ReleaseResult{}, &device.PermissionError{Call: fmt.Sprintf("release reservation %q of owner %q", req.ReservationID, owner), Lacks: "reserve:" + owner}
				}
				h.reach("Release " + req.ReservationID)
				return device.ReleaseResult{Released: []string{req.ReservationID}}, nil
			}
			h.reach("Release " + req.OwnerID)
			return device.ReleaseResult{}, nil
		},
		CordonFunc: func(_ context.Context, req device.CordonRequest) (device.Cordon, error) {
			h.reach("Cordon " + req.DeviceID)
			return device.Cordon{Reason: req.Reason, By: req.By}, nil
		},
		UncordonFunc: func(_ context.Context, id string) (*device.Cordon, error) {
			h.reach("Uncordon " + id)
			return nil, nil
		},
		ReownFunc: func(_ context.Context, req device.ReownRequest) (device.Reservation, error) {
			h.reach("Reown " + req.NewOwnerID)
			return device.Reservation{ID: req.ReservationID, OwnerID: req.NewOwnerID}, nil
		},
	}
	var err2 error
	h.srv, err2 = server.New(server.Config{
		Manager:    mgr,
		Logger:     hclog.New(&hclog.LoggerOptions{Output: h.logs, Level: hclog.Debug, JSONFormat: true}),
		PeerGrants: pg,
	})
	if err2 != nil {
		t.Fatal(err2)
	}
	var wg sync.WaitGroup
	for name, allow := range ls {
		addr := endpoint.Address{Network: "unix", Path: filepath.Join(dir, name+".sock")}
		lis, err := endpoint.Listen(addr, endpoint.TLS{})
		if err != nil {
			t.Fatal(err)
		}
		h.addrs[name] = addr
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := h.srv.ServeListener(lis, server.Listener{Name: name, Allow: allow}); err != nil {
				t.Errorf("ServeListener %s: %v", name, err)
			}
		}()
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		h.srv.Shutdown(ctx)
		wg.Wait()
	})
	return h
}

func (h *accessHost) dial(t *testing.T, listener string) *grpc.ClientConn {
	t.Helper()
	conn, err := endpoint.Dial(h.addrs[listener], endpoint.TLS{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// rpc is one call of the table: what it asks, and what reaches the manager when it is
// allowed.
type rpc struct {
	name    string
	call    func(ctx context.Context, conn *grpc.ClientConn) error
	reaches string // "" for a read
}

func recvOne[T any](s interface{ Recv() (T, error) }, err error) error {
	if err != nil {
		return err
	}
	_, err = s.Recv()
	return err
}

var rpcs = []rpc{
	{"Fingerprint", func(ctx context.Context, c *grpc.ClientConn) error {
		return recvOne(pb.NewDeviceHostClient(c).Fingerprint(ctx, &pb.FingerprintRequest{}))
	}, ""},
	{"Stats", func(ctx context.Context, c *grpc.ClientConn) error {
		return recvOne(pb.NewDeviceHostClient(c).Stats(ctx, &pb.StatsRequest{}))
	}, ""},
	{"ListReservations", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).ListReservations(ctx, &pb.ListReservationsRequest{})
		return err
	}, ""},
	{"ListPlugins", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).ListPlugins(ctx, &pb.ListPluginsRequest{})
		return err
	}, ""},
	{"Health", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := healthpb.NewHealthClient(c).Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}, ""},
	{"Reflection", func(ctx context.Context, c *grpc.ClientConn) error {
		s, err := reflectionpb.NewServerReflectionClient(c).ServerReflectionInfo(ctx)
		if err != nil {
			return err
		}
		// A Send may find the stream already ended by the server's refusal: gRPC then
		// returns io.EOF, and the status is Recv's to tell.
		if err := s.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil && err != io.EOF {
			return err
		}
		_, err = s.Recv()
		return err
	}, ""},
	{"Reserve k8s", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).Reserve(ctx, reserveReq("k8s/ns/pod/c"))
		return err
	}, "Reserve k8s/ns/pod/c"},
	{"Reserve nomad", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).Reserve(ctx, reserveReq("nomad/default/job/a/t"))
		return err
	}, "Reserve nomad/default/job/a/t"},
	{"Reserve k8s taking over claims", func(ctx context.Context, c *grpc.ClientConn) error {
		req := reserveReq("k8s/ns/pod/c")
		req.TakeOverOwnerPrefixes = []string{"k8s-claim/"}
		_, err := pb.NewDeviceHostClient(c).Reserve(ctx, req)
		return err
	}, "Reserve k8s/ns/pod/c"},
	{"Release owner k8s", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_OwnerId{OwnerId: "k8s/ns/pod/c"}})
		return err
	}, "Release k8s/ns/pod/c"},
	{"Release owner nomad", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_OwnerId{OwnerId: "nomad/default/job/a/t"}})
		return err
	}, "Release nomad/default/job/a/t"},
	{"Release ID of k8s", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: "r-k8s"}})
		return err
	}, "Release r-k8s"},
	{"Release ID of nomad", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: "r-nomad"}})
		return err
	}, "Release r-nomad"},
	{"Reown k8s to k8s", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).ReownReservation(ctx, &pb.ReownReservationRequest{ReservationId: "r-k8s", OwnerId: "k8s/ns/pod/c", NewOwnerId: "k8s/ns/pod2/c"})
		return err
	}, "Reown k8s/ns/pod2/c"},
	{"Reown k8s to nomad", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).ReownReservation(ctx, &pb.ReownReservationRequest{ReservationId: "r-k8s", OwnerId: "k8s/ns/pod/c", NewOwnerId: "nomad/default/job/a/t"})
		return err
	}, "Reown nomad/default/job/a/t"},
	{"CordonDevice", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).CordonDevice(ctx, &pb.CordonDeviceRequest{DeviceId: "GPU-0", Reason: "ECC storm"})
		return err
	}, "Cordon GPU-0"},
	{"UncordonDevice", func(ctx context.Context, c *grpc.ClientConn) error {
		_, err := pb.NewDeviceHostClient(c).UncordonDevice(ctx, &pb.UncordonDeviceRequest{DeviceId: "GPU-0"})
		return err
	}, "Uncordon GPU-0"},
	{"Unknown method", func(ctx context.Context, c *grpc.ClientConn) error {
		return c.Invoke(ctx, "/devicehost.v1.DeviceHost/Cordon", &pb.ListPluginsRequest{}, &pb.ListPluginsResponse{})
	}, "unimplemented"},
}

func reserveReq(owner string) *pb.ReserveRequest {
	return &pb.ReserveRequest{OwnerId: owner, Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIds: []string{"GPU-0"}}
}

// Every RPC on every kind of listener: allowed where the listener's grants cover it,
// PERMISSION_DENIED naming the listener, the peer and the grant it lacked where not,
// and a refused call reaches nothing.
func TestGrantsOnEveryRPC(t *testing.T) {
	listeners := map[string]server.Allow{
		"read":    grants(t, "read"),
		"k8s":     grants(t, "read", "reserve:k8s/"),
		"reserve": grants(t, "reserve"),
		"admin":   grants(t, "admin"),
	}
	h := startAccessHost(t, listeners, nil)
	// What each listener may do, by rpc name; the rest is refused.
	allowed := map[string]map[string]bool{
		"read": {"Fingerprint": true, "Stats": true, "ListReservations": true, "ListPlugins": true, "Health": true, "Reflection": true},
		"k8s": {"Fingerprint": true, "Stats": true, "ListReservations": true, "ListPlugins": true, "Health": true, "Reflection": true,
			"Reserve k8s": true, "Release owner k8s": true, "Release ID of k8s": true, "Reown k8s to k8s": true},
		"reserve": {"Reserve k8s": true, "Reserve nomad": true, "Reserve k8s taking over claims": true, "Release owner k8s": true,
			"Release owner nomad": true, "Release ID of k8s": true, "Release ID of nomad": true, "Reown k8s to k8s": true, "Reown k8s to nomad": true},
	}
	for name := range listeners {
		conn := h.dial(t, name)
		for _, r := range rpcs {
			t.Run(name+"/"+r.name, func(t *testing.T) {
				h.takeReached()
				err := r.call(testContext(t), conn)
				want := name == "admin" || allowed[name][r.name]
				if r.reaches == "unimplemented" {
					// No grant makes an unknown method exist; only admin may learn so.
					if want && status.Code(err) != codes.Unimplemented || !want && status.Code(err) != codes.PermissionDenied {
						t.Fatalf("got %v, want %s", err, map[bool]string{true: "UNIMPLEMENTED", false: "PERMISSION_DENIED"}[want])
					}
					return
				}
				reached := h.takeReached()
				if want {
					if err != nil {
						t.Fatalf("refused: %v", err)
					}
					if r.reaches != "" && (len(reached) != 1 || reached[0] != r.reaches) {
						t.Errorf("reached the manager: %q, want %q", reached, r.reaches)
					}
					return
				}
				if status.Code(err) != codes.PermissionDenied || client.Reason(err) != client.ReasonPermissionDenied {
					t.Fatalf("got %v (reason %q), want PERMISSION_DENIED", err, client.Reason(err))
				}
				msg := status.Convert(err).Message()
				for _, part := range []string{fmt.Sprintf("listener %q", name), fmt.Sprintf("uid=%d,", os.Getuid()), "lacks grant", "it has: " + listeners[name].String()} {
					if !strings.Contains(msg, part) {
						t.Errorf("message %q does not say %q", msg, part)
					}
				}
				if len(reached) > 0 {
					t.Errorf("a refused call reached the manager: %q", reached)
				}
			})
		}
	}
	// Refusals are logged with the listener and the peer, as every call is.
	lines := h.logs.waitCallLines(t, "/devicehost.v1.DeviceHost/Reserve", 1)
	var denied bool
	for _, l := range lines {
		if l["code"] == "PermissionDenied" {
			denied = true
			if l["@level"] != "warn" || l["listener"] == nil || l["peer_uid"] == nil {
				t.Errorf("refusal logged as %v, want a warning naming the listener and peer", l)
			}
		}
	}
	if !denied {
		t.Error("no refused Reserve in the call log")
	}
}

// The grant a refusal names is the one that would allow the call.
func TestRefusalNamesTheGrant(t *testing.T) {
	h := startAccessHost(t, map[string]server.Allow{"k8s": grants(t, "read", "reserve:k8s/")}, nil)
	conn := h.dial(t, "k8s")
	ctx := testContext(t)
	_, err := pb.NewDeviceHostClient(conn).Reserve(ctx, reserveReq("nomad/default/job/a/t"))
	if got, want := status.Convert(err).Message(), fmt.Sprintf(`permission denied: listener "k8s" peer uid=%d,gid=%d,pid=%d may not reserve for owner "nomad/default/job/a/t": it lacks grant "reserve:nomad/default/job/a/t" (it has: read, reserve:k8s/)`, os.Getuid(), os.Getgid(), os.Getpid()); got != want {
		t.Errorf("message\n%s\nwant\n%s", got, want)
	}
	_, err = pb.NewDeviceHostClient(conn).Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: "r-nomad"}})
	if got := status.Convert(err).Message(); !strings.Contains(got, `listener "k8s"`) || !strings.Contains(got, `may not release reservation "r-nomad" of owner "nomad/default/job/a/t": it lacks grant "reserve:nomad/default/job/a/t"`) {
		t.Errorf("a release by ID the ledger refuses: %q, want it completed with the listener", got)
	}
}

// Peer grants add to a listener's: by uid and gid on a unix socket, and only for peers
// that match.
func TestPeerGrantsAddToTheListeners(t *testing.T) {
	uid, gid, other := uint32(os.Getuid()), uint32(os.Getgid()), uint32(os.Getuid()+1)
	for _, tt := range []struct {
		name  string
		grant server.PeerGrant
		want  codes.Code
	}{
		{"this uid", server.PeerGrant{UID: &uid, Allow: grants(t, "reserve:nomad/")}, codes.OK},
		{"this gid", server.PeerGrant{GID: &gid, Allow: grants(t, "admin")}, codes.OK},
		{"another uid", server.PeerGrant{UID: &other, Allow: grants(t, "admin")}, codes.PermissionDenied},
		{"another gid's", server.PeerGrant{GID: &other, Allow: grants(t, "admin")}, codes.PermissionDenied},
		{"a certificate identity", server.PeerGrant{Identity: fmt.Sprint(uid), Allow: grants(t, "admin")}, codes.PermissionDenied},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := startAccessHost(t, map[string]server.Allow{"read": grants(t, "read")}, []server.PeerGrant{tt.grant})
			_, err := pb.NewDeviceHostClient(h.dial(t, "read")).Reserve(testContext(t), reserveReq("nomad/default/job/a/t"))
			if status.Code(err) != tt.want {
				t.Fatalf("Reserve: %v, want %s", err, tt.want)
			}
		})
	}
}

// Serve's listener is the admin one: everything, as before listeners had grants.
func TestServeAllowsEverything(t *testing.T) {
	h := startHost(t, &devicetest.Fake{
		ReserveFunc: func(context.Context, device.ReserveRequest) (device.Reservation, error) {
			return device.Reservation{ID: "r"}, nil
		},
	})
	if _, err := h.client.Reserve(testContext(t), reserveReq("anyone")); err != nil {
		t.Fatal(err)
	}
}

func TestParseAllow(t *testing.T) {
	for _, tt := range []struct {
		words []string
		err   string
	}{
		{[]string{"read", "reserve:k8s/", "admin"}, ""},
		{[]string{"reserve"}, ""},
		{nil, "no grants"},
		{[]string{"reed"}, `unknown grant "reed"`},
		{[]string{"reserve:"}, `grant "reserve:": the owner prefix after "reserve:" is empty`},
		{[]string{"admin:x"}, `unknown grant "admin:x"`},
	} {
		a, err := server.ParseAllow(tt.words)
		switch {
		case tt.err == "" && err != nil:
			t.Errorf("%q: %v", tt.words, err)
		case tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)):
			t.Errorf("%q: %v, want an error with %q", tt.words, err, tt.err)
		case err == nil && a.String() != strings.Join(tt.words, ", "):
			t.Errorf("%q: String() = %q", tt.words, a.String())
		}
	}
}

// childReserveEnv, set to a socket path, makes the test binary a client that Reserves
// for a nomad owner there and prints the answer's code: the peer of another uid.
const childReserveEnv = "DEVICEHOST_TEST_RESERVE_AT"

// runChildReserve is the test binary as childReserveEnv's client.
func runChildReserve(path string) {
	conn, err := endpoint.Dial(endpoint.Address{Network: "unix", Path: path}, endpoint.TLS{})
	if err != nil {
		fmt.Println("dial:", err)
		os.Exit(2)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = pb.NewDeviceHostClient(conn).Reserve(ctx, reserveReq("nomad/default/job/a/t"))
	fmt.Println(status.Code(err))
}

// Every method the server serves has its grant written down: a new RPC is not admin-only
// by accident, nor open by one.
func TestEveryMethodHasItsGrant(t *testing.T) {
	h := startHost(t, &devicetest.Fake{})
	served := map[string]bool{}
	for svc, info := range h.srv.GetServiceInfo() {
		for _, m := range info.Methods {
			method := "/" + svc + "/" + m.Name
			served[method] = true
			if server.MethodGrants[method] == "" {
				t.Errorf("%s has no grant in methodGrants", method)
			}
		}
	}
	for method := range server.MethodGrants {
		if !served[method] {
			t.Errorf("methodGrants names %s, which the server does not serve", method)
		}
	}
}
