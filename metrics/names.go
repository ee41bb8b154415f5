package metrics

import (
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/textline"
	"github.com/devicehost/devicehost/validate"
)

// statPrefix starts the name of every device stat that has no dcgm-exporter name.
const statPrefix = "devicehost_device_"

// maxStatNameLen bounds, in bytes, the part of a metric name made from a stat's name.
const maxStatNameLen = 128

// statHelp is the help of every devicehost_device_<stat> family. It depends on nothing
// a plugin sends, so two plugins' stats of one name can never disagree about it.
const statHelp = "A device statistic as its plugin reports it, converted to the Prometheus base unit its name ends with (none: as reported). See devicehost's docs/metrics.md."

// convert returns v (in unit from) in unit to, when both are known units of one
// quantity.
func convert(v float64, from, to string) (float64, bool) {
	f, ok1 := validate.LookupUnit(from)
	t, ok2 := validate.LookupUnit(to)
	if !ok1 || !ok2 || f.Base != t.Base {
		return 0, false
	}
	if f.Factor == t.Factor {
		return v, true
	}
	return v * f.Factor / t.Factor, true
}

// sanitize reduces a plugin's stat name to Prometheus' name charset, snake case: ASCII
// letters (lowered) and digits are kept, every run of anything else becomes one "_",
// and leading and trailing "_" go; the result is cut to maxStatNameLen bytes. It may be
// empty (a name with no letter or digit).
func sanitize(name string) string {
	var b strings.Builder
	gap := false
	for i := 0; i < len(name); i++ {
		c := name[i] // bytes: anything not ASCII is a gap
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c >= 'A' && c <= 'Z':
			c += 'a' - 'A'
		default:
			gap = true
			continue
		}
		need := 1
		if gap && b.Len() > 0 {
			need = 2
		}
		if b.Len()+need > maxStatNameLen {
			break
		}
		if need == 2 {
			b.WriteByte('_')
		}
		gap = false
		b.WriteByte(c)
	}
	return b.String()
}

// statName is the metric name of a stat in unit u: devicehost_device_<stat> plus
// "_<base unit>" unless the stat's name already ends with it or u is a plain number.
// Empty when the stat's name has nothing usable.
func statName(stat string, u validate.Unit) string {
	s := sanitize(stat)
	if s == "" {
		return ""
	}
	if suffix := "_" + u.Base; u.Base != "" && !strings.HasSuffix("_"+s, suffix) {
		s += suffix
	}
	return statPrefix + s
}

// number returns a stat's value as a float: ints, floats and bools (0 or 1). Strings,
// and unset values, have none.
func number(v device.Value) (float64, bool) {
	switch v.Kind {
	case device.KindInt:
		return float64(v.Int), true
	case device.KindFloat:
		return v.Float, true
	case device.KindBool:
		if v.Bool {
			return 1, true
		}
		return 0, true
	default:
		return 0, false
	}
}

// dcgmField is the dcgm-exporter series a stat of the nvidia-example plugin becomes.
type dcgmField struct {
	name string
	typ  prometheus.ValueType
	unit string // dcgm-exporter's unit, in devicehost's unit names, or dcgmRatio
	help string
}

// dcgmRatio is the unit of a dcgm-exporter field that is a fraction from 0 to 1 (the
// profiling fields): a stat in % is divided by 100. It is no plugin unit.
const dcgmRatio = "ratio"

// dcgmLabels are dcgm-exporter's labels of a GPU, in its order.
var dcgmLabels = []string{"gpu", "UUID", "device", "modelName", "pci_bus_id", "Hostname"}

// dcgmMIGLabels are dcgm-exporter's labels of a MIG device (a GPU instance): a GPU's,
// plus the GPU instance's profile and ID. dcgm-exporter leaves the two out, rather
// than empty, for a GPU that is not partitioned.
var dcgmMIGLabels = []string{"gpu", "UUID", "device", "modelName", "pci_bus_id", "GPU_I_PROFILE", "GPU_I_ID", "Hostname"}

// Stats and attributes of the nvidia-example plugin that become dcgm-exporter's labels
// rather than series.
const (
	// dcgmIndexStat numbers a GPU (dcgm-exporter's gpu label, and device="nvidia<gpu>");
	// a MIG device's is its GPU's.
	dcgmIndexStat = "index"
	// dcgmInstanceStat is a MIG device's GPU instance ID (GPU_I_ID), an integer; a MIG
	// device without one is not a GPU instance dcgm-exporter would show.
	dcgmInstanceStat = "gpu_instance_id"
	// dcgmParentStat is the UUID of the GPU a MIG device is on, a string: dcgm-exporter's
	// UUID label of a GPU instance is its GPU's.
	dcgmParentStat = "gpu_uuid"
	// dcgmModelAttr is the attribute of a MIG group that names its GPU's model
	// (modelName); a GPU group's name is the model.
	dcgmModelAttr = "gpu_model"
)

// maxLabelValueLen bounds, in bytes, a label value taken from a plugin's string (a
// stat or attribute): as long as a device ID may be.
const maxLabelValueLen = 256

// labelValue says whether s, a plugin's string, may be a label value: at most
// maxLabelValueLen bytes of printable UTF-8. (The exposition format escapes what
// needs it; this keeps a plugin from making series that are huge or unreadable.)
func labelValue(s string) bool { return len(s) <= maxLabelValueLen && textline.Printable(s) }

// dcgmFields maps the nvidia-example plugin's stats to dcgm-exporter's fields
// (default-counters.csv, plus FB_TOTAL and the volatile ECC totals), with the unit
// dcgm-exporter reports each in. Stats of an NVIDIA GPU not listed here are exported
// as devicehost_device_<stat>.
var dcgmFields = map[string]dcgmField{
	"gpu_utilization":        {"DCGM_FI_DEV_GPU_UTIL", prometheus.GaugeValue, "%", "Share of time the GPU was busy, in %."},
	"memory_utilization":     {"DCGM_FI_DEV_MEM_COPY_UTIL", prometheus.GaugeValue, "%", "Share of time the GPU memory was read or written, in %."},
	"memory_used":            {"DCGM_FI_DEV_FB_USED", prometheus.GaugeValue, "MiB", "Framebuffer memory in use, in MiB."},
	"memory_free":            {"DCGM_FI_DEV_FB_FREE", prometheus.GaugeValue, "MiB", "Framebuffer memory free, in MiB."},
	"memory_total":           {"DCGM_FI_DEV_FB_TOTAL", prometheus.GaugeValue, "MiB", "Framebuffer memory in all, in MiB."},
	"temperature":            {"DCGM_FI_DEV_GPU_TEMP", prometheus.GaugeValue, "C", "GPU temperature, in degrees Celsius."},
	"power":                  {"DCGM_FI_DEV_POWER_USAGE", prometheus.GaugeValue, "W", "Power the GPU draws, in W."},
	"sm_clock":               {"DCGM_FI_DEV_SM_CLOCK", prometheus.GaugeValue, "MHz", "Current SM clock, in MHz."},
	"memory_clock":           {"DCGM_FI_DEV_MEM_CLOCK", prometheus.GaugeValue, "MHz", "Current memory clock, in MHz."},
	"last_xid":               {"DCGM_FI_DEV_XID_ERRORS", prometheus.GaugeValue, "", "Number of the last XID error the GPU raised; 0 when none."},
	"ecc_errors_corrected":   {"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", prometheus.CounterValue, "count", "Corrected (single-bit) ECC errors since the driver loaded."},
	"ecc_errors_uncorrected": {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", prometheus.CounterValue, "count", "Uncorrected (double-bit) ECC errors since the driver loaded."},
	"tensor_active":          {"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", prometheus.GaugeValue, dcgmRatio, "Ratio of cycles any tensor pipe was active, from 0 to 1."},
}

// isDCGMGroup says whether a group's stats get dcgm-exporter's names: NVIDIA GPUs and
// MIG devices, as the nvidia-example plugin reports them.
func isDCGMGroup(k device.GroupKey) bool {
	return k.Vendor == "nvidia" && (k.Type == "gpu" || isMIGGroup(k))
}

// isMIGGroup says whether a group is of NVIDIA MIG devices, named after their profile
// (nvidia/mig/1g.10gb): dcgm-exporter's GPU instances.
func isMIGGroup(k device.GroupKey) bool { return k.Vendor == "nvidia" && k.Type == "mig" }

// dcgmBusID writes a PCI bus ID the way DCGM (and NVML) do, with a 32-bit domain in
// upper case: "0000:1b:00.0" becomes "00000000:1B:00.0". Anything else is kept.
func dcgmBusID(id string) string {
	var domain, bus, dev, fn uint64
	if _, err := fmt.Sscanf(id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn); err != nil {
		return id
	}
	return fmt.Sprintf("%08X:%02X:%02X.%X", domain, bus, dev, fn)
}
