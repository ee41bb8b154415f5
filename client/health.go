package client

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/textline"
)

// Health is what a fingerprint says of its devices' health, for a one-line verdict:
// `devicehost health-check` (node-problem-detector) and the DRA module's node condition.
type Health struct {
	// Total counts the devices, each ID once (a plugin may list one ID in two groups).
	Total int
	// Unhealthy are those not healthy, sorted by ID, each with why: its health reason,
	// or "unhealthy"/"unknown" where the plugin gave none. A cordoned device counts as
	// its health says: cordoning is no health problem.
	Unhealthy []UnhealthyDevice
}

// UnhealthyDevice is a device that is not healthy, and why.
type UnhealthyDevice struct{ ID, Why string }

// HealthOf sums up the health of fp's devices in the groups keep admits (every group
// when keep is nil).
func HealthOf(fp *pb.FingerprintResponse, keep func(*pb.DeviceGroup) bool) Health {
	seen := make(map[string]bool)
	var h Health
	for _, g := range fp.GetGroups() {
		if keep != nil && !keep(g) {
			continue
		}
		for _, d := range g.GetDevices() {
			if seen[d.GetId()] {
				continue
			}
			seen[d.GetId()] = true
			if d.GetHealth() != pb.Health_HEALTH_HEALTHY {
				why := cmp.Or(d.GetHealthReason(), strings.ToLower(strings.TrimPrefix(d.GetHealth().String(), "HEALTH_")))
				h.Unhealthy = append(h.Unhealthy, UnhealthyDevice{d.GetId(), why})
			}
		}
	}
	h.Total = len(seen)
	slices.SortFunc(h.Unhealthy, func(a, b UnhealthyDevice) int { return strings.Compare(a.ID, b.ID) })
	return h
}

// Bounds of Health.Line: each device's ID and reason, as printed.
const maxHealthPart = 48

// Line is the verdict in one line of at most limit bytes: "8 devices healthy", or "2 of
// 8 devices unhealthy: GPU-1 (XID 79), GPU-3 (plugin exited: signal: killed)", naming
// at most named devices (", and N more" after them; the full list is in `devicehost
// devices`), each ID and reason cut to 48 bytes, everything a plugin said escaped
// (textline.Line).
func (h Health) Line(named, limit int) string {
	if len(h.Unhealthy) == 0 {
		return fmt.Sprintf("%d devices healthy", h.Total)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d of %d devices unhealthy: ", len(h.Unhealthy), h.Total)
	for i, d := range h.Unhealthy {
		if i == named {
			fmt.Fprintf(&b, ", and %d more", len(h.Unhealthy)-i)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s (%s)", textline.Line(d.ID, maxHealthPart), textline.Line(d.Why, maxHealthPart))
	}
	return textline.Line(b.String(), limit)
}
