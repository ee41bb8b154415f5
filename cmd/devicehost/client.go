package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/internal/textline"
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
// registered into the returned clientFlags; -timeout is the deadline of the request.
func newClientFlagSet(env *cmdEnv, name, usage string) (*flag.FlagSet, *clientFlags) {
	fs := newFlagSet(env, name, usage)
	var cf clientFlags
	cf.register(fs, env)
	fs.DurationVar(&cf.timeout, "timeout", 30*time.Second, "deadline for the request")
	return fs, &cf
}

// register adds -address and the TLS flags (not -timeout, whose meaning differs).
func (c *clientFlags) register(fs *flag.FlagSet, env *cmdEnv) {
	def := endpoint.DefaultAddress
	if v := env.getenv(addressEnv); v != "" {
		def = v
	}
	fs.StringVar(&c.address, "address", def, "agent `address`: unix:///path.sock or tcp://host:port (default from $"+addressEnv+" when set)")
	registerTLSFlags(fs, &c.tls, "client certificate", "client key", "CA that the agent's certificate must chain to")
}

// connect dials the agent and checks, within reachTimeout, that it answers, so that an
// agent that is not running gives one clear error at once rather than a failed call
// later. An address or TLS flags the transport policy refuses are a usage error.
func (c *clientFlags) connect(ctx context.Context) (*client.Client, error) {
	rctx, cancel := context.WithTimeout(ctx, reachTimeout)
	defer cancel()
	cl, err := client.Dial(rctx, c.address, client.WithTLS(c.tls))
	var ce *endpoint.ConfigError
	if errors.As(err, &ce) {
		return nil, usageError{err.Error()}
	}
	return cl, err
}

// dial is connect under a context that ends after -timeout, for a subcommand that
// makes one request: it returns that context for the calls, and done, which the caller
// must call to close the connection and end the context. On error nothing is left open.
func (c *clientFlags) dial(ctx context.Context) (_ context.Context, _ *client.Client, done func(), _ error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	cl, err := c.connect(ctx)
	if err != nil {
		cancel()
		return nil, nil, nil, err
	}
	return ctx, cl, func() {
		cl.Close()
		cancel()
	}, nil
}

// callError renders a failed call as "what: message (Code)" on one line. A message
// that already starts with "what: " (the agent named the operation itself) is not
// prefixed again.
func callError(what string, err error) error {
	st := status.Convert(err)
	msg := textline.Line(st.Message(), 0)
	for strings.HasPrefix(msg, what+": ") {
		msg = strings.TrimPrefix(msg, what+": ")
	}
	return fmt.Errorf("%s: %s (%s)", what, msg, st.Code())
}
