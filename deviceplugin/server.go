package deviceplugin

import (
	"context"
	"errors"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Server adapts a Plugin to the generated pb.DevicePluginServer; it is what Serve
// registers. It is safe for concurrent use and holds no resources of its own.
//
// Errors: SetConfig's and CheckConfig's errors become INVALID_ARGUMENT with their message; an error that
// already carries a gRPC status keeps it; a stream whose context ended answers with the
// context's code (CANCELED / DEADLINE_EXCEEDED); other errors reach the host as UNKNOWN
// with their message. Fingerprint, Stats and Reserve before the first SetConfig are
// refused with FAILED_PRECONDITION, so an implementation never runs unconfigured.
type Server struct {
	pb.UnimplementedDevicePluginServer
	impl       Plugin
	configured atomic.Bool
}

var _ pb.DevicePluginServer = (*Server)(nil)

// NewServer returns a Server calling impl.
func NewServer(impl Plugin) *Server {
	return &Server{impl: impl}
}

// GetPluginInfo answers with impl.Info and the protocol version this SDK speaks.
func (s *Server) GetPluginInfo(context.Context, *pb.GetPluginInfoRequest) (*pb.GetPluginInfoResponse, error) {
	info := s.impl.Info()
	return &pb.GetPluginInfoResponse{
		Name:             info.Name,
		PluginVersion:    info.Version,
		ProtocolVersions: []string{ProtocolVersion},
	}, nil
}

// SetConfig hands the config to impl. It may be called again (a host that reattaches
// after a restart configures the plugin again).
func (s *Server) SetConfig(ctx context.Context, req *pb.SetConfigRequest) (*pb.SetConfigResponse, error) {
	if v := req.GetProtocolVersion(); v != "" && v != ProtocolVersion {
		return nil, status.Errorf(codes.FailedPrecondition,
			"host chose protocol version %q, plugin speaks [%s]", v, ProtocolVersion)
	}
	if err := s.impl.SetConfig(ctx, req.GetConfigJson()); err != nil {
		return nil, configError(err)
	}
	s.configured.Store(true)
	return &pb.SetConfigResponse{}, nil
}

// CheckConfig calls impl's CheckConfig when it implements ConfigChecker, else answers
// UNIMPLEMENTED (the host then applies a new config without checking it first). It
// needs no SetConfig before it.
func (s *Server) CheckConfig(ctx context.Context, req *pb.CheckConfigRequest) (*pb.CheckConfigResponse, error) {
	chk, ok := s.impl.(ConfigChecker)
	if !ok {
		return nil, status.Error(codes.Unimplemented, "plugin does not implement CheckConfig")
	}
	if err := chk.CheckConfig(ctx, req.GetConfigJson()); err != nil {
		return nil, configError(err)
	}
	return &pb.CheckConfigResponse{}, nil
}

// configError is how a config the plugin refuses reaches the host, from SetConfig and
// CheckConfig alike: INVALID_ARGUMENT with the error's message.
func configError(err error) error {
	return status.Error(codes.InvalidArgument, err.Error())
}

// Fingerprint runs impl.Fingerprint until the stream's context ends.
func (s *Server) Fingerprint(_ *pb.FingerprintRequest, stream grpc.ServerStreamingServer[pb.FingerprintResponse]) error {
	if err := s.checkConfigured(); err != nil {
		return err
	}
	ctx := stream.Context()
	err := s.impl.Fingerprint(ctx, func(m *pb.FingerprintResponse) error {
		if m == nil {
			return errors.New("deviceplugin: Fingerprint sent a nil message")
		}
		return stream.Send(m)
	})
	return streamError(ctx, err)
}

// Stats runs impl.Stats with the requested interval until the stream's context ends.
func (s *Server) Stats(req *pb.StatsRequest, stream grpc.ServerStreamingServer[pb.StatsResponse]) error {
	if err := s.checkConfigured(); err != nil {
		return err
	}
	iv := req.GetInterval()
	if iv == nil {
		return status.Error(codes.InvalidArgument, "interval: required")
	}
	if err := iv.CheckValid(); err != nil {
		return status.Errorf(codes.InvalidArgument, "interval: %v", err)
	}
	interval := iv.AsDuration()
	if interval <= 0 {
		return status.Errorf(codes.InvalidArgument, "interval: must be positive, got %s", interval)
	}
	ctx := stream.Context()
	err := s.impl.Stats(ctx, interval, func(m *pb.StatsResponse) error {
		if m == nil {
			return errors.New("deviceplugin: Stats sent a nil message")
		}
		return stream.Send(m)
	})
	return streamError(ctx, err)
}

// Reserve calls impl's ReserveOptions when it implements OptionReserver, else
// impl.Reserve; a request with options for an impl without OptionReserver is refused
// (UnknownOptions) before impl is called.
func (s *Server) Reserve(ctx context.Context, req *pb.ReserveRequest) (*pb.ReserveResponse, error) {
	if err := s.checkConfigured(); err != nil {
		return nil, err
	}
	var r *pb.ContainerReservation
	var err error
	if or, ok := s.impl.(OptionReserver); ok {
		r, err = or.ReserveOptions(ctx, req.GetDeviceIds(), req.GetOptions())
	} else if err = UnknownOptions(s.impl.Info().Name, req.GetOptions()); err == nil {
		r, err = s.impl.Reserve(ctx, req.GetDeviceIds())
	}
	if err != nil {
		return nil, rpcError(ctx, err)
	}
	if r == nil {
		r = &pb.ContainerReservation{}
	}
	return &pb.ReserveResponse{Reservation: r}, nil
}

// Release calls impl's Release when it implements Releaser, else answers UNIMPLEMENTED
// (which the host treats as "nothing to clean").
func (s *Server) Release(ctx context.Context, req *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	rel, ok := s.impl.(Releaser)
	if !ok {
		return nil, status.Error(codes.Unimplemented, "plugin does not implement Release")
	}
	if err := s.checkConfigured(); err != nil {
		return nil, err
	}
	if err := rel.Release(ctx, req.GetReservationId(), req.GetDeviceIds()); err != nil {
		return nil, rpcError(ctx, err)
	}
	return &pb.ReleaseResponse{}, nil
}

// Reconcile calls impl's Reconcile when it implements Reconciler, else answers
// UNIMPLEMENTED (which the host treats as "nothing to do").
func (s *Server) Reconcile(ctx context.Context, req *pb.ReconcileRequest) (*pb.ReconcileResponse, error) {
	rec, ok := s.impl.(Reconciler)
	if !ok {
		return nil, status.Error(codes.Unimplemented, "plugin does not implement Reconcile")
	}
	if err := s.checkConfigured(); err != nil {
		return nil, err
	}
	live := make([]LiveReservation, len(req.GetReservations()))
	for i, r := range req.GetReservations() {
		live[i] = LiveReservation{ID: r.GetReservationId(), DeviceIDs: r.GetDeviceIds(), Options: r.GetOptions()}
	}
	if err := rec.Reconcile(ctx, live); err != nil {
		return nil, rpcError(ctx, err)
	}
	return &pb.ReconcileResponse{}, nil
}

func (s *Server) checkConfigured() error {
	if !s.configured.Load() {
		return status.Error(codes.FailedPrecondition, "SetConfig has not been called")
	}
	return nil
}

// streamError turns what a stream method returned into the stream's status.
func streamError(ctx context.Context, err error) error {
	if err == nil && ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	if err == nil {
		return nil
	}
	return rpcError(ctx, err)
}

// rpcError keeps a gRPC status, reports an ended context with its code, and leaves
// anything else to gRPC (UNKNOWN with the message).
func rpcError(ctx context.Context, err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	if ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return status.FromContextError(ctx.Err()).Err()
	}
	return err
}
