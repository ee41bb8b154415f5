package pluginloader

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/deviceplugin"
)

// dialOptions are the host's gRPC dial options for plugin name: recvLimit's, and the
// connection's fixed windows (deviceplugin.Window).
func dialOptions(name string, max int) []grpc.DialOption {
	return append(recvLimit(name, max), deviceplugin.WindowDialOptions()...)
}

// recvLimit is the gRPC dial options that bound what the host reads from plugin name:
// messages of at most max bytes (go-plugin's own options, which come first, allow 2 GiB),
// and errors that say which plugin sent how much. gRPC reads only a message's 5-byte
// header before refusing it, so a refused message never sits in the host's memory.
func recvLimit(name string, max int) []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(max)),
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return limitError(name, method, invoker(ctx, method, req, reply, cc, opts...))
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			s, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil {
				return nil, limitError(name, method, err)
			}
			return &limitStream{ClientStream: s, name: name, method: method}, nil
		}),
	}
}

// limitStream rewrites the errors of RecvMsg with limitError.
type limitStream struct {
	grpc.ClientStream
	name, method string
}

func (s *limitStream) RecvMsg(m any) error {
	return limitError(s.name, s.method, s.ClientStream.RecvMsg(m))
}

// limitError turns gRPC's "received message larger than max (N vs. M)" into an error
// that names the plugin, the call and both sizes; other errors are returned as they are.
func limitError(name, method string, err error) error {
	if status.Code(err) != codes.ResourceExhausted {
		return err
	}
	var got, max int
	if _, scanErr := fmt.Sscanf(status.Convert(err).Message(), "grpc: received message larger than max (%d vs. %d)", &got, &max); scanErr != nil {
		return err
	}
	return status.Errorf(codes.ResourceExhausted, "plugin %q sent a %d-byte message in %s, over the host's limit of %d bytes; the message was refused",
		name, got, method, max)
}
