package dra

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// staleRound is what one round of the stale-claim collector did.
type staleRound struct {
	claims   int      // claims with live reservations
	missing  int      // of them, not (or no longer with that UID) in the API server
	released []string // owners released this round
	err      error    // why the round stopped early (then nothing was released)
}

// staleLoop runs a round of collectStale at once and every StaleInterval until ctx
// ends.
func (d *Driver) staleLoop(ctx context.Context) error {
	t := time.NewTicker(d.cfg.StaleInterval)
	defer t.Stop()
	for {
		r := d.collectStale(ctx, time.Now())
		if r.err != nil && ctx.Err() == nil {
			d.log.Warn("stale claims not collected this round", "error", r.err)
		}
		if d.afterStaleRound != nil {
			d.afterStaleRound(r)
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return nil
		}
	}
}

// collectStale releases the reservations of claims that the API server has not had
// (by namespace, name and UID) for StaleGrace: claims deleted while the driver or the
// node was down, whose NodeUnprepareResources never came. A round in which the agent
// or the API server cannot be read releases nothing; the grace of a claim that is
// back (or whose reservations are gone) starts again when it is next missing.
func (d *Driver) collectStale(ctx context.Context, now time.Time) staleRound {
	byClaim, err := d.claimReservations(ctx)
	if err != nil {
		return staleRound{err: err}
	}
	r := staleRound{claims: len(byClaim)}
	missing := make(map[claimRef]bool)
	for ref := range byClaim {
		c, err := d.cfg.Kube.ResourceV1().ResourceClaims(ref.namespace).Get(ctx, ref.name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			missing[ref] = true
		case err != nil:
			return staleRound{claims: len(byClaim), err: fmt.Errorf("read claim %s/%s: %w", ref.namespace, ref.name, err)}
		case c.UID != types.UID(ref.uid):
			missing[ref] = true
		}
	}
	r.missing = len(missing)
	for owner := range d.stale {
		if ref, ok := parseOwner(owner); !ok || !missing[ref] {
			delete(d.stale, owner)
		}
	}
	for ref := range missing {
		owner := ref.owner()
		since, seen := d.stale[owner]
		if !seen {
			d.stale[owner] = now
			d.log.Info("claim with reservations is gone from the API server; released after the grace period unless it comes back",
				"owner", owner, "grace", d.cfg.StaleGrace)
			since = now
		}
		if now.Sub(since) < d.cfg.StaleGrace {
			continue
		}
		if err := d.unprepare(ctx, ref); err != nil {
			d.log.Warn("stale claim not released", "owner", owner, "error", err)
			continue
		}
		delete(d.stale, owner)
		r.released = append(r.released, owner)
		d.log.Info("stale claim released", "owner", owner, "missing_for", now.Sub(since).Round(time.Millisecond))
	}
	return r
}
