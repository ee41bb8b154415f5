package main

import (
	"context"
	"flag"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server/endpoint"
)

// addressEnv, when set, is the client subcommands' default -address.
const addressEnv = "DEVICEHOST_ADDRESS"

// reachTimeout bounds how long a client subcommand waits to reach the agent.
const reachTimeout = 5 * time.Second

func registerTLSFlags(fs *flag.FlagSet, t *endpoint.TLS, certUse, keyUse, caUse string) {
	fs.StringVar(&t.Cert, "tls-cert", "", "PEM `file`: "+certUse+" (tcp only)")
	fs.StringVar(&t.Key, "tls-key", "", "PEM `file`: "+keyUse+" (tcp only)")
	fs.StringVar(&t.CA, "tls-ca", "", "PEM `file`: "+caUse+" (tcp only)")
	fs.BoolVar(&t.Insecure, "insecure", false, "plaintext tcp, allowed on loopback addresses only")
}

// clientFlags are the flags every client subcommand has.
type clientFlags struct {
	address string
	tls     endpoint.TLS
	timeout time.Duration
}

// newClientFlagSet is newFlagSet with the flags every client subcommand has,
// registered into the returned clientFlags.
func newClientFlagSet(env *cmdEnv, name, usage string) (*flag.FlagSet, *clientFlags) {
	fs := newFlagSet(env, name, usage)
	var cf clientFlags
	cf.register(fs, env)
	return fs, &cf
}

func (c *clientFlags) register(fs *flag.FlagSet, env *cmdEnv) {
	def := endpoint.DefaultAddress
	if v := env.getenv(addressEnv); v != "" {
		def = v
	}
	fs.StringVar(&c.address, "address", def, "agent `address`: unix:///path.sock or tcp://host:port (default from $"+addressEnv+" when set)")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Second, "deadline for a request")
	registerTLSFlags(fs, &c.tls, "client certificate", "client key", "CA that the agent's certificate must chain to")
}

// agentClient is a connection to a running agent.
type agentClient struct {
	pb.DeviceHostClient
	addr endpoint.Address
	conn *grpc.ClientConn
}

func (c *agentClient) Close() error { return c.conn.Close() }

// connect dials the agent and checks that it answers, so that an agent that is not
// running gives one clear error at once rather than a failed call later.
func (c *clientFlags) connect(ctx context.Context) (*agentClient, error) {
	addr, err := endpoint.Parse(c.address)
	if err != nil {
		return nil, usageError{err.Error()}
	}
	conn, err := endpoint.Dial(addr, c.tls)
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, reachTimeout)
	defer cancel()
	// Not WaitForReady: a refused or missing socket fails the call at once.
	_, err = healthpb.NewHealthClient(conn).Check(rctx, &healthpb.HealthCheckRequest{})
	switch status.Code(err) {
	case codes.OK, codes.Unimplemented, codes.NotFound:
		// Reached: something answered (a server without health, or one that does not
		// know the overall service, still answers).
	default:
		conn.Close()
		return nil, fmt.Errorf("cannot reach agent at %s: %s", addr, oneLine(status.Convert(err).Message()))
	}
	return &agentClient{DeviceHostClient: pb.NewDeviceHostClient(conn), addr: addr, conn: conn}, nil
}

// dial is connect under a context that ends after -timeout, for a subcommand that
// makes one request: it returns that context for the calls, and done, which the caller
// must call to close the connection and end the context. On error nothing is left open.
func (c *clientFlags) dial(ctx context.Context) (_ context.Context, _ *agentClient, done func(), _ error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	ac, err := c.connect(ctx)
	if err != nil {
		cancel()
		return nil, nil, nil, err
	}
	return ctx, ac, func() {
		ac.Close()
		cancel()
	}, nil
}

// callError renders a failed call as "what: message (Code)".
func callError(what string, err error) error {
	st := status.Convert(err)
	return fmt.Errorf("%s: %s (%s)", what, oneLine(st.Message()), st.Code())
}

func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}
