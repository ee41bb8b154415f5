package kubernetes

import (
	"fmt"
	"slices"
	"testing"
)

// dev is a placement in group "g" for the tables.
func dev(id string, numa int32, root string) placement {
	return placement{id: id, group: "g", numa: numa, root: root}
}

func TestPreferDevices(t *testing.T) {
	// A DGX-like node: NUMA node 0 holds GPUs 0-3, node 1 GPUs 4-7; two GPUs share
	// each PCIe root (switch).
	dgx := []placement{
		dev("0", 0, "a"), dev("1", 0, "a"), dev("2", 0, "b"), dev("3", 0, "b"),
		dev("4", 1, "c"), dev("5", 1, "c"), dev("6", 1, "d"), dev("7", 1, "d"),
	}
	without := func(ps []placement, ids ...string) []placement {
		return slices.DeleteFunc(slices.Clone(ps), func(p placement) bool { return slices.Contains(ids, p.id) })
	}
	for _, tc := range []struct {
		name      string
		available []placement
		must      []string
		size      int
		want      []string
	}{
		{"two on one root", dgx, nil, 2, []string{"0", "1"}},
		{"four on one NUMA node", dgx, nil, 4, []string{"0", "1", "2", "3"}},
		{"five: a whole node and one more", dgx, nil, 5, []string{"0", "1", "2", "3", "4"}},
		{"all", dgx, nil, 8, []string{"0", "1", "2", "3", "4", "5", "6", "7"}},
		{"must-include picks the node and root", dgx, []string{"6"}, 2, []string{"6", "7"}},
		{"must-include on two nodes, the rest fills them", dgx, []string{"0", "7"}, 4, []string{"0", "1", "6", "7"}},
		{"must-include only", dgx, []string{"5"}, 1, []string{"5"}},
		{"more must-include than size", dgx, []string{"1", "5"}, 1, []string{"1", "5"}},
		{"one free on root a: keep pairs on roots whole", without(dgx, "0"), nil, 1, []string{"1"}},
		{"the tightest NUMA node that fits", without(dgx, "0"), nil, 3, []string{"1", "2", "3"}},
		{"tightest fit leaves the whole node", without(dgx, "4"), nil, 2, []string{"6", "7"}},
		{"fewer roots beats tighter fit", []placement{
			dev("0", 0, "a"), dev("1", 0, "b"), dev("2", 0, "c"),
			dev("4", 1, "d"), dev("5", 1, "d"), dev("6", 1, "e"), dev("7", 1, "e"),
		}, nil, 2, []string{"4", "5"}},
		{"roots: same NUMA count, fewer roots", []placement{
			dev("0", 0, "a"), dev("1", 0, "b"),
			dev("4", 1, "c"), dev("5", 1, "c"),
		}, nil, 2, []string{"4", "5"}},
		{"over two nodes, whole roots first", without(dgx, "0", "1"), nil, 5, []string{"2", "3", "4", "5", "6"}},
		{"not enough: all there is", without(dgx, "0", "1", "2", "3", "4", "5"), nil, 3, []string{"6", "7"}},
		{"unknown NUMA and root count as one place", []placement{
			dev("x", -1, ""), dev("y", -1, ""), dev("z", 0, "a"),
		}, nil, 2, []string{"x", "y"}},
		{"one group first", []placement{
			{id: "a0", group: "A100", numa: 0}, {id: "h0", group: "H100", numa: 0}, {id: "h1", group: "H100", numa: 1},
		}, nil, 2, []string{"h0", "h1"}},
		{"must-include picks the group", []placement{
			{id: "a0", group: "A100", numa: 0}, {id: "a1", group: "A100", numa: 1},
			{id: "h0", group: "H100", numa: 0}, {id: "h1", group: "H100", numa: 0},
		}, []string{"a1"}, 2, []string{"a0", "a1"}},
		{"shares of one GPU on a root of two", []placement{
			{id: "a::mps::0", group: "g", root: "r", parent: "GPU-a"}, {id: "a::mps::1", group: "g", root: "r", parent: "GPU-a"},
			{id: "b::mps::0", group: "g", root: "r", parent: "GPU-b"}, {id: "b::mps::1", group: "g", root: "r", parent: "GPU-b"},
			{id: "b::mps::2", group: "g", root: "r", parent: "GPU-b"},
		}, []string{"b::mps::0"}, 2, []string{"b::mps::0", "b::mps::1"}},
		{"shares: the tightest GPU that fits", []placement{
			{id: "a::mps::0", group: "g", root: "r", parent: "GPU-a"}, {id: "a::mps::1", group: "g", root: "r", parent: "GPU-a"},
			{id: "a::mps::2", group: "g", root: "r", parent: "GPU-a"},
			{id: "b::mps::3", group: "g", root: "r", parent: "GPU-b"}, {id: "b::mps::2", group: "g", root: "r", parent: "GPU-b"},
		}, nil, 2, []string{"b::mps::2", "b::mps::3"}},
		{"duplicates in available count once", append(slices.Clone(dgx), dgx...), nil, 2, []string{"0", "1"}},
		{"size zero", dgx, nil, 0, []string{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := preferDevices(tc.available, tc.must, tc.size)
			if !slices.Equal(got, tc.want) && !(len(got) == 0 && len(tc.want) == 0) {
				t.Errorf("preferDevices(size %d, must %v) = %v, want %v", tc.size, tc.must, got, tc.want)
			}
		})
	}
}

// Whatever the input, the answer is size devices of the available ones (all of them
// if fewer), holds every must-include device, and has no duplicates.
func TestPreferDevicesInvariants(t *testing.T) {
	var all []placement
	for i := range 24 {
		all = append(all, placement{id: fmt.Sprintf("d%02d", i), group: fmt.Sprint("g", i%2), numa: int32(i % 3), root: fmt.Sprint("r", i%5)})
	}
	for size := 0; size <= 25; size++ {
		for _, must := range [][]string{nil, {"d03"}, {"d00", "d07", "d13"}} {
			got := preferDevices(all, must, size)
			want := max(min(size, len(all)), len(must))
			if len(got) != want {
				t.Errorf("size %d must %v: %d devices %v, want %d", size, must, len(got), got, want)
			}
			if len(slices.Compact(slices.Clone(got))) != len(got) {
				t.Errorf("size %d must %v: duplicates in %v", size, must, got)
			}
			for _, m := range must {
				if !slices.Contains(got, m) {
					t.Errorf("size %d: must-include %s missing from %v", size, m, got)
				}
			}
		}
	}
}

// The worst input the plugin accepts (every device a place of its own at every level)
// is answered: the search stays polynomial and small.
func TestPreferDevicesWorstCase(t *testing.T) {
	var all []placement
	for i := range maxPreferredDevices {
		id := fmt.Sprintf("d%04d", i)
		all = append(all, placement{id: id, group: id, numa: int32(i), root: id})
	}
	if got := preferDevices(all, []string{"d0007"}, maxPreferredDevices/2); len(got) != maxPreferredDevices/2 || !slices.Contains(got, "d0007") {
		t.Errorf("got %d devices (d0007 in: %v), want %d with d0007", len(got), slices.Contains(got, "d0007"), maxPreferredDevices/2)
	}
}

func BenchmarkPreferDevicesWorstCase(b *testing.B) {
	var all []placement
	for i := range maxPreferredDevices {
		id := fmt.Sprintf("d%04d", i)
		all = append(all, placement{id: id, group: id, numa: int32(i), root: id})
	}
	for b.Loop() {
		preferDevices(all, nil, maxPreferredDevices/2)
	}
}
