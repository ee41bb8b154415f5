package shim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/backoff"
	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/integrations/nomad/nomadapi"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/textline"
)

const (
	// DefaultReleaseGrace is how long a reservation no running allocation holds stays
	// before it is released.
	DefaultReleaseGrace = 30 * time.Second
	// blockingWait is the wait of each blocking query (Nomad's default).
	blockingWait = 5 * time.Minute
	// fetchSlack is added to a query's wait and jitter for its deadline, and bounds a
	// query that does not block.
	fetchSlack = 15 * time.Second
	// minPause paces blocking queries that answer without a new index.
	minPause = time.Second
	// passTimeout bounds one pass's calls at the agent.
	passTimeout = 10 * time.Second
	// passRetry is when a pass whose agent calls failed is tried again.
	passRetry = 5 * time.Second
	// maxLogValue bounds a value from Nomad in a log line.
	maxLogValue = 512
	// startupQuiet is how long after the follower starts a failure to read Nomad is
	// only logged at DEBUG, unless Nomad was read before: a Nomad agent launches its
	// plugins before its HTTP API listens.
	startupQuiet = 30 * time.Second
)

// errNotClient is a Nomad agent that runs no client: it has no node to follow.
var errNotClient = errors.New("the Nomad agent runs no client (its /v1/agent/self names no client node_id)")

// followConfig is what the allocation follower needs.
type followConfig struct {
	nomad *nomadapi.Client
	agent *client.Client
	grace time.Duration
	clock clock
	log   hclog.Logger
	// observe, if set, is told of each answer, failure and pass (tests).
	observe func(followEvent)
}

// eventKind is what a followEvent reports.
type eventKind int

const (
	evFetched eventKind = iota + 1 // Nomad answered
	evFailed                       // Nomad could not be read
	evPass                         // a pass over the agent's reservations ended
)

// followEvent is one step of the follower, for tests.
type followEvent struct {
	kind     eventKind
	index    uint64   // evFetched: X-Nomad-Index
	err      error    // evFailed
	reowned  []string // evPass: "reservation=owner"
	released []string // evPass: reservation IDs
}

// follower follows the node's allocations in Nomad and, by them, names the agent's
// "nomad/" reservations after the tasks that hold them and releases those whose
// allocation ended (see tracker.decide). Run owns it; Nudge is safe from any goroutine.
type follower struct {
	cfg   followConfig
	nudge chan struct{} // a Reserve happened: ask Nomad afresh
	track *tracker

	started     time.Time // when run began
	everRead    bool      // Nomad answered at least once
	lastProblem string    // key of the Nomad access problem last logged
	lastPassErr string    // the last agent failure of a pass logged
}

func newFollower(cfg followConfig) *follower {
	return &follower{cfg: cfg, nudge: make(chan struct{}, 1), track: newTracker(cfg.grace)}
}

// Nudge asks for an answer of Nomad sent after now, so that a reservation just made
// is judged soon rather than at the next change of the node's allocations.
func (f *follower) Nudge() {
	select {
	case f.nudge <- struct{}{}:
	default:
	}
}

// fetchResult is one answer of Nomad, or why there is none.
type fetchResult struct {
	gen    int
	issued time.Time
	q      nomadapi.Query
	nodeID string
	allocs []nomadapi.Allocation
	meta   nomadapi.Meta
	err    error
}

// run follows Nomad until ctx ends: a blocking query after each answer (a change is
// seen at once), a query that answers at once after a Nudge, a pass over the agent's
// reservations after each answer and when a grace period ends, and nothing released
// while Nomad cannot be read (retried with backoff). It returns once the query in
// flight has returned.
func (f *follower) run(ctx context.Context) {
	var (
		nodeID   string
		index    uint64
		view     *nomadView
		readable bool
		gen      int
		inFlight bool
		cancel   = func() {}
		retryC   <-chan time.Time
		stopRtry = func() {}
		graceC   <-chan time.Time
		stopGrc  = func() {}
		bo       = backoff.Backoff{Base: time.Second, Max: 30 * time.Second}
		wg       sync.WaitGroup
	)
	f.started = f.cfg.clock.Now()
	results := make(chan fetchResult)
	defer func() {
		cancel()
		wg.Wait()
		stopRtry()
		stopGrc()
	}()
	start := func(q nomadapi.Query) {
		gen++
		timeout := fetchSlack
		if q.Index > 0 {
			timeout += q.Wait + q.Wait/16
		}
		fctx, fcancel := context.WithTimeout(ctx, timeout)
		cancel, inFlight = fcancel, true
		g, node, issued := gen, nodeID, f.cfg.clock.Now()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer fcancel()
			r := f.fetch(fctx, node, q)
			r.gen, r.issued, r.q = g, issued, q
			select {
			case results <- r:
			case <-ctx.Done():
			}
		}()
	}
	setRetry := func(d time.Duration) {
		stopRtry()
		retryC, stopRtry = f.cfg.clock.NewTimer(d)
	}
	pass := func() {
		next, ev := f.pass(ctx, view)
		stopGrc()
		graceC, stopGrc = nil, func() {}
		if !next.IsZero() {
			graceC, stopGrc = f.cfg.clock.NewTimer(max(next.Sub(f.cfg.clock.Now()), 0))
		}
		f.emit(ev) // once the timer is set: a test may move the clock on it
	}

	start(nomadapi.Query{})
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-results:
			if r.gen != gen {
				continue // superseded by a Nudge
			}
			inFlight = false
			if r.err != nil {
				if ctx.Err() != nil {
					return
				}
				readable, nodeID, index = false, "", 0
				f.problem(r.err)
				setRetry(bo.Next())
				f.emit(followEvent{kind: evFailed, err: r.err})
				continue
			}
			bo.Reset()
			if !readable {
				f.recovered()
			}
			f.everRead = true
			readable, nodeID = true, r.nodeID
			advanced := r.meta.Index > index
			switch {
			case r.meta.Index < index:
				index = 0 // Nomad's index went back (a restored snapshot): start over
			default:
				index = max(r.meta.Index, 1)
			}
			view = &nomadView{issued: r.issued, index: r.meta.Index, allocs: r.allocs}
			f.emit(followEvent{kind: evFetched, index: r.meta.Index})
			pass()
			if r.q.Index > 0 && !advanced {
				setRetry(minPause)
			} else {
				start(nomadapi.Query{Index: index, Wait: blockingWait})
			}
		case <-retryC:
			retryC = nil
			if !inFlight {
				start(nomadapi.Query{Index: index, Wait: blockingWait})
			}
		case <-graceC:
			graceC = nil
			if readable && view != nil {
				pass()
			}
		case <-f.nudge:
			if !inFlight && !readable {
				continue // waiting to retry: the retry is sent after this anyway
			}
			// The query in flight may have been sent before the reservation was made,
			// and a blocking one may not answer until the next change: ask anew.
			cancel()
			stopRtry()
			retryC = nil
			start(nomadapi.Query{})
		}
	}
}

// fetch reads the node's allocations at q, finding the node first when nodeID is "".
func (f *follower) fetch(ctx context.Context, nodeID string, q nomadapi.Query) fetchResult {
	if nodeID == "" {
		self, err := f.cfg.nomad.Self(ctx)
		if err != nil {
			return fetchResult{err: err}
		}
		if nodeID = self.NodeID(); nodeID == "" {
			return fetchResult{err: errNotClient}
		}
		q = nomadapi.Query{}
	}
	allocs, meta, err := f.cfg.nomad.NodeAllocations(ctx, nodeID, q)
	return fetchResult{nodeID: nodeID, allocs: allocs, meta: meta, err: err}
}

// pass lists the agent's live reservations, decides by view and makes the calls;
// it returns when the next pass is due without a new answer (zero: none), and what it
// did.
func (f *follower) pass(ctx context.Context, view *nomadView) (time.Time, followEvent) {
	ctx, cancel := context.WithTimeout(ctx, passTimeout)
	defer cancel()
	log := f.cfg.log
	rs, err := f.cfg.agent.Reservations(ctx, &pb.ListReservationsRequest{State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil {
		if ctx.Err() == nil || errors.Is(ctx.Err(), context.DeadlineExceeded) {
			f.passFailed("cannot list the agent's reservations; trying again", err)
		}
		return f.cfg.clock.Now().Add(passRetry), followEvent{kind: evPass}
	}
	now := f.cfg.clock.Now()
	acts, next := f.track.decide(view, rs, now)
	ev := followEvent{kind: evPass}
	failed := false
	for _, a := range acts {
		id := a.res.GetReservationId()
		bk := f.track.bookings[id]
		switch a.kind {
		case actReown:
			if _, err := f.cfg.agent.Reown(ctx, id, a.res.GetOwnerId(), a.newOwner); err != nil {
				if changed(err) {
					// Released or reowned since the listing (a Reserve took it over):
					// the next pass sees it as it is now.
					log.Debug("reservation changed before it could be named", "reservation", id, "error", err)
					continue
				}
				log.Warn("cannot name a reservation after the Nomad task that holds it; trying again at the next change",
					"reservation", id, "owner", textline.Escape(a.newOwner, maxLogValue), "error", err)
				bk.reownFailed = a.newOwner
				continue
			}
			log.Info("reservation serves a Nomad task", "reservation", id, "owner", textline.Escape(a.newOwner, maxLogValue),
				"devices", a.res.GetDeviceIds(), "was_owner", a.res.GetOwnerId())
			ev.reowned = append(ev.reowned, id+"="+a.newOwner)
		case actRelease:
			_, err := f.cfg.agent.ReleaseReservation(ctx, id)
			if err != nil && !client.IsReservationNotFound(err) {
				if msg := err.Error(); msg != bk.releaseFailed {
					log.Warn("cannot release a reservation no running Nomad allocation holds; trying again",
						"reservation", id, "error", err)
					bk.releaseFailed = msg
				}
				failed = true
				continue
			}
			log.Info("released a reservation no running Nomad allocation holds", "reservation", id,
				"owner", a.res.GetOwnerId(), "devices", a.res.GetDeviceIds(), "reason", textline.Escape(a.why, maxLogValue),
				"free_for", a.freeFor.Round(time.Millisecond))
			delete(f.track.bookings, id)
			ev.released = append(ev.released, id)
		}
	}
	if f.lastPassErr != "" && !failed {
		log.Info("the agent answers the allocation follower again")
		f.lastPassErr = ""
	}
	if failed {
		if retry := now.Add(passRetry); next.IsZero() || retry.Before(next) {
			next = retry
		}
	}
	return next, ev
}

// changed reports whether a Reown failed because the reservation is no longer as
// listed: unknown (deleted), released, or of another owner. An owner the agent refuses
// is INVALID_ARGUMENT too, but names new_owner_id.
func changed(err error) bool {
	if client.IsReservationNotFound(err) {
		return true
	}
	st, ok := status.FromError(err)
	return ok && st.Code() == codes.InvalidArgument && !strings.Contains(st.Message(), "new_owner_id")
}

func (f *follower) passFailed(what string, err error) {
	if msg := what + ": " + err.Error(); msg != f.lastPassErr {
		f.cfg.log.Warn(what, "error", err)
		f.lastPassErr = msg
	}
}

// problem logs why Nomad cannot be read, at WARN, when the reason differs from the
// last one logged; at DEBUG while Nomad was never read and the follower started less
// than startupQuiet ago.
func (f *follower) problem(err error) {
	key, hint := accessProblem(err)
	if key == f.lastProblem {
		return
	}
	if !f.everRead && f.cfg.clock.Now().Sub(f.started) < startupQuiet {
		f.cfg.log.Debug("cannot read this node's allocations from Nomad yet", "nomad_address", f.cfg.nomad.Address(), "error", err)
		return
	}
	f.lastProblem = key
	f.cfg.log.Warn("cannot read this node's allocations from Nomad: reservations keep the owner Reserve gave them and are released only when Nomad hands their devices to another allocation, until it can",
		"nomad_address", f.cfg.nomad.Address(), "error", err, "hint", hint)
}

// recovered logs that Nomad can be read again, if a problem was logged.
func (f *follower) recovered() {
	if f.lastProblem != "" {
		f.cfg.log.Info("reading this node's allocations from Nomad again", "nomad_address", f.cfg.nomad.Address())
	}
	f.lastProblem = ""
}

// accessProblem classes err so that the same problem is logged once however its
// message varies, with a hint at the fix.
func accessProblem(err error) (key, hint string) {
	var se *nomadapi.StatusError
	var ne net.Error
	switch {
	case errors.As(err, &se) && nomadapi.IsForbidden(err):
		return fmt.Sprintf("HTTP %d", se.Code), "give the shim a token (nomad_token or NOMAD_TOKEN) whose policy has agent read, node read and namespace \"*\" read-job (docs/nomad.md)"
	case errors.As(err, &se):
		return fmt.Sprintf("HTTP %d", se.Code), "the Nomad agent answered with an error"
	case errors.Is(err, errNotClient):
		return "not a client", "point nomad_address at this node's Nomad client agent"
	case errors.As(err, &ne):
		return "unreachable", "is the Nomad agent running, and nomad_address (or NOMAD_ADDR) its HTTP address?"
	}
	return err.Error(), ""
}

func (f *follower) emit(ev followEvent) {
	if f.cfg.observe != nil {
		f.cfg.observe(ev)
	}
}
