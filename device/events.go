package device

import (
	"context"
	"time"
)

// EventKind is what an event of the audit trail records.
type EventKind string

// The kinds of events: every change to the ledger or to who may hold a device.
const (
	EventReserve  EventKind = "reserve"   // a new reservation (a retried Reserve that got its own is none)
	EventTakeOver EventKind = "take-over" // a reservation released by another's Reserve (its take-over prefixes)
	EventRelease  EventKind = "release"   // reservations released by a Release
	EventReown    EventKind = "reown"     // a reservation handed to another owner
	EventDelete   EventKind = "gc-delete" // released reservations deleted by the garbage collector
	EventCordon   EventKind = "cordon"    // a device taken out of service
	EventUncordon EventKind = "uncordon"  // a device put back in service
	EventRefused  EventKind = "refused"   // a Reserve, Release or Reown the ledger refused
	// An admin access given (ReserveRequest.AdminAccess), and one ended by a Release.
	EventAdminAccess    EventKind = "admin-access"
	EventAdminAccessEnd EventKind = "admin-access-end"
)

// Event is one entry of the audit trail, kept in the ledger (Manager.Events).
type Event struct {
	// Seq is the event's position: increasing in commit order, never reused, with gaps
	// where events were not committed. A consumer resumes after the last it saw.
	Seq  uint64
	Time time.Time
	Kind EventKind
	// By is who made the call (the caller's listener and peer, see WithCaller); "gc"
	// for the garbage collector; empty where unknown.
	By string
	// Call, for a refused call, is what was asked: "reserve", "release" or "reown".
	Call         string
	Owner        string   // the owner the call was for; for a reown, the old one
	NewOwner     string   // a reown's new owner
	Devices      []string // the devices concerned
	Reservations []string // the reservations concerned
	// Detail says more: a cordon's reason, a take-over's new holder, a refusal's error.
	Detail string
}

// EventFilter selects events of the trail; zero fields match anything.
type EventFilter struct {
	After  uint64 // only events with a larger Seq
	Owner  string // an owner; ending in "/": every owner that starts with it
	Device string
	// Limit bounds the events returned; zero means MaxEventsPerCall.
	Limit int
}

// MaxEventsPerCall bounds what one Manager.Events call returns.
const MaxEventsPerCall = 1024

// EventsResult is a page of the trail: the events matching the filter, and how far it
// was read (a later call resumes with After set to Through).
type EventsResult struct {
	Events  []Event
	Through uint64 // the last Seq examined; the filter's After when there is nothing new
	Oldest  uint64 // the oldest Seq the trail still holds; 0 when it holds none
}

type callerKey struct{}

// WithCaller returns ctx carrying who makes the call (the server's name for its
// listener and peer), for the audit trail of what the call changes.
func WithCaller(ctx context.Context, by string) context.Context {
	return context.WithValue(ctx, callerKey{}, by)
}

// CallerOf is the caller WithCaller put in ctx; "" where none.
func CallerOf(ctx context.Context) string {
	by, _ := ctx.Value(callerKey{}).(string)
	return by
}
