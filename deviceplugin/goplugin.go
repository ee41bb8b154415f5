package deviceplugin

import (
	"context"
	"errors"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// HandshakeVersion is the go-plugin protocol version of the plugin set below. It moves
// in step with ProtocolVersion: "v1" is served as go-plugin version 1.
const HandshakeVersion = 1

// PluginKey names the device plugin in go-plugin's plugin set (what Dispense takes).
const PluginKey = "device"

// Handshake is the go-plugin handshake host and plugins share. The magic cookie only
// stops a plugin binary run by hand from hanging silently; it is not a security measure.
var Handshake = plugin.HandshakeConfig{
	ProtocolVersion:  HandshakeVersion,
	MagicCookieKey:   "DEVICEHOST_PLUGIN",
	MagicCookieValue: "a9c3e1d4f6b2-devicehost-device-plugin",
}

// Window is the flow-control window, fixed, of both ends of the connection between the
// host and a plugin: the host's dial (pluginloader) and Serve's server. gRPC's default
// estimates a window by pinging the peer each time data arrives with no estimate under
// way: a PING the host would read and answer while it waits on each answer of the
// plugin, and one more the plugin would. A local socket needs no estimate, and 1 MiB is
// room for any message either side sends (a larger one still flows). It also bounds
// what a plugin can make the host hold unread: 1 MiB a stream, where the estimate lets
// the window grow to 16 MiB.
const Window = 1 << 20

// WindowDialOptions fixes a client's windows at Window (the host's dial of a plugin).
func WindowDialOptions() []grpc.DialOption {
	return []grpc.DialOption{grpc.WithStaticStreamWindowSize(Window), grpc.WithStaticConnWindowSize(Window)}
}

// WindowServerOptions fixes a server's windows at Window (Serve's server).
func WindowServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.StaticStreamWindowSize(Window), grpc.StaticConnWindowSize(Window)}
}

// VersionedPlugins is the plugin set keyed by go-plugin protocol version. The host
// passes nil (it only dispenses clients); a plugin passes the server it serves.
// A fresh map is returned on every call, so callers may change it.
func VersionedPlugins(server pb.DevicePluginServer) map[int]plugin.PluginSet {
	return map[int]plugin.PluginSet{
		HandshakeVersion: {PluginKey: &GRPCPlugin{Impl: server}},
	}
}

// GRPCPlugin is go-plugin's glue for the device plugin protocol, gRPC only.
type GRPCPlugin struct {
	plugin.NetRPCUnsupportedPlugin
	// Impl is what the plugin process serves; unused (nil) on the host side.
	Impl pb.DevicePluginServer
}

var _ plugin.GRPCPlugin = (*GRPCPlugin)(nil)

// GRPCServer registers Impl on the plugin's gRPC server.
func (p *GRPCPlugin) GRPCServer(_ *plugin.GRPCBroker, s *grpc.Server) error {
	if p.Impl == nil {
		return errors.New("deviceplugin: GRPCPlugin has no Impl to serve")
	}
	pb.RegisterDevicePluginServer(s, p.Impl)
	return nil
}

// GRPCClient returns a *Client. doneCtx is go-plugin's context that ends when the plugin
// process exits.
func (p *GRPCPlugin) GRPCClient(doneCtx context.Context, _ *plugin.GRPCBroker, conn *grpc.ClientConn) (any, error) {
	return &Client{DevicePluginClient: pb.NewDevicePluginClient(conn), exitCtx: doneCtx}, nil
}

// Client is the host's end of a plugin connection: the generated gRPC client plus the
// context go-plugin cancels when the plugin process exits. It is safe for concurrent
// use; its lifetime is the go-plugin client's (closing that closes the connection).
type Client struct {
	pb.DevicePluginClient
	exitCtx context.Context
}

// ExitContext is done once the plugin process has exited. An RPC error of code
// Unavailable or Canceled while it is done means "the plugin died", not "the caller gave
// up". For in-process test connections it never ends.
func (c *Client) ExitContext() context.Context { return c.exitCtx }
