package nodestatus

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/textline"
)

// ConditionType is the node condition Publisher writes: True while every device the
// agent serves is healthy, False while any is not (the message names them and why),
// Unknown while the agent cannot be asked.
const ConditionType = "DevicehostDevicesHealthy"

// The condition's reasons.
const (
	ReasonHealthy     = "DevicesHealthy"
	ReasonUnhealthy   = "DevicesUnhealthy"
	ReasonUnreachable = "AgentUnreachable"
)

// Bounds of the condition's message: the devices it names, and its length (the full
// list is in `devicehost devices`).
const (
	maxNamedDevices = 16
	maxReason       = 48
	maxMessage      = 1024
)

// Health is the condition's state: Status is "True", "False" or "Unknown".
type Health struct {
	Status, Reason, Message string
}

// HealthOf is the condition fp gives. A device listed in several groups (a GPU and its
// replicas share nothing of the ID, but a plugin may list one ID twice) is counted once;
// a cordoned device counts as its health says: cordoning is no health problem.
func HealthOf(fp *pb.FingerprintResponse) Health {
	seen := make(map[string]bool)
	var bad []string
	why := make(map[string]string)
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			if seen[d.GetId()] {
				continue
			}
			seen[d.GetId()] = true
			if d.GetHealth() != pb.Health_HEALTH_HEALTHY {
				bad = append(bad, d.GetId())
				why[d.GetId()] = cmp.Or(d.GetHealthReason(), strings.ToLower(strings.TrimPrefix(d.GetHealth().String(), "HEALTH_")))
			}
		}
	}
	if len(bad) == 0 {
		return Health{Status: "True", Reason: ReasonHealthy, Message: fmt.Sprintf("%d devices healthy", len(seen))}
	}
	slices.Sort(bad)
	var b strings.Builder
	fmt.Fprintf(&b, "%d of %d devices unhealthy: ", len(bad), len(seen))
	for i, id := range bad {
		if i == maxNamedDevices {
			fmt.Fprintf(&b, ", and %d more", len(bad)-i)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s (%s)", textline.Line(id, maxReason), textline.Line(why[id], maxReason))
	}
	return Health{Status: "False", Reason: ReasonUnhealthy, Message: textline.Line(b.String(), maxMessage)}
}

// Unreachable is the condition while the agent cannot be asked.
func Unreachable(err error) Health {
	return Health{Status: "Unknown", Reason: ReasonUnreachable, Message: textline.Line("devicehost agent unreachable: "+err.Error(), maxMessage)}
}
