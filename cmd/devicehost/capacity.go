package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// groupCapacity is one device group's capacity on this node, as `devicehost capacity`
// prints it. A device counts in every column that holds for it: a held device that
// turned unhealthy is held and unhealthy; Free is what a Reserve could get now (healthy,
// not cordoned, not held, not blocked by a shared counter).
type groupCapacity struct {
	Group     string        `json:"group"` // vendor/type/name
	Plugin    string        `json:"plugin"`
	Total     int           `json:"total"`
	Free      int           `json:"free"`
	Held      int           `json:"held"`
	Blocked   int           `json:"blocked"` // free, but its shared counters are taken
	Unhealthy int           `json:"unhealthy"`
	Cordoned  int           `json:"cordoned"`
	Holders   []ownerDevice `json:"holders,omitempty"` // by owner, sorted
}

// ownerDevice is how many devices of a group one owner holds.
type ownerDevice struct {
	OwnerID string `json:"owner_id"`
	Devices int    `json:"devices"`
}

// setCapacity is one counter set in use (a partitioned or shared GPU): its holders,
// the sharing mode they hold it in, and its fullest counter.
type setCapacity struct {
	Set      string   `json:"counter_set"`
	Plugin   string   `json:"plugin"`
	Holders  []string `json:"holders"`                    // owner IDs, sorted
	SharedAs []string `json:"shared_as,omitempty"`        // the holders' common compatibility groups
	Fullest  string   `json:"fullest_counter,omitempty"`  // the counter with the largest share used
	Used     int64    `json:"fullest_used"`               // of it
	Capacity int64    `json:"fullest_capacity,omitempty"` // of it
}

// capacityReport is `devicehost capacity -json`.
type capacityReport struct {
	Groups      []groupCapacity `json:"groups"`
	CounterSets []setCapacity   `json:"counter_sets,omitempty"`
}

// runCapacity is `devicehost capacity`.
func runCapacity(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "capacity", "[-json] [-address ADDR]\n\n"+
		"Prints, per device group on this node, how many devices there are, how many a Reserve\n"+
		"could get now (FREE), and how many are held (by whom), blocked by shared counters,\n"+
		"unhealthy or cordoned; on-demand MIG placements are devices of their profile's\n"+
		"group, so FREE of nvidia/mig/<profile> is the placements still possible. Then each\n"+
		"counter set in use (a partitioned or shared GPU): its holders, the sharing mode they\n"+
		"hold it in, and its fullest counter.")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	ctx, c, done, err := cf.dial(ctx)
	if err != nil {
		return err
	}
	defer done()
	fp, err := c.Devices(ctx)
	if err != nil {
		return callError("fingerprint", err)
	}
	r := capacityOf(fp)
	if *asJSON {
		b, err := json.MarshalIndent(r, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(env.stdout, "%s\n", b)
		return err
	}
	t := newTable(env.stdout, "GROUP", "TOTAL", "FREE", "HELD", "BLOCKED", "UNHEALTHY", "CORDONED", "HOLDERS")
	for _, g := range r.Groups {
		var hs []string
		for _, h := range g.Holders {
			hs = append(hs, fmt.Sprintf("%s (%d)", cell(h.OwnerID), h.Devices))
		}
		t.rowEscaped(cell(g.Group), fmt.Sprint(g.Total), fmt.Sprint(g.Free), fmt.Sprint(g.Held), fmt.Sprint(g.Blocked),
			fmt.Sprint(g.Unhealthy), fmt.Sprint(g.Cordoned), joinOr(hs))
	}
	if err := t.flush(); err != nil || len(r.CounterSets) == 0 {
		return err
	}
	fmt.Fprintln(env.stdout)
	t = newTable(env.stdout, "COUNTER SET", "PLUGIN", "HOLDERS", "SHARED AS", "FULLEST COUNTER")
	for _, s := range r.CounterSets {
		hs := make([]string, len(s.Holders))
		for i, h := range s.Holders {
			hs[i] = cell(h)
		}
		mode := device.SharedAs(s.SharedAs)
		mode = strings.TrimPrefix(mode, "shared as ")
		full := cell("")
		if s.Fullest != "" {
			full = fmt.Sprintf("%s %d/%d", cell(s.Fullest), s.Used, s.Capacity)
		}
		t.rowEscaped(cell(s.Set), cell(s.Plugin), joinOr(hs), mode, full)
	}
	return t.flush()
}

// joinOr joins cells with ", ", or is "-" for none.
func joinOr(cells []string) string {
	if len(cells) == 0 {
		return cell("")
	}
	return strings.Join(cells, ", ")
}

// capacityOf works the report out of one snapshot.
func capacityOf(fp *pb.FingerprintResponse) capacityReport {
	var r capacityReport
	type setKey struct{ plugin, name string }
	setHolders := make(map[setKey]map[string]bool)
	setGroups := make(map[setKey][]string) // the holders' common groups (present once one holds it)
	for _, g := range fp.GetGroups() {
		gc := groupCapacity{Group: groupName(g.GetVendor(), g.GetType(), g.GetName()), Plugin: g.GetPlugin()}
		owners := make(map[string]int)
		for _, d := range g.GetDevices() {
			gc.Total++
			healthy := d.GetHealth() == pb.Health_HEALTH_HEALTHY
			h := d.GetHolder()
			switch {
			case h != nil:
				gc.Held++
				owners[h.GetOwnerId()]++
				for _, c := range d.GetConsumes() {
					k := setKey{g.GetPlugin(), c.GetCounterSet()}
					if setHolders[k] == nil {
						setHolders[k] = make(map[string]bool)
					}
					setHolders[k][h.GetOwnerId()] = true
					if held, seen := setGroups[k]; !seen {
						setGroups[k] = c.GetCompatibilityGroups()
					} else if common, ok := device.Compatible(held, c.GetCompatibilityGroups()); ok {
						setGroups[k] = common
					}
				}
			case len(d.GetBlockedBy()) > 0:
				gc.Blocked++
			case healthy && d.GetCordon() == nil:
				gc.Free++
			}
			if !healthy {
				gc.Unhealthy++
			}
			if d.GetCordon() != nil {
				gc.Cordoned++
			}
		}
		for _, o := range slices.Sorted(maps.Keys(owners)) {
			gc.Holders = append(gc.Holders, ownerDevice{OwnerID: o, Devices: owners[o]})
		}
		r.Groups = append(r.Groups, gc)
	}
	for _, cs := range fp.GetCounterSets() {
		k := setKey{cs.GetPlugin(), cs.GetName()}
		if len(setHolders[k]) == 0 {
			continue
		}
		sc := setCapacity{Set: cs.GetName(), Plugin: cs.GetPlugin(), Holders: slices.Sorted(maps.Keys(setHolders[k])), SharedAs: setGroups[k]}
		best := -1.0
		for _, name := range slices.Sorted(maps.Keys(cs.GetCapacity())) {
			capacity, used := cs.GetCapacity()[name], cs.GetUsed()[name]
			if capacity <= 0 {
				continue
			}
			if ratio := float64(used) / float64(capacity); ratio > best {
				best, sc.Fullest, sc.Used, sc.Capacity = ratio, name, used, capacity
			}
		}
		r.CounterSets = append(r.CounterSets, sc)
	}
	slices.SortFunc(r.CounterSets, func(a, b setCapacity) int {
		return cmp.Or(strings.Compare(a.Plugin, b.Plugin), strings.Compare(a.Set, b.Set))
	})
	return r
}
