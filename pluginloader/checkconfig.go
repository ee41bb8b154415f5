package pluginloader

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/textline"
)

// CheckConfig asks the running plugin whether it would accept configJSON as its config
// (the protocol's CheckConfig), changing nothing in it: the config in force stays. The
// call is bounded by ctx and the plugin's exit (CallContext); ctx should carry a
// deadline.
//
// It returns nil when the plugin accepts the config; a *ConfigError (matching
// ErrConfigRejected, with the plugin's message as a SetConfig rejection has it) when
// the plugin rejects it; an error wrapping ErrConfigCheckUnsupported when the plugin
// does not implement CheckConfig; an error wrapping ErrExited when the plugin exited;
// ctx's error when ctx ended first (an INVALID_ARGUMENT that arrives within 100ms of
// ctx's deadline counts as that: the plugin's answer to the deadline); and otherwise
// one line naming the plugin and the RPC's code, wrapping a status of that code. Safe
// for concurrent use, beside every other call to the plugin.
func (p *Plugin) CheckConfig(ctx context.Context, configJSON []byte) error {
	return CheckConfig(ctx, p.name, p, p.rpc, configJSON)
}

// CheckConfig is (*Plugin).CheckConfig for a caller's stand-in for a plugin process
// (the manager's in-process test plugins): name is the plugin's name as the host
// knows it, p its process, c its client.
func CheckConfig(ctx context.Context, name string, p Process, c pb.DevicePluginClient, configJSON []byte) error {
	cctx, cancel := CallContext(ctx, p)
	defer cancel()
	_, err := c.CheckConfig(cctx, &pb.CheckConfigRequest{ConfigJson: configJSON})
	if err == nil {
		return nil
	}
	if exited := RPCError(cctx, p, err); errors.Is(exited, ErrExited) {
		return fmt.Errorf("plugin %q: CheckConfig: %w", name, exited)
	}
	if deadlineReached(ctx) {
		if ctx.Err() != nil {
			return fmt.Errorf("plugin %q: CheckConfig: %w", name, context.Cause(ctx))
		}
		return fmt.Errorf("plugin %q: CheckConfig did not answer in time: %w", name, context.DeadlineExceeded)
	}
	st := status.Convert(err)
	switch st.Code() {
	case codes.InvalidArgument:
		return &ConfigError{Plugin: name, Message: textline.Escape(st.Message(), maxQuoted)}
	case codes.Unimplemented:
		return fmt.Errorf("plugin %q: %w", name, ErrConfigCheckUnsupported)
	}
	return fmt.Errorf("plugin %q: CheckConfig failed: %w", name, status.Error(st.Code(), rpcText(err)))
}
