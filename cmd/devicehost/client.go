package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/textline"
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
	// envAddress is $DEVICEHOST_ADDRESS, the default of -address when set.
	envAddress string
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
	c.envAddress = env.getenv(addressEnv)
	def, from := endpoint.DefaultAddress, "; $"+addressEnv+" overrides it"
	if c.envAddress != "" {
		def, from = c.envAddress, ", from $"+addressEnv
	}
	fs.StringVar(&c.address, "address", def, fmt.Sprintf("agent `address`: unix:///path.sock or tcp://host:port (default %q%s)", def, from))
	// The usage says where the default comes from; the flag package would print it again.
	fs.Lookup("address").DefValue = ""
	registerTLSFlags(fs, &c.tls, "client certificate", "client key", "CA that the agent's certificate must chain to")
}

// connect dials the agent and checks, within reachTimeout, that it answers, so that an
// agent that is not running gives one clear error at once rather than a failed call
// later (see unreachable). An address or TLS flags the transport policy refuses are a
// usage error.
func (c *clientFlags) connect(ctx context.Context) (*client.Client, error) {
	rctx, cancel := context.WithTimeout(ctx, reachTimeout)
	defer cancel()
	cl, err := client.Dial(rctx, c.address, client.WithTLS(c.tls))
	var ce *endpoint.ConfigError
	switch {
	case errors.As(err, &ce):
		return nil, usageError{err.Error()}
	case client.IsUnavailable(err):
		return nil, c.unreachable(err)
	}
	return cl, err
}

// unreachable is connect's error for an agent that could not be reached (err, an
// UNAVAILABLE status): it says why in a person's words (for a unix socket, whether
// the socket is there at all), that the agent may not be running, and how to give
// another address.
func (c *clientFlags) unreachable(err error) error {
	why := dialFailure(status.Convert(err).Message())
	if a, perr := endpoint.Parse(c.address); perr == nil && a.Network == "unix" {
		fi, serr := os.Stat(a.Path)
		switch {
		case errors.Is(serr, os.ErrNotExist):
			why = fmt.Sprintf("no socket at %s (%s)", a.Path, "no such file or directory")
		case serr != nil:
			why = fmt.Sprintf("cannot look at the socket: %s", textline.Line(serr.Error(), 0))
		case fi.Mode().Type() != os.ModeSocket:
			why = fmt.Sprintf("%s is not a socket", a.Path)
		case strings.Contains(why, "connection refused"):
			why = fmt.Sprintf("the socket %s exists but no agent accepts on it (connection refused)", a.Path)
		case strings.Contains(why, "permission denied"):
			return fmt.Errorf("cannot reach agent at %s: permission denied on the socket %s; run as a user the socket lets in", c.address, a.Path)
		}
	}
	hint := "If it listens elsewhere, give its address with -address or $" + addressEnv
	if c.envAddress != "" && c.address == c.envAddress {
		hint = "The address is from $" + addressEnv + "; -address overrides it"
	}
	return fmt.Errorf("cannot reach agent at %s: %s; is the agent running ('devicehost agent')? %s", c.address, why, hint)
}

// dialFailure is the reason in a gRPC connection error: "connection refused" of
// `connection error: desc = "transport: Error while dialing: dial tcp ...: connect:
// connection refused"`. Other messages are returned whole, on one line.
func dialFailure(msg string) string {
	msg = textline.Line(msg, 0)
	if !strings.Contains(msg, "Error while dialing") {
		return msg
	}
	msg = strings.TrimSuffix(msg, `"`)
	if i := strings.LastIndex(msg, ": "); i >= 0 {
		return msg[i+2:]
	}
	return msg
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
// prefixed again. An error that is no gRPC status (the CLI's own refusal of a request)
// has no code to show.
func callError(what string, err error) error {
	st, isStatus := status.FromError(err)
	msg := textline.Line(st.Message(), 0)
	for strings.HasPrefix(msg, what+": ") {
		msg = strings.TrimPrefix(msg, what+": ")
	}
	if !isStatus {
		return fmt.Errorf("%s: %s", what, msg)
	}
	return fmt.Errorf("%s: %s (%s)", what, msg, st.Code())
}
