package client

import (
	"strings"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// IsShareGroup says whether a group holds MPS shares: its type or name ends in ".mps",
// as the nvidia-example plugin's gpu.mps and mig/<profile>.mps do. A container's shares
// must all be of one device, whose MPS daemon its pipe directory names.
func IsShareGroup(g *pb.DeviceGroup) bool {
	return strings.HasSuffix(g.GetType(), ".mps") || strings.HasSuffix(g.GetName(), ".mps")
}

// CounterSets indexes a fingerprint's counter sets by plugin and name.
type CounterSets map[[2]string]*pb.CounterSet

// IndexCounterSets returns snap's counter sets by plugin and name.
func IndexCounterSets(snap *pb.FingerprintResponse) CounterSets {
	sets := make(CounterSets, len(snap.GetCounterSets()))
	for _, s := range snap.GetCounterSets() {
		sets[[2]string{s.GetPlugin(), s.GetName()}] = s
	}
	return sets
}

// ShareParent returns the device an MPS share of plugin's divides: the counter set of
// its one consumption, when the share draws on every counter of that set, as a share
// of a whole GPU or of a static MIG device does (the set is that device's). ok is false
// for a share that draws on part of a set, as a share of an on-demand MIG placement
// draws on its placement's slices of the GPU's set: no counter set names the device it
// divides, so such shares cannot be grouped or pooled by device. A share whose set is
// not among sets is taken at its word, and so is one whose use carries compatibility
// groups: the set is then divided by sharing mode (a GPU offered time-sliced and in
// MPS shares), each mode drawing on counters of its own, never at once.
func (sets CounterSets) ShareParent(plugin string, d *pb.Device) (parent string, ok bool) {
	if len(d.GetConsumes()) != 1 {
		return "", false
	}
	c := d.GetConsumes()[0]
	if set, known := sets[[2]string{plugin, c.GetCounterSet()}]; known && len(c.GetCompatibilityGroups()) == 0 {
		for name := range set.GetCapacity() {
			if _, uses := c.GetCounters()[name]; !uses {
				return "", false
			}
		}
	}
	return c.GetCounterSet(), true
}

// HoldersCounter is the counter of a device offered to several holders at once: a
// counter set with capacity {"holders": N} stands for the device, and each of its N
// copies consumes {"holders": 1} of it (the hostdev plugin's count).
const HoldersCounter = "holders"

// IsHolder reports whether d is one copy of a device offered to several holders: it
// consumes one holder (HoldersCounter) of one counter set, and nothing else.
func IsHolder(d *pb.Device) bool {
	c := d.GetConsumes()
	return len(c) == 1 && len(c[0].GetCounters()) == 1 && c[0].GetCounters()[HoldersCounter] == 1
}
