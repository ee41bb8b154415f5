package server

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/manager/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/validate"
)

// Fingerprint sends the full snapshot at once and then on every change. The Manager's
// latest-value delivery means a slow client skips to the newest snapshot.
func (s *Server) Fingerprint(_ *pb.FingerprintRequest, stream grpc.ServerStreamingServer[pb.FingerprintResponse]) error {
	ctx := stream.Context()
	return forward(ctx, s.quit, s.mgr.Watch(ctx), func(snap device.Snapshot) error {
		return stream.Send(snapshotToProto(snap.Inventory, snap.State, snap.Time))
	})
}

// Stats sends the stats of the groups that match the request's filters at the requested
// interval.
func (s *Server) Stats(req *pb.StatsRequest, stream grpc.ServerStreamingServer[pb.StatsResponse]) error {
	var interval = req.GetInterval().AsDuration()
	if req.GetInterval() != nil {
		if err := req.GetInterval().CheckValid(); err != nil {
			return toStatus(&device.FieldError{Field: "interval", Rule: err.Error()})
		}
	}
	if interval < 0 {
		return toStatus(&device.FieldError{Field: "interval", Rule: "must not be negative"})
	}
	ctx := stream.Context()
	filters := req.GetGroups()
	return forward(ctx, s.quit, s.mgr.WatchStats(ctx, interval), func(snap device.StatsSnapshot) error {
		return stream.Send(statsToProto(snap, filters))
	})
}

// forward calls send with each value from ch, a Manager watch channel, until send
// fails, ch closes, ctx ends or quit is closed; it returns the error that ends the
// stream.
func forward[T any](ctx context.Context, quit <-chan struct{}, ch <-chan T, send func(T) error) error {
	for {
		select {
		case <-quit:
			return errServerShutdown
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case v, ok := <-ch:
			if !ok {
				return streamClosed(ctx)
			}
			if err := send(v); err != nil {
				return err
			}
		}
	}
}

// streamClosed says why a Manager closed a watch channel: the caller went away, or the
// manager is shutting down.
func streamClosed(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return status.FromContextError(err).Err()
	}
	return status.Error(codes.Unavailable, "device manager closed the stream: "+device.ErrShuttingDown.Error())
}

// Reserve validates the request and reserves the devices.
func (s *Server) Reserve(ctx context.Context, in *pb.ReserveRequest) (*pb.ReserveResponse, error) {
	req := reserveRequestFromProto(in)
	if err := validate.ReserveRequest(req); err != nil {
		return nil, toStatus(err)
	}
	res, err := s.mgr.Reserve(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.ReserveResponse{
		ReservationId: res.ID,
		Reservation:   containerToProto(res.Container),
	}, nil
}

// Release validates the request, ends the reservations it names and says which it
// released and which were released before.
func (s *Server) Release(ctx context.Context, in *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	req := releaseRequestFromProto(in)
	if err := validate.ReleaseRequest(req); err != nil {
		return nil, toStatus(err)
	}
	res, err := s.mgr.Release(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.ReleaseResponse{
		ReleasedReservationIds:        res.Released,
		AlreadyReleasedReservationIds: res.AlreadyReleased,
	}, nil
}

// ListReservations lists the ledger's reservations that match the request's filters.
func (s *Server) ListReservations(ctx context.Context, in *pb.ListReservationsRequest) (*pb.ListReservationsResponse, error) {
	f, err := reservationFilterFromProto(in)
	if err != nil {
		return nil, toStatus(err)
	}
	if err := validate.ReservationFilter(f); err != nil {
		return nil, toStatus(err)
	}
	rs, err := s.mgr.Reservations(ctx, f)
	if err != nil {
		return nil, toStatus(err)
	}
	out := &pb.ListReservationsResponse{Reservations: make([]*pb.Reservation, 0, len(rs))}
	for _, r := range rs {
		out.Reservations = append(out.Reservations, reservationToProto(r))
	}
	return out, nil
}

// ReownReservation validates the request and hands the reservation to the new owner.
func (s *Server) ReownReservation(ctx context.Context, in *pb.ReownReservationRequest) (*pb.ReownReservationResponse, error) {
	req := device.ReownRequest{ReservationID: in.GetReservationId(), OwnerID: in.GetOwnerId(), NewOwnerID: in.GetNewOwnerId()}
	if err := validate.ReownRequest(req); err != nil {
		return nil, toStatus(err)
	}
	r, err := s.mgr.Reown(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.ReownReservationResponse{Reservation: reservationToProto(r)}, nil
}

// ListPlugins reports every plugin's status.
func (s *Server) ListPlugins(context.Context, *pb.ListPluginsRequest) (*pb.ListPluginsResponse, error) {
	st := s.mgr.State()
	out := &pb.ListPluginsResponse{Plugins: make([]*pb.Plugin, 0, len(st.Plugins))}
	for _, p := range st.Plugins {
		out.Plugins = append(out.Plugins, pluginToProto(p))
	}
	return out, nil
}
