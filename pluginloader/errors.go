package pluginloader

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/textline"
)

// ErrChecksumMismatch, ErrProtocolVersion, ErrConfigRejected, ErrInsecurePath and
// ErrNotPlugin are wrapped by Launch/Discover errors so callers (the manager) can tell a
// permanent failure from a crash worth retrying.
var (
	ErrChecksumMismatch = errors.New("plugin checksum mismatch")
	ErrProtocolVersion  = errors.New("no common plugin protocol version")
	ErrConfigRejected   = errors.New("plugin rejected its config")
	ErrInsecurePath     = errors.New("insecure plugin path")
	// ErrNotPlugin: the executable does not speak go-plugin's handshake with the
	// host's magic cookie (another program's plugin, a script, a plain binary).
	ErrNotPlugin = errors.New("not a devicehost plugin")
)

// ErrConfigCheckUnsupported is wrapped by CheckConfig's error when the plugin does not
// implement CheckConfig (it answered UNIMPLEMENTED): whether it accepts a config is
// only known once SetConfig is handed it.
var ErrConfigCheckUnsupported = errors.New("plugin cannot check a config without applying it")

// ConfigError is Launch's error when the plugin rejected its config: SetConfig
// answered INVALID_ARGUMENT; and CheckConfig's, when CheckConfig did. It matches ErrConfigRejected. Message is the plugin's own
// text, escaped to one line and clipped, for a caller that reports it with where the
// config came from.
type ConfigError struct {
	Plugin  string
	Message string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("plugin %q: %s: %v", e.Plugin, e.Message, ErrConfigRejected)
}

// Unwrap returns ErrConfigRejected.
func (e *ConfigError) Unwrap() error { return ErrConfigRejected }

// ErrExited is wrapped by errors that are due to the plugin process having exited: from
// Launch when the plugin dies while starting, and from RPCError.
var ErrExited = errors.New("plugin process exited")

// maxQuoted bounds the plugin-supplied text (a printed line, an error message, version
// names) that goes into one launch error, so the error stays one short line. It is
// escaped too (textline.Escape), so the plugin's text cannot break that line.
const maxQuoted = 160

// pathLike matches absolute paths in go-plugin's and gRPC's error texts (the plugin's
// socket path, the binary's path), which do not belong in a short error.
var pathLike = regexp.MustCompile(`/[^\s"':,()]+`)

// hostText makes a go-plugin or gRPC error text fit for a launch error: its first line,
// without paths, clipped.
func hostText(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return textline.Escape(pathLike.ReplaceAllString(s, "<path>"), maxQuoted)
}

var (
	unrecognizedMsg = "Unrecognized remote plugin message: "
	pluginVersionRe = regexp.MustCompile(`Plugin version: ([^,\s]*)`)
)

// startError turns the error of go-plugin's Start into one line in our words. exit is
// the process's exit ("signal: killed"), or "" when it is not known; cookie says that
// the plugin printed go-plugin's wrong-cookie note.
func (p *Plugin) startError(err error, exit string, cookie bool) error {
	var pathErr *os.PathError
	msg := err.Error()
	switch {
	case errors.Is(err, plugin.ErrChecksumsDoNotMatch):
		return fmt.Errorf("plugin %q changed after its checksum was checked: %w", p.name, ErrChecksumMismatch)
	case errors.As(err, &pathErr):
		// The exec itself failed: no such file, permission denied, exec format error
		// (a binary for another machine, a script without a "#!" line).
		return fmt.Errorf("plugin %q could not be started: %w", p.name, pathErr.Err)
	case cookie:
		return fmt.Errorf("plugin %q has another magic cookie (a go-plugin plugin of another program?): %w", p.name, ErrNotPlugin)
	case strings.HasPrefix(msg, unrecognizedMsg):
		line, _, _ := strings.Cut(strings.TrimPrefix(msg, unrecognizedMsg), "\n")
		if line != "" {
			return fmt.Errorf("plugin %q printed %q instead of a go-plugin handshake: %w", p.name, textline.Escape(line, maxQuoted), ErrNotPlugin)
		}
		// Its stdout closed without a line: it exited (or closed stdout and was killed).
		return p.exitedError("before its handshake", exit)
	case strings.HasPrefix(msg, "plugin exited before we could connect"):
		return p.exitedError("before its handshake", exit)
	case strings.HasPrefix(msg, "incompatible API version"):
		return fmt.Errorf("plugin %q speaks go-plugin protocol version %s, the host speaks %d: %w",
			p.name, pluginVersion(msg), deviceplugin.HandshakeVersion, ErrProtocolVersion)
	case strings.HasPrefix(msg, "incompatible core API version"):
		return fmt.Errorf("plugin %q speaks go-plugin core protocol %s, the host speaks %d: %w",
			p.name, pluginVersion(msg), plugin.CoreProtocolVersion, ErrProtocolVersion)
	case strings.HasPrefix(msg, "unsupported plugin protocol"):
		return fmt.Errorf("plugin %q serves go-plugin's net/rpc, the host speaks gRPC only: %w", p.name, ErrProtocolVersion)
	case strings.HasPrefix(msg, "error parsing"), strings.HasPrefix(msg, "Error parsing"), strings.HasPrefix(msg, "unknown address type"):
		return fmt.Errorf("plugin %q sent a malformed go-plugin handshake (%s): %w", p.name, hostText(msg), ErrNotPlugin)
	default:
		if exit != "" {
			return p.exitedError("before its handshake", exit)
		}
		return fmt.Errorf("plugin %q: go-plugin handshake failed: %s", p.name, hostText(msg))
	}
}

// pluginVersion is the "Plugin version: X" of go-plugin's version mismatch errors.
func pluginVersion(msg string) string {
	if m := pluginVersionRe.FindStringSubmatch(msg); m != nil {
		return textline.Escape(m[1], 20)
	}
	return "?"
}

func (p *Plugin) exitedError(when, exit string) error {
	if exit == "" {
		exit = "exited"
	}
	return fmt.Errorf("plugin %q exited %s (%s): %w", p.name, when, exit, ErrExited)
}

// timeoutError is the error of a launch step that did not end within the start
// timeout ("SetConfig did not answer within 10s"), or whose context (the caller's)
// ended first. rpc is "" for go-plugin's handshake.
func (p *Plugin) timeoutError(ctx context.Context, rpc string, timeout time.Duration) error {
	step := rpc
	if step == "" {
		step = "the go-plugin handshake"
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("launching plugin %q (%s): %w", p.name, step, err)
	}
	if rpc == "" {
		return fmt.Errorf("plugin %q did not complete its go-plugin handshake within %s: %w", p.name, timeout, context.DeadlineExceeded)
	}
	return fmt.Errorf("plugin %q: %s did not answer within %s: %w", p.name, rpc, timeout, context.DeadlineExceeded)
}

// rpcText describes a failed RPC in one line: the code, and the plugin's message
// clipped. An Unavailable error's text is gRPC's, naming the plugin's socket: left out.
func rpcText(err error) string {
	st := status.Convert(err)
	switch st.Code() {
	case codes.Unavailable:
		return "the connection to the plugin failed (Unavailable)"
	case codes.ResourceExhausted:
		return textline.Escape(st.Message(), 2*maxQuoted) // our own text, from limitError
	}
	return fmt.Sprintf("%s: %s", st.Code(), textline.Escape(st.Message(), maxQuoted))
}
