package client_test

import (
	"testing"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// ShareParent names the device a share divides only when the share draws on its whole
// counter set, or on the set as one sharing mode's (compatibility groups); a share of
// an on-demand placement, on part of its GPU's set, divides no device of its own.
func TestShareParent(t *testing.T) {
	snap := &pb.FingerprintResponse{CounterSets: []*pb.CounterSet{
		{Plugin: "nv", Name: "GPU-0", Capacity: map[string]int64{"mps-memory": 4, "mps-compute": 4}},
		{Plugin: "nv", Name: "GPU-1", Capacity: map[string]int64{"mps-memory": 4, "mps-compute": 4, "time-slices": 4}},
		{Plugin: "nv", Name: "GPU-2", Capacity: map[string]int64{"memory-slice-0": 2, "memory-slice-1": 2, "compute-slices": 14}},
	}}
	sets := client.IndexCounterSets(snap)
	use := func(set string, groups []string, counters ...string) *pb.Device {
		c := &pb.CounterConsumption{CounterSet: set, Counters: map[string]int64{}, CompatibilityGroups: groups}
		for _, n := range counters {
			c.Counters[n] = 1
		}
		return &pb.Device{Id: set + "::share", Consumes: []*pb.CounterConsumption{c}}
	}
	for _, tc := range []struct {
		name string
		d    *pb.Device
		want string
	}{
		{"a share of a whole GPU", use("GPU-0", nil, "mps-memory", "mps-compute"), "GPU-0"},
		{"an MPS share of a GPU also time-sliced", use("GPU-1", []string{"mps"}, "mps-memory", "mps-compute"), "GPU-1"},
		{"the same without its group", use("GPU-1", nil, "mps-memory", "mps-compute"), ""},
		{"a share of an on-demand placement", use("GPU-2", nil, "memory-slice-0", "compute-slices"), ""},
		{"a share of a set not reported", use("GPU-9", nil, "x"), "GPU-9"},
		{"no consumption", &pb.Device{Id: "d"}, ""},
	} {
		got, ok := sets.ShareParent("nv", tc.d)
		if got != tc.want || ok != (tc.want != "") {
			t.Errorf("%s: ShareParent = %q, %v; want %q", tc.name, got, ok, tc.want)
		}
	}
}
