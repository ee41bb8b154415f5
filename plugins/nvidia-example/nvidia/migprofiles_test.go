package nvidia

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
)

// mig_profiles offers only the listed profiles' placements, with the same counters: the
// whole GPU and the 7 1g.10gb placements still cannot all be held, and 7 of them fit;
// a Reserve of one makes its instance. Unknown or misplaced names refuse the config.
func TestMIGProfilesOffered(t *testing.T) {
	cfg := onDemand(filepath.Join(t.TempDir(), "sim.json"))
	cfg.MIGProfiles = []string{"1g.10gb", "7g.80gb"}
	p, _ := newTestPlugin(t, cfg)
	resp := fingerprintOf(t, p)
	sizes := groupSizes(resp)
	want := map[string]int{"nvidia/gpu/" + h100: 8, "nvidia/mig/1g.10gb": 56, "nvidia/mig/7g.80gb": 8}
	if len(sizes) != len(want) {
		t.Errorf("groups %v, want %v", sizes, want)
	}
	for g, n := range want {
		if sizes[g] != n {
			t.Errorf("group %s has %d devices, want %d (all groups: %v)", g, sizes[g], n, sizes)
		}
	}
	gpu0 := simulatedUUID("dgxh100", 0)
	var small []string
	for i := range 7 {
		small = append(small, partitionID(gpu0, "1g.10gb", uint32(i)))
	}
	if over := fits(resp, small...); over != "" {
		t.Errorf("the 7 1g.10gb placements of GPU 0 do not fit together: %s", over)
	}
	if over := fits(resp, append(small[:1:1], gpu0)...); over == "" {
		t.Error("a 1g.10gb placement and its whole GPU fit together")
	}
	if _, err := p.Reserve(context.Background(), small[:1]); err != nil {
		t.Fatalf("Reserve of an offered placement: %v", err)
	}
	if got := simInstances(simOf(t, p), 0); len(got) != 1 {
		t.Errorf("GPU 0's instances after the Reserve: %v, want one", got)
	}

	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{Simulate: "dgxh100", MIG: MIGOnDemand, MIGProfiles: []string{"1g.10gb", "2g.25gb"}}, `mig_profiles: "2g.25gb" is a profile of no GPU offered on demand (they offer 1g.10gb`},
		{Config{Simulate: "dgxh100", MIGProfiles: []string{"1g.10gb"}}, `mig_profiles ["1g.10gb"]: only with mig = "on-demand"`},
		{Config{Simulate: "dgxh100", MIG: MIGOnDemand, MIGProfiles: []string{"1g.10gb", "1g.10gb"}}, `"1g.10gb" is empty or given twice`},
	} {
		q, _ := newUnconfigured(t)
		c.cfg.SimStateFile = ptr(filepath.Join(t.TempDir(), "sim.json"))
		err := q.SetConfig(context.Background(), mustJSON(t, c.cfg))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("SetConfig(mig_profiles %q, mig %q) = %v, want an error saying %q", c.cfg.MIGProfiles, c.cfg.MIG, err, c.want)
		}
	}
}
