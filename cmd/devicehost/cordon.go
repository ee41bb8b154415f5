package main

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

const cordonUsage = `-device ID -reason TEXT [-json] [-address ADDR]

Takes a device out of service: its holder keeps it, but no new holder may take it on
any path (the kubelet bridge reports it unhealthy, the DRA driver taints it NoSchedule,
the Nomad shim reports it unhealthy, a Reserve is refused with the reason). Durable
across agent restarts; 'devicehost uncordon' puts it back. Needs the admin grant.`

// runCordon is `devicehost cordon`.
func runCordon(ctx context.Context, env *cmdEnv, args []string) error {
	return cordonCommand(ctx, env, args, "cordon", cordonUsage, false)
}

const drainUsage = `-device ID [-reason TEXT] [-timeout D] [-json] [-address ADDR]

Cordons a device and asks its holder's runtime to let go where a path can (the DRA
driver's taint becomes NoExecute, so Kubernetes evicts the pod); then waits until the
device is free or -timeout ends, showing the holder. A holder of another path (a pod of
the kubelet bridge, a Nomad allocation) is named for its operator to move. Needs the
admin grant.`

// drainTimeout is drain's default -timeout: long enough for a pod's graceful end.
const drainTimeout = 5 * time.Minute

// runDrain is `devicehost drain`.
func runDrain(ctx context.Context, env *cmdEnv, args []string) error {
	return cordonCommand(ctx, env, args, "drain", drainUsage, true)
}

// cordonCommand is cordon (drain false) and drain.
func cordonCommand(ctx context.Context, env *cmdEnv, args []string, name, usage string, drain bool) error {
	fs, cf := newClientFlagSet(env, name, usage)
	if drain {
		cf.timeout = drainTimeout
		fs.Lookup("timeout").DefValue = drainTimeout.String()
		fs.Lookup("timeout").Usage = "how long to wait for the device to be free"
	}
	id := fs.String("device", "", "the device `ID`")
	reason := fs.String("reason", "", "why it goes out of service (`TEXT`, shown wherever it is refused)")
	asJSON := fs.Bool("json", false, "print the cordon as JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *id == "" || (*reason == "" && !drain) {
		return usagef("give -device and -reason")
	}
	if *reason == "" {
		*reason = "drained"
	}
	ctx, c, done, err := cf.dial(ctx)
	if err != nil {
		return err
	}
	defer done()
	cordon, err := c.Cordon(ctx, *id, *reason, drain)
	if err != nil {
		return callError(name, err)
	}
	if *asJSON {
		if err := printJSON(env.stdout, cordon); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(env.stdout, "cordoned %s: %s\n", cell(*id), cell(cordon.GetReason()))
	}
	if !drain {
		return nil
	}
	return waitFree(ctx, env, pb.NewDeviceHostClient(c.Conn()), *id, *asJSON)
}

// waitFree waits until device id has no holder, saying who holds it meanwhile (not
// with quiet), and fails naming the holder when ctx ends first.
func waitFree(ctx context.Context, env *cmdEnv, conn pb.DeviceHostClient, id string, quiet bool) error {
	stream, err := conn.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		return callError("drain", err)
	}
	var last *pb.Holder
	for {
		fp, err := stream.Recv()
		if err != nil {
			// The timeout: ctx's, or the server's end of the stream at the same deadline,
			// which can come first (gRPC then says DeadlineExceeded while ctx.Err() is
			// still nil, its timer not yet run).
			if last != nil && (ctx.Err() != nil || status.Code(err) == codes.DeadlineExceeded) {
				return fmt.Errorf("drain: %s is still held by %s (%s); it stays cordoned: release it through its runtime, or wait and drain again",
					id, cell(last.GetOwnerId()), cell(last.GetReservationId()))
			}
			return callError("drain", err)
		}
		var found *pb.Device
		for _, g := range fp.GetGroups() {
			for _, d := range g.GetDevices() {
				if d.GetId() == id {
					found = d
				}
			}
		}
		if found == nil || found.GetHolder() == nil {
			if !quiet {
				fmt.Fprintf(env.stdout, "%s is free\n", id)
			}
			return nil
		}
		if h := found.GetHolder(); last == nil || h.GetReservationId() != last.GetReservationId() {
			last = h
			if !quiet {
				fmt.Fprintf(env.stdout, "waiting for %s (%s) to let go of %s\n", cell(h.GetOwnerId()), cell(h.GetReservationId()), id)
			}
		}
	}
}

const uncordonUsage = `-device ID [-json] [-address ADDR]

Puts a cordoned device back in service, on every path at once. Uncordoning a device that
is not cordoned is not an error. Needs the admin grant.`

// runUncordon is `devicehost uncordon`.
func runUncordon(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "uncordon", uncordonUsage)
	id := fs.String("device", "", "the device `ID`")
	asJSON := fs.Bool("json", false, "print the lifted cordon as JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *id == "" {
		return usagef("give -device")
	}
	ctx, c, done, err := cf.dial(ctx)
	if err != nil {
		return err
	}
	defer done()
	was, err := c.Uncordon(ctx, *id)
	if err != nil {
		return callError("uncordon", err)
	}
	switch {
	case *asJSON:
		return printJSON(env.stdout, &pb.UncordonDeviceResponse{Lifted: was})
	case was == nil:
		fmt.Fprintf(env.stdout, "%s was not cordoned (nothing done)\n", *id)
	default:
		fmt.Fprintf(env.stdout, "uncordoned %s (was: %s, by %s)\n", *id, cell(was.GetReason()), cell(was.GetBy()))
	}
	return nil
}
