package validate

import (
	"fmt"

	"google.golang.org/protobuf/proto"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// stats is Stats' body; see its doc comment for the rules.
func stats(resp *pb.StatsResponse, known func(string) bool) error {
	var c collector
	if resp == nil {
		c.add("stats", RuleMissing, "")
		return c.err()
	}
	if n := proto.Size(resp); n > MaxStatsBytes {
		c.add("stats", RuleTooLarge, tooLarge(n, MaxStatsBytes))
	}
	devices := resp.GetDevices()
	if len(devices) > MaxDevices {
		c.add("devices", RuleTooMany, tooMany(len(devices), MaxDevices))
		devices = devices[:MaxDevices]
	}
	seen := make(map[string]int, len(devices))
	for i, d := range devices {
		if d == nil {
			c.add(fmt.Sprintf("device[%d]", i), RuleMissing, "")
			continue
		}
		id := d.GetDeviceId()
		item := fmt.Sprintf("device[%d] %s", i, q(id))
		switch {
		case id == "":
			c.add(at(item, "device_id"), RuleEmpty, "")
		case known == nil || !known(id):
			c.add(item, RuleUnknownDevice, "")
		}
		if id != "" {
			if first, dup := seen[id]; dup {
				c.add(item, RuleDuplicate, fmt.Sprintf("first seen at device[%d]", first))
			} else {
				seen[id] = i
			}
		}
		if ts := d.GetTimestamp(); ts != nil {
			if err := ts.CheckValid(); err != nil {
				c.add(at(item, "timestamp"), RuleTimestamp, err.Error())
			}
		}
		c.checkValues(item, "value", d.GetValues(), MaxStatsValues)
		c.checkProcesses(item, d.GetProcesses())
	}
	return c.err()
}

// checkProcesses checks a device's processes: at most MaxProcessesPerDevice, each
// present, its pid not 0 and not repeated, its memory from 0 to MaxCounterValue bytes,
// its SM utilization at most 100 %.
func (c *collector) checkProcesses(item string, procs []*pb.ProcessMemory) {
	if len(procs) > MaxProcessesPerDevice {
		c.add(at(item, "processes"), RuleTooMany, tooMany(len(procs), MaxProcessesPerDevice))
		procs = procs[:MaxProcessesPerDevice]
	}
	seen := make(map[uint32]int, len(procs))
	for i, p := range procs {
		field := at(item, fmt.Sprintf("processes[%d]", i))
		switch {
		case p == nil:
			c.add(field, RuleMissing, "")
			continue
		case p.GetPid() == 0:
			c.add(field, RuleEmpty, "pid 0")
		case p.GetUsedBytes() < 0 || p.GetUsedBytes() > MaxCounterValue:
			c.add(field, RuleCounterRange, fmt.Sprintf("used_bytes %d, want 0 to %d", p.GetUsedBytes(), int64(MaxCounterValue)))
		case p.GetSmUtilization() > 100:
			c.add(field, RuleCounterRange, fmt.Sprintf("sm_utilization %d, want 0 to 100", p.GetSmUtilization()))
		}
		if first, dup := seen[p.GetPid()]; dup && p.GetPid() != 0 {
			c.add(field, RuleDuplicate, fmt.Sprintf("pid %d first at processes[%d]", p.GetPid(), first))
		} else {
			seen[p.GetPid()] = i
		}
	}
}
