// Command devicehost is the node-local device host: `devicehost agent` runs the host
// (plugins, manager, gRPC API), and the client subcommands talk to a running agent.
//
//	devicehost agent -dev                    a working host with 8 simulated H100s
//	devicehost agent -config /etc/devicehost/devicehost.hcl
//	devicehost devices | capacity | stats | plugins | reserve | release | reservations
//	devicehost kubelet-plugin                the Kubernetes device plugin, a client of the agent
//	devicehost version                       the version it was built from
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/devicehost/devicehost/plugins/nvidia-example/nvidia"
)

// command is one subcommand. run gets the arguments after the subcommand's name and
// returns an error to print; a usageError also prints the subcommand's usage.
type command struct {
	name    string
	summary string
	hidden  bool
	run     func(ctx context.Context, env *cmdEnv, args []string) error
}

// cmdEnv is what a subcommand may touch of the process, so tests can run subcommands
// in-process.
type cmdEnv struct {
	stdout, stderr io.Writer
	// getenv reads the environment (os.Getenv in the binary).
	getenv func(string) string
	// terminal reports whether w is a terminal and its width in columns (0: unknown);
	// nil asks the operating system (see terminalOf).
	terminal func(w io.Writer) (width int, ok bool)
}

func commands() []command {
	return []command{
		{name: "agent", summary: "run the device host (plugins, manager and the gRPC API)", run: runAgent},
		{name: "devices", summary: "list devices with their health and holder", run: runDevices},
		{name: "capacity", summary: "per device group: total, free, held (by whom), blocked, unhealthy, cordoned", run: runCapacity},
		{name: "stats", summary: "show live device statistics", run: runStats},
		{name: "plugins", summary: "list plugins with their status", run: runPlugins},
		{name: "reserve", summary: "reserve devices for an owner", run: runReserve},
		{name: "release", summary: "release a reservation, or all of an owner's", run: runRelease},
		{name: "reservations", summary: "list reservations", run: runReservations},
		{name: "events", summary: "show the audit trail: every change, with who made it", run: runEvents},
		{name: "cordon", summary: "take a device out of service: its holder keeps it, no new one gets it", run: runCordon},
		{name: "drain", summary: "cordon a device and wait until its holder lets go", run: runDrain},
		{name: "uncordon", summary: "put a cordoned device back in service", run: runUncordon},
		{name: "kubelet-plugin", summary: "serve the agent's devices to the kubelet (Kubernetes device plugin)", run: runKubeletPlugin},
		{name: "version", summary: "print the version devicehost was built from", run: runVersion},
		{name: "plugin", summary: "serve a bundled plugin (run by the agent)", hidden: true, run: runPlugin},
	}
}

// version is the version the binary was built from: the Dockerfile sets it with
// -ldflags "-X main.version=..." (scripts/image passes the git commit); "dev" otherwise.
var version = "dev"

// runVersion is `devicehost version`: prints "devicehost VERSION".
func runVersion(_ context.Context, env *cmdEnv, args []string) error {
	fs := newFlagSet(env, "version", "")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	fmt.Fprintf(env.stdout, "devicehost %s\n", version)
	return nil
}

func main() {
	// The bundled nvidia-example plugin runs this binary as its simulated MPS control
	// daemon (sharing = "mps" with simulate).
	nvidia.RunSimulatedMPSIfAsked()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, &cmdEnv{stdout: os.Stdout, stderr: os.Stderr, getenv: os.Getenv}, os.Args[1:])
	stop()
	os.Exit(code)
}

// usageError is a mistake on the command line: exit code 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

// run runs the subcommand named by args[0] and returns the exit code: 0 on success, 1
// on failure, 2 on a usage mistake. ctx ends on SIGINT or SIGTERM.
func run(ctx context.Context, env *cmdEnv, args []string) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "-help" || args[0] == "--help" || args[0] == "help" {
		printUsage(env.stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, env, args[1:])
		var ue usageError
		switch {
		case err == nil:
			return 0
		case errors.Is(err, flag.ErrHelp):
			return 0
		case errors.As(err, &ue):
			fmt.Fprintf(env.stderr, "devicehost %s: %v\n", c.name, err)
			fmt.Fprintf(env.stderr, "Run 'devicehost %s -h' for usage.\n", c.name)
			return 2
		default:
			fmt.Fprintf(env.stderr, "devicehost: %v\n", err)
			return 1
		}
	}
	fmt.Fprintf(env.stderr, "devicehost: unknown command %q\n", args[0])
	printUsage(env.stderr)
	return 2
}

func printUsage(w io.Writer) {
	fmt.Fprintln(w, "Usage: devicehost <command> [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	for _, c := range commands() {
		if !c.hidden {
			fmt.Fprintf(w, "  %-15s %s\n", c.name, c.summary)
		}
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run 'devicehost <command> -h' for a command's flags.")
}

// newFlagSet makes a subcommand's flag set that returns errors instead of exiting and
// prints its usage to env.stderr.
func newFlagSet(env *cmdEnv, name, usage string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(env.stderr)
	fs.Usage = func() {
		fmt.Fprintf(env.stderr, "Usage: devicehost %s %s\n\nFlags:\n", name, usage)
		fs.PrintDefaults()
	}
	return fs
}

// parseFlags parses args, refusing positional arguments. Flag errors are usage errors
// (already printed by the flag package).
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err.Error()}
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	return nil
}
