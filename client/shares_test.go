package client

import (
	"testing"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

func TestIsHolder(t *testing.T) {
	cons := func(set string, counters map[string]int64) *pb.CounterConsumption {
		return &pb.CounterConsumption{CounterSet: set, Counters: counters}
	}
	tests := []struct {
		name string
		d    *pb.Device
		want bool
	}{
		{"one holder", &pb.Device{Consumes: []*pb.CounterConsumption{cons("fuse", map[string]int64{HoldersCounter: 1})}}, true},
		{"nothing consumed", &pb.Device{}, false},
		{"two holders", &pb.Device{Consumes: []*pb.CounterConsumption{cons("fuse", map[string]int64{HoldersCounter: 2})}}, false},
		{"a GPU's slices", &pb.Device{Consumes: []*pb.CounterConsumption{cons("GPU-0", map[string]int64{"memory-slices": 8})}}, false},
		{"holders and more", &pb.Device{Consumes: []*pb.CounterConsumption{cons("fuse", map[string]int64{HoldersCounter: 1, "memory": 1})}}, false},
		{"two sets", &pb.Device{Consumes: []*pb.CounterConsumption{cons("a", map[string]int64{HoldersCounter: 1}), cons("b", map[string]int64{HoldersCounter: 1})}}, false},
	}
	for _, tt := range tests {
		if got := IsHolder(tt.d); got != tt.want {
			t.Errorf("%s: IsHolder = %v, want %v", tt.name, got, tt.want)
		}
	}
}
