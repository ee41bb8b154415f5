// Package units translates units between devicehost (validate.KnownUnits) and Nomad:
// device attributes carry a unit of Nomad's unit index (plugins/shared/structs), which
// its scheduler converts and whose unknown units make Nomad reject a whole fingerprint;
// stats carry free text ("%", "MiB", "bytes"). For a unit of one side the functions say
// which unit of the other holds the same quantity and by what factor to multiply. The
// tables are fixed; the functions are pure and safe for concurrent use. See docs/nomad.md.
package units

// Conversion turns a number in one unit into another: To is the target unit and the
// value is multiplied by Factor. Factor 1 means the number is unchanged.
type Conversion struct {
	To     string
	Factor float64
}

// toHost maps a Nomad attribute unit (its unit index) to devicehost's. Units both
// sides share map to themselves; the rest go to the largest devicehost unit of the same
// quantity.
var toHost = map[string]Conversion{
	// Binary bytes.
	"KiB": {"KiB", 1}, "MiB": {"MiB", 1}, "GiB": {"GiB", 1}, "TiB": {"TiB", 1},
	"PiB": {"TiB", 1 << 10}, "EiB": {"TiB", 1 << 20},
	// Decimal bytes (Nomad knows both kB and KB).
	"kB": {"KB", 1}, "KB": {"KB", 1}, "MB": {"MB", 1}, "GB": {"GB", 1},
	"TB": {"GB", 1e3}, "PB": {"GB", 1e6}, "EB": {"GB", 1e9},
	// Byte rates: devicehost has MB/s and GB/s.
	"kB/s": {"MB/s", 1e-3}, "KB/s": {"MB/s", 1e-3}, "MB/s": {"MB/s", 1}, "GB/s": {"GB/s", 1},
	"TB/s": {"GB/s", 1e3}, "PB/s": {"GB/s", 1e6}, "EB/s": {"GB/s", 1e9},
	"KiB/s": {"MB/s", 1024 / 1e6}, "MiB/s": {"MB/s", (1 << 20) / 1e6},
	"GiB/s": {"GB/s", (1 << 30) / 1e9}, "TiB/s": {"GB/s", (1 << 40) / 1e9},
	"PiB/s": {"GB/s", (1 << 50) / 1e9}, "EiB/s": {"GB/s", (1 << 60) / 1e9},
	// Frequency and power.
	"MHz": {"MHz", 1}, "GHz": {"GHz", 1},
	"mW": {"mW", 1}, "W": {"W", 1}, "kW": {"W", 1e3}, "MW": {"W", 1e6}, "GW": {"W", 1e9},
}

// statsAliases are the free-text units Nomad plugins put on stats values that
// devicehost spells differently, or that are devicehost units already.
var statsAliases = map[string]Conversion{
	"": {"", 1}, "%": {"%", 1}, "count": {"count", 1},
	"B": {"B", 1}, "byte": {"B", 1}, "bytes": {"B", 1},
	"V": {"V", 1}, "mV": {"mV", 1},
	"C": {"C", 1}, "°C": {"C", 1}, "celsius": {"C", 1}, "Celsius": {"C", 1},
	"ns": {"ns", 1}, "us": {"us", 1}, "µs": {"us", 1}, "ms": {"ms", 1}, "s": {"s", 1},
	"rpm": {"rpm", 1}, "RPM": {"rpm", 1},
}

// FromNomadAttribute returns how to carry a number with Nomad attribute unit u as a
// devicehost value; ok is false for a unit outside Nomad's index (Nomad itself would
// refuse it) and for "", which needs no conversion.
func FromNomadAttribute(u string) (c Conversion, ok bool) {
	c, ok = toHost[u]
	return c, ok
}

// FromNomadStat returns how to carry a number with the free-text Nomad stats unit u
// as a devicehost value: a unit of Nomad's index as FromNomadAttribute does, the
// common spellings of bytes, degrees Celsius, durations and the like as devicehost
// writes them. ok is false for a unit devicehost has no name for.
func FromNomadStat(u string) (c Conversion, ok bool) {
	if c, ok = statsAliases[u]; ok {
		return c, true
	}
	return FromNomadAttribute(u)
}

// fromHost maps devicehost units to Nomad attribute units. Devicehost units without a
// Nomad attribute unit ("%", "C", "count", durations...) are absent.
var fromHost = map[string]Conversion{
	"B":   {"KiB", 1.0 / 1024},
	"KiB": {"KiB", 1}, "MiB": {"MiB", 1}, "GiB": {"GiB", 1}, "TiB": {"TiB", 1},
	"KB": {"KB", 1}, "MB": {"MB", 1}, "GB": {"GB", 1},
	"MB/s": {"MB/s", 1}, "GB/s": {"GB/s", 1},
	"MHz": {"MHz", 1}, "GHz": {"GHz", 1},
	"W": {"W", 1}, "mW": {"mW", 1},
}

// ToNomadAttribute returns how to carry a number with devicehost unit u as a Nomad
// device attribute, whose units Nomad's scheduler understands. ok is false when Nomad
// has no attribute unit for that quantity (percent, degrees, counts, volts,
// durations, rpm, and no unit at all): the number is then best given without a unit.
func ToNomadAttribute(u string) (c Conversion, ok bool) {
	c, ok = fromHost[u]
	return c, ok
}
