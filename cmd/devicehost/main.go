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
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
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
		{name: "health-check", summary: "node-problem-detector custom plugin: exit 0 all devices healthy, 1 not, 2 agent unreachable", run: runHealthCheck},
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

// buildInfo is what `devicehost version` reports: the version set at link time, and
// from the Go toolchain's build information, the main module's version, the VCS
// revision and time it was built from and whether the tree had changes.
type buildInfo struct {
	Version       string `json:"version"`
	ModuleVersion string `json:"module_version,omitempty"` // "(devel)" for a build in the source tree
	Revision      string `json:"vcs_revision,omitempty"`
	RevisionTime  string `json:"vcs_time,omitempty"`
	Modified      bool   `json:"vcs_modified,omitempty"`
	GoVersion     string `json:"go_version"`
}

// readBuildInfo reads the binary's build information.
func readBuildInfo() buildInfo {
	b := buildInfo{Version: version, GoVersion: runtime.Version()}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	b.ModuleVersion = info.Main.Version
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Revision = s.Value
		case "vcs.time":
			b.RevisionTime = s.Value
		case "vcs.modified":
			b.Modified = s.Value == "true"
		}
	}
	return b
}

// runVersion is `devicehost version`: "devicehost VERSION", then the module version,
// the VCS revision (with "+changes" when the tree had some) and the Go version, where
// the build recorded them; -json prints them as an object.
func runVersion(_ context.Context, env *cmdEnv, args []string) error {
	fs := newFlagSet(env, "version", "[-json]\n\nPrints the version devicehost was built from.")
	asJSON := fs.Bool("json", false, "print the build information as JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	b := readBuildInfo()
	if *asJSON {
		out, err := json.MarshalIndent(b, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(env.stdout, "%s\n", out)
		return err
	}
	fmt.Fprintf(env.stdout, "devicehost %s\n", b.Version)
	if b.ModuleVersion != "" {
		fmt.Fprintf(env.stdout, "module:   github.com/devicehost/devicehost %s\n", b.ModuleVersion)
	}
	if b.Revision != "" {
		rev := b.Revision
		if b.Modified {
			rev += " +changes"
		}
		if b.RevisionTime != "" {
			rev += " (" + b.RevisionTime + ")"
		}
		fmt.Fprintf(env.stdout, "revision: %s\n", rev)
	}
	fmt.Fprintf(env.stdout, "go:       %s\n", b.GoVersion)
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
	if len(args) == 0 {
		printUsage(env.stderr)
		return 2
	}
	if args[0] == "-h" || args[0] == "-help" || args[0] == "--help" || args[0] == "help" {
		printUsage(env.stdout) // asked for: to stdout, so that `devicehost -h | less` shows it
		return 0
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, env, args[1:])
		var ue usageError
		var es exitStatus
		switch {
		case err == nil:
			return 0
		case errors.As(err, &es):
			return int(es) // its message is printed
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
	fs.SetOutput(&usageOutput{env: env})
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: devicehost %s %s\n\nFlags:\n", name, usage)
		fs.PrintDefaults()
	}
	return fs
}

// usageOutput holds what the flag package prints while parsing (a flag error, the
// usage) until parseFlags knows where it goes: help asked for (-h) to stdout, so that
// `devicehost reserve -h | less` shows it; a mistake to stderr.
type usageOutput struct {
	env *cmdEnv
	buf bytes.Buffer
}

func (u *usageOutput) Write(p []byte) (int, error) { return u.buf.Write(p) }

// flush writes what was held to stdout (help) or stderr.
func (u *usageOutput) flush(help bool) {
	w := u.env.stderr
	if help {
		w = u.env.stdout
	}
	w.Write(u.buf.Bytes())
	u.buf.Reset()
}

// parseFlags parses args, refusing positional arguments. Flag errors are usage errors
// (already printed by the flag package).
func parseFlags(fs *flag.FlagSet, args []string) error {
	err := fs.Parse(args)
	if u, ok := fs.Output().(*usageOutput); ok {
		u.flush(errors.Is(err, flag.ErrHelp))
	}
	if err != nil {
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
