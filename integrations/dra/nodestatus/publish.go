package nodestatus

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/hashicorp/go-hclog"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/devicehost/devicehost/client"
)

// The server-side apply field managers of what Publisher writes: the node's labels and
// its status (the condition). A node's labels and condition it wrote are those these
// managers own: applying fewer removes the rest, and Remove removes them all, without
// reading or touching what other writers (the kubelet, GFD, a person) set. Two names,
// not one manager on two subresources, so that a writer that does not keep the
// subresources apart cannot take one apply for the removal of the other's fields.
const (
	LabelsManager    = "devicehost-node-labels"
	ConditionManager = "devicehost-node-condition"
)

// Publisher writes one node's labels and condition.
type Publisher struct {
	Kube kubernetes.Interface
	Node string
	Log  hclog.Logger

	labels map[string]string // last applied; nil before the first
	stale  bool              // Resync: the next Apply writes the labels, changed or not
	health Health            // last applied condition; zero before the first
	since  metav1.Time       // when the condition took its status
}

// Apply makes the node's labels of LabelsManager exactly labels and its condition h. The
// condition's lastTransitionTime moves only when its status changes, taken at first from
// the node as it is; lastHeartbeatTime is now.
func (p *Publisher) Apply(ctx context.Context, labels map[string]string, h Health) error {
	changed := p.labels != nil && !maps.Equal(p.labels, labels)
	if p.labels == nil || p.stale || changed {
		if _, err := p.Kube.CoreV1().Nodes().Apply(ctx, corev1ac.Node(p.Node).WithLabels(labels), applyAs(LabelsManager)); err != nil {
			return fmt.Errorf("apply the labels of node %s: %w", p.Node, err)
		}
		if changed {
			p.Log.Info("node labels changed", "labels", len(labels))
		}
		p.labels, p.stale = maps.Clone(labels), false
	}
	now := metav1.Now()
	if p.health.Status == "" {
		p.since = now
		if n, err := p.Kube.CoreV1().Nodes().Get(ctx, p.Node, metav1.GetOptions{}); err == nil {
			for _, c := range n.Status.Conditions {
				if c.Type == ConditionType && string(c.Status) == h.Status {
					p.since = c.LastTransitionTime
				}
			}
		}
	} else if p.health.Status != h.Status {
		p.since = now
	}
	cond := corev1ac.NodeCondition().WithType(ConditionType).WithStatus(corev1.ConditionStatus(h.Status)).
		WithReason(h.Reason).WithMessage(h.Message).WithLastTransitionTime(p.since).WithLastHeartbeatTime(now)
	if _, err := p.Kube.CoreV1().Nodes().ApplyStatus(ctx, corev1ac.Node(p.Node).WithStatus(corev1ac.NodeStatus().WithConditions(cond)), applyAs(ConditionManager)); err != nil {
		return fmt.Errorf("apply the %s condition of node %s: %w", ConditionType, p.Node, err)
	}
	if p.health.Status != h.Status {
		p.Log.Info("node condition", "type", ConditionType, "status", h.Status, "reason", h.Reason, "message", h.Message)
	}
	p.health = h
	return nil
}

// Resync makes the next Apply write the labels even where they did not change: one a
// person or another tool removed or changed since comes back.
func (p *Publisher) Resync() { p.stale = true }

// Remove takes off the node every label and the condition this manager wrote.
func (p *Publisher) Remove(ctx context.Context) error {
	_, err := p.Kube.CoreV1().Nodes().Apply(ctx, corev1ac.Node(p.Node), applyAs(LabelsManager))
	if err == nil {
		_, err = p.Kube.CoreV1().Nodes().ApplyStatus(ctx, corev1ac.Node(p.Node).WithStatus(corev1ac.NodeStatus()), applyAs(ConditionManager))
	}
	if err != nil {
		return fmt.Errorf("remove the labels and condition of node %s: %w", p.Node, err)
	}
	p.labels, p.health = nil, Health{}
	return nil
}

// applyAs is a forced apply as manager: a label another manager set (GFD's, before a
// move) becomes this one's.
func applyAs(manager string) metav1.ApplyOptions {
	return metav1.ApplyOptions{FieldManager: manager, Force: true}
}

// RunConfig is how Run publishes.
type RunConfig struct {
	// Machine is the node's machine type for nvidia.com/gpu.machine ("" for none).
	Machine string
	// Resync is how often the node is written again though nothing changed, so that a
	// label someone removed comes back and the heartbeat moves.
	Resync time.Duration
	// Unreachable is how long the agent may be unreachable before the condition turns
	// Unknown (an agent restart is shorter).
	Unreachable time.Duration
	// Retry is the wait after a failed write before the next try.
	Retry time.Duration
	// WriteTimeout bounds one write to the API server (zero: 30 s).
	WriteTimeout time.Duration
	// Tokens, when set, is a liveness.Monitor loop's token channel: Run takes its tokens
	// in the select it waits in, so that a stuck write is seen.
	Tokens <-chan struct{}
	// Agent, when set, is told on each update of the agent watch whether it is
	// connected (liveness.Monitor.Agent).
	Agent func(reachable bool)
}

// Run publishes what the agent c serves onto p's node until ctx ends: at each inventory
// change, every cfg.Resync, and Unknown once the agent has been unreachable for
// cfg.Unreachable. It returns nil when ctx ends.
func Run(ctx context.Context, c *client.Client, p *Publisher, cfg RunConfig) error {
	if cfg.Resync <= 0 || cfg.Unreachable <= 0 || cfg.Retry <= 0 {
		return errors.New("nodestatus: Resync, Unreachable and Retry must be positive")
	}
	updates := c.WatchDevices(ctx)
	var (
		labels  map[string]string
		health  Health
		pending bool // a state to write
		lost    bool // the watch is disconnected; unreachable is (or was) armed
		lostErr error
	)
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = 30 * time.Second
	}
	resync := time.NewTicker(cfg.Resync)
	defer resync.Stop()
	var retry, unreachable <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-cfg.Tokens:
			continue
		case u, ok := <-updates:
			if !ok {
				return nil
			}
			if cfg.Agent != nil {
				cfg.Agent(!u.Disconnected())
			}
			if u.Disconnected() {
				if !lost {
					lost, unreachable = true, time.After(cfg.Unreachable)
				}
				lostErr = u.Err
				continue
			}
			lost, unreachable = false, nil
			labels, health, pending = Labels(u.Snapshot, cfg.Machine), HealthOf(u.Snapshot), true
		case <-unreachable:
			unreachable = nil
			if labels == nil {
				continue // nothing published yet: no labels to keep, no condition to turn
			}
			health, pending = Unreachable(lostErr), true
		case <-resync.C:
			pending = labels != nil
			if pending {
				p.Resync()
			}
		case <-retry:
			retry = nil
		}
		if !pending || retry != nil {
			continue
		}
		wctx, cancel := context.WithTimeout(ctx, cfg.WriteTimeout)
		err := p.Apply(wctx, labels, health)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			p.Log.Warn("node status not written; retrying", "error", err, "retry_in", cfg.Retry)
			retry = time.After(cfg.Retry)
			continue
		}
		pending = false
	}
}

// RemoveAll removes this manager's labels and condition from every node that has some,
// as an uninstall does: it returns the nodes it cleaned.
func RemoveAll(ctx context.Context, kube kubernetes.Interface, log hclog.Logger) ([]string, error) {
	nodes, err := kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list the nodes: %w", err)
	}
	var cleaned []string
	var errs []error
	for _, n := range nodes.Items {
		if !slices.ContainsFunc(n.ManagedFields, func(f metav1.ManagedFieldsEntry) bool {
			return f.Manager == LabelsManager || f.Manager == ConditionManager
		}) {
			continue
		}
		p := &Publisher{Kube: kube, Node: n.Name, Log: log}
		if err := p.Remove(ctx); err != nil {
			errs = append(errs, err)
			continue
		}
		cleaned = append(cleaned, n.Name)
	}
	return cleaned, errors.Join(errs...)
}
