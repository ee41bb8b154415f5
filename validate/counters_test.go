package validate_test

import (
	"fmt"
	"testing"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

// gpuSet is a GPU's shared capacity as a partitioning plugin declares it.
func gpuSet(name string) *pb.CounterSet {
	return &pb.CounterSet{Name: name, Counters: map[string]int64{"memory-slices": 8, "compute-slices": 7}}
}

func consumes(set string, counters map[string]int64) []*pb.CounterConsumption {
	return []*pb.CounterConsumption{{CounterSet: set, Counters: counters}}
}

func grouped(set string, counters map[string]int64, groups ...string) []*pb.CounterConsumption {
	return []*pb.CounterConsumption{{CounterSet: set, Counters: counters, CompatibilityGroups: groups}}
}

// partitioned is a fingerprint of one GPU and one of its partitions, both consuming
// its counter set.
func partitioned(sets []*pb.CounterSet, whole, part []*pb.CounterConsumption) *pb.FingerprintResponse {
	return &pb.FingerprintResponse{
		CounterSets: sets,
		Groups: []*pb.DeviceGroup{
			{Vendor: "nvidia", Type: "gpu", Name: "H100", Devices: []*pb.Device{{Id: "GPU-0", Health: pb.Health_HEALTH_HEALTHY, Consumes: whole}}},
			{Vendor: "nvidia", Type: "mig", Name: "1g.10gb", Devices: []*pb.Device{{Id: "MIG-0-0", Health: pb.Health_HEALTH_HEALTHY, Consumes: part}}},
		},
	}
}

func TestFingerprintCounterSets(t *testing.T) {
	full := map[string]int64{"memory-slices": 8, "compute-slices": 7}
	one := map[string]int64{"memory-slices": 1, "compute-slices": 1}
	const gpu, mig = `group[0] "nvidia/gpu/H100": device[0] "GPU-0"`, `group[1] "nvidia/mig/1g.10gb": device[0] "MIG-0-0"`
	for _, tc := range []struct {
		name string
		resp *pb.FingerprintResponse
		want []found
	}{
		{"whole GPU and a partition on one set", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, consumes("gpu-0", full), consumes("gpu-0", one)), nil},
		{"devices without consumption beside sets", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, nil, nil), nil},
		{"zero use and zero capacity", partitioned([]*pb.CounterSet{{Name: "s", Counters: map[string]int64{"c": 0}}}, consumes("s", map[string]int64{"c": 0}), nil), nil},
		{"unknown set", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, consumes("gpu-1", full), nil),
			[]found{{gpu + `: consumes[0] "gpu-1"`, validate.RuleUnknownCounterSet}}},
		{"no sets at all", partitioned(nil, nil, consumes("gpu-0", one)),
			[]found{{mig + `: consumes[0] "gpu-0"`, validate.RuleUnknownCounterSet}}},
		{"unknown counter", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, nil, consumes("gpu-0", map[string]int64{"encoders": 1})),
			[]found{{mig + `: consumes[0] "gpu-0": counter "encoders"`, validate.RuleUnknownCounter}}},
		{"over its own capacity", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, consumes("gpu-0", map[string]int64{"memory-slices": 9}), nil),
			[]found{{gpu + `: consumes[0] "gpu-0": counter "memory-slices"`, validate.RuleOverCapacity}}},
		{"negative use", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, nil, consumes("gpu-0", map[string]int64{"compute-slices": -1})),
			[]found{{mig + `: consumes[0] "gpu-0": counter "compute-slices"`, validate.RuleCounterRange}}},
		{"negative capacity", partitioned([]*pb.CounterSet{{Name: "s", Counters: map[string]int64{"c": -5}}}, nil, nil),
			[]found{{`counter_set[0] "s": counter "c"`, validate.RuleCounterRange}}},
		{"absurd capacity", partitioned([]*pb.CounterSet{{Name: "s", Counters: map[string]int64{"c": 1 << 62}}}, nil, nil),
			[]found{{`counter_set[0] "s": counter "c"`, validate.RuleCounterRange}}},
		{"compatibility groups", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, nil, grouped("gpu-0", one, "time-slicing", "mps")), nil},
		{"three compatibility groups", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, nil, grouped("gpu-0", one, "a", "b", "c")),
			[]found{{mig + `: consumes[0] "gpu-0": compatibility_groups`, validate.RuleTooMany}}},
		{"a compatibility group twice", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, nil, grouped("gpu-0", one, "mps", "mps")),
			[]found{{mig + `: consumes[0] "gpu-0": compatibility_group[1] "mps"`, validate.RuleDuplicate}}},
		{"compatibility groups that are no DNS labels", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, grouped("gpu-0", full, "Time_Slicing"), grouped("gpu-0", one, "")),
			[]found{{gpu + `: consumes[0] "gpu-0": compatibility_group[0] "Time_Slicing"`, validate.RuleGroupName},
				{mig + `: consumes[0] "gpu-0": compatibility_group[0] ""`, validate.RuleGroupName}}},
		{"a set twice", partitioned([]*pb.CounterSet{gpuSet("gpu-0"), gpuSet("gpu-0")}, nil, nil),
			[]found{{`counter_set[1] "gpu-0"`, validate.RuleDuplicate}}},
		{"a set without counters", partitioned([]*pb.CounterSet{{Name: "s"}}, nil, nil),
			[]found{{`counter_set[0] "s": counters`, validate.RuleEmpty}}},
		{"a set without a name", partitioned([]*pb.CounterSet{{Counters: map[string]int64{"c": 1}}}, nil, nil),
			[]found{{`counter_set[0] "": name`, validate.RuleEmpty}}},
		{"a nil set", partitioned([]*pb.CounterSet{nil}, nil, nil),
			[]found{{`counter_set[0]`, validate.RuleMissing}}},
		{"a device names a set twice", partitioned([]*pb.CounterSet{gpuSet("gpu-0")}, nil,
			append(consumes("gpu-0", one), consumes("gpu-0", one)...)),
			[]found{{mig + `: consumes[1] "gpu-0"`, validate.RuleDuplicate}}},
		{"a control character in a counter name", partitioned([]*pb.CounterSet{{Name: "s", Counters: map[string]int64{"c\x1b[2J": 1}}}, nil, nil),
			[]found{{`counter_set[0] "s": counter "c\x1b[2J"`, validate.RuleNotPrintable}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkViolations(t, validate.Fingerprint(tc.resp), tc.want)
		})
	}
}

// A hostile plugin's counter lists are cut at their limits: the work stays bounded and
// one violation says so.
func TestFingerprintCounterBounds(t *testing.T) {
	sets := make([]*pb.CounterSet, validate.MaxCounterSets+1)
	for i := range sets {
		sets[i] = &pb.CounterSet{Name: fmt.Sprintf("s%d", i), Counters: map[string]int64{"c": 1}}
	}
	checkViolations(t, validate.Fingerprint(partitioned(sets, nil, nil)), []found{{"counter_sets", validate.RuleTooMany}})

	wide := &pb.CounterSet{Name: "wide", Counters: map[string]int64{}}
	for i := range validate.MaxCountersPerSet + 1 {
		wide.Counters[fmt.Sprintf("c%03d", i)] = 1
	}
	checkViolations(t, validate.Fingerprint(partitioned([]*pb.CounterSet{wide}, nil, nil)), []found{{`counter_set[0] "wide": counters`, validate.RuleTooMany}})

	var many []*pb.CounterConsumption
	var manySets []*pb.CounterSet
	for i := range validate.MaxConsumptions + 1 {
		manySets = append(manySets, gpuSet(fmt.Sprintf("gpu-%d", i)))
		many = append(many, consumes(fmt.Sprintf("gpu-%d", i), map[string]int64{"memory-slices": 1})...)
	}
	checkViolations(t, validate.Fingerprint(partitioned(manySets, many, nil)),
		[]found{{`group[0] "nvidia/gpu/H100": device[0] "GPU-0": consumes`, validate.RuleTooMany}})
}
