// Package client is the Go client of the devicehost host API (devicehost.v1.DeviceHost),
// what other services, the devicehost CLI and the runtime bridges use instead of the
// generated stubs: Dial under the host's transport policy, calls in the API's own
// protobuf types, WatchDevices and WatchStats that reconnect by themselves, and errors
// to branch on (IsHeld, IsUnavailable...) read from the status details, never the text;
// HeldError and CapacityError turn a refusal's details into the contract's errors
// (package device), the one wording of a refusal.
// Calls return the agent's gRPC status error, so status.FromError works on them too.
//
// See docs/api.md#go-client.
package client

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/backoff"
	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/endpoint"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/textline"
)

// ServiceName is the host API's gRPC service name, under which the agent reports its
// health.
const ServiceName = "devicehost.v1.DeviceHost"

// Defaults of the reconnect backoff of watches (and of the connection underneath).
const (
	DefaultBackoffBase = 100 * time.Millisecond
	DefaultBackoffMax  = 5 * time.Second
)

// MaxRecvMsgSize bounds an answer the client accepts (gRPC's default is 4 MiB). A
// ListReservations of a ledger allowed to keep many thousand reservations
// (gc_max_reservations) passes 4 MiB: about 2 KiB each with their container data.
const MaxRecvMsgSize = 64 << 20

// Option configures Dial.
type Option func(*options)

type options struct {
	tls         endpoint.TLS
	lazy        bool
	backoffBase time.Duration
	backoffMax  time.Duration
	dialOpts    []grpc.DialOption
}

// WithTLS sets the PEM files for a tcp address: the client's certificate and key, and
// the CA the agent's certificate must chain to; or Insecure for plaintext on a loopback
// address. A unix address takes none.
func WithTLS(t endpoint.TLS) Option { return func(o *options) { o.tls = t } }

// WithInsecure allows plaintext tcp to a loopback address (the agent must run with
// -insecure too).
func WithInsecure() Option { return func(o *options) { o.tls = endpoint.TLS{Insecure: true} } }

// WithoutReachCheck makes Dial return without contacting the agent. Calls then fail
// with UNAVAILABLE while the agent is not there, and watches deliver a disconnected
// update and keep trying: for a service that starts before, or beside, the agent.
func WithoutReachCheck() Option { return func(o *options) { o.lazy = true } }

// WithBackoff sets the reconnect backoff of watches and of the connection: the first
// retry after base, each next one twice as late, at most max, each spread by ±20%
// jitter (and still at most max). Zero values keep DefaultBackoffBase and
// DefaultBackoffMax.
func WithBackoff(base, max time.Duration) Option {
	return func(o *options) {
		if base > 0 {
			o.backoffBase = base
		}
		if max > 0 {
			o.backoffMax = max
		}
	}
}

// WithDialOptions adds gRPC dial options, after the client's own (transport
// credentials, keepalive, connect backoff), which they may override.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOpts = append(o.dialOpts, opts...) }
}

// Client is a connection to one devicehost agent. Its methods are safe for concurrent
// use. Close ends its watches and releases the connection.
type Client struct {
	addr   endpoint.Address
	opts   options
	conn   *grpc.ClientConn
	api    pb.DeviceHostClient
	health healthpb.HealthClient

	closeOnce sync.Once
	closed    chan struct{} // closed by Close: watches end

	mu       sync.Mutex
	isClosed bool           // set by Close before it waits on watches
	watches  sync.WaitGroup // watch goroutines; Added under mu while !isClosed
}

// Dial connects to the agent at address ("unix:///path.sock" or "tcp://host:port")
// under the transport policy, and checks that it answers a health check under ctx
// (unless WithoutReachCheck), so that a wrong address or an agent that is not running
// is one clear error at once. A malformed address or TLS settings the policy refuses are
// an *endpoint.ConfigError; an agent that cannot be reached is an UNAVAILABLE status
// (IsUnavailable) naming the address.
func Dial(ctx context.Context, address string, opts ...Option) (*Client, error) {
	o := options{backoffBase: DefaultBackoffBase, backoffMax: DefaultBackoffMax}
	for _, opt := range opts {
		opt(&o)
	}
	if o.backoffMax < o.backoffBase {
		o.backoffMax = o.backoffBase
	}
	addr, err := endpoint.Parse(address)
	if err != nil {
		return nil, err
	}
	dialOpts := append([]grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxRecvMsgSize)), grpc.WithConnectParams(grpc.ConnectParams{
		Backoff: grpcbackoff.Config{
			BaseDelay:  o.backoffBase,
			Multiplier: 2,
			Jitter:     backoff.Fraction,
			MaxDelay:   o.backoffMax,
		},
		MinConnectTimeout: 5 * time.Second,
	})}, o.dialOpts...)
	conn, err := endpoint.Dial(addr, o.tls, dialOpts...)
	if err != nil {
		return nil, err
	}
	c := &Client{
		addr:   addr,
		opts:   o,
		conn:   conn,
		api:    pb.NewDeviceHostClient(conn),
		health: healthpb.NewHealthClient(conn),
		closed: make(chan struct{}),
	}
	if !o.lazy {
		if err := c.reach(ctx); err != nil {
			conn.Close()
			return nil, err
		}
	}
	return c, nil
}

// reach checks that something answers at the address. Not WaitForReady: a refused or
// missing socket fails at once.
func (c *Client) reach(ctx context.Context) error {
	_, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{})
	switch status.Code(err) {
	case codes.OK, codes.Unimplemented, codes.NotFound:
		// Reached: something answered (a server without health, or one that does not
		// know the overall service, still answers).
		return nil
	}
	return &reachError{addr: c.addr.String(), st: status.Convert(err)}
}

// reachError is Dial's error for an agent that did not answer: its text names the
// address, its status is the call's (UNAVAILABLE, or DEADLINE_EXCEEDED when ctx ended).
type reachError struct {
	addr string
	st   *status.Status
}

func (e *reachError) Error() string {
	return fmt.Sprintf("cannot reach agent at %s: %s", e.addr, textline.Line(e.st.Message(), 0))
}

// GRPCStatus makes status.Code and IsUnavailable see the failed call's status.
func (e *reachError) GRPCStatus() *status.Status { return e.st }

// Address returns the agent's address, as Dial read it.
func (c *Client) Address() string { return c.addr.String() }

// Conn returns the underlying gRPC connection, for services the Client does not wrap
// (reflection, say). It stays owned by the Client: do not close it.
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Close closes the connection (calls in flight fail with CANCELED) and ends every watch:
// their channels close, and their goroutines are gone when Close returns. Safe to call
// more than once.
func (c *Client) Close() error {
	var err error
	c.closeOnce.Do(func() {
		c.mu.Lock()
		c.isClosed = true
		c.mu.Unlock()
		close(c.closed)
		err = c.conn.Close()
		c.watches.Wait()
	})
	return err
}

// WaitServing waits until the agent reports its API SERVING on the standard health
// service, through agent restarts and while it is not yet listening, until ctx ends.
func (c *Client) WaitServing(ctx context.Context) error {
	b := c.newBackoff()
	for {
		err := c.watchServing(ctx)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("wait for %s to serve: %w", c.addr, err)
		}
		if !sleep(ctx, c.closed, b.Next()) {
			return fmt.Errorf("wait for %s to serve: %w", c.addr, err)
		}
	}
}

// watchServing returns nil once a health Watch says SERVING, or the error that ended it.
func (c *Client) watchServing(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.health.Watch(ctx, &healthpb.HealthCheckRequest{Service: ServiceName}, grpc.WaitForReady(true))
	if err != nil {
		return err
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return err
		}
		if resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
	}
}

// Devices returns the agent's current inventory with its state: the first snapshot of
// a Fingerprint stream.
func (c *Client) Devices(ctx context.Context) (*pb.FingerprintResponse, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.api.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		return nil, err
	}
	return stream.Recv()
}

// MaxTakeOverPrefixes is the most owner prefixes the agent takes in one Reserve
// (req.TakeOverOwnerPrefixes); it refuses a request with more (INVALID_ARGUMENT).
const MaxTakeOverPrefixes = device.MaxTakeOverPrefixes

// MaxOwnerLabelLen is the longest value a Reserve's owner_labels may have, in bytes
// (several pods joined by ",").
const MaxOwnerLabelLen = device.MaxOwnerLabelLen

// Reserve reserves devices of one group for an owner and returns the reservation ID and
// how to expose the devices to a container. A held device is an error IsHeld reports
// with its holders (HeldError: the same as the contract's error); unknown and unhealthy
// devices, and a plugin that is down, are IsUnknownDevice, IsUnhealthy and IsUnavailable
// errors. The same owner asking again for the same devices gets the same reservation
// back, so a call whose answer was lost can be retried.
//
// With req.TakeOverOwnerPrefixes set, devices held by live reservations of owners with
// those prefixes are taken over: the agent releases those reservations in the same
// durable write that makes the new one, and lists them in the answer's
// TakenOverReservationIds; a holder of any other owner still refuses (IsHeld, naming
// only such holders) and then nothing is released.
func (c *Client) Reserve(ctx context.Context, req *pb.ReserveRequest) (*pb.ReserveResponse, error) {
	return c.api.Reserve(ctx, req)
}

// Release ends the reservations req names and says which this call released and which
// were released before. Releasing twice is not an error. An unknown reservation ID is an
// IsReservationNotFound error.
func (c *Client) Release(ctx context.Context, req *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	return c.api.Release(ctx, req)
}

// ReleaseReservation is Release of one reservation by its ID.
func (c *Client) ReleaseReservation(ctx context.Context, reservationID string) (*pb.ReleaseResponse, error) {
	return c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: reservationID}})
}

// ReleaseOwner is Release of every reservation of an owner.
func (c *Client) ReleaseOwner(ctx context.Context, ownerID string) (*pb.ReleaseResponse, error) {
	return c.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_OwnerId{OwnerId: ownerID}})
}

// Reservations lists the ledger's reservations that match filter (nil: all), oldest
// first.
func (c *Client) Reservations(ctx context.Context, filter *pb.ListReservationsRequest) ([]*pb.Reservation, error) {
	if filter == nil {
		filter = &pb.ListReservationsRequest{}
	}
	resp, err := c.api.ListReservations(ctx, filter)
	if err != nil {
		return nil, err
	}
	return resp.GetReservations(), nil
}

// Reown hands the live reservation reservationID from owner to newOwner and returns
// it as stored (same ID, devices and container data): for a runtime that learns who
// the allocation is only after Reserve. Asking again once it is done is not an error.
// An unknown reservation is an IsReservationNotFound error; a released one, or one
// whose owner is not owner, an INVALID_ARGUMENT status naming the field.
func (c *Client) Reown(ctx context.Context, reservationID, owner, newOwner string) (*pb.Reservation, error) {
	resp, err := c.api.ReownReservation(ctx, &pb.ReownReservationRequest{ReservationId: reservationID, OwnerId: owner, NewOwnerId: newOwner})
	if err != nil {
		return nil, err
	}
	return resp.GetReservation(), nil
}

// Cordon takes a device out of service (the admin grant): it keeps its holder, but no
// new one may take it, and every path stops offering it. With drain, the paths that can
// also ask the holder's runtime to let go. Cordoning again replaces the reason.
func (c *Client) Cordon(ctx context.Context, deviceID, reason string, drain bool) (*pb.Cordon, error) {
	resp, err := c.api.CordonDevice(ctx, &pb.CordonDeviceRequest{DeviceId: deviceID, Reason: reason, Drain: drain})
	if err != nil {
		return nil, err
	}
	return resp.GetCordon(), nil
}

// Uncordon puts a cordoned device back in service and returns the cordon it lifted;
// nil when the device was not cordoned.
func (c *Client) Uncordon(ctx context.Context, deviceID string) (*pb.Cordon, error) {
	resp, err := c.api.UncordonDevice(ctx, &pb.UncordonDeviceRequest{DeviceId: deviceID})
	if err != nil {
		return nil, err
	}
	return resp.GetLifted(), nil
}

// Plugins lists the agent's plugins with their status, restarts and last error.
func (c *Client) Plugins(ctx context.Context) ([]*pb.Plugin, error) {
	resp, err := c.api.ListPlugins(ctx, &pb.ListPluginsRequest{})
	if err != nil {
		return nil, err
	}
	return resp.GetPlugins(), nil
}

// errStreamEnded is a watch stream the agent ended without an error status.
var errStreamEnded = status.Error(codes.Unavailable, "the agent ended the stream")
