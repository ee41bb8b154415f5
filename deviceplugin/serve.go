package deviceplugin

import (
	"os"
	"os/signal"
	"sync"
	"syscall"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"
)

// stderr is the process's stderr as it was before go-plugin's Serve swaps os.Stderr for
// a pipe: the file the host reads log lines from.
var stderr = os.Stderr

var logger = sync.OnceValue(func() hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{
		// The host decides what it keeps: it drops lines below its own level.
		Level:      hclog.Trace,
		Output:     stderr,
		JSONFormat: true,
	})
})

// Logger is the logger a plugin logs with: hclog JSON lines on the process's stderr,
// which go-plugin on the host parses and re-logs through the host's logger (named after
// the plugin), keeping each line's level. It is unnamed on purpose: the host names the
// lines. Safe for concurrent use; the same logger on every call.
//
// Do not write to stdout before Serve: go-plugin's handshake uses it.
func Logger() hclog.Logger { return logger() }

// Serve serves impl to the host that launched this process, over go-plugin gRPC, and
// returns when the host shuts the plugin down (the process should then exit). It makes
// Logger the hclog default. Run by hand, outside a host, it prints a note and exits 1.
//
// Serve ignores SIGPIPE: once a host has died, writing a log line to the dead host's
// stderr pipe must not kill a plugin that a restarted host is about to reattach to.
func Serve(impl Plugin) {
	signal.Ignore(syscall.SIGPIPE)
	hclog.SetDefault(Logger())
	plugin.Serve(ServeConfig(impl))
}

// ServeConfig is the go-plugin configuration Serve uses, for callers that need to
// adjust it before calling plugin.Serve themselves (test fixtures, ServeConfig.Test).
// A fresh value on every call.
func ServeConfig(impl Plugin) *plugin.ServeConfig {
	return &plugin.ServeConfig{
		HandshakeConfig:  Handshake,
		VersionedPlugins: VersionedPlugins(NewServer(impl)),
		GRPCServer:       grpcServer,
		Logger:           Logger(),
	}
}

// grpcServer is go-plugin's gRPC server with the connection's windows fixed
// (WindowServerOptions).
func grpcServer(opts []grpc.ServerOption) *grpc.Server {
	return grpc.NewServer(append(opts, WindowServerOptions()...)...)
}
