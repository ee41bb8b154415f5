package dra

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/devicehost/devicehost/deviceplugin/cdi"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// cdiSpecs keeps one CDI spec file per prepared claim, "<driver>-claim-<uid>.json"
// (JSON: written while the kubelet waits, in half of YAML's time), of kind
// "<driver>/claim", with one CDI device per reservation of the claim, named
// "<claim UID>-<reservation ID>":
// unique per claim UID, as the kubelet's contract asks (a runtime that caches specs
// never mistakes one claim's device for another's), and derived from the ledger alone,
// so a driver that restarts writes the same names again. Safe for concurrent use.
type cdiSpecs struct {
	dir  string
	file string // file name prefix: "<driver>-claim-"
	kind string

	mu      sync.Mutex
	writers map[string]*cdi.Writer // by claim UID
	base    *cdi.Writer            // the first writer made: the others are its siblings
}

func newCDISpecs(dir, driver string) (*cdiSpecs, error) {
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("dra: CDI directory %q: must be an absolute path", dir)
	}
	return &cdiSpecs{dir: dir, file: driver + "-claim-", kind: driver + "/claim", writers: make(map[string]*cdi.Writer)}, nil
}

// validUID reports whether uid can name a file and a CDI device (a Kubernetes UID is
// a UUID).
func validUID(uid string) bool {
	if uid == "" || len(uid) > 64 {
		return false
	}
	for _, c := range uid {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// id is the CDI device ID of reservation resID of claim uid.
func (c *cdiSpecs) id(uid, resID string) string { return cdi.Name(c.kind, uid+"-"+resID) }

func (c *cdiSpecs) writer(uid string) (*cdi.Writer, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if w, ok := c.writers[uid]; ok {
		return w, nil
	}
	var w *cdi.Writer
	var err error
	if c.base == nil {
		w, err = cdi.NewJSONWriter(c.dir, c.file+uid)
		c.base = w
	} else {
		w, err = c.base.Sibling(c.file + uid) // no read of the whole directory per claim
	}
	if err != nil {
		return nil, err
	}
	c.writers[uid] = w
	return w, nil
}

// staleTempAge is how old a temporary spec file in the CDI dir must be for repairCDI to
// remove it: other writers' (the agent's kubelet bridge) live for the length of a write.
const staleTempAge = time.Minute

// ahead does what the next claim's spec write can do before the claim comes (its
// temporary file: cdi.Writer.Ahead), once a first spec was written. A failure is left
// for that write to meet and report.
func (c *cdiSpecs) ahead() {
	if base := c.baseWriter(); base != nil {
		_ = base.Ahead()
	}
}

// discard removes what ahead made (the driver stops).
func (c *cdiSpecs) discard() {
	if base := c.baseWriter(); base != nil {
		base.Discard()
	}
}

// baseWriter is the first claim spec writer made, whose siblings the others are; nil
// before the first write.
func (c *cdiSpecs) baseWriter() *cdi.Writer {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.base
}

// write makes claim uid's spec describe its reservations rs (namespace/name label the
// container through DEVICEHOST_CLAIM).
func (c *cdiSpecs) write(uid, claim string, rs []*pb.Reservation) error {
	if !validUID(uid) {
		return fmt.Errorf("claim UID %q: not usable in a CDI name", uid)
	}
	w, err := c.writer(uid)
	if err != nil {
		return err
	}
	s := cdi.Spec{Kind: c.kind, Devices: make(map[string]cdi.Edits, len(rs))}
	for _, r := range rs {
		s.Devices[uid+"-"+r.GetReservationId()] = containerEdits(claim, r.GetReservation())
	}
	_, err = w.Write(s)
	return err
}

// remove deletes claim uid's spec; a missing one is not an error.
func (c *cdiSpecs) remove(uid string) error {
	if !validUID(uid) {
		return nil
	}
	w, err := c.writer(uid)
	if err != nil {
		return err
	}
	err = w.Remove()
	c.mu.Lock()
	delete(c.writers, uid)
	c.mu.Unlock()
	return err
}

// claims lists the UIDs of the claims that have a spec file.
func (c *cdiSpecs) claims() ([]string, error) {
	entries, err := os.ReadDir(c.dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var uids []string
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), c.file)
		if !ok {
			continue
		}
		if uid, ok := strings.CutSuffix(rest, ".json"); ok {
			uids = append(uids, uid)
		}
	}
	return uids, nil
}

// containerEdits is what the claim's CDI device gives a container: the reservation's
// env vars and mounts, its device nodes unless the plugin names CDI devices of its own
// for them (they come through the plugin's spec), and DEVICEHOST_CLAIM.
func containerEdits(claim string, r *pb.ContainerReservation) cdi.Edits {
	out := cdi.Edits{Env: map[string]string{"DEVICEHOST_CLAIM": claim}}
	for k, v := range r.GetEnvs() {
		out.Env[k] = v
	}
	for _, m := range r.GetMounts() {
		out.Mounts = append(out.Mounts, cdi.Mount{HostPath: m.GetHostPath(), ContainerPath: m.GetContainerPath(), ReadOnly: m.GetReadOnly()})
	}
	if len(r.GetCdiDevices()) == 0 {
		for _, d := range r.GetDevices() {
			out.DeviceNodes = append(out.DeviceNodes, cdi.DeviceNode{HostPath: d.GetHostPath(), ContainerPath: d.GetContainerPath(), Permissions: d.GetPermissions()})
		}
	}
	return out
}

// claimRef is a claim as its reservations' owner ID names it.
type claimRef struct{ namespace, name, uid string }

func (r claimRef) owner() string {
	return ClaimOwnerPrefix + r.namespace + "/" + r.name + "/" + r.uid
}

// parseOwner reads "k8s-claim/<namespace>/<name>/<uid>".
func parseOwner(owner string) (claimRef, bool) {
	rest, ok := strings.CutPrefix(owner, ClaimOwnerPrefix)
	if !ok {
		return claimRef{}, false
	}
	parts := strings.Split(rest, "/")
	if len(parts) != 3 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
		return claimRef{}, false
	}
	return claimRef{parts[0], parts[1], parts[2]}, true
}

// claimReservations lists the agent's live reservations of claims, by claim.
func (d *Driver) claimReservations(ctx context.Context) (map[claimRef][]*pb.Reservation, error) {
	// With the claims' admin accesses: a claim that has only those is prepared too.
	rs, err := d.agent.Reservations(ctx, &pb.ListReservationsRequest{State: pb.ReservationState_RESERVATION_STATE_ACTIVE, IncludeAdminAccess: true})
	if err != nil {
		return nil, fmt.Errorf("list reservations: %w", err)
	}
	out := make(map[claimRef][]*pb.Reservation)
	for _, r := range rs {
		if ref, ok := parseOwner(r.GetOwnerId()); ok {
			out[ref] = append(out[ref], r)
		}
	}
	return out, nil
}

// repairCDI makes the spec files match the ledger: a spec for every claim with live
// reservations (written again if lost, say /var/run/cdi is a tmpfs and the node
// rebooted), none for any other claim.
func (d *Driver) repairCDI(ctx context.Context) error {
	byClaim, err := d.claimReservations(ctx)
	if err != nil {
		return err
	}
	live := make(map[string]bool)
	var errs []error
	for ref, rs := range byClaim {
		live[ref.uid] = true
		if err := d.cdi.write(ref.uid, ref.namespace+"/"+ref.name, rs); err != nil {
			errs = append(errs, fmt.Errorf("claim %s/%s: %w", ref.namespace, ref.name, err))
		}
	}
	have, err := d.cdi.claims()
	if err != nil {
		errs = append(errs, err)
	}
	removed := 0
	for _, uid := range have {
		if !live[uid] {
			if err := d.cdi.remove(uid); err != nil {
				errs = append(errs, err)
				continue
			}
			removed++
		}
	}
	// A driver killed while it held a file made ahead (or in a write) left it.
	temps, err := cdi.RemoveStaleTemps(d.cdi.dir, staleTempAge)
	if err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	d.log.Debug("CDI specs match the ledger", "claims", len(byClaim), "removed", removed, "stale_temporary_files", temps)
	return nil
}
