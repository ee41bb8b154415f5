// Package deviceplugin is the SDK for device plugin authors.
//
// A plugin author implements Plugin (and, optionally, Releaser, Reconciler and
// ConfigChecker) and calls Serve from main. The messages are the protocol's own
// protobuf types (package devicepluginv1), so what a plugin builds is exactly what goes
// on the wire and what the host validates.
//
// The same package holds the go-plugin glue the host uses to talk to a plugin: the
// handshake, the plugin set and the gRPC client side.
package deviceplugin

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// ProtocolVersion is the plugin protocol version this SDK speaks, as sent in
// GetPluginInfo and SetConfig.
const ProtocolVersion = "v1"

// Info describes a plugin.
type Info struct {
	Name    string // e.g. "nvidia-example"
	Version string // the plugin's own version, e.g. "0.1.0"
}

// Plugin is what a device plugin implements.
//
// Every method may be called concurrently with the others. Fingerprint and Stats are
// long-lived: they block, calling send for each message, until ctx ends (return nil or
// ctx.Err()) or they fail (return the error). They must return promptly once ctx ends.
type Plugin interface {
	// Info names the plugin.
	Info() Info
	// SetConfig receives the plugin's config block as a JSON object (nil or empty when
	// the host has none). An error rejects the config: the host reports it and does not
	// run the plugin. Called before any other call but Info, and again, possibly with a
	// different config, each time a host reattaches to the running process.
	SetConfig(ctx context.Context, configJSON []byte) error
	// Fingerprint sends the full inventory at once, then again whenever it changes.
	Fingerprint(ctx context.Context, send func(*pb.FingerprintResponse) error) error
	// Stats sends device stats every interval.
	Stats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error
	// Reserve prepares devices for a container. An error naming the bad IDs refuses it.
	// A plugin that takes reservation options implements OptionReserver too; one that
	// does not never sees them: a Reserve with options is refused for it (UnknownOptions).
	Reserve(ctx context.Context, deviceIDs []string) (*pb.ContainerReservation, error)
}

// OptionReserver is implemented by plugins that take options per reservation (the
// host API's ReserveRequest.plugin_options, e.g. the nvidia-example plugin's
// mps_isolation). When a plugin implements it, every Reserve calls ReserveOptions, with
// options empty when the caller gave none, and never Reserve. ReserveOptions refuses an
// option it does not know (UnknownOptions says so) or a value it cannot honour with a
// gRPC INVALID_ARGUMENT status naming the option, before it prepares anything. A
// plugin without it refuses every Reserve that carries options (UnknownOptions with no
// known keys).
type OptionReserver interface {
	ReserveOptions(ctx context.Context, deviceIDs []string, options map[string]string) (*pb.ContainerReservation, error)
}

// Releaser is implemented by plugins that clean up after a reservation ends. Plugins
// without it answer Release with UNIMPLEMENTED, which the host treats as done. A device
// whose fingerprint sets nothing_to_release (its Reserve leaves nothing to clean up) is
// left out of Release, and a reservation of only such devices gets no call.
//
// Release must be idempotent: the host records a successful cleanup in a later commit
// of its ledger, so after a host crash (or an answer lost on the way) it calls Release
// again for the same reservation, and that call must succeed and change nothing.
type Releaser interface {
	Release(ctx context.Context, reservationID string, deviceIDs []string) error
}

// ConfigChecker is implemented by plugins that can tell whether SetConfig would accept
// a config without applying it. The host calls CheckConfig on the running process
// before it restarts the plugin for a new config (an agent reload), so a config the
// plugin rejects is refused while the running one serves on. Plugins without it answer
// UNIMPLEMENTED, and the host applies the config as it always has.
//
// CheckConfig must parse and validate configJSON exactly as SetConfig does and return
// the error SetConfig would return for it (it becomes INVALID_ARGUMENT, as SetConfig's
// does), and must change nothing: no hardware, no files, no plugin state; the config in
// force stays. It may be called at any time, before SetConfig too, concurrently with
// every other call.
type ConfigChecker interface {
	CheckConfig(ctx context.Context, configJSON []byte) error
}

// LiveReservation is one reservation the host holds live, as Reconcile hands it over.
type LiveReservation struct {
	ID        string
	DeviceIDs []string
	// Options are the options of the Reserve that made it (OptionReserver); nil for
	// none. A plugin that rebuilds what it prepared rebuilds it as they asked.
	Options map[string]string
}

// Reconciler is implemented by plugins that prepare per-reservation state in Reserve
// (a MIG instance carved for it) and must not leak it when the host never recorded
// the reservation. The host calls Reconcile after SetConfig and before any Reserve
// each time it starts or reattaches to the plugin, with every live reservation of the
// plugin's devices: the plugin undoes what no live reservation holds and keeps what
// one does. Plugins without it answer UNIMPLEMENTED, which the host treats as done.
type Reconciler interface {
	Reconcile(ctx context.Context, live []LiveReservation) error
}

// NoStats is the Stats of a plugin whose devices have no statistics (device nodes, a
// kubelet device plugin's devices): an empty StatsResponse every interval, so the host
// sees the stream alive (it ends one silent for several intervals as stalled), until
// ctx ends (it then returns nil) or send fails.
func NoStats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
	tick := time.NewTicker(max(interval, time.Millisecond))
	defer tick.Stop()
	for {
		if err := send(&pb.StatsResponse{}); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// UnknownOptions refuses, with a gRPC INVALID_ARGUMENT status, the options of a Reserve
// whose keys are not among known: `option "x" is unknown to plugin "widgets",
// which takes none` (or `which takes a, b`). nil when every key is known. plugin is the
// plugin's name. The Server answers with it for a plugin without OptionReserver, and
// a plugin with one calls it first.
func UnknownOptions(plugin string, options map[string]string, known ...string) error {
	var unknown []string
	for k := range options {
		if !slices.Contains(known, k) {
			unknown = append(unknown, strconv.Quote(k))
		}
	}
	if len(unknown) == 0 {
		return nil
	}
	slices.Sort(unknown)
	takes := "none"
	if len(known) > 0 {
		takes = strings.Join(known, ", ")
	}
	what := "option " + unknown[0] + " is"
	if len(unknown) > 1 {
		what = "options " + strings.Join(unknown, ", ") + " are"
	}
	return status.Error(codes.InvalidArgument, fmt.Sprintf("%s unknown to plugin %q, which takes %s", what, plugin, takes))
}
