package nodestatus

import (
	"github.com/devicehost/devicehost/client"
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
	maxMessage      = 1024
)

// Health is the condition's state: Status is "True", "False" or "Unknown".
type Health struct {
	Status, Reason, Message string
}

// HealthOf is the condition fp gives (client.HealthOf: each device once, a cordoned one
// as its health says).
func HealthOf(fp *pb.FingerprintResponse) Health {
	h := client.HealthOf(fp, nil)
	if len(h.Unhealthy) == 0 {
		return Health{Status: "True", Reason: ReasonHealthy, Message: h.Line(maxNamedDevices, maxMessage)}
	}
	return Health{Status: "False", Reason: ReasonUnhealthy, Message: h.Line(maxNamedDevices, maxMessage)}
}

// Unreachable is the condition while the agent cannot be asked.
func Unreachable(err error) Health {
	return Health{Status: "Unknown", Reason: ReasonUnreachable, Message: textline.Line("devicehost agent unreachable: "+err.Error(), maxMessage)}
}
