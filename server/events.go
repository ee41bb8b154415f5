package server

import (
	"google.golang.org/grpc"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/validate"
)

// WatchEvents sends the audit trail after the request's position, a page per message,
// and with follow each new event as it is committed. It counts as a stream (max_streams).
func (s *Server) WatchEvents(req *pb.WatchEventsRequest, stream grpc.ServerStreamingServer[pb.WatchEventsResponse]) error {
	f := device.EventFilter{After: req.GetAfterSeq(), Owner: req.GetOwnerId(), Device: req.GetDeviceId()}
	if err := validate.EventFilter(f); err != nil {
		return toStatus(err)
	}
	ctx := stream.Context()
	release, err := s.limits.acquire(ctx)
	if err != nil {
		return err
	}
	defer release()
	for {
		// Ask for the wake-up first: an event committed while the page is read wakes it.
		next := s.mgr.EventsAfter(f.After)
		page, err := s.mgr.Events(ctx, f)
		if err != nil {
			return toStatus(err)
		}
		if len(page.Events) > 0 {
			out := &pb.WatchEventsResponse{Events: make([]*pb.Event, 0, len(page.Events)), OldestSeq: page.Oldest}
			for _, e := range page.Events {
				out.Events = append(out.Events, eventToProto(e))
			}
			if err := stream.Send(out); err != nil {
				return err
			}
		}
		if page.Through > f.After {
			f.After = page.Through
			continue // read on: there may be more
		}
		if !req.GetFollow() {
			return nil
		}
		select {
		case <-next:
		case <-ctx.Done():
			return ctx.Err()
		case <-s.quit:
			return errServerShutdown
		}
	}
}

func eventToProto(e device.Event) *pb.Event {
	return &pb.Event{
		Seq: e.Seq, Time: timeToProto(e.Time), Kind: string(e.Kind), By: e.By, Call: e.Call,
		OwnerId: e.Owner, NewOwnerId: e.NewOwner, DeviceIds: e.Devices, ReservationIds: e.Reservations, Detail: e.Detail,
	}
}
