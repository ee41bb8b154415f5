package validate_test

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

// knownIDs returns a known func for Stats that accepts exactly ids.
func knownIDs(ids ...string) func(string) bool {
	set := make(map[string]bool, len(ids))
	for _, id := range ids {
		set[id] = true
	}
	return func(id string) bool { return set[id] }
}

// goodStats returns a fresh stats message that breaks no rule for knownIDs("GPU-0", "GPU-1").
func goodStats() *pb.StatsResponse {
	return &pb.StatsResponse{Devices: []*pb.DeviceStats{
		{
			DeviceId: "GPU-0",
			Values: map[string]*pb.Value{
				"gpu_utilization": {Kind: &pb.Value_FloatValue{FloatValue: 97.5}, Unit: "%"},
				"memory_used":     {Kind: &pb.Value_IntValue{IntValue: 1 << 30}, Unit: "B"},
				"throttled":       {Kind: &pb.Value_BoolValue{BoolValue: true}},
				"pstate":          {Kind: &pb.Value_StringValue{StringValue: "P0"}},
			},
			Timestamp: &timestamppb.Timestamp{Seconds: 1767225600},
		},
		{DeviceId: "GPU-1"}, // no values, no timestamp: allowed
	}}
}

func TestStats(t *testing.T) {
	known := knownIDs("GPU-0", "GPU-1")
	const d0 = `device[0] "GPU-0"`
	val := func(r *pb.StatsResponse, name string, v *pb.Value) { r.Devices[0].Values[name] = v }
	tests := []struct {
		name   string
		mutate func(*pb.StatsResponse)
		known  func(string) bool
		want   []found
	}{
		{name: "good", mutate: func(*pb.StatsResponse) {}, known: known},
		{name: "empty", mutate: func(r *pb.StatsResponse) { r.Devices = nil }, known: nil},
		{
			name: "processes",
			mutate: func(r *pb.StatsResponse) {
				r.Devices[0].Processes = []*pb.ProcessMemory{{Pid: 4242, UsedBytes: 1 << 30, SmUtilization: proto.Uint32(100)}, {Pid: 4243}}
			},
			known: known,
		},
		{
			name: "processes broken",
			mutate: func(r *pb.StatsResponse) {
				r.Devices[0].Processes = []*pb.ProcessMemory{{Pid: 0}, nil, {Pid: 7, UsedBytes: -1}, {Pid: 8, UsedBytes: 1<<50 + 1}, {Pid: 7}, {Pid: 9, SmUtilization: proto.Uint32(101)}}
			},
			known: known,
			want: []found{
				{d0 + ": processes[0]", validate.RuleEmpty}, {d0 + ": processes[1]", validate.RuleMissing},
				{d0 + ": processes[2]", validate.RuleCounterRange}, {d0 + ": processes[3]", validate.RuleCounterRange},
				{d0 + ": processes[4]", validate.RuleDuplicate}, {d0 + ": processes[5]", validate.RuleCounterRange},
			},
		},
		{
			name: "too many processes",
			mutate: func(r *pb.StatsResponse) {
				for i := range validate.MaxProcessesPerDevice + 1 {
					r.Devices[0].Processes = append(r.Devices[0].Processes, &pb.ProcessMemory{Pid: uint32(i + 1)})
				}
			},
			known: known,
			want:  []found{{d0 + ": processes", validate.RuleTooMany}},
		},
		{
			name:   "nil entry",
			mutate: func(r *pb.StatsResponse) { r.Devices[1] = nil },
			known:  known,
			want:   []found{{"device[1]", validate.RuleMissing}},
		},
		{
			name:   "empty device ID",
			mutate: func(r *pb.StatsResponse) { r.Devices[1].DeviceId = "" },
			known:  known,
			want:   []found{{`device[1] "": device_id`, validate.RuleEmpty}},
		},
		{
			name:   "unknown device",
			mutate: func(r *pb.StatsResponse) { r.Devices[1].DeviceId = "GPU-9" },
			known:  known,
			want:   []found{{`device[1] "GPU-9"`, validate.RuleUnknownDevice}},
		},
		{
			name:   "nil known knows nothing",
			mutate: func(*pb.StatsResponse) {},
			known:  nil,
			want:   []found{{d0, validate.RuleUnknownDevice}, {`device[1] "GPU-1"`, validate.RuleUnknownDevice}},
		},
		{
			name:   "duplicate device",
			mutate: func(r *pb.StatsResponse) { r.Devices[1].DeviceId = "GPU-0" },
			known:  known,
			want:   []found{{`device[1] "GPU-0"`, validate.RuleDuplicate}},
		},
		{
			name:   "invalid timestamp",
			mutate: func(r *pb.StatsResponse) { r.Devices[0].Timestamp = &timestamppb.Timestamp{Seconds: 1, Nanos: -1} },
			known:  known,
			want:   []found{{d0 + ": timestamp", validate.RuleTimestamp}},
		},
		{
			name:   "nil value",
			mutate: func(r *pb.StatsResponse) { val(r, "power", nil) },
			known:  known,
			want:   []found{{d0 + `: value "power"`, validate.RuleValueUnset}},
		},
		{
			name:   "value kind not set",
			mutate: func(r *pb.StatsResponse) { val(r, "power", &pb.Value{Unit: "W"}) },
			known:  known,
			want:   []found{{d0 + `: value "power"`, validate.RuleValueUnset}},
		},
		{
			name: "NaN",
			mutate: func(r *pb.StatsResponse) {
				val(r, "power", &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: math.NaN()}, Unit: "W"})
			},
			known: known,
			want:  []found{{d0 + `: value "power"`, validate.RuleNotFinite}},
		},
		{
			name: "Inf",
			mutate: func(r *pb.StatsResponse) {
				val(r, "power", &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: math.Inf(-1)}, Unit: "W"})
			},
			known: known,
			want:  []found{{d0 + `: value "power"`, validate.RuleNotFinite}},
		},
		{
			name: "unknown unit",
			mutate: func(r *pb.StatsResponse) {
				val(r, "power", &pb.Value{Kind: &pb.Value_IntValue{IntValue: 1}, Unit: "hp"})
			},
			known: known,
			want:  []found{{d0 + `: value "power"`, validate.RuleUnknownUnit}},
		},
		{
			name:   "metric name not UTF-8",
			mutate: func(r *pb.StatsResponse) { val(r, "pow\xfer", &pb.Value{Kind: &pb.Value_IntValue{}}) },
			known:  known,
			want:   []found{{d0 + `: value "pow\xfer"`, validate.RuleInvalidUTF8}},
		},
		{
			name:   "empty metric name",
			mutate: func(r *pb.StatsResponse) { val(r, "", &pb.Value{Kind: &pb.Value_IntValue{}}) },
			known:  known,
			want:   []found{{d0 + `: value ""`, validate.RuleEmpty}},
		},
		{
			name: "metric name too long",
			mutate: func(r *pb.StatsResponse) {
				val(r, strings.Repeat("m", validate.MaxNameLen+1), &pb.Value{Kind: &pb.Value_IntValue{}})
			},
			known: known,
			want:  []found{{d0 + `: value "` + strings.Repeat("m", 64) + `"...`, validate.RuleTooLong}},
		},
		{
			name: "string value too long",
			mutate: func(r *pb.StatsResponse) {
				val(r, "s", &pb.Value{Kind: &pb.Value_StringValue{StringValue: strings.Repeat("s", validate.MaxStringValueLen+1)}})
			},
			known: known,
			want:  []found{{d0 + `: value "s"`, validate.RuleTooLong}},
		},
		{
			name: "too many devices",
			mutate: func(r *pb.StatsResponse) {
				r.Devices = nil
				for i := range validate.MaxDevices + 1 {
					r.Devices = append(r.Devices, &pb.DeviceStats{DeviceId: fmt.Sprint(i)})
				}
			},
			known: func(string) bool { return true },
			want:  []found{{"devices", validate.RuleTooMany}},
		},
		{
			name: "too many values",
			mutate: func(r *pb.StatsResponse) {
				for i := range validate.MaxStatsValues {
					val(r, fmt.Sprintf("m%03d", i), &pb.Value{Kind: &pb.Value_IntValue{}})
				}
			},
			known: known,
			want:  []found{{d0 + ": values", validate.RuleTooMany}},
		},
		{
			name: "every violation is reported",
			mutate: func(r *pb.StatsResponse) {
				val(r, "power", &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: math.Inf(1)}, Unit: "hp"})
				r.Devices[1].DeviceId = "GPU-7"
				r.Devices = append(r.Devices, &pb.DeviceStats{DeviceId: "GPU-0"})
			},
			known: known,
			want: []found{
				{d0 + `: value "power"`, validate.RuleNotFinite},
				{d0 + `: value "power"`, validate.RuleUnknownUnit},
				{`device[1] "GPU-7"`, validate.RuleUnknownDevice},
				{`device[2] "GPU-0"`, validate.RuleDuplicate},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := goodStats()
			tt.mutate(resp)
			checkViolations(t, validate.Stats(resp, tt.known), tt.want)
		})
	}
}

func TestStatsNil(t *testing.T) {
	checkViolations(t, validate.Stats(nil, knownIDs("GPU-0")), []found{{"stats", validate.RuleMissing}})
}
