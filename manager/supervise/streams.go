package supervise

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/manager/inventory"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/textline"
	"github.com/devicehost/devicehost/validate"
)

const (
	// statsStallFactor × the sampling interval (at least minStatsStall) without a stats
	// message ends the stats stream as stalled; it is then retried with backoff.
	statsStallFactor = 5
	minStatsStall    = 2 * time.Second
)

// budgetRefusal stands for every byte-budget refusal in a row of refusals, whose texts
// differ only in sizes.
const budgetRefusal = "\x00over the byte budget"

// fingerprint consumes the fingerprint stream for one run. The first message must come
// within FingerprintTimeout. Each message is validated and charged against the host's
// byte budget: a refused one is logged (once while the same refusal repeats) and the
// last good inventory stays; a good one replaces the plugin's inventory, less the
// device IDs bound to other plugins (logged once per change, naming them and those plugins).
// The first good one sets *upAt, closes fingerprinted and calls onUp. It returns only
// with an error: the stream is the plugin's lifeline, so its end ends the run (and the
// plugin is restarted).
func (s *Supervisor) fingerprint(ctx context.Context, p Plugin, fingerprinted chan<- struct{}, upAt *time.Time) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	firstTimer := time.AfterFunc(s.cfg.FingerprintTimeout, func() { cancel(errNoFirstFingerprint) })
	defer firstTimer.Stop()

	stream, err := p.Client().Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		return s.fingerprintError(ctx, p, err)
	}
	// Refusals are handled here, once: logged, and shown as the plugin's last error.
	// Only an accepted fingerprint stops the first-fingerprint timer, so a plugin that
	// never sends one is restarted, not left running deviceless.
	var refusals repeats
	var lastRefused string
	for {
		resp, err := stream.Recv()
		if err != nil {
			return s.fingerprintError(ctx, p, err)
		}
		if verr := validate.Fingerprint(resp); verr != nil {
			msg := textline.Line(verr.Error(), 0)
			if isNew, _, _ := refusals.see(msg); isNew {
				// State first, then the log: whoever reads the log line finds the
				// plugin's last error already saying it.
				s.reg.Rejected(s.name, fmt.Errorf("fingerprint rejected: %s", msg))
				s.log.Error("fingerprint rejected; keeping the last good inventory", "violations", msg)
			}
			continue
		}
		refused, err := s.reg.SetFingerprint(s.name, resp)
		if err != nil {
			// Keyed by kind, not text: the sizes in it change with every message.
			if isNew, _, _ := refusals.see(budgetRefusal); isNew {
				s.reg.Rejected(s.name, err)
				s.log.Error("fingerprint refused; keeping the last good inventory", "error", err)
			}
			continue
		}
		refusals.reset()
		switch {
		case refused == nil:
			lastRefused = ""
		case refused.Error() != lastRefused:
			lastRefused = refused.Error()
			s.reg.PluginError(s.name, refused)
			if len(refused.NotAllowed) > 0 {
				s.log.Error("device IDs outside the plugin's device_ids patterns refused", "devices", inventory.ListIDs(refused.NotAllowed))
			}
			for _, other := range slices.Sorted(maps.Keys(refused.ByPlugin)) {
				s.log.Error("device IDs bound to another plugin refused", "bound_to", other, "devices", inventory.ListIDs(refused.ByPlugin[other]))
			}
		}
		firstTimer.Stop()
		if fingerprinted != nil {
			*upAt = time.Now()
			close(fingerprinted)
			fingerprinted = nil
			s.up()
			if s.onUp != nil {
				s.onUp()
			}
		}
	}
}

func (s *Supervisor) fingerprintError(ctx context.Context, p Plugin, err error) error {
	switch {
	case context.Cause(ctx) == errNoFirstFingerprint:
		return fmt.Errorf("no fingerprint within %v of start: %w", s.cfg.FingerprintTimeout, errNoFirstFingerprint)
	case errors.Is(err, io.EOF):
		return errors.New("fingerprint stream ended")
	}
	return rpcError(ctx, p, "fingerprint stream", err)
}

// statsLoop keeps one stats stream open to the plugin for the run, reopening it with
// backoff when it fails or stalls. Every failure is logged with the plugin's error and
// recorded as the plugin's last error. It returns when ctx ends (nil) or the plugin
// exits (that error, ending the run).
//
// A failure identical to the one before is logged at DEBUG only, and the plugin's last
// error is not touched again; when the error changes, one line gives the count.
func (s *Supervisor) statsLoop(ctx context.Context, p Plugin) error {
	bo := s.backoff()
	var failures repeats
	for {
		started := time.Now()
		err := s.statsStream(ctx, p)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, errPluginExited) {
			return err
		}
		delay := bo.next(time.Since(started), 0)
		line := inventory.ErrorLine(err.Error())
		isNew, prev, times := failures.see(line)
		if times > 1 {
			s.log.Warn("stats stream failed repeatedly with the same error", "error", prev, "times", times)
		}
		if isNew {
			s.reg.PluginError(s.name, err)
			s.log.Warn("stats stream failed; retrying", "error", line, "retry_in", delay)
		} else {
			s.log.Debug("stats stream failed again with the same error; retrying", "error", line, "retry_in", delay)
		}
		if !sleep(ctx, delay) {
			return nil
		}
	}
}

// statsStream opens one stats stream and stores every message that validates, until
// the stream fails, stalls or ctx ends. Rejected messages are logged (once per distinct
// error in a row) and the last good stats stay.
func (s *Supervisor) statsStream(ctx context.Context, p Plugin) error {
	stall := max(statsStallFactor*s.cfg.StatsInterval, minStatsStall)
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	watchdog := time.AfterFunc(stall, func() { cancel(errStatsStalled) })
	defer watchdog.Stop()

	stream, err := p.Client().Stats(ctx, &pb.StatsRequest{Interval: durationpb.New(s.cfg.StatsInterval)})
	if err != nil {
		return s.statsError(ctx, p, err, stall)
	}
	var lastRejection string
	for {
		resp, err := stream.Recv()
		if err != nil {
			return s.statsError(ctx, p, err, stall)
		}
		watchdog.Reset(stall)
		if verr := validate.Stats(resp, s.reg.Known(s.name)); verr != nil {
			if msg := textline.Line(verr.Error(), 0); msg != lastRejection {
				lastRejection = msg
				s.log.Error("stats rejected; keeping the last good stats", "violations", msg)
			}
			continue
		}
		if err := s.stats.Set(s.name, resp, s.cfg.Now(), s.reg.StatsGroupCost(s.name)); err != nil {
			if lastRejection != budgetRefusal { // logged once in a row: the sizes change every message
				lastRejection = budgetRefusal
				s.log.Error("stats refused; keeping the last good stats", "error", err)
				s.reg.PluginError(s.name, err)
			}
			continue
		}
		lastRejection = ""
	}
}

func (s *Supervisor) statsError(ctx context.Context, p Plugin, err error, stall time.Duration) error {
	switch {
	case context.Cause(ctx) == errStatsStalled:
		return fmt.Errorf("no stats within %v: %w", stall, errStatsStalled)
	case errors.Is(err, io.EOF):
		return errors.New("stats stream ended")
	}
	return rpcError(ctx, p, "stats stream", err)
}
