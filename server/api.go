package server

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/internal/steps"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server/internal/fanout"
	"github.com/devicehost/devicehost/validate"
)

// Fingerprint sends the full snapshot of the groups the request selects at once, and
// then on every change. Every Fingerprint stream shares one Manager watch; a slow
// client skips to the newest snapshot (see package fanout).
func (s *Server) Fingerprint(req *pb.FingerprintRequest, stream grpc.ServerStreamingServer[pb.FingerprintResponse]) error {
	filter, err := newStreamFilter(req.GetGroups(), req.GetPlugins())
	if err != nil {
		return toStatus(err)
	}
	ctx := stream.Context()
	release, err := s.limits.acquire(ctx)
	if err != nil {
		return err
	}
	defer release()
	sb, cur, _, ok := s.fingerprints.Join("", s.mgr.Watch, sendStream(stream), connID(ctx), filter.key(), newSnapshotEncoder(filter).encode)
	if !ok {
		return errServerShutdown
	}
	defer sb.Leave()
	first := cur
	// The Manager publishes a change once the reply of the call that made it is out
	// (device.AfterReply), and the feed's goroutine takes it after that: a stream
	// joining in between would get the snapshot from before a Reserve its client has
	// seen answered. Its first message is the Manager's current snapshot then.
	if snap := s.mgr.Snapshot(); cur != nil && snap.Seq > cur.Seq() {
		first = newSnapshotEncoder(filter).encode(snap)
	}
	return s.serveStream(ctx, sb, first, cur)
}

// Stats sends the stats of the groups the request selects at the requested interval.
// The streams asking for the same interval share one Manager watch, and those with the
// same filter too one encoding of each message.
func (s *Server) Stats(req *pb.StatsRequest, stream grpc.ServerStreamingServer[pb.StatsResponse]) error {
	interval, err := statsInterval(req)
	if err != nil {
		return toStatus(err)
	}
	filter, err := newStreamFilter(req.GetGroups(), req.GetPlugins())
	if err != nil {
		return toStatus(err)
	}
	ctx := stream.Context()
	release, err := s.limits.acquire(ctx)
	if err != nil {
		return err
	}
	defer release()
	encode := func(snap device.StatsSnapshot) *fanout.Frame { return fanout.Encode(statsToProto(snap, filter)) }
	watch := func(ctx context.Context) <-chan device.StatsSnapshot { return s.mgr.WatchStats(ctx, interval) }
	sb, cur, hadValue, ok := s.stats.Join(interval.String(), watch, sendStream(stream), connID(ctx), filter.key(), encode)
	if !ok {
		return errServerShutdown
	}
	defer sb.Leave()
	first := cur
	if hadValue {
		// The shared watch's latest value may be up to an interval old; the first
		// message is a fresh one.
		if first, err = s.freshStats(ctx, watch, encode); err != nil {
			return err
		}
	}
	return s.serveStream(ctx, sb, first, cur)
}

// statsInterval converts a Stats request's interval, once it is a valid Duration and
// validate.StatsInterval accepts it.
func statsInterval(req *pb.StatsRequest) (time.Duration, error) {
	if req.GetInterval() == nil {
		return 0, nil
	}
	if err := req.GetInterval().CheckValid(); err != nil {
		return 0, &device.FieldError{Field: "interval", Rule: err.Error()}
	}
	interval := req.GetInterval().AsDuration()
	if err := validate.StatsInterval(interval); err != nil {
		return 0, err
	}
	return interval, nil
}

// freshStats takes the current stats from a watch of its own, which it ends.
func (s *Server) freshStats(ctx context.Context, watch func(context.Context) <-chan device.StatsSnapshot, encode func(device.StatsSnapshot) *fanout.Frame) (*fanout.Frame, error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	select {
	case <-s.quit:
		return nil, errServerShutdown
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	case v, ok := <-watch(wctx):
		if !ok {
			return nil, streamClosed(ctx)
		}
		return encode(v), nil
	}
}

// serveStream sends first (unless nil), and hands the stream to its feed's rounds, which
// send its group's newest frame on every change, skipping a frame already sent (seen: the
// group's frame when the stream joined). It returns when a send fails, the stream's
// context ends, the feed's Manager watch closes or the server shuts down; the caller's
// Leave then waits for a send in progress.
func (s *Server) serveStream(ctx context.Context, sb *fanout.Sub, first, seen *fanout.Frame) error {
	sb.Start(first, seen)
	select {
	case <-sb.Failed():
		return sb.Err()
	case <-s.quit:
		return errServerShutdown
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	case <-sb.Gone():
		return streamClosed(ctx)
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

// Reserve validates the request and reserves the devices, taking them over from the
// owners the request names (take_over_owner_prefixes) when it names any.
func (s *Server) Reserve(ctx context.Context, in *pb.ReserveRequest) (*pb.ReserveResponse, error) {
	region := steps.Start(ctx, "validate request")
	req := reserveRequestFromProto(in)
	err := validate.ReserveRequest(req)
	region.End()
	if err != nil {
		return nil, toStatus(err)
	}
	if err := mayReserve(ctx, req); err != nil {
		return nil, toStatus(err)
	}
	res, err := s.mgr.Reserve(device.WithCaller(ctx, describeCaller(ctx)), req)
	if err != nil {
		return nil, toStatus(err)
	}
	defer steps.Start(ctx, "reply").End()
	return &pb.ReserveResponse{
		ReservationId:           res.ID,
		Reservation:             containerToProto(res.Container),
		TakenOverReservationIds: res.TakenOver,
	}, nil
}

// Release validates the request, ends the reservations it names and says which it
// released and which were released before.
func (s *Server) Release(ctx context.Context, in *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	region := steps.Start(ctx, "validate request")
	req := releaseRequestFromProto(in)
	err := validate.ReleaseRequest(req)
	region.End()
	if err != nil {
		return nil, toStatus(err)
	}
	if req.OwnerID != "" {
		if err := mayOwn(ctx, fmt.Sprintf("release for owner %q", req.OwnerID), req.OwnerID); err != nil {
			return nil, toStatus(err)
		}
	}
	req.OwnerPrefixes = ownerPrefixes(ctx)
	res, err := s.mgr.Release(device.WithCaller(ctx, describeCaller(ctx)), req)
	if err != nil {
		return nil, toStatus(withCaller(ctx, err))
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
	for _, owner := range []string{req.OwnerID, req.NewOwnerID} {
		if err := mayOwn(ctx, fmt.Sprintf("reown reservation %q from owner %q to %q", req.ReservationID, req.OwnerID, req.NewOwnerID), owner); err != nil {
			return nil, toStatus(err)
		}
	}
	r, err := s.mgr.Reown(device.WithCaller(ctx, describeCaller(ctx)), req)
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

// CordonDevice validates the request and takes the device out of service, in the name
// of the caller (its listener and peer).
func (s *Server) CordonDevice(ctx context.Context, in *pb.CordonDeviceRequest) (*pb.CordonDeviceResponse, error) {
	req := device.CordonRequest{DeviceID: in.GetDeviceId(), Reason: in.GetReason(), Drain: in.GetDrain(), By: describeCaller(ctx)}
	if err := validate.CordonRequest(req); err != nil {
		return nil, toStatus(err)
	}
	c, err := s.mgr.Cordon(device.WithCaller(ctx, req.By), req)
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.CordonDeviceResponse{Cordon: cordonToProto(c)}, nil
}

// UncordonDevice puts the device back in service and returns the cordon it lifted.
func (s *Server) UncordonDevice(ctx context.Context, in *pb.UncordonDeviceRequest) (*pb.UncordonDeviceResponse, error) {
	id := in.GetDeviceId()
	if err := validate.UncordonRequest(id); err != nil {
		return nil, toStatus(err)
	}
	was, err := s.mgr.Uncordon(device.WithCaller(ctx, describeCaller(ctx)), id)
	if err != nil {
		return nil, toStatus(err)
	}
	out := &pb.UncordonDeviceResponse{}
	if was != nil {
		out.Lifted = cordonToProto(*was)
	}
	return out, nil
}

// sendStream is the stream a feed sends a handler's messages on: ss past the wrappers
// that leave SendMsg as the wrapped stream's (the generated code's typed stream,
// StrictServices' and the access check's), so that a round's send for each stream does
// not go through them: each is an object of its own, one more cache miss per stream
// and message when thousands are sent to. Any other wrapper (a ServerOption's
// interceptor) stays in the way, as it may send differently.
func sendStream(ss grpc.ServerStream) fanout.Sender {
	for {
		switch s := ss.(type) {
		case *grpc.GenericServerStream[pb.FingerprintRequest, pb.FingerprintResponse]:
			ss = s.ServerStream
		case *grpc.GenericServerStream[pb.StatsRequest, pb.StatsResponse]:
			ss = s.ServerStream
		case *callerStream:
			ss = s.ServerStream
		default:
			inner, ok := fanout.Unstrict(ss)
			if !ok {
				return ss
			}
			ss = inner
		}
	}
}
