package units_test

import (
	"testing"

	"github.com/hashicorp/nomad/plugins/shared/structs"

	"github.com/devicehost/devicehost/integrations/nomad/units"
	"github.com/devicehost/devicehost/validate"
)

// Every unit of Nomad's index has a devicehost unit of the same quantity, and the
// factor converts between them: a Nomad plugin's attribute is never refused by the
// host for its unit.
func TestFromNomadAttributeCoversNomadsIndex(t *testing.T) {
	for name, u := range structs.UnitIndex {
		c, ok := units.FromNomadAttribute(name)
		if !ok {
			t.Errorf("Nomad unit %q has no devicehost unit", name)
			continue
		}
		if !validate.KnownUnit(c.To) {
			t.Errorf("Nomad unit %q maps to %q, which the host refuses", name, c.To)
		}
		to, ok := structs.UnitIndex[c.To]
		if !ok {
			t.Errorf("Nomad unit %q maps to %q, outside Nomad's index", name, c.To)
			continue
		}
		if to.Base != u.Base {
			t.Errorf("Nomad unit %q (base %d) maps to %q (base %d): another quantity", name, u.Base, c.To, to.Base)
		}
		if got, want := c.Factor*multiplier(to), multiplier(u); !near(got, want) {
			t.Errorf("1 %s = %g %s; want %g", name, c.Factor, c.To, want/multiplier(to))
		}
	}
	if _, ok := units.FromNomadAttribute("furlong"); ok {
		t.Error("an unknown unit was mapped")
	}
}

// Every devicehost unit Nomad can carry on an attribute lands in Nomad's index with the
// right factor; the others are refused (the caller then drops the unit).
func TestToNomadAttribute(t *testing.T) {
	for _, name := range validate.KnownUnits() {
		c, ok := units.ToNomadAttribute(name)
		if !ok {
			continue
		}
		to, inIndex := structs.UnitIndex[c.To]
		if !inIndex {
			t.Errorf("%q maps to %q, which Nomad refuses", name, c.To)
			continue
		}
		if name == "B" {
			if c.To != "KiB" || c.Factor != 1.0/1024 {
				t.Errorf("B maps to %g %s, want 1/1024 KiB", c.Factor, c.To)
			}
			continue
		}
		if from := structs.UnitIndex[name]; from == nil || from.Base != to.Base || !near(c.Factor*multiplier(to), multiplier(from)) {
			t.Errorf("%q maps to %g %q", name, c.Factor, c.To)
		}
	}
	for _, name := range []string{"%", "C", "count", "V", "ms", "rpm", ""} {
		if c, ok := units.ToNomadAttribute(name); ok {
			t.Errorf("%q maps to %q; Nomad has no unit for it", name, c.To)
		}
	}
}

// The free-text units of Nomad plugins' stats land on devicehost units.
func TestFromNomadStat(t *testing.T) {
	for in, want := range map[string]string{
		"bytes": "B", "°C": "C", "C": "C", "%": "%", "MiB": "MiB", "W": "W", "µs": "us", "RPM": "rpm", "": "", "kW": "W",
	} {
		c, ok := units.FromNomadStat(in)
		if !ok || c.To != want || !validate.KnownUnit(c.To) {
			t.Errorf("FromNomadStat(%q) = %+v, %v; want %q", in, c, ok, want)
		}
	}
	if _, ok := units.FromNomadStat("parsecs"); ok {
		t.Error("an unknown unit was mapped")
	}
}

// multiplier is how many base units one u is.
func multiplier(u *structs.Unit) float64 {
	if u.InverseMultiplier {
		return 1 / float64(u.Multiplier)
	}
	return float64(u.Multiplier)
}

func near(a, b float64) bool {
	d := a - b
	if d < 0 {
		d = -d
	}
	return d <= 1e-9*b
}
