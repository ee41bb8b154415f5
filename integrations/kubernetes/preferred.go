package kubernetes

import (
	"cmp"
	"slices"
	"strconv"
)

// placement is where a device sits, for GetPreferredAllocation: its device group, NUMA
// node, PCIe root and parent (each a key; an empty root or a NUMA node of -1 means
// unknown, and unknowns count as one place). The parent is the counter set the device
// consumes: the GPU that replicas or MPS shares divide ("" for a device that divides
// nothing).
type placement struct {
	id     string
	group  string
	numa   int32
	root   string
	parent string
}

// placementLevels are the keys a preferred allocation keeps together, most important
// first: one device group (a container's devices make one reservation, of one group),
// then as few NUMA nodes, then as few PCIe roots, then as few parents as possible (a
// container's MPS shares must all be of one GPU: its pipe directory names one daemon).
var placementLevels = []func(placement) string{
	func(p placement) string { return p.group },
	func(p placement) string { return strconv.Itoa(int(p.numa)) },
	func(p placement) string { return p.root },
	func(p placement) string { return p.parent },
}

// preferDevices chooses size devices among available (which must hold every device of
// mustInclude): all of mustInclude, and the others so that the choice spans as few
// device groups, then NUMA nodes, then PCIe roots as it can. Among equal choices it
// takes from the place where the rest fits most tightly, leaving larger blocks free for
// later requests; ties go to the lower key and device ID, so the answer is
// deterministic. With fewer available devices than size, it returns them all; with
// more must-include devices than size, it returns those.
func preferDevices(available []placement, mustInclude []string, size int) []string {
	must := make(map[string]bool, len(mustInclude))
	for _, id := range mustInclude {
		must[id] = true
	}
	devs := slices.Clone(available)
	slices.SortFunc(devs, func(a, b placement) int { return cmp.Compare(a.id, b.id) })
	devs = slices.CompactFunc(devs, func(a, b placement) bool { return a.id == b.id })
	chosen := pick(devs, must, 0, size)
	ids := make([]string, len(chosen))
	for i, p := range chosen {
		ids[i] = p.id
	}
	slices.Sort(ids)
	return ids
}

// pick returns want devices of devs (sorted by ID): every must-include one, and the
// others placed by placementLevels[level:].
func pick(devs []placement, must map[string]bool, level, want int) []placement {
	forced := 0
	for _, d := range devs {
		if must[d.id] {
			forced++
		}
	}
	if want >= len(devs) {
		return devs
	}
	if level == len(placementLevels) {
		out := make([]placement, 0, max(want, forced))
		for _, d := range devs {
			if must[d.id] {
				out = append(out, d)
			}
		}
		for _, d := range devs {
			if len(out) >= want {
				break
			}
			if !must[d.id] {
				out = append(out, d)
			}
		}
		return out
	}

	// Sort the devices into bins by this level's key.
	key := placementLevels[level]
	type bin struct {
		key    string
		devs   []placement
		forced int
		take   int // how many that are not must-include fill takes from it
	}
	var bins []*bin
	byKey := map[string]*bin{}
	for _, d := range devs {
		k := key(d)
		b := byKey[k]
		if b == nil {
			b = &bin{key: k}
			byKey[k] = b
			bins = append(bins, b)
		}
		b.devs = append(b.devs, d)
		if must[d.id] {
			b.forced++
		}
	}
	slices.SortFunc(bins, func(a, b *bin) int { return cmp.Compare(a.key, b.key) })
	free := func(b *bin) int { return len(b.devs) - b.forced - b.take }

	// fill takes need devices from bins, opening as few as it can: one bin that
	// holds them all if there is one, else all of the largest bin and on. Among bins
	// that do equally well here, it takes the one where the devices it would take
	// span the fewest places at the next levels, then (when it fits) the one with the
	// fewest free devices, leaving larger blocks whole for later requests.
	fill := func(bins []*bin, need int) {
		for need > 0 {
			var best *bin
			var bestSpread []int
			bestFits := false
			for _, b := range bins {
				n := free(b)
				if n == 0 {
					continue
				}
				fits := n >= need
				var sp []int // nil at the last level: nothing below to compare
				if level+1 < len(placementLevels) {
					sp = spread(pick(b.devs, must, level+1, b.forced+b.take+min(n, need)), level+1)
				}
				better := false
				switch {
				case best == nil:
					better = true
				case fits != bestFits:
					better = fits
				case fits:
					c := slices.Compare(sp, bestSpread)
					better = c < 0 || c == 0 && n < free(best)
				default:
					better = n > free(best) || n == free(best) && slices.Compare(sp, bestSpread) < 0
				}
				if better {
					best, bestSpread, bestFits = b, sp, fits
				}
			}
			if best == nil {
				return // not enough devices: all there are
			}
			take := min(free(best), need)
			best.take += take
			need -= take
		}
	}
	// Bins with must-include devices are used anyway: take what they hold first,
	// then open as few other bins as possible for the rest.
	var closed []*bin
	openFree := 0
	for _, b := range bins {
		if b.forced > 0 {
			openFree += free(b)
		} else {
			closed = append(closed, b)
		}
	}
	fill(closed, max(want-forced-openFree, 0))

	// Any choice within the chosen bins spans no more of them: let the next levels
	// choose among all their devices together.
	var chosen []placement
	for _, b := range bins {
		if b.forced > 0 || b.take > 0 {
			chosen = append(chosen, b.devs...)
		}
	}
	slices.SortFunc(chosen, func(a, b placement) int { return cmp.Compare(a.id, b.id) })
	return pick(chosen, must, level+1, want)
}

// spread counts, for each placement level from level on, the distinct places devs
// occupy.
func spread(devs []placement, level int) []int {
	out := make([]int, 0, len(placementLevels)-level)
	for _, key := range placementLevels[level:] {
		seen := map[string]bool{}
		for _, d := range devs {
			seen[key(d)] = true
		}
		out = append(out, len(seen))
	}
	return out
}
